"""Pipeline parallelism's settings, checked before launch.

A pipeline microbatch is one packed window with its own plan (microbatch size 1), so
`[training] local_batch_size` is the number of microbatches per optimizer micro step. The stages
are TorchTitan's split (`pipeline_llm`); its layer arithmetic is asked here, with the job's layers,
so that a degree that cannot split them is refused in one line instead of on every rank.
"""

from __future__ import annotations

from types import SimpleNamespace

from flashcp.titan.config.keys import ConfigError
from flashcp.titan.config.converters import model_compiled
from flashcp.titan.config.model import model_dims
from flashcp.titan.config.schema import SCHEMA

# [parallelism] keys that only configure pipeline parallelism (the degree itself aside).
PIPELINE_KEYS = ("module_fqns_per_model_part",) + tuple(
    name for name in SCHEMA["parallelism"] if name.startswith("pipeline_parallel_") and name != "pipeline_parallel_degree"
)
# TorchTitan 0.3.0's schedules (torch's `get_schedule_class`), each run with FlashCP's per-window
# dispatches in tests/titan/test_pp_train.py; the zero-bubble ones split each backward in two (input,
# then weight gradients), DualPipeV overlaps one microbatch's forward with another's backward.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Those run with tensor parallelism and with [compile] enable ('model') in tests/titan/test_pp_tp.py; the
# others are refused with either until run (compiled, the first tried, InterleavedZeroBubble, did not
# finish on CPU in 15 minutes).
TP_AND_COMPILE_SCHEDULES = ("1F1B", "Interleaved1F1B")


def check_pipeline(cfg: dict, given: list[str]) -> None:
    """`[parallelism] pipeline_parallel_*` against the model, the schedule and what FlashCP's PP runs;
    `given`: the [parallelism] keys the job sets."""
    par = cfg["parallelism"]
    pp = par["pipeline_parallel_degree"]
    if pp < 1:
        raise ConfigError(f"[parallelism] pipeline_parallel_degree must be >= 1, got {pp}")
    if pp == 1:
        stray = [name for name in given if name in PIPELINE_KEYS]
        if stray:
            raise ConfigError(f"[parallelism] {stray[0]} only applies to pipeline parallelism "
                              "(pipeline_parallel_degree > 1)")  # fmt: skip
        return
    _check_machine()
    _check_combinations(cfg)
    schedule = par["pipeline_parallel_schedule"]
    if schedule.lower() not in {s.lower() for s in SCHEDULES}:
        raise ConfigError(f"[parallelism] pipeline_parallel_schedule = {schedule!r}: FlashCP runs "
                          f"{', '.join(SCHEDULES)}")  # fmt: skip
    limited = [(model_compiled(cfg), "[compile] enable with 'model'"),
               (par["tensor_parallel_degree"] > 1, "[parallelism] tensor_parallel_degree > 1")]  # fmt: skip
    for on, what in limited:
        if on and schedule.lower() not in {s.lower() for s in TP_AND_COMPILE_SCHEDULES}:
            raise ConfigError(f"[parallelism] pipeline_parallel_schedule = {schedule!r} does not run with {what} "
                              f"(checked with it: {', '.join(TP_AND_COMPILE_SCHEDULES)})")  # fmt: skip
    if par["pipeline_parallel_microbatch_size"] != 1:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_microbatch_size must be 1 with FlashCP (a microbatch is one packed "
            f"window; [training] local_batch_size sets how many), got {par['pipeline_parallel_microbatch_size']}"
        )
    stages = _check_stages(cfg)
    microbatches = cfg["training"]["local_batch_size"]
    if schedule.lower() in ("1f1b", "dualpipev") and microbatches < stages:
        raise ConfigError(
            f"[training] local_batch_size ({microbatches}, the pipeline's microbatches) must be >= its {stages} "
            f"stages for schedule {schedule!r} (pipeline_parallel_degree {pp} x {stages // pp} stage(s) per rank)"
        )
    rounds = max(1, microbatches // pp)  # torch's Interleaved1F1B runs its microbatches in rounds of pp
    if schedule.lower() == "interleaved1f1b" and microbatches % rounds:
        raise ConfigError(f"[training] local_batch_size ({microbatches}, the pipeline's microbatches) must be a "
                          f"multiple of {rounds} (rounds of pipeline_parallel_degree {pp}) for schedule "
                          "'Interleaved1F1B'")  # fmt: skip


def _check_machine() -> None:
    from flashcp.titan import compat

    problem = compat.pipeline_problem()
    if problem:
        raise ConfigError(f"[parallelism] pipeline_parallel_degree > 1 cannot run here: {problem}")


def _check_combinations(cfg: dict) -> None:
    """What FlashCP's pipeline does not run yet, one line each."""
    fcp, model = cfg["flashcp"], cfg["model"]
    refused = [
        (model["attention"] != "flashcp", f"[model] attention = {model['attention']!r} (TorchTitan's own attention "
                                          "is compared with FlashCP's without PP)"),
        (model["name"] == "qwen3_5", "a qwen3_5 model (its Gated DeltaNet steps are not pipeline kwargs yet)"),
        (fcp["comm"] == "ring", "[flashcp] comm = 'ring'"),
        (fcp["overlap"], "[flashcp] overlap = true"),
        (cfg["activation_checkpoint"]["offload"], "[activation_checkpoint] offload = true"),
        (cfg["validation"]["enable"], "[validation] enable (held-out windows run the model whole)"),
        (cfg["probe"]["enable"], "[probe] enable (the probe runs the model whole)"),
        (cfg["checkpoint"]["initial_load_in_hf"], "[checkpoint] initial_load_in_hf (a stage's import of a "
                                                  "Hugging Face folder is not checked yet)"),
        (cfg["parallelism"]["pipeline_parallel_schedule_csv"], "[parallelism] pipeline_parallel_schedule_csv "
                                                              "(a schedule of its own, not run with FlashCP yet)"),
    ]  # fmt: skip
    for refuse, what in refused:
        if refuse:
            raise ConfigError(f"[parallelism] pipeline_parallel_degree > 1 does not run with {what}")


def _check_stages(cfg: dict) -> int:
    """The pipeline's stage count, after TorchTitan's split of the job's layers over them (ConfigError
    naming the problem when it cannot, or when a stage would hold no decoder layer)."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _get_pipeline_metadata

    par = cfg["parallelism"]
    n_layers = model_dims(cfg)[1]
    try:
        stages, _, first, last = _get_pipeline_metadata(SimpleNamespace(pp=par["pipeline_parallel_degree"]),
                                                        SimpleNamespace(**par),
                                                        SimpleNamespace(layers=range(n_layers)))  # fmt: skip
        split = par["module_fqns_per_model_part"] or _generate_llm_fqn_per_model_part(stages, n_layers, first, last)
    except ValueError as e:
        raise ConfigError(f"[parallelism] pipeline_parallel_degree = {par['pipeline_parallel_degree']} cannot split "
                          f"the model's {n_layers} layers: {e}") from None  # fmt: skip
    empty = [i for i, names in enumerate(split) if not any(name.startswith("layers.") for name in names)]
    if empty:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_degree = {par['pipeline_parallel_degree']} splits the model's {n_layers} "
            f"layers into {len(split)} stages, and stage {empty[0]} holds none: use fewer stages, or lower "
            "pipeline_parallel_first_stage_less_layers / pipeline_parallel_last_stage_less_layers"
        )
    return len(split)
