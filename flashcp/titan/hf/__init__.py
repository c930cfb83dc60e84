"""Hugging Face interop: a model folder read before anything loads, and a checkpoint written out as one.

- `config`: a model's architecture as config.json describes it, in both directions;
- `folder`: an HF folder's files checked (headers, index, shapes) against the model that will load it;
- `files`: what is read from a folder is a regular file inside it, read with a bound;
- `sidefiles`: the tokenizer's files and generation_config.json an export carries, checked;
- `export`: a FlashCP checkpoint written as an HF folder, whole or not at all (`python -m flashcp.titan.export`).

May import: torch, safetensors, TorchTitan, `flashcp.run` (manifests, safe loading) and
`flashcp.titan.models` (architectures, RoPE, the state-dict adapters).
"""
