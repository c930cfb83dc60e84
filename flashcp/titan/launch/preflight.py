"""Checks of a job's inputs that open files: run once by the launcher, before any rank starts.

`flashcp.titan.config` checks every key without touching the disk; this opens what the job will
read -- the tokenizer, the data source (each source of a mixture) and the held-out data of
`[validation]`, down to the first document -- so that a missing file, an undecodable corpus, a
length filter that keeps nothing or a vocabulary the model cannot embed fails in seconds with one
line, instead of after the ranks spawned behind torchrun's start-up messages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flashcp.titan.config import ConfigError, dryrun_command, model_dims, model_head_dim
from flashcp.titan.components.heldout import held_out_data
from flashcp.data.mixture import build_data, open_first
from flashcp.data.sources import DataConfig, DEFAULT_TOKENIZER
from flashcp.data.tokenizer import load_tokenizer


def check_inputs(cfg: dict[str, Any]) -> int:
    """Load the tokenizer, check the model's vocabulary against it, open the data; DataError /
    TokenizerError / ConfigError name the problem. Returns the model's vocabulary size."""
    data = DataConfig(**cfg["data"])
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER if data.tokenizer == "default" else data.tokenizer)
    vocab = model_dims(cfg)[4]
    if vocab is not None and vocab < tokenizer.vocab_size:
        raise ConfigError(
            f"[model] vocab_size ({vocab}, flavor {cfg['model']['flavor']!r}) is smaller than the "
            f"tokenizer's vocabulary ({tokenizer.vocab_size}, [data] tokenizer = {data.tokenizer!r})"
        )
    open_first(build_data(data, tokenizer))  # reads and tokenises the first (kept) document
    held_out = held_out_data(cfg)
    if held_out is not None and (cfg["validation"]["enable"] or cfg["probe"]["enable"]):
        open_first(build_data(held_out, tokenizer))  # [validation] source, also the probe's haystack
    check_hf_import(cfg, tokenizer.vocab_size)
    check_export_files(cfg, tokenizer.path)
    return vocab or tokenizer.vocab_size


def check_export_files(cfg: dict[str, Any], tokenizer: Path) -> None:
    """With `last_save_in_hf`: ConfigError naming a file the export at the end of the run would refuse
    to carry (`flashcp.titan.hf.sidefiles`: a link out of its folder, not a regular file, too large,
    a bad generation_config.json), read now rather than after training."""
    ckpt = cfg["checkpoint"]
    if not ckpt["last_save_in_hf"]:
        return
    from flashcp.titan.hf.files import FolderFileError
    from flashcp.titan.hf.sidefiles import side_files

    source = str(Path(ckpt["initial_load_path"]).resolve()) if ckpt["initial_load_in_hf"] else None
    try:
        side_files(str(Path(tokenizer).resolve()), source)  # the paths a checkpoint's manifest records
    except FolderFileError as e:
        raise ConfigError(f"[checkpoint] last_save_in_hf: {e}") from e


def check_hf_import(cfg: dict[str, Any], tokenizer_vocab: int) -> None:
    """With `initial_load_in_hf`: ConfigError naming the first problem of the HF folder (config.json,
    a missing, truncated or malformed safetensors file, a tensor the model lacks or shapes it
    otherwise) against the job's model, from the files' headers, then any tensor holding NaN or
    inf, reading them all once (`flashcp.titan.hf.folder`)."""
    ckpt = cfg["checkpoint"]
    if not ckpt["initial_load_in_hf"]:
        return
    import torch

    from flashcp.titan.models.decoders import job_architecture, state_dict_adapter, titan_config
    from flashcp.titan.hf.config import HFConfigError, read_hf_config
    from flashcp.titan.hf.folder import check_finite, check_weights, HFFolderError

    path = Path(ckpt["initial_load_path"])
    try:
        if not path.is_dir():
            raise HFFolderError(f"{path} " + ("is not a folder" if path.exists() else "does not exist"))
        stored = read_hf_config(path)
        arch = job_architecture(cfg["model"], tokenizer_vocab, cfg["training"]["seq_len"])
        if stored.name != arch.name:
            raise HFFolderError(f"{path} holds a {stored.name} model but the job's model ([model] name "
                                f"{cfg['model']['name']!r}) is {arch.name}: name the folder's family or leave name "
                                "and flavor unset to train the folder's architecture")  # fmt: skip
        if (stored.experts is None) != (arch.experts is None):
            kinds = ("a mixture-of-experts", "a dense") if stored.experts else ("a dense", "a mixture-of-experts")
            raise HFFolderError(f"{path} holds {kinds[0]} {stored.name} model but the job's model ([model] flavor "
                                f"{cfg['model']['flavor']!r}) is {kinds[1]} one: name the folder's flavor or "
                                "leave flavor unset to train the folder's architecture")  # fmt: skip
        if stored.latent:
            _refuse_mtp(path, stored.n_layers)
        model_config = titan_config(arch, attn_backend="flex", max_seq_len=cfg["training"]["seq_len"])
        with torch.device("meta"):
            state = model_config.build().state_dict()
        check_weights(path, {k: tuple(v.shape) for k, v in state_dict_adapter(model_config).to_hf(state).items()})
        check_finite(path)
    except (HFConfigError, HFFolderError) as e:
        raise ConfigError(f"[checkpoint] initial_load_path: {e}") from e


