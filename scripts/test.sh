#!/usr/bin/env bash
# The README's test command: set up the environment (idempotent), then run the whole suite and
# print its 15 slowest tests. Test files run on PYTEST_WORKERS processes (default 2, pytest-xdist):
# the end-to-end tests mostly wait on processes starting, so two files at a time keep both cores busy
# (README gives the suite's measured time).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 "$@"
