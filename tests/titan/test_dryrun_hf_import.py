"""The dry run of a job importing a Hugging Face folder plans rank 0's load as the checkpointer does
(`flashcp.titan.dryrun.hfload`): the model's HF keys, this rank's share (its experts only), DCP's
strict load plan against the folder's safetensors headers, or the headers the model implies where
the folder is absent.

- A tiny Qwen3-MoE folder as rank 0 of 8 at EP 4 (one expert of 8 a layer on rank 0, after FSDP):
  27 of the 69 tensors; a folder with an expert too many exits 2 naming it.
- Every shipped job with `initial_load_in_hf`, built at the world size its comment names (the
  Qwen3-30B-A3B recipe at 16 ranks, EP 8), plans its load from the implied headers. The rest of
  their dry run (the step) is test_dryrun_no_data's and docs/dryrun.md's; the build and the plan
  take seconds.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from scripts.make_tiny_hf import make_tiny_hf  # noqa: E402
from tests.titan.test_dryrun_no_data import _job  # noqa: E402

from flashcp.titan.config import CONFIG_DIR, resolve_config_path  # noqa: E402
from flashcp.titan.dryrun import cli, fakes, run  # noqa: E402
from flashcp.titan.dryrun.hfload import plan_hf_import  # noqa: E402
from flashcp.titan.dryrun.standin import with_stand_ins  # noqa: E402

JOB = """
[model]
name = "qwen3"
[data]
source = "synthetic"
[training]
seq_len = 4096
steps = 10
mixed_precision_param = "bfloat16"
[lr_scheduler]
warmup_steps = 1
[parallelism]
context_parallel_degree = 4
expert_parallel_degree = 4
[activation_checkpoint]
mode = "full"
[checkpoint]
enable = true
initial_load_in_hf = true
"""
IMPORTS = sorted(p.stem for p in CONFIG_DIR.glob("*.toml") if re.search(r"^initial_load_in_hf = true", p.read_text(), re.M))


def _dry_run(tmp_path: Path, capsys, hf: Path) -> tuple[int, str, str]:
    job = tmp_path / "moe.toml"
    job.write_text(JOB + f'initial_load_path = "{hf}"\n')
    capsys.readouterr()
    code = cli.main(["--config", str(job), "--world-size", "8", "--json"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_rank_0_plans_its_experts_of_the_folder(tmp_path, capsys):
    hf = make_tiny_hf(tmp_path / "hf", model_type="qwen3_moe")
    code, out, err = _dry_run(tmp_path, capsys, hf)
    assert code == 0, err[-2000:]
    # 69 = 2 layers x (8 experts x 3 + router, 4 attention, 2 q/k norms, 2 norms) + embedding, norm, head
    assert json.loads(out)["hf_import"] == (f"rank 0 of 8 loads 27 of the 69 HF tensors (27 reads; the rest are "
                                            f"other ranks' experts) from {hf}")  # fmt: skip


def test_a_folder_with_an_expert_too_many_is_one_line(tmp_path, capsys):
    hf = make_tiny_hf(tmp_path / "hf", model_type="qwen3_moe")
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.experts.8.up_proj.weight"] = tensors["model.layers.1.mlp.experts.7.up_proj.weight"].clone()
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    code, out, err = _dry_run(tmp_path, capsys, hf)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("error: [checkpoint] initial_load_path: ")
    assert "model.layers.1.mlp.experts.8.up_proj.weight which the model has no place for" in err


def _world_size(name: str, cfg: dict) -> int:
    """The world size the job's own comment checks it at (`config --check NAME --world-size N`), else its
    degrees' product (a CPU job)."""
    found = re.search(rf"--check {name} --world-size (\d+)", resolve_config_path(name).read_text())
    par = cfg["parallelism"]
    degrees = (par["data_parallel_replicate_degree"], max(1, par["data_parallel_shard_degree"]),
               par["context_parallel_degree"], par["tensor_parallel_degree"])  # fmt: skip
    return int(found.group(1)) if found else math.prod(degrees)


@pytest.mark.parametrize("name", IMPORTS)
def test_every_shipped_import_plans_its_load_at_its_world_size(name, tmp_path):
    cfg, _ = with_stand_ins(_job(name, tmp_path))
    world = _world_size(name, cfg)
    with tempfile.TemporaryDirectory() as tmp, fakes.fake_world(world), fakes.fake_kernel(), fakes.balanced_routing(cfg):
        trainer = run._build(run._dry_job(cfg, tmp))
        try:
            line = plan_hf_import(trainer, cfg["checkpoint"]["initial_load_path"])
        finally:
            trainer.close()
    loads, whole = map(int, re.search(r"loads (\d+) of the (\d+) HF tensors", line).groups())
    assert line.startswith(f"rank 0 of {world} loads ")
    if cfg["parallelism"]["expert_parallel_degree"] > 1:  # rank 0 holds its experts only
        assert loads < whole
    else:
        assert loads == whole
    if name == "qwen3_30b_a3b_128k":  # 48 layers of 128 experts x 3 and 9 others; 16 experts a rank at EP 8, 8 after FSDP 2
        assert (loads, whole) == (48 * (8 * 3 + 9) + 3, 48 * (128 * 3 + 9) + 3)


def test_the_shipped_imports_include_the_moe_recipe():
    assert "qwen3_30b_a3b_128k" in IMPORTS and len(IMPORTS) >= 3
