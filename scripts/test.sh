#!/usr/bin/env bash
# The README's test command: set up the environment (idempotent), then run the suite and print its 15
# slowest tests. Test files run on PYTEST_WORKERS processes (default 2, pytest-xdist): the end-to-end
# tests mostly wait on processes starting, so two files at a time keep both cores busy.
#   bash scripts/test.sh          the CI tier: every test but those marked `slow` (README gives its time)
#   bash scripts/test.sh --all    every test, the slow tier too (multi-process runs of a minute or more each)
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not slow")
if [[ "${1:-}" == "--all" ]]; then
    tier=()
    shift
fi
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 \
    "${tier[@]}" "$@"
