"""A job's keys against `SCHEMA`, then every check that needs several keys but no world size.

`validate` names unknown sections and keys with the allowed ones, checks types and choices, fills
defaults, refuses settings FlashCP cannot combine with (experts for a dense model, what its pipeline
parallelism does not run yet, `pipeline.py`, TorchTitan's own CP knobs under FlashCP attention, ...), values that would train wrongly or exhaust the machine
(a model's sizes among them: `sizes`), and finally runs TorchTitan's own checks by building its
config objects, all before any process starts. Checks that need the number of ranks are
`flashcp.titan.config.layout`.
"""

from __future__ import annotations

import os
from typing import Any

from flashcp.costmodel.model import window_exchange
from flashcp.titan.config.converters import check_converters, model_compiled
from flashcp.titan.config.families import check_families
from flashcp.titan.config.keys import check_value, ConfigError
from flashcp.data.errors import DataError
from flashcp.data.sources import DataConfig
from flashcp.titan.config.model import check_model, model_dims, model_latent
from flashcp.titan.config.pipeline import check_pipeline
from flashcp.titan.config.schema import RANKS_PER_NODE_COMMS, RENAMED_SECTIONS, SCHEMA
from flashcp.titan.config.scope import check_mesh_scope
from flashcp.titan.config.sizes import check_host_objects
from flashcp.titan.config.titan import ac_keys, section_config, TITAN_KEYS

MAX_SEQ_LEN = 2**31 - 1  # cu_seqlens (flashcp.dispatch, the varlen kernels) are int32
WINDOW_BYTES_PER_TOKEN = 16  # a window's int64 tokens and labels, a lower bound on the loader's memory
MAX_PREFETCH = 64  # windows the loader's thread builds ahead; more only costs memory


