"""Hugging Face interop: a model folder read before anything loads, and a checkpoint written out as one.

- `architecture`: FlashCP's description of a decoder (`Architecture`);
- `config`: a model's architecture as config.json describes it, in both directions;
- `gpt_oss`: gpt-oss's own config.json entries, and its MXFP4 folders refused by name;
- `qwen3_5`, `qwen3_next`: the hybrid Gated DeltaNet decoders' config.json entries (Qwen3.5, its MoE,
  Qwen3-Next), and a folder whose layers hold another kind's weights refused by layer;
- `adapters`: the HF <-> TorchTitan state-dict adapters (gpt-oss's unquantized experts among them);
- `dequant`: an MXFP4 gpt-oss folder written once as an unquantized bf16 one (`python -m flashcp.titan.hf.dequant`);
- `folder`: an HF folder's files checked (headers, index, shapes) against the model that will load it;
- `files`: what is read from a folder is a regular file inside it, read with a bound;
- `sidefiles`: the tokenizer's files and generation_config.json an export carries, checked;
- `export`: a FlashCP checkpoint written as an HF folder, whole or not at all (`python -m flashcp.titan.export`).

May import: torch, safetensors, TorchTitan, `flashcp.run` (manifests, safe loading) and
`flashcp.titan.models` (architectures, RoPE, the state-dict adapters).
"""
