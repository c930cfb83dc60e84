#!/usr/bin/env bash
# The README's test command: set up the environment (idempotent), then run the whole suite and
# print its 15 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest --durations=15 "$@"
