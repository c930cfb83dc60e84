"""FlashCP inside TorchTitan 0.3.0: only what adapts TorchTitan.

The job file -> TorchTitan's config (the `config` package, `job`), the launcher's
front end that checks a job (`launch`, `preflight`), the model specs with FlashCP's attention
swapped in from outside (`model`, `attention`), built from TorchTitan's Llama 3 / Qwen3 flavors,
custom sizes or HF config.json files (`decoders`, `hf_config`, `rope`; the flavors and their
sizes read from TorchTitan's registries: `registry`), the trainer (`trainer`), the data loader as
TorchTitan sees it (`components`), validation on held-out data with the loss by position (`validate`, `heldout`), the
chunked loss (`loss`), metrics (`metrics`), checkpoints through TorchTitan's
manager (`checkpoint`), Hugging Face folders checked before import (`hf_folder`) and checkpoints
exported as HF folders (`hf_export`, the CLI `export`), the dry run on fake tensors (`dryrun`, `memtrack`, `memory_estimate`) and
the version shims (`compat`, each commented with the versions that need it).

May import: torchtitan, torch, and every other room of FlashCP (the engine, `flashcp.data`,
`flashcp.run`, `flashcp.costmodel`); no other room imports this one.

Importing this package applies the version / CPU shims of `compat` before anything imports
TorchTitan, so import `flashcp.titan` (or a module of it) before importing `torchtitan`.
"""

from flashcp.titan import compat

compat.prepare()
