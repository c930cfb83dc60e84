#!/usr/bin/env bash
# The README's test command: set up the environment (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
