"""The trainer's parts, as TorchTitan's components: what `FlashCPTrainer` plugs into TorchTitan's slots.

- `data`: FlashCP's tokenizer and window loader as TorchTitan's tokenizer and data loader;
- `checkpoint`: DCP checkpoints published whole, verified on load, never rewritten in place;
- `validate` and `heldout`: validation through FlashCP's own path, and the held-out data it reads;
- `metrics`: TorchTitan's metrics with document-masked FLOPs and FlashCP's plan figures;
- `loss`: cross-entropy a chunk of tokens at a time.

May import: torch, TorchTitan, the core, `flashcp.data`, `flashcp.run`, `flashcp.costmodel` and
`flashcp.titan.hf` (a checkpoint's model record and HF export).
"""
