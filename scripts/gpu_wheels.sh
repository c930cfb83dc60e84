#!/usr/bin/env bash
# Download the wheels a GPU machine lacks for the lease into .gpu_wheels/ (ignored by git), and check
# that the checkout and the wheels together stay within what travels to it (64 MiB).
#
#   bash scripts/gpu_wheels.sh          # idempotent: wheels already there are not fetched again
#
# The list, pinned, is scripts/gpu_wheels.txt: cp312 (the GPU machine's Python 3.12), manylinux
# x86_64, each wheel alone (--no-deps: every dependency is named in the list, so nothing else comes).
# Wheels in the folder that the list no longer names are removed. scripts/gpu_lease.sh installs them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.gpu_wheels"
LIMIT_MIB=64
PYTHON="${PYTHON:-python3}"

mapfile -t PINS < <(grep -E '^[A-Za-z0-9_.-]+==' "$ROOT/scripts/gpu_wheels.txt" | sed 's/[[:space:]]*#.*//')
mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    -d "$DEST" "${PINS[@]}"

# Keep exactly the pinned wheels: a wheel's file name starts with its normalised name and version.
"$PYTHON" - "$DEST" "${PINS[@]}" <<'PY'
import re, sys
from pathlib import Path
dest, pins = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
wanted = {f"{norm(n)}-{v}" for n, v in (p.split("==") for p in pins)}
have = {}
for whl in dest.glob("*.whl"):
    name, version = whl.name.split("-")[:2]
    have.setdefault(f"{norm(name)}-{version}", []).append(whl)
for key, files in have.items():
    if key not in wanted:
        for f in files:
            print(f"removed {f.name} (not in scripts/gpu_wheels.txt)")
            f.unlink()
missing = sorted(wanted - set(have))
if missing:
    sys.exit(f"error: no wheel downloaded for {', '.join(missing)}")
PY

wheels_kib=$(du -sk "$DEST" | cut -f1)
tree_kib=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | du -skc --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total_kib=$((wheels_kib + tree_kib))
echo "gpu wheels: ${#PINS[@]} wheels, $((wheels_kib / 1024)) MiB in $DEST; with the checkout ($((tree_kib / 1024)) MiB): $((total_kib / 1024)) MiB of ${LIMIT_MIB} MiB"
if ((total_kib > LIMIT_MIB * 1024)); then
    echo "error: the checkout and the wheels ($((total_kib / 1024)) MiB) exceed the ${LIMIT_MIB} MiB that travel to a GPU machine" >&2
    exit 1
fi
