#!/usr/bin/env bash
# One GPU lease, fully used: the GPU check, the trainer's variants, the dry run against the allocator
# and Llama 3 8B layers at the memory frontier, each part under its own time budget (docs/gpucheck.md).
#
#   bash scripts/gpu_lease.sh OUTDIR [--device cpu --quick] [--only PART] [--skip PART]
#
# PART: gpucheck, train, dryrun, frontier (or a, b, c, d); repeat --only / --skip or comma-separate.
# `--device cpu --quick` rehearses every part at toy sizes on a machine without a GPU.
#
# On a bare GPU machine (torch, no TorchTitan, no network) the wheels scripts/gpu_wheels.sh put in
# .gpu_wheels/ are installed first, those whose distribution this python lacks only, into a site
# folder outside the checkout (FLASHCP_LEASE_SITE, default $TMPDIR/flashcp-lease-site-pyX.Y; kept
# for a rerun). PYTHON picks the interpreter (default: .venv's where it exists, else python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
SITE="${FLASHCP_LEASE_SITE:-${TMPDIR:-/tmp}/flashcp-lease-site-py$PYVER}"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# The carried wheels whose distribution is missing here (with the site on the path: a rerun installs nothing).
mapfile -t WHEELS < <("$PYTHON" - "$ROOT/scripts/gpu_wheels.txt" "$ROOT/.gpu_wheels" <<'PY'
import re, sys
from importlib import metadata
from pathlib import Path
pins = [l.split("#")[0].strip() for l in Path(sys.argv[1]).read_text().splitlines() if re.match(r"^[A-Za-z0-9_.-]+==", l)]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
wheels = {norm(w.name.split("-")[0]): w for w in Path(sys.argv[2]).glob("*.whl")}
for pin in pins:
    name = pin.split("==")[0]
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        if norm(name) in wheels:
            print(wheels[norm(name)])
        else:
            print(f"lease: warning: {name} is missing and {sys.argv[2]} has no wheel for it "
                  "(run scripts/gpu_wheels.sh where there is a network)", file=sys.stderr)
PY
)
if ((${#WHEELS[@]})); then
    echo "lease: installing ${#WHEELS[@]} carried wheels into $SITE"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$SITE" "${WHEELS[@]}"
fi
exec "$PYTHON" -m flashcp.gpucheck.lease "$@"
