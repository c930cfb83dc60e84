#!/usr/bin/env bash
# One GPU lease, fully used: the GPU check, the trainer's variants, the dry run against the allocator
# and Llama 3 8B layers at the memory frontier, each part under its own time budget (docs/gpucheck.md).
#
#   bash scripts/gpu_lease.sh OUTDIR [--device cpu --quick] [--only PART] [--skip PART] [--budget-scale X]
#
# PART: gpucheck, train, dryrun, frontier (or a, b, c, d); repeat --only / --skip or comma-separate.
# `--device cpu --quick` rehearses every part at toy sizes on a machine without a GPU. OUTDIR must
# be new or empty: a lease never replaces results. A bad input is one line and exit 2, before anything.
#
# On a bare GPU machine (torch, no TorchTitan, no network) the wheels scripts/gpu_wheels.sh put in
# .gpu_wheels/ are installed first, those whose distribution this python lacks only, into a site
# folder the lease makes owner-only and verifies before each use (FLASHCP_LEASE_SITE, default
# $TMPDIR/flashcp-lease-site-UID-pyX.Y; kept for a rerun). PYTHON picks the interpreter (default:
# .venv's where it exists, else python3). flashcp/gpucheck/lease_start.py does all of this.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null; then
    echo "lease: error: PYTHON $PYTHON is not a command" >&2
    exit 2
fi
exec "$PYTHON" "$ROOT/flashcp/gpucheck/lease_start.py" "$@"
