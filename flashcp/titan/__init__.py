"""FlashCP inside TorchTitan 0.3.0: only what adapts TorchTitan, in rooms as TorchTitan groups them.

- `config/`: the job file (TOML) -> a checked job, every key with its type and default;
- `launch/`: the job's front end: `python -m flashcp.titan.launch`, the checks that open files
  before any rank starts, the job as TorchTitan's `Trainer.Config`;
- `models/`: Llama 3 / Qwen3 built by TorchTitan's builders (flavors from its registries, custom
  sizes or an HF config.json), RoPE, and FlashCP's attention swapped in from outside;
- `hf/`: Hugging Face folders checked before import, checkpoints exported as HF folders;
- `components/`: what the trainer plugs into TorchTitan's slots (data, checkpoints, validation,
  metrics, loss);
- `dryrun/`: `python -m flashcp.titan.dryrun`, one rank of a job on fake tensors;
- `probe/`: a retrieval probe by needle depth and prompt length through the CP path, in training
  and as `python -m flashcp.titan.probe` on a checkpoint or HF folder;
- `lease/`: the GPU lease's TorchTitan parts (the trainer's variants, the dry run against the
  allocator, 8B layers at the frontier), which `scripts/gpu_lease.sh` runs;
- `trainer`: TorchTitan's Trainer with a FlashCP context-parallel dimension, on `safe_trainer`'s
  run safety around TorchTitan's loop (stop, save, restore checks); `export`: the
  `python -m flashcp.titan.export` command; `compat`: the version shims, each commented with the
  versions that need it.

May import: torchtitan, torch, and every other room of FlashCP (the engine, `flashcp.data`,
`flashcp.run`, `flashcp.costmodel`); no other room imports this one. Each room's `__init__` says
which rooms of flashcp.titan it may import (tests/test_layout.py holds them to it).

Importing this package applies the version / CPU shims of `compat` before anything imports
TorchTitan, so import `flashcp.titan` (or a module of it) before importing `torchtitan`.
"""

from flashcp.titan import compat

compat.prepare()
