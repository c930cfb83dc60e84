"""Create a tiny random Hugging Face Llama (or Qwen3, Qwen3-MoE, DeepSeek-V3, gpt-oss, Qwen3.5-MoE, Qwen3-Next) folder, to try importing / exporting without downloads.

    python scripts/make_tiny_hf.py /tmp/tiny-llama           # Llama, vocab 4096 (the shipped tokenizer's)
    python scripts/make_tiny_hf.py /tmp/tiny-qwen3 --model-type qwen3
    python scripts/make_tiny_hf.py /tmp/tiny-qwen3-moe --model-type qwen3_moe   # 8 experts, top-2
    python scripts/make_tiny_hf.py /tmp/tiny-deepseek --model-type deepseek_v3  # MLA, a dense layer then MoE
    python scripts/make_tiny_hf.py /tmp/tiny-gpt-oss --model-type gpt_oss       # window + full layers, sinks
    python scripts/make_tiny_hf.py /tmp/tiny-qwen3-5-moe --model-type qwen3_5_moe_text  # Gated DeltaNet + MoE
    python scripts/make_tiny_hf.py /tmp/tiny-qwen3-next --model-type qwen3_next  # the same, fused projections

Written with `transformers` (the test extra: pip install -e .[test]) as `save_pretrained` writes
any HF model: config.json and model.safetensors, plus the shipped tokenizer's files, so that the
folder loads in transformers and imports into FlashCP (`[checkpoint] initial_load_in_hf`). The
weights are random (seeded): the point is the plumbing, not the text it writes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "data" / "default"  # the shipped tokenizer: 4,096 tokens


def tiny_config(model_type: str = "llama", vocab_size: int = 4096, **overrides: Any) -> Any:
    """A small GQA config: 2 layers, 4 heads over 2 KV heads, dim 32, context 512 (Qwen3: head_dim 16, tied
    embeddings; Qwen3-MoE: Qwen3 untied, 8 experts of width 16 per layer, top-2; DeepSeek-V3: MLA with
    kv_lora_rank 32 and q_lora_rank 24, YaRN, 3 layers, the first dense, then 8 experts, top-2, and a shared one;
    gpt-oss: a sliding layer (16 keys) then a full one, heads of 8, YaRN, 8 biased experts of width 24, top-2;
    Qwen3.5-MoE text and Qwen3-Next: 3 Gated DeltaNet layers (2 key heads, 4 value heads, of 8) then a gated
    full one (heads of 8, RoPE on half), 8 experts of width 16, top-2, and a sigmoid-gated shared one of 24)."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    if model_type == "llama":  # a short context and a small RoPE base: the starting point of an extension
        return transformers.LlamaConfig(**(common | {"rope_theta": 10000.0} | overrides))
    if model_type == "qwen3":
        qwen = {"head_dim": 16, "tie_word_embeddings": True, "rope_theta": 1000000.0}
        return transformers.Qwen3Config(**(common | qwen | overrides))
    if model_type == "qwen3_moe":
        moe = {"head_dim": 16, "rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 16, "norm_topk_prob": True}  # fmt: skip
        return transformers.Qwen3MoeConfig(**(common | moe | overrides))
    if model_type == "deepseek_v3":
        mla = {
            "num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 24,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "first_k_dense_replace": 1,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
            "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_mtp_layers": 0,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                                "mscale_all_dim": 0.707, "original_max_position_embeddings": 128},
        }  # fmt: skip
        return transformers.DeepseekV3Config(**(common | mla | overrides))
    if model_type == "gpt_oss":
        oss = {
            "head_dim": 8, "intermediate_size": 24, "num_local_experts": 8, "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16, "swiglu_limit": 7.0,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
        }  # fmt: skip
        return transformers.GptOssConfig(**(common | oss | overrides))
    if model_type in ("qwen3_5_moe_text", "qwen3_next"):
        hybrid = {
            "num_hidden_layers": 4, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        }  # fmt: skip
        if model_type == "qwen3_next":
            return transformers.Qwen3NextConfig(**(common | hybrid | overrides))
        common.pop("intermediate_size")  # the MoE text decoder has no dense feed-forward
        return transformers.Qwen3_5MoeTextConfig(**(common | hybrid | overrides))
    raise ValueError(f"model type {model_type!r}: llama, qwen3, qwen3_moe, deepseek_v3, gpt_oss, qwen3_5_moe_text "
                     "or qwen3_next")


def make_tiny_hf(folder: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny model (random weights from `seed`) and the shipped tokenizer into `folder`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    if model_type == "gpt_oss":  # transformers starts the biases at zero: drawn, so that they count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(std=0.3)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / name, Path(folder) / name)
    return Path(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("folder", type=Path, help="where to write the model (must not exist)")
    parser.add_argument("--model-type", default="llama", choices=("llama", "qwen3", "qwen3_moe", "deepseek_v3",
                                                                  "gpt_oss", "qwen3_5_moe_text", "qwen3_next"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.folder.exists():
        print(f"error: {args.folder} exists; choose a new folder", file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("error: this script needs transformers (pip install -e .[test])", file=sys.stderr)
        return 2
    make_tiny_hf(args.folder, args.model_type, args.seed)
    print(f"tiny {args.model_type} written to {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