def validate(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Types, choices and known names; returns every section with defaults filled in."""
    for section, values in raw.items():
        if section in RENAMED_SECTIONS:
            raise ConfigError(f"unknown section [{section}]: TorchTitan's [{section}] is [{RENAMED_SECTIONS[section]}] "
                              "in a FlashCP job")  # fmt: skip
        if section not in SCHEMA:
            raise ConfigError(f"unknown section [{section}]; allowed sections: {', '.join(SCHEMA)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of settings, got {values!r}")
        for name in values:
            if name not in SCHEMA[section]:
                raise ConfigError(
                    f"unknown key [{section}] {name}; allowed keys: {', '.join(SCHEMA[section])}"
                )
    cfg: dict[str, dict[str, Any]] = {}
    for section, keys in SCHEMA.items():
        given = raw.get(section, {})
        cfg[section] = {
            name: check_value(section, name, key, given[name]) if name in given else key.default
            for name, key in keys.items()
        }
    cfg["_given"] = {section: sorted(values) for section, values in raw.items()}
    cfg["_warnings"] = []  # one line each, printed once the job is known to run (`--check`, the launcher)
    # Relative to the directory the job is started from, resolved once so that nothing depends
    # on a later working directory and everything printed is absolute.
    cfg["job"]["dump_folder"] = os.path.abspath(cfg["job"]["dump_folder"])
    if cfg["checkpoint"]["initial_load_path"]:  # the same for the folder loaded first (TorchTitan wants it absolute)
        cfg["checkpoint"]["initial_load_path"] = os.path.abspath(cfg["checkpoint"]["initial_load_path"])
    _check_semantics(cfg)
    _check_torchtitan(cfg)
    return cfg


def _given(cfg: dict, section: str) -> list[str]:
    return cfg["_given"].get(section, [])


def _positive(cfg: dict, section: str, *names: str, minimum: int = 1) -> None:
    for name in names:
        value = cfg[section][name]
        if value is not None and value < minimum:
            raise ConfigError(f"[{section}] {name} must be >= {minimum}, got {value}")


def _check_semantics(cfg: dict) -> None:
    """Checks that need several keys but no world size."""
    try:  # the data pipeline's own checks of [data] (choices, bounds, a mixture's entries)
        DataConfig(**cfg["data"])
    except DataError as e:
        raise ConfigError(str(e)) from e
    par, fcp = cfg["parallelism"], cfg["flashcp"]
    _positive(cfg, "training", "seq_len", "steps", "local_batch_size", "gc_freq")
    names = ("data_parallel_replicate_degree", "context_parallel_degree", "tensor_parallel_degree")
    _positive(cfg, "parallelism", *names)
    _positive(cfg, "checkpoint", "interval")
    _positive(cfg, "metrics", "log_freq")
    _check_profiler(cfg)
    _positive(cfg, "loss", "chunk_tokens", minimum=0)
    _positive(cfg, "lr_scheduler", "warmup_steps", minimum=0)
    _positive(cfg, "lr_scheduler", "total_steps")
    shard = par["data_parallel_shard_degree"]
    if shard == 0 or shard < -1:
        raise ConfigError(f"[parallelism] data_parallel_shard_degree must be -1 or >= 1, got {shard}")
    if cfg["checkpoint"]["keep_latest_k"] < 0 or cfg["checkpoint"]["keep_latest_k"] == 1:
        raise ConfigError(
            "[checkpoint] keep_latest_k must be 0 (keep all) or >= 2 (the newest may be mid-write), "
            f"got {cfg['checkpoint']['keep_latest_k']}"
        )
    for name in ("create_seed_checkpoint", "initial_load_path", "last_save_in_hf"):
        if cfg["checkpoint"][name] and not cfg["checkpoint"]["enable"]:
            raise ConfigError(f"[checkpoint] {name} needs [checkpoint] enable = true")
    if cfg["checkpoint"]["initial_load_in_hf"] and not cfg["checkpoint"]["initial_load_path"]:
        raise ConfigError("[checkpoint] initial_load_in_hf needs initial_load_path (the Hugging Face model folder)")
    if cfg["checkpoint"]["initial_load_in_hf_quantized"]:
        raise ConfigError("[checkpoint] initial_load_in_hf_quantized: quantized Hugging Face weights are not supported "
                          "(FlashCP imports float safetensors)")  # fmt: skip
    _check_optimizer(cfg)
    _check_bounds(cfg)
    _check_validation(cfg)
    _check_probe(cfg)
    if not fcp["target_imbalance"] >= 1.0:
        raise ConfigError(f"[flashcp] target_imbalance must be >= 1.0, got {fcp['target_imbalance']}")
    check_model(cfg)
    check_host_objects(cfg)  # before anything is built from the model's sizes
    check_converters(cfg, cfg["_given"])
    _check_attention(cfg)
    _check_ranks_per_node(cfg)  # after [flashcp] is reset for TorchTitan's attention
    _check_window_comm(cfg)
    _check_ring(cfg)
    _check_plan_worker(cfg)
    _check_settings_in_effect(cfg)
    _check_unsupported(cfg)
    check_mesh_scope(cfg)


def _check_ranks_per_node(cfg: dict) -> None:
    """`[flashcp] ranks_per_node` (the two-level exchange's simulated nodes) divides the CP degree."""
    fcp, cp = cfg["flashcp"], cfg["parallelism"]["context_parallel_degree"]
    g = fcp["ranks_per_node"]
    if fcp["scope"] == "mesh" and g >= 0:  # it divides DP x CP: checked at start (flashcp.titan.mesh_scope)
        return
    if g < 0 or (g and cp % g):
        raise ConfigError(
            f"[flashcp] ranks_per_node must be 0 (from the launch) or a divisor of context_parallel_degree "
            f"({cp}): the CP group's ranks per node, got {g}"
        )


def _check_window_comm(cfg: dict) -> None:
    """`[flashcp] window_comm` is an exchange the window dispatch can build beside `comm`
    (`window_exchange`: two_level only on the job's own node layout); the ring takes no window."""
    fcp = cfg["flashcp"]
    if fcp["comm"] == "ring":  # _check_settings_in_effect names a window_comm set beside it
        return
    try:
        window_exchange(fcp["comm"], fcp["window_comm"])
    except ValueError as e:
        raise ConfigError(f"[flashcp] {e}") from e


def _check_plan_worker(cfg: dict) -> None:
    """The planning worker's time-out is below the peers' collective time-out, so that a hung worker
    is named by its own rank before the peers fail in a collective naming nothing; 0 (the default)
    resolves to half of it."""
    fcp, train = cfg["flashcp"], cfg["comm"]["train_timeout_seconds"]
    timeout = fcp["plan_worker_timeout_seconds"]
    if timeout == 0:
        fcp["plan_worker_timeout_seconds"] = train / 2
    elif not 0 < timeout < train:
        raise ConfigError(f"[flashcp] plan_worker_timeout_seconds must be 0 (half of [comm] train_timeout_seconds) or "
                          f"> 0 and below [comm] train_timeout_seconds ({train}), got {timeout}")  # fmt: skip


def _quoted(values: tuple[str, ...]) -> str:
    return " or ".join(repr(v) for v in values)


def _check_settings_in_effect(cfg: dict) -> None:
    """A key set in the job that the chosen mode does not read is refused, naming the mode: a setting
    that silently does nothing is a mistake the user believes was applied."""
    fcp, data = cfg["flashcp"], cfg["data"]
    trained = [data["source"], *(entry.get("source", "") for entry in data["mix"].values())]
    sources = [*trained, cfg["validation"]["source"] or ""]  # held-out data reads [data]'s settings but hf_split
    deferring, targeted = ("deferral", "deferral-cut"), ("deferral", "deferral-cut", "mesh-cut")
    rules = [  # (section, key, whether it takes effect, the mode that ignores it, the modes that use it)
        ("data", "max_delay_steps", data["balance"] in deferring, f"balance = {data['balance']!r}",
         f"balance = {_quoted(deferring)}"),
        ("data", "balance_target", data["balance"] in targeted, f"balance = {data['balance']!r}",
         f"balance = {_quoted(targeted)}"),
        ("data", "min_pairs_kept", data["balance"] == "deferral-cut", f"balance = {data['balance']!r}",
         "balance = 'deferral-cut'"),
        ("data", "synthetic_lengths", "synthetic" in sources, "no synthetic source", 'a "synthetic" source'),
        ("data", "hf_config", any(s.startswith("hf:") for s in sources), "no hub source", 'an "hf:NAME" source'),
        ("data", "hf_split", any(s.startswith("hf:") for s in trained), "no hub source in [data]",
         'an "hf:NAME" source of [data]'),
    ]  # fmt: skip
    if cfg["model"]["attention"] == "flashcp":  # else [flashcp] is ignored whole (_check_attention warns)
        rules += [
            # scope = "auto" may become "mesh" once DP is known: flashcp.titan.config.scope.resolve_scope checks then
            ("flashcp", "ranks_per_node", fcp["comm"] in RANKS_PER_NODE_COMMS or fcp["scope"] != "group",
             f"comm = {fcp['comm']!r}", f"comm = {_quoted(RANKS_PER_NODE_COMMS)} or scope = 'mesh'"),
            ("flashcp", "plan_worker_timeout_seconds", fcp["plan_worker"], "plan_worker = false", "plan_worker = true"),
            ("flashcp", "window_comm", fcp["comm"] != "ring", "comm = 'ring'", "a collective comm"),
        ]  # fmt: skip
    for section, key, in_effect, mode, users in rules:
        if key in _given(cfg, section) and not in_effect:
            raise ConfigError(f"[{section}] {key} = {cfg[section][key]!r} has no effect with {mode}: only {users} "
                              "uses it; remove it or choose that mode")  # fmt: skip


def _check_ring(cfg: dict) -> None:
    """The ring runs every step's kernel beside its transfer already, on kernels with an LSE backward."""
    fcp = cfg["flashcp"]
    if fcp["comm"] != "ring":
        return
    if fcp["overlap"]:
        raise ConfigError("[flashcp] overlap = true is for the collective exchanges; comm = 'ring' overlaps "
                          "each step's transfer with its kernel already: set overlap = false")  # fmt: skip
    if fcp["backend"] == "flash_attn":
        raise ConfigError("[flashcp] comm = 'ring' runs on backend 'torch' or 'reference' (it needs a kernel "
                          "backward from the merged output and LSE); got 'flash_attn'")  # fmt: skip


def _check_attention(cfg: dict) -> None:
    """FlashCP's attention and TorchTitan's own CP exclude each other's settings."""
    model, train, par = cfg["model"], cfg["training"], cfg["parallelism"]
    if model["attention"] == "flashcp":
        if train["local_batch_size"] != 1 and par["pipeline_parallel_degree"] == 1:
            raise ConfigError(
                "[training] local_batch_size must be 1 with FlashCP (one window per rank and micro step; "
                "use global_batch_size for more windows per step, or with pipeline parallelism its "
                f"microbatches), got {train['local_batch_size']}"
            )
        for name in ("context_parallel_load_balancer", "context_parallel_ptrr_mask_key"):
            if name in _given(cfg, "parallelism"):
                raise ConfigError(
                    f"[parallelism] {name} is TorchTitan's CP; with model.attention = 'flashcp' the "
                    "sharding is [flashcp] strategy"
                )
    elif "flashcp" in cfg["_given"]:
        # The shipped jobs carry a [flashcp] table: one override compares TorchTitan's attention / CP on them.
        cfg["_warnings"].append(
            f"[flashcp] is ignored: model.attention = {model['attention']!r} runs TorchTitan's own attention"
            + (" and CP" if par["context_parallel_degree"] > 1 else "")
        )
        cfg["flashcp"] = {name: key.default for name, key in SCHEMA["flashcp"].items()}
    if model["attention"] == "varlen" and par["context_parallel_degree"] > 1:
        raise ConfigError(
            "model.attention = 'varlen' has no CP in TorchTitan 0.3.0; use 'flashcp' or 'flex' with "
            "context_parallel_degree > 1"
        )
    if par["spmd_backend"] not in (None, "partial_dtensor") and model["attention"] == "flashcp":
        raise ConfigError(
            "[parallelism] spmd_backend must be 'partial_dtensor' with FlashCP attention, "
            f"got {par['spmd_backend']!r}"
        )


def _check_unsupported(cfg: dict) -> None:
    """TorchTitan settings FlashCP cannot combine with, refused with the reason."""
    par, debug, ac = cfg["parallelism"], cfg["debug"], cfg["activation_checkpoint"]
    check_pipeline(cfg, _given(cfg, "parallelism"))
    _positive(cfg, "parallelism", "expert_parallel_degree")
    check_families(cfg)
    if debug["batch_invariant"]:
        raise ConfigError("[debug] batch_invariant: TorchTitan 0.3.0's trainer has no batch-invariant mode "
                          "for pre-training")  # fmt: skip
    mode = cfg["comm"]["mode"]
    if mode in ("local_tensor", "torchcomms"):
        raise ConfigError(
            f"[comm] mode = {mode!r} is not supported: FlashCP's KV exchange runs torch.distributed "
            "collectives between one process per rank ('default', or 'fake_backend' for a dry run)"
        )
    _positive(cfg, "activation_checkpoint", "mlp_tiles", minimum=-1)  # -1: automatic
    _check_head_groups(cfg)
    stray = sorted(set(_given(cfg, "activation_checkpoint")) - ac_keys(ac["mode"]))
    if stray:
        raise ConfigError(f"[activation_checkpoint] {stray[0]} does not apply to mode = {ac['mode']!r}")
    compiled = model_compiled(cfg)
    if ac["mode"] == "memory-budget" and not compiled:
        raise ConfigError("[activation_checkpoint] mode = 'memory-budget' needs the model compiled: "
                          "[compile] enable = true with 'model' in components")  # fmt: skip
    if ac["offload"] and compiled:
        raise ConfigError("[activation_checkpoint] offload = true hooks each block's saved tensors in eager mode: "
                          "not with the model compiled ([compile] enable with 'model' in components)")  # fmt: skip


def _check_head_groups(cfg: dict) -> None:
    """`[activation_checkpoint] head_groups` (flashcp.titan.models.head_groups) runs the full-attention
    GQAttention layers of Llama 3 and Qwen3 (MoE included) on FlashCP's op, without TP; G divides n_kv_heads."""
    model, groups = cfg["model"], cfg["activation_checkpoint"]["head_groups"]
    if groups == 0 or groups < -1:
        raise ConfigError(f"[activation_checkpoint] head_groups must be -1 (automatic) or >= 1, got {groups}")
    if cfg["activation_checkpoint"]["head_group_prefetch"]:
        refused = [(groups == 1, "head_groups = 1 (no groups: set head_groups to 2 or more, or -1)"),
                   (model_compiled(cfg), "the model compiled (a compiled block launches each group's exchange "
                                         "itself)"),
                   (cfg["flashcp"]["comm"] == "ring", "[flashcp] comm = 'ring' (the ring has no exchange to launch "
                                                      "ahead)")]  # fmt: skip
        for bad, what in refused:
            if bad:
                raise ConfigError(f"[activation_checkpoint] head_group_prefetch = true: not with {what}")
    if groups == 1:
        return
    refused = [
        (model["attention"] != "flashcp", f"[model] attention = {model['attention']!r} (the groups call FlashCP's op)"),
        (model["name"] in ("gpt_oss", "qwen3_5") or model_latent(cfg) is not None,
         f"a {model['name']} model (the groups run Llama 3's and Qwen3's full attention: not MLA, sinks, "
         "sliding windows or hybrids)"),
        (cfg["parallelism"]["tensor_parallel_degree"] != 1, "[parallelism] tensor_parallel_degree > 1 (TP splits "
                                                            "the heads already)"),
        (bool(model["converters"]), f"[model] converters {model['converters']} (the groups multiply by rows of the "
                                    "weights, not through the converted linears)"),
    ]  # fmt: skip
    for bad, what in refused:
        if bad:
            raise ConfigError(f"[activation_checkpoint] head_groups = {groups}: not with {what}")
    n_kv_heads = model_dims(cfg)[3]
    if groups != -1 and n_kv_heads % groups:
        raise ConfigError(f"[activation_checkpoint] head_groups ({groups}) must divide the model's {n_kv_heads} "
                          "KV heads")  # fmt: skip


def _check_profiler(cfg: dict) -> None:
    """TorchTitan's profiler asserts its schedule on every rank at the first step; checked here instead."""
    prof = cfg["profiler"]
    _positive(cfg, "profiler", "profile_freq", "profiler_active", "memory_snapshot_freq")
    _positive(cfg, "profiler", "profiler_warmup", "profiler_repeat", "profiler_skip_first",
              "profiler_skip_first_wait", minimum=0)  # fmt: skip
    if prof["enable_profiling"] and prof["profile_freq"] < prof["profiler_warmup"] + prof["profiler_active"]:
        raise ConfigError(
            f"[profiler] profile_freq ({prof['profile_freq']}) must be >= profiler_warmup + profiler_active "
            f"({prof['profiler_warmup']} + {prof['profiler_active']}): each profiled window of steps holds both"
        )


def _check_torchtitan(cfg: dict) -> None:
    """TorchTitan's own checks (its config classes' __post_init__), named by section, before launch.
    Enabling FSDP symmetric memory checks the GPU, which `layout.check_layout` does instead."""
    symm_mem = cfg["parallelism"]["enable_fsdp_symm_mem"]
    cfg["parallelism"]["enable_fsdp_symm_mem"] = False
    try:
        for section in TITAN_KEYS:
            try:
                section_config(cfg, section)
            except ValueError as e:
                raise ConfigError(f"[{section}] {e}") from e
    finally:
        cfg["parallelism"]["enable_fsdp_symm_mem"] = symm_mem


def _check_validation(cfg: dict) -> None:
    """Validation needs held-out data: reading the training data would hide overfitting, so there is no default."""
    val = cfg["validation"]
    _positive(cfg, "validation", "freq", "bucket_min")
    if val["steps"] == 0 or val["steps"] < -1:
        raise ConfigError(f"[validation] steps must be >= 1 (windows per data-parallel rank) or -1 (the whole "
                          f"held-out data), got {val['steps']}")  # fmt: skip
    if val["enable"] and val["source"] is None:
        raise ConfigError(
            '[validation] enable = true needs [validation] source, the held-out data (as [data] source; "default": '
            "the shipped corpus's held-out split)"
        )


def _check_probe(cfg: dict) -> None:
    """The probe's grid fits the window, and its haystack is held-out text (`flashcp.titan.probe`)."""
    probe, seq_len = cfg["probe"], cfg["training"]["seq_len"]
    _positive(cfg, "probe", "freq", "min_length", "samples", "key_digits")
    if probe["key_digits"] > 18:
        raise ConfigError(f"[probe] key_digits must be <= 18, got {probe['key_digits']}")
    too_long = [n for n in probe["lengths"] if not 1 <= n <= seq_len]
    if too_long:
        raise ConfigError(f"[probe] lengths must be in [1, seq_len = {seq_len}] (each prompt fits a window), "
                          f"got {too_long[0]}")  # fmt: skip
    if len(set(probe["lengths"])) != len(probe["lengths"]):
        raise ConfigError(f"[probe] lengths must differ from each other, got {probe['lengths']}")
    depths = probe["depths"]
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths) or len(set(depths)) != len(depths):
        raise ConfigError(f"[probe] depths must be distinct fractions in [0, 1] (0: the haystack's start), got {depths}")
    if probe["enable"] and cfg["validation"]["source"] is None:
        raise ConfigError('[probe] enable = true needs [validation] source: the haystack is held-out text (as [data] '
                          'source; "default": the shipped corpus\'s held-out split)')
    if probe["enable"] and cfg["model"]["attention"] != "flashcp":
        raise ConfigError("[probe] enable = true needs model.attention = 'flashcp': the probe runs FlashCP's CP path")


def _check_bounds(cfg: dict) -> None:
    """Values that pass every type check yet would hang or exhaust the machine instead of failing:
    a zero timeout, a window larger than the host's memory, an unbounded prefetch queue."""
    _positive(cfg, "comm", "init_timeout_seconds", "train_timeout_seconds")
    prefetch = cfg["data"]["prefetch"]
    if not 0 <= prefetch <= MAX_PREFETCH:
        raise ConfigError(f"[data] prefetch must be in [0, {MAX_PREFETCH}] (windows the loader builds ahead; "
                          f"more only holds memory), got {prefetch}")  # fmt: skip
    seq_len = cfg["training"]["seq_len"]
    if seq_len > MAX_SEQ_LEN:
        raise ConfigError(f"[training] seq_len ({seq_len}) must be < 2**31: the attention kernels index a "
                          "window with int32")  # fmt: skip
    need = seq_len * WINDOW_BYTES_PER_TOKEN
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ConfigError(
            f"[training] seq_len ({seq_len}) is too long for this host: one window's int64 tokens and labels "
            f"alone need {need / 2**30:.1f} GiB and it has {have / 2**30:.1f} GiB of memory"
        )


def _check_optimizer(cfg: dict) -> None:
    """Values that would train silently wrong (a negative lr is gradient ascent) or not at all."""
    opt, sched, train = cfg["optimizer"], cfg["lr_scheduler"], cfg["training"]
    rules = [
        ("optimizer", "lr", opt["lr"] > 0, "> 0"),
        ("optimizer", "eps", opt["eps"] > 0, "> 0"),
        ("optimizer", "beta1", 0 <= opt["beta1"] < 1, "in [0, 1)"),
        ("optimizer", "beta2", 0 <= opt["beta2"] < 1, "in [0, 1)"),
        ("optimizer", "weight_decay", opt["weight_decay"] >= 0, ">= 0"),
        ("training", "max_norm", train["max_norm"] > 0, "> 0"),
        ("lr_scheduler", "min_lr_factor", 0 <= sched["min_lr_factor"] <= 1, "in [0, 1]"),
        ("lr_scheduler", "decay_ratio", sched["decay_ratio"] is None or 0 <= sched["decay_ratio"] <= 1, "in [0, 1]"),
    ]
    for section, name, ok, allowed in rules:
        if not ok:
            raise ConfigError(f"[{section}] {name} must be {allowed}, got {cfg[section][name]}")
    total, total_name = (sched["total_steps"], "[lr_scheduler] total_steps") if sched["total_steps"] else \
        (train["steps"], "[training] steps")  # fmt: skip
    if sched["warmup_steps"] > total:
        default = "" if "warmup_steps" in _given(cfg, "lr_scheduler") else ", the default"
        raise ConfigError(
            f"[lr_scheduler] warmup_steps ({sched['warmup_steps']}{default}) must be <= {total_name} ({total})"
        )