def _refuse_mtp(path: Path, n_layers: int) -> None:
    """HFFolderError when a DeepSeek-V3 folder stores multi-token-prediction layers (`model.layers.<n_layers>`
    and on). FlashCP does not train them: an MTP layer reads each token's next-token embedding, which
    under CP lives on another rank for every shard's last token; importing the rest would drop them."""
    from flashcp.titan.hf.folder import HFFolderError, read_header, weight_files

    prefix = f"model.layers.{n_layers}."
    for file in weight_files(path):
        if any(name.startswith(prefix) for name in read_header(file)):
            raise HFFolderError(f"{path} holds a multi-token-prediction layer ({prefix}*), which FlashCP does not "
                                "train (next-token embeddings cross CP ranks): remove it from the folder (and set "
                                "num_nextn_predict_layers = 0) to train the main model")  # fmt: skip


def parameter_count(cfg: dict[str, Any], vocab: int) -> int:
    """A lower bound on the model's parameters.

    The feed-forward width is taken as 8/3 dim (flavors with a multiplier are wider), so estimates
    built on it never exceed the real size: a check on them refuses no run that fits.
    """
    dim, n_layers, n_heads, n_kv, _ = model_dims(cfg)
    head_dim = model_head_dim(cfg)
    per_layer = 2 * dim * n_heads * head_dim + 2 * dim * n_kv * head_dim + 3 * dim * (8 * dim // 3)
    return n_layers * per_layer + 2 * vocab * dim


def checkpoint_bytes(cfg: dict[str, Any], vocab: int) -> int:
    """A lower bound on one checkpoint's size: fp32 weights and AdamW's two fp32 moments."""
    return 12 * parameter_count(cfg, vocab)


def check_offload_memory(cfg: dict[str, Any], ranks_per_node: int, world_size: int | None = None) -> None:
    """ConfigError when the offloads would keep more host memory than the node has: with
    `[activation_checkpoint] offload` each rank pins every layer input but the last's
    (`flashcp.titan.models.offload`); with `[training] enable_cpu_offload` (FSDP2's CPU offload) each
    holds its shard of the fp32 weights, their gradients and AdamW's two moments, 16 bytes per
    parameter (at least: `parameter_count`) over the world's ranks but dp_replicate's copies."""
    ac, train, par = cfg["activation_checkpoint"], cfg["training"], cfg["parallelism"]
    inputs = ac["mode"] == "full" and ac["offload"]
    if not inputs and not train["enable_cpu_offload"]:
        return
    import torch

    from flashcp.titan.models.offload import offload_bytes_per_rank

    dim, n_layers = model_dims(cfg)[:2]
    held, per_rank = [], 0.0
    if inputs:
        dtype_bytes = torch.finfo(getattr(torch, train["mixed_precision_param"])).bits // 8
        tp = par["tensor_parallel_degree"] if par["enable_sequence_parallel"] else 1
        per_rank += offload_bytes_per_rank(n_layers, train["seq_len"], par["context_parallel_degree"], dim, dtype_bytes,
                                           train["local_batch_size"], tp)  # fmt: skip
        held.append(f"[activation_checkpoint] offload = true: {n_layers - 1} layer inputs")
    if train["enable_cpu_offload"]:
        shard = 16 * parameter_count(cfg, model_dims(cfg)[4] or 0) * par["data_parallel_replicate_degree"] / \
            (world_size or ranks_per_node)  # fmt: skip
        per_rank += shard
        held.append(f"[training] enable_cpu_offload = true: {shard / 2**30:.1f} GiB of fp32 weights, gradients and "
                    "AdamW states at least")  # fmt: skip
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if per_rank * ranks_per_node > have:
        raise ConfigError(
            f"the offloads keep {per_rank / 2**30:.1f} GiB of host memory per rank ({'; '.join(held)}), "
            f"{per_rank * ranks_per_node / 2**30:.0f} GiB for this node's {ranks_per_node} ranks, which has "
            f"{have / 2**30:.0f} GiB; set them false or raise context_parallel_degree (more ranks)"
        )


def check_cpu_memory(cfg: dict[str, Any], ranks_per_node: int, world_size: int) -> None:
    """ConfigError when the model cannot train on this machine's CPUs: fp32 weights, gradients and
    AdamW's two moments (16 bytes per parameter), sharded over every rank at best, against the
    node's memory. Run first on CPU machines, so a GPU job is named as such before anything else."""
    params = parameter_count(cfg, model_dims(cfg)[4] or 0)
    need = 16 * params / world_size * ranks_per_node
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        model = cfg["model"]
        raise ConfigError(
            f"no GPU found, and {model['name']} {model['flavor']} (at least {params / 1e9:.1f}B parameters) is not a CPU "
            f"job: its weights, gradients and AdamW states alone need at least {need / 2**30:.0f} GiB on this "
            f"node's {ranks_per_node} CPU rank(s), which has {have / 2**30:.0f} GiB of memory; run it on a "
            "machine whose GPUs torch can see, or check its memory per GPU here, without GPUs: "
            f"{dryrun_command(cfg['_path'], world_size)}"
        )
