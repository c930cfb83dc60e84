"""The job's models: TorchTitan's Llama 3 / Qwen3 / DeepSeek-V3 / gpt-oss / Qwen3.5 decoders with FlashCP's attention swapped in from outside.

- `spec`: the job's model as a TorchTitan ModelSpec (parallelize, FSDP, the attention swap);
- `decoders`: FlashCP's `Architecture` <-> TorchTitan's model configs, built by TorchTitan's builders;
- `registry`: the flavors TorchTitan registers, read as architectures (and the families refused);
- `rope`: RoPE base and scaling, as config.json and the job's `[model]` keys say;
- `attention`: FlashCP's CP attention as TorchTitan's inner attention;
- `latent`: DeepSeek-V3's MLA exchanging latent rows (`cp_latent_attention`) instead of K and V;
- `offload`: full activation checkpointing's saved layer inputs in host memory (`[activation_checkpoint] offload`);
- `rotary`: RoPE rows for this rank's tokens, once per step, instead of a table in every layer;
- `windows`: a sliding-window model's dispatches (its full layers' and one per window), built together;
- `gated_deltanet`: Qwen3.5's hybrid text decoder (Gated DeltaNet on FlashCP's linear-attention ops),
  its dispatches and steps;
- `tiled_mlp`: the MLP over sequence tiles (`[activation_checkpoint] mlp_tiles`);
- `tiled_block`: a dense block's norms, MLP and FFN residual over the same tiles;
- `head_groups`: attention over groups of KV heads (`[activation_checkpoint] head_groups`).

May import: torch, TorchTitan, the core (plan, dispatch, attention), `flashcp.titan.config` (its
errors and flavor lists), `flashcp.titan.hf` (architectures read from config.json) and `compat`.
"""
