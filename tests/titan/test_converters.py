"""`[model] converters`: TorchTitan's Float8 / MXFP8 linears from a job file, refused before launch in
one line where this machine cannot run them, applied by TorchTitan's own converter to FlashCP's
model config (the attention untouched, the output projection kept), and their memory in the dry
run's estimate.

torchao is not installed here, and no GPU: TorchTitan's converter runs in
`test_float8_converts_flashcps_linears_but_not_its_attention` with torchao's two names it imports
stood in for (a plain Linear as the float8 module), which checks which linears are swapped and that
the swap happens in the config, before the model is built and parallelised; float8 numerics, and
Float8Linear under compile, FSDP and TP, need torchao and a GPU and are not tested here."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest
from harness import tiny_job

from flashcp.titan.config import check_layout, ConfigError
from flashcp.titan.config import converters
from flashcp.titan.dryrun.estimate import cast_bytes, estimate, GIB, Layout, LowPrecision, ModelShape

ROOT = Path(__file__).resolve().parents[2]
ON_CPU = "Float8 needs an NVIDIA GPU of compute capability >= 8.9 or an AMD MI300 and this machine has no GPU"


def test_float8_is_refused_on_cpu_in_one_line(tmp_path, monkeypatch):
    """Here (no torchao, no GPU) both reasons in one line; with torchao installed, the GPU's alone."""
    cfg = tiny_job(tmp_path, model={"converters": ["float8"]})
    monkeypatch.setattr(converters, "torchao_module", lambda name: False)
    monkeypatch.setattr(converters, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as refused:
        check_layout(cfg, 1, has_cuda=False)
    assert str(refused.value) == f"[model] converters = ['float8'] cannot run on this machine: torchao is not " \
                                 f"installed; {ON_CPU}"  # fmt: skip
    monkeypatch.setattr(converters, "torchao_module", lambda name: True)
    with pytest.raises(ConfigError) as refused:
        check_layout(cfg, 1, has_cuda=False)
    assert str(refused.value) == f"[model] converters = ['float8'] cannot run on this machine: {ON_CPU}"


def test_the_launcher_check_refuses_float8_on_cpu_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a machine without GPUs, whichever runs the test
    proc = subprocess.run([sys.executable, "-m", "flashcp.titan.config", "--check", "debug_cpu",
                           "--model.converters", "float8"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    missing = "" if find_spec("torchao") else "torchao is not installed; "
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"error: [model] converters = ['float8'] cannot run on this machine: "
                                        f"{missing}{ON_CPU}"]  # fmt: skip


def test_the_launcher_refuses_float8_on_cpu_in_one_line(tmp_path, capsys, monkeypatch):
    from flashcp.titan.launch import node as launch

    monkeypatch.delenv("NGPU", raising=False)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)  # a machine without GPUs
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code = launch.main(["--config", "debug_cpu", "--model.converters", "float8", "--job.dump_folder", str(tmp_path)])
    missing = "" if find_spec("torchao") else "torchao is not installed; "
    assert code == 2 and capsys.readouterr().err.splitlines() == [
        "error: no GPU found, so the job was laid out on 4 CPU rank(s) (the job's layout; set NGPU to the ranks per "
        f"node to choose): [model] converters = ['float8'] cannot run on this machine: {missing}{ON_CPU}"
    ]


@pytest.mark.parametrize(
    "name, emulate, has_cuda, capability, rocm, problem",
    [
        ("float8", False, True, (9, 0), False, None),
        ("float8", False, True, (8, 9), False, None),
        ("float8", False, True, (8, 0), False, "Float8 needs an NVIDIA GPU of compute capability >= 8.9 or an AMD "
                                               "MI300; this GPU's compute capability is 8.0"),
        ("float8", False, True, (9, 4), True, None),  # AMD MI300
        ("float8", True, False, None, False, None),  # TorchTitan's emulation: eager, anywhere
        ("mx", False, True, (10, 0), False, None),
        ("mx", False, True, (9, 0), False, "MXFP8 needs an NVIDIA GPU of compute capability >= 10.0; this GPU's "
                                           "compute capability is 9.0"),
        ("mx", False, True, (9, 4), True, "MXFP8 needs an NVIDIA GPU of compute capability >= 10.0; this GPU's "
                                          "compute capability is 9.4"),
        ("mx", False, False, None, False, "MXFP8 needs an NVIDIA GPU of compute capability >= 10.0 and this "
                                          "machine has no GPU"),
    ],
)
def test_each_converter_names_what_this_machine_lacks(monkeypatch, name, emulate, has_cuda, capability, rocm,
                                                      problem):  # fmt: skip
    monkeypatch.setattr(converters, "torchao_module", lambda name: True)
    assert converters.converter_problem(name, emulate, has_cuda, capability, rocm) == problem
    monkeypatch.setattr(converters, "torchao_module", lambda name: False)
    monkeypatch.setattr(converters, "find_spec", lambda name: object())  # a torchao without the module
    module = {"float8": "torchao.float8", "mx": "torchao.prototype.moe_training.mxfp8_linear"}[name]
    assert converters.converter_problem(name, emulate, has_cuda, capability, rocm) == \
        "; ".join([f"this torchao has no {module}", *([problem] if problem else [])])  # fmt: skip


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"model": {"converters": ["fp8"]}}, r"^\[model\] converters: unknown 'fp8'; allowed: float8, mx$"),
        ({"model": {"converters": ["float8", "mx"]}}, r"^\[model\] converters = \['float8', 'mx'\]: both swap"),
        ({"float8": {"recipe_name": "rowwise"}}, r"^\[float8\] settings need \[model\] converters = \['float8'\]$"),
        ({"model": {"converters": ["float8"]}, "mx": {"fqns": []}}, r"^\[mx\] settings need \[model\] converters"),
        ({"float8": {"recipe_name": "tensorwise"}}, r"^\[float8\] recipe_name must be one of rowwise, "
                                                    r"rowwise_with_gw_hp; got 'tensorwise'$"),
        ({"model": {"converters": ["float8"]}, "float8": {"emulate": True}, "compile": {"enable": True}},
         r"^\[float8\] emulate = true runs in eager mode only"),
    ],
)
def test_bad_converter_settings_name_the_key(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        tiny_job(tmp_path, **sections)


def test_the_job_gives_torchtitans_converter_config():
    """Field for field from [float8], TorchTitan's compile flag from [compile], in the listed order."""
    from torchtitan.components.quantization import Float8LinearConverter, MXFP8LinearConverter

    cfg = tiny_job(Path("/tmp/unused"), model={"converters": ["float8"]}, compile={"enable": True},
                   float8={"recipe_name": "rowwise_with_gw_hp"})  # fmt: skip
    assert converters.converter_configs(cfg) == [Float8LinearConverter.Config(
        model_compile_enabled=True, recipe_name="rowwise_with_gw_hp", filter_fqns=["lm_head"], emulate=False)]
    cfg = tiny_job(Path("/tmp/unused"), model={"converters": ["mx"]})
    assert converters.converter_configs(cfg) == [MXFP8LinearConverter.Config(model_compile_enabled=False,
                                                                             fqns=["layers"])]  # fmt: skip
    assert converters.converter_configs(tiny_job(Path("/tmp/unused"))) == []


@pytest.fixture
def stand_in_torchao(monkeypatch):
    """torchao's Float8Linear and Float8LinearConfig, the two names TorchTitan's Float8 converter takes
    from torchao, stood in for: the module is TorchTitan's plain Linear (no float8 arithmetic)."""
    import torch
    from torchtitan.components.quantization import float8
    from torchtitan.models.common.linear import Linear

    class StandInFloat8Linear(Linear):
        @dataclass(kw_only=True, slots=True)
        class Config(Linear.Config):
            _torchao_config: object = None

    class StandInConfig:
        def __init__(self, emulate: bool = False) -> None:
            self.emulate = emulate

        @classmethod
        def from_recipe_name(cls, name: str) -> StandInConfig:
            return cls()

    monkeypatch.setattr(float8, "Float8Linear", StandInFloat8Linear)
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", types.SimpleNamespace(Float8LinearConfig=StandInConfig))
    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", False)  # the converter sets it
    return StandInFloat8Linear


def test_float8_converts_flashcps_linears_but_not_its_attention(tmp_path, stand_in_torchao):
    """TorchTitan's converter on the job's model config (FlashCP attention, tiled blocks): every linear of
    the layers is swapped, the output projection and FlashCP's attention are not, and the spec holds
    the converted config, so the model TorchTitan's trainer builds, then parallelises (TP, AC, compile,
    FSDP in `parallelize_flashcp`), is the converted one, as in TorchTitan's own registries."""
    from torchtitan.models.common.linear import Linear

    from flashcp.titan.launch.job import trainer_config
    from flashcp.titan.models.attention import FlashCPAttention
    from flashcp.titan.models.spec import parallelize_flashcp
    from flashcp.titan.models.tiled_block import TiledTransformerBlock

    cfg = tiny_job(tmp_path, model={"converters": ["float8"]}, float8={"emulate": True},
                   activation_checkpoint={"mlp_tiles": 2})  # fmt: skip
    spec = trainer_config(cfg).model_spec
    kinds = {fqn: type(lin) for fqn, lin, _, _ in spec.model.traverse(Linear.Config)}
    swapped = sorted(fqn for fqn, kind in kinds.items() if kind is stand_in_torchao.Config)
    assert swapped == sorted(f"layers.{i}.{name}" for i in range(2) for name in
                             ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                              "feed_forward.w3"))  # fmt: skip
    assert kinds["lm_head"] is Linear.Config
    assert all(isinstance(layer.attention.inner_attention, FlashCPAttention.Config) for layer in spec.model.layers)
    assert spec.parallelize_fn is parallelize_flashcp
    # The dry run's account of the same job names the same linears.
    assert sorted(fqn for fqn, _ in converters.converted_linears(trainer_config(
        tiny_job(tmp_path, activation_checkpoint={"mlp_tiles": 2})).model_spec.model, cfg)) == swapped
    import torch

    with torch.device("meta"):
        model = spec.model.build()
    assert isinstance(model.layers["0"], TiledTransformerBlock)  # converted inside the tiled block
    assert isinstance(model.layers["0"].feed_forward.w2, stand_in_torchao)
    assert not isinstance(model.lm_head, stand_in_torchao)


