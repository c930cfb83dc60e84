"""FlashCP inside TorchTitan 0.3.0: the trainer, model wiring, metrics and configs of `train.py`.

Importing this package applies the version / CPU shims of `compat` before anything imports
TorchTitan, so import `flashcp.titan` (or a module of it) before importing `torchtitan`.
"""

from flashcp.titan import compat

compat.prepare()
