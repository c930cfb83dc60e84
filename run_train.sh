#!/usr/bin/env bash
# Train with FlashCP on TorchTitan: one node's GPUs, torchrun multi-node, or CPU (gloo).
#
#   ./run_train.sh                                     # the embedded default job (train_configs/default.toml)
#   ./run_train.sh --config llama8b_128k.toml          # a job by name in train_configs/ or by path
#   ./run_train.sh --config debug_cpu --training.steps 20   # TorchTitan-style overrides
#   NGPU=4 ./run_train.sh ...                          # ranks per node (default: visible GPUs, or the
#                                                      # job's layout / 2 on CPU)
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 ./run_train.sh --config llama70b_128k   # on every node
#
# Sets up .venv first when it is missing (scripts/setup_env.sh), checks the job for this world
# size, then starts train.py on every rank through torchrun (flashcp/titan/launch/node.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${FLASHCP_VENV:-$ROOT/.venv}"

"$ROOT/scripts/setup_env.sh"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m flashcp.titan.launch "$@"