def test_the_filters_follow_torchtitans_rules(tmp_path):
    model = _tiny_model(tmp_path)
    everything = {fqn for fqn, _ in converters.converted_linears(model, tiny_job(
        tmp_path, model={"converters": ["float8"]}, float8={"filter_fqns": []}))}  # fmt: skip
    assert "lm_head" in everything and len(everything) == 11
    no_mlp = {fqn for fqn, _ in converters.converted_linears(model, tiny_job(
        tmp_path, model={"converters": ["float8"]}, float8={"filter_fqns": ["lm_head", "feed_forward"]}))}
    assert no_mlp == {f"layers.{i}.attention.{n}" for i in range(2) for n in ("qkv_linear.wqkv", "wo")}
    mx = {fqn for fqn, _ in converters.converted_linears(model, tiny_job(tmp_path, model={"converters": ["mx"]}))}
    assert mx == everything - {"lm_head"}


def _tiny_model(tmp_path):
    from flashcp.titan.launch.job import trainer_config

    return trainer_config(tiny_job(tmp_path)).model_spec.model


SHAPE = ModelShape(dim=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256,
                   rope_rows=16384, rope_row_bytes=512)  # fmt: skip
LAYOUT = Layout(fsdp=8, tp=1, sequence_parallel=False, tokens=16384, kv_rows=20000, loss_tokens=2048, full_ac=True)


