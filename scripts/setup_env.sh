#!/usr/bin/env bash
# Create .venv (python >= 3.11) with FlashCP and its training / test dependencies, if missing.
#
#   scripts/setup_env.sh            # idempotent: does nothing when .venv already works
#
# torch is installed first and pinned: torch==2.13.0, the CPU build on machines without GPUs (an
# unpinned `torch` would pull a multi-GB CUDA build); where a GPU build of torch is already
# importable (the venv sees the system site-packages of a GPU machine) it is kept as is.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLASHCP_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

# Installed distributions are looked up without importing them (importing torchtitan takes seconds).
ready() {
    [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "
import importlib.metadata as m
for name in ('torch', 'torchtitan', 'triton', 'tensorboard', 'tokenizers', 'sentencepiece',
             'datasets', 'pytest', 'pytest-xdist', 'hypothesis', 'transformers', 'safetensors', 'fla-core'):
    m.version(name)
" 2>/dev/null
}
ready && exit 0

# Several nodes sharing one checkout start here at once: one sets the venv up, the others wait for
# it and then find it ready (flock works on NFS through its lock daemon, and on local disks).
if command -v flock >/dev/null; then
    exec 9>"$VENV.setup.lock"
    flock 9
    ready && exit 0
fi

# torchtitan 0.3.0 requires Python >= 3.11: check the interpreter before creating or installing
# anything, instead of failing deep inside pip (Ubuntu 22.04's python3 is 3.10). A venv that exists
# but did not pass the check above may be one an earlier run made with such a python3: check it.
if [[ -x "$VENV/bin/python" ]]; then
    py="$VENV/bin/python" fix="remove $VENV and rerun with PYTHON=python3.11 (or newer)"
else
    py="$PYTHON" fix="install python3.11 or 3.12 and rerun with e.g. PYTHON=python3.11 ./run_train.sh"
fi
version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || version=""
if [[ ! "$version" =~ ^([0-9]+)\.([0-9]+)$ ]]; then
    echo "setup_env: error: cannot run '$py'; $fix" >&2
    exit 1
fi
if (( BASH_REMATCH[1] < 3 || (BASH_REMATCH[1] == 3 && BASH_REMATCH[2] < 11) )); then
    echo "setup_env: error: $py is Python $version but FlashCP (torchtitan 0.3.0) needs >= 3.11; $fix" >&2
    exit 1
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_env: creating $VENV" >&2
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "setup_env: keeping the installed GPU build of torch" >&2
else
    echo "setup_env: installing torch==2.13.0" >&2
    "${PIP[@]}" "torch==2.13.0"
fi

echo "setup_env: installing flashcp[train,test]" >&2
"${PIP[@]}" -e "$ROOT[train,test]"
"$VENV/bin/python" -c "import torch, torchtitan; print('setup_env: torch', torch.__version__)" >&2
