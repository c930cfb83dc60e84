"""TorchTitan's sections of a job file come from its config classes: every field is a key with
TorchTitan's default or listed with a reason, values reach the built `Trainer.Config`, overrides
work on them, and what FlashCP cannot run is refused before launch."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from harness import tiny_job

from flashcp.titan.config import titan as config_titan
from flashcp.titan.config import apply_overrides, load_job, main, SCHEMA, validate
from flashcp.titan.config.keys import ConfigError, field_default
from flashcp.titan.config.titan import AC_MODES, FILLED, NOT_SECTIONS, OWN_DEFAULTS, OWN_KEYS, RENAMED, SECTIONS


def _suppressed(cls: type, name: str) -> bool:
    return config_titan._suppressed(typing.get_type_hints(cls, include_extras=True)[name])


def _trainer_config_class() -> type:
    from flashcp.titan.trainer import FlashCPTrainer

    return FlashCPTrainer.Config


def _trainer_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(_trainer_config_class())}


def test_every_trainer_section_is_a_job_section_or_says_where_it_comes_from():
    """A TorchTitan upgrade adding a section (or changing a section's class) fails here."""
    fields = _trainer_fields()
    assert set(fields) == set(SECTIONS) | {"activation_checkpoint"} | set(NOT_SECTIONS)
    for section, cls in SECTIONS.items():
        assert type(field_default(fields[section])) is cls, section
    # The policy union, with TorchTitan's default policy as mode's default.
    hint = typing.get_type_hints(_trainer_config_class(), include_extras=True)["activation_checkpoint"]
    assert {typing.get_args(a)[0] for a in typing.get_args(hint)} == {c or type(None) for c in AC_MODES.values()}
    default = type(field_default(fields["activation_checkpoint"]))
    assert AC_MODES[SCHEMA["activation_checkpoint"]["mode"].default] is default
    assert SCHEMA["job"]["dump_folder"].default == field_default(fields["dump_folder"])


def _reachable(section: str, name: str) -> tuple[str, str]:
    return RENAMED.get((section, name), (section, name))


@pytest.mark.parametrize("section", [*SECTIONS, "activation_checkpoint", "validation"])
def test_every_field_is_a_key_with_torchtitans_default_or_listed(section):
    """Each field of the section's class(es) is settable from the TOML with TorchTitan's default, unless
    FlashCP fills it (FILLED), keeps its own default (OWN_DEFAULTS) or TorchTitan hides it from its CLI."""
    from torchtitan.components.validate import Validator

    classes = {"activation_checkpoint": [c for c in AC_MODES.values() if c], "validation": [Validator.Config]}
    for cls in classes.get(section, [SECTIONS.get(section)]):
        for f in dataclasses.fields(cls):
            if (section, f.name) in FILLED:
                assert f.name not in SCHEMA[section], f"[{section}] {f.name} is filled by FlashCP and a key"
                continue
            if _suppressed(cls, f.name):
                continue
            to_section, to_name = _reachable(section, f.name)
            assert to_name in SCHEMA[to_section], f"{cls.__qualname__}.{f.name} is not reachable from the TOML"
            want = OWN_DEFAULTS[(section, f.name)][0] if (section, f.name) in OWN_DEFAULTS else field_default(f)
            assert SCHEMA[to_section][to_name].default == want, f"[{to_section}] {to_name}"
    # FlashCP's own keys in the section are the only keys without a field behind them.
    names = {_reachable(section, f.name) for cls in classes.get(section, [SECTIONS.get(section)])
             for f in dataclasses.fields(cls)}  # fmt: skip
    own = {k for k in SCHEMA[section] if (section, k) not in names}
    renamed_here = {name for (s, name) in RENAMED.values() if s == section}
    flashcp_valid = {"source", "hf_split", "bucket_min"} if section == "validation" else set()
    assert own == set(OWN_KEYS.get(section, {})) | renamed_here | flashcp_valid


# The fields of each section's class as reviewed for FlashCP (TorchTitan 0.3.0 plus FlashCP's subclasses'
# own). A field added by an upgrade becomes a key by itself; this makes someone decide that FlashCP
# honours it, fills it (FILLED) or refuses it (flashcp.titan.config.checks._check_unsupported) before it ships.
REVIEWED = {
    "training": "local_batch_size global_batch_size seq_len max_norm steps enable_cpu_offload disable_cuda_graphs "
                "dtype mixed_precision_param mixed_precision_reduce gc_freq gc_debug",
    "optimizer": "param_groups implementation optimizer_factory_kwargs_by_name",
    "lr_scheduler": "warmup_steps total_steps decay_ratio decay_type min_lr_factor",
    "parallelism": "data_parallel_replicate_degree data_parallel_shard_degree fsdp_reshard_after_forward "
                   "enable_fsdp_symm_mem tensor_parallel_degree enable_sequence_parallel spmd_backend "
                   "pipeline_parallel_degree module_fqns_per_model_part pipeline_parallel_first_stage_less_layers "
                   "pipeline_parallel_last_stage_less_layers pipeline_parallel_layers_per_stage "
                   "pipeline_parallel_schedule pipeline_parallel_schedule_csv pipeline_parallel_microbatch_size "
                   "context_parallel_degree context_parallel_load_balancer context_parallel_ptrr_mask_key "
                   "expert_parallel_degree",
    "checkpoint": "enable folder interval initial_load_path initial_load_model_only initial_load_in_hf "
                  "initial_load_in_hf_quantized last_save_model_only last_save_in_hf export_dtype keep_latest_k "
                  "load_step exclude_from_loading enable_first_step_checkpoint create_seed_checkpoint load_only "
                  "async_mode load_unverified model_record",
    "metrics": "log_freq enable_tensorboard disable_color_printing save_tb_folder save_for_all_ranks enable_wandb "
               "peak_tflops",
    "compile": "enable enable_async_tensor_parallel components backend",
    "comm": "init_timeout_seconds train_timeout_seconds trace_buf_size save_traces_folder save_traces_file_prefix mode",
    "profiler": "enable_profiling save_traces_folder profile_freq profiler_repeat profiler_skip_first "
                "profiler_skip_first_wait profiler_active profiler_warmup enable_memory_snapshot memory_snapshot_freq "
                "save_memory_snapshot_folder memory_snapshot_max_entries trace_post_processor",
    "debug": "seed spmd_typechecking deterministic deterministic_warn_only moe_force_load_balance detect_anomaly "
             "batch_invariant print_config save_config_file enable_structured_logging",
    "activation_checkpoint:selective": "preserve_rng_state determinism_check debug force_recompute_mm_shapes_by_fqns",
    "activation_checkpoint:full": "preserve_rng_state determinism_check debug",
    "activation_checkpoint:memory-budget": "preserve_rng_state determinism_check debug memory_budget "
                                           "visualize_memory_budget_pareto",
}  # fmt: skip


def test_no_field_arrives_unreviewed():
    classes = dict(SECTIONS) | {f"activation_checkpoint:{mode}": cls for mode, cls in AC_MODES.items() if cls}
    assert set(classes) == set(REVIEWED)
    for section, cls in classes.items():
        new = [f.name for f in dataclasses.fields(cls) if f.name not in REVIEWED[section].split()]
        assert not new, f"{cls.__qualname__} has new fields {new}: review them for FlashCP (see REVIEWED)"


def test_the_exclusion_lists_name_real_fields():
    fields = _trainer_fields()
    assert all(name in fields for name in NOT_SECTIONS)
    for section, name in [*FILLED, *OWN_DEFAULTS, *RENAMED]:
        if section == "validation":
            continue
        assert name in {f.name for f in dataclasses.fields(SECTIONS[section])}, (section, name)


def test_new_keys_flow_into_the_trainer_config(tmp_path):
    from flashcp.titan.launch.job import trainer_config

    cfg = tiny_job(
        tmp_path,
        profiler={"enable_profiling": True, "profile_freq": 5},
        training={"gc_freq": 7, "seed": 5},
        checkpoint={"enable": True, "last_save_in_hf": True, "exclude_from_loading": ["dataloader"]},
        debug={"detect_anomaly": True},
        activation_checkpoint={"mode": "full", "preserve_rng_state": False},
        comm={"trace_buf_size": 0},
        lr_scheduler={"total_steps": 8},
        optimizer={"implementation": "for-loop", "lr": 1e-3},
        metrics={"save_for_all_ranks": True},
        parallelism={"fsdp_reshard_after_forward": "never"},
    )
    tc = trainer_config(cfg)
    assert (tc.profiler.enable_profiling, tc.profiler.profile_freq) == (True, 5)
    assert tc.training.gc_freq == 7 and tc.training.disable_cuda_graphs
    assert (tc.debug.seed, tc.debug.detect_anomaly) == (5, True)
    assert tc.checkpoint.last_save_in_hf and tc.checkpoint.exclude_from_loading == ["dataloader"]
    assert type(tc.activation_checkpoint).__qualname__ == "FullAC.Config"
    assert tc.activation_checkpoint.preserve_rng_state is False
    assert tc.comm.trace_buf_size == 0 and tc.lr_scheduler.total_steps == 8
    assert tc.optimizer.implementation == "for-loop"
    assert tc.optimizer.param_groups[0].optimizer_kwargs["lr"] == 1e-3
    assert tc.metrics.save_for_all_ranks and tc.parallelism.fsdp_reshard_after_forward == "never"
    assert tc.parallelism.spmd_backend == "partial_dtensor"  # FlashCP's parallelize recipe
    assert trainer_config(tiny_job(tmp_path, activation_checkpoint={"mode": "none"})).activation_checkpoint is None


def test_cli_overrides_reach_derived_keys(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\nsteps = 3\n[lr_scheduler]\nwarmup_steps = 1\n")
    cfg = load_job(path, ["--profiler.enable_profiling", "--training.gc_freq", "9", "--compile.components",
                          "model,loss", "--checkpoint.exclude_from_loading=optimizer", "--comm.trace_buf_size=0",
                          "--debug.deterministic_warn_only", "true"])  # fmt: skip
    assert cfg["profiler"]["enable_profiling"] is True and cfg["training"]["gc_freq"] == 9
    assert cfg["compile"]["components"] == ["model", "loss"]  # TorchTitan's comma form
    assert cfg["checkpoint"]["exclude_from_loading"] == ["optimizer"]
    assert cfg["comm"]["trace_buf_size"] == 0 and cfg["debug"]["deterministic_warn_only"] is True
    with pytest.raises(ConfigError, match=r"^\[profiler\] profile_freq must be an integer, got 'often' \(str\)$"):
        load_job(path, ["--profiler.profile_freq", "often"])
    assert apply_overrides({}, ["--compile.components", '["model"]']) == {"compile": {"components": ["model"]}}


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"parallelism": {"pipeline_parallel_degree": 2}},
         r"^\[training\] local_batch_size \(1, the pipeline's microbatches\) must be >= its 2 stages for schedule '1F1B'"),
        ({"parallelism": {"pipeline_parallel_schedule": "GPipe"}},
         r"^\[parallelism\] pipeline_parallel_schedule only applies to pipeline parallelism"),
        ({"parallelism": {"expert_parallel_degree": 2}},
         r"^\[parallelism\] expert_parallel_degree applies to mixture-of-experts models"),
        ({"debug": {"moe_force_load_balance": True}}, r"^\[debug\] moe_force_load_balance applies to mixture"),
        ({"debug": {"batch_invariant": True}}, r"^\[debug\] batch_invariant: .*no batch-invariant mode"),
        ({"comm": {"mode": "local_tensor"}}, r"^\[comm\] mode = 'local_tensor' is not supported"),
        ({"comm": {"mode": "ring"}}, r"^\[comm\] mode must be one of default, fake_backend, local_tensor"),
        ({"parallelism": {"context_parallel_ptrr_mask_key": "x"}}, r"ptrr_mask_key is TorchTitan's CP"),
        ({"parallelism": {"context_parallel_load_balancer": "zigzag"}},
         r"^\[parallelism\] context_parallel_load_balancer must be one of headtail, ptrr; got 'zigzag'$"),
        ({"activation_checkpoint": {"mode": "selective", "memory_budget": 0.3}},
         r"^\[activation_checkpoint\] memory_budget does not apply to mode = 'selective'$"),
        ({"activation_checkpoint": {"mode": "memory-budget"}}, r"'memory-budget' needs the model compiled"),
        ({"training": {"mixed_precision_reduce": "bfloat16"}}, r"mixed_precision_reduce must be one of float32;"),
        ({"profiler": {"profile_freq": 0}}, r"^\[profiler\] profile_freq must be >= 1, got 0$"),
        ({"profiler": {"enable_profiling": True, "profile_freq": 2}},
         r"^\[profiler\] profile_freq \(2\) must be >= profiler_warmup \+ profiler_active \(3 \+ 1\)"),
        ({"lr_scheduler": {"total_steps": 0}}, r"^\[lr_scheduler\] total_steps must be >= 1"),
        ({"lr_scheduler": {"warmup_steps": 3, "total_steps": 2}},
         r"warmup_steps \(3\) must be <= \[lr_scheduler\] total_steps \(2\)"),
        ({"checkpoint": {"folder": " "}}, r"^\[checkpoint\] The 'folder' field cannot be empty"),  # TorchTitan's
        ({"checkpoint": {"exclude_from_loading": ["model"]}}, r"^\[checkpoint\] model key shouldn't be in"),
        ({"compile": {"enable_async_tensor_parallel": True}}, r"^\[compile\] Async TP requires"),
        ({"validator": {"enable": True}}, r"^unknown section \[validator\]: TorchTitan's \[validator\] is \[validation\]"),
        ({"optimizer": {"param_groups": []}}, r"^unknown key \[optimizer\] param_groups; allowed keys: name, lr"),
    ],
)  # fmt: skip
def test_what_flashcp_cannot_run_is_refused_with_the_reason(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message) as err:
        tiny_job(tmp_path, **sections)
    assert "\n" not in str(err.value)


def test_fsdp_symmetric_memory_is_checked_against_the_machine(tmp_path):
    from flashcp.titan.config import check_layout

    cfg = tiny_job(tmp_path, parallelism={"enable_fsdp_symm_mem": True})  # validates on any machine
    with pytest.raises(ConfigError, match=r"enable_fsdp_symm_mem needs NVIDIA GPUs of compute capability 9.0"):
        check_layout(cfg, 1, has_cuda=False)


def test_keys_lists_every_key_with_its_default(capsys):
    assert main(["--keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == sum(len(keys) for keys in SCHEMA.values())
    assert "[profiler] enable_profiling = false  (true or false)" in lines
    assert '[checkpoint] export_dtype = "float32"  (a string, one of float16, bfloat16, float32)' in \
        [line.split("  dtype")[0] for line in lines]  # fmt: skip
    assert any(line.startswith("[training] local_batch_size = 1 ") and "TorchTitan's: 8" in line for line in lines)


def test_defaults_build_torchtitans_classes():
    cfg = validate({})
    built = config_titan.titan_configs(cfg)
    assert built["training"].local_batch_size == 1 and built["debug"].seed is None
    assert built["checkpoint"].initial_load_model_only is False  # no initial load: nothing to restrict