def test_the_estimate_adds_only_the_casts_of_the_largest_backward():
    """Llama 3 8B at 16K tokens per rank: the weights, gradients, moments and activations are those of
    the bf16 model (torchao saves the bf16 input and weight; FSDP gathers bf16 with rowwise scaling);
    the one added term is w1's (or w3's) backward casts: 2 T N + T K + K N bytes."""
    t, k, n = 16384, 4096, 14336  # w1: dim -> ffn
    mlp, qkv = (k, n, t), (k, 6144, t)
    plain = estimate(SHAPE, LAYOUT)
    for converter, gw_hp, expected in [
        ("float8", False, 2 * t * n + t * k + k * n),
        ("float8", True, t * n + k * n),
        ("mx", False, (2 * t * n + t * k + k * n) * 33 / 32),
    ]:
        lp = LowPrecision(converter, (qkv, mlp, (n, k, t)), grad_weight_hp=gw_hp)
        est = estimate(SHAPE, dataclasses.replace(LAYOUT, low_precision=lp))
        assert est["low_precision_casts"] == pytest.approx(expected / GIB)
        assert {k_: v for k_, v in est.items() if k_ not in ("low_precision_casts", "peak")} == \
            {k_: v for k_, v in plain.items() if k_ != "peak"}  # fmt: skip
        assert est["peak"] == pytest.approx(plain["peak"] + expected / GIB)
    assert cast_bytes(LowPrecision("float8", ())) == 0
    assert 2 * t * n + t * k + k * n == pytest.approx(0.555 * GIB, rel=0.01)  # 8B at 16K tokens: 0.555 GiB


def test_the_dry_run_of_a_float8_job_adds_its_modelled_casts(tmp_path):
    """The dry run builds the job without torchao (not refused on this CPU machine), tracks the same
    bf16 model, and adds the casts of the converted linears to the estimate and to the verdict."""
    from flashcp.titan.config import load_job, resolve_config_path
    from flashcp.titan.dryrun.run import dry_run

    overrides = ["--job.dump_folder", str(tmp_path)]
    plain = dry_run(load_job(resolve_config_path("debug_cpu"), overrides), 4)
    report = dry_run(load_job(resolve_config_path("debug_cpu"), [*overrides, "--model.converters", "float8"]), 4)
    assert report.by_category == plain.by_category and report.peak_gib == plain.peak_gib
    # debug_cpu: dim 64, ffn 192 (w1), 256 tokens per rank (seq_len 512 over CP 2), lm_head kept.
    t, k, n = 256, 64, 192
    assert report.low_precision == {"converter": "float8", "linears": 10,
                                    "casts_gib": (2 * t * n + t * k + k * n) / GIB}  # fmt: skip
    assert report.estimate_gib["low_precision_casts"] == report.casts_gib
    assert report.estimate_gib["peak"] == pytest.approx(plain.estimate_gib["peak"] + report.casts_gib)
    tight = dry_run(load_job(resolve_config_path("debug_cpu"), [*overrides, "--model.converters", "float8"]), 4,
                    gpu_gib=plain.peak_gib + report.casts_gib / 2, reserve_gib=0)  # fmt: skip
    assert not tight.fits_gpu  # the modelled casts count in the verdict
