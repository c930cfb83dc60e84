"""`python -m flashcp.titan.dryrun`: a tiny job as rank 0 of 8 on fake tensors prints one JSON object
with the peak by category, a GPU too small for it exits 1 with one line naming the biggest term, and
with full activation checkpointing each layer adds only its checkpointed input to the activations.

The first test runs the command as a user does, in a process of its own; the others call its
`main` in this one (`dry_run` cleans up after itself): a process start, importing TorchTitan, costs
seconds of CPU."""

from __future__ import annotations

import dataclasses

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = """
[model]
flavor = "custom"
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
multiple_of = 64
[data]
source = "synthetic"
synthetic_lengths = "wlbllm"
balance = "off"
[training]
seq_len = 4096
steps = 10
mixed_precision_param = "bfloat16"
[lr_scheduler]
warmup_steps = 1
[parallelism]
context_parallel_degree = 4
[activation_checkpoint]
mode = "full"
[loss]
chunk_tokens = 256
"""


def _args(tmp_path: Path, *args: str) -> list[str]:
    """The CLI's arguments for JOB with `args` (options, then `--section.key value` overrides)."""
    job = tmp_path / "tiny.toml"
    job.write_text(JOB)
    return ["--config", str(job), "--world-size", "8", "--json", *args]


def _dry_run_process(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m flashcp.titan.dryrun` on JOB with `args`, in a process of its own."""
    cmd = [sys.executable, "-m", "flashcp.titan.dryrun", *_args(tmp_path, *args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def _dry_run(tmp_path: Path, capsys, *args: str) -> SimpleNamespace:
    """The same CLI called in this process: its exit code, stdout and stderr."""
    from flashcp.titan.dryrun import cli

    capsys.readouterr()
    code = cli.main(_args(tmp_path, *args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_dry_run_prints_the_peak_by_category_as_one_json_object(tmp_path):
    """Also for a job that imports Hugging Face weights from a folder not there: with the architecture
    named (here custom sizes; the shipped recipes name a flavor) the dry run loads nothing."""
    hf_import = ["--checkpoint.enable", "true", "--checkpoint.initial_load_in_hf", "true",
                 "--checkpoint.initial_load_path", str(tmp_path / "no-hf-folder")]  # fmt: skip
    proc = _dry_run_process(tmp_path, *hf_import)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    report = json.loads(line)
    assert report["fits"] is True and report["gpu_gib"] == 80.0
    assert set(report["by_category"]) >= {"parameters", "gradients", "optimizer_states", "activations",
                                          "flashcp_buffers", "loss"}  # fmt: skip
    assert report["peak_gib"] > 0 and report["peak_gib"] >= max(report["by_category"].values())
    assert report["degrees"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 4, "tp": 1, "pp": 1}
    assert report["loss_chunks"] == 4 and 0 < report["plan"]["imbalance"]


def test_a_gpu_too_small_exits_1_naming_the_biggest_term(tmp_path, capsys):
    proc = _dry_run(tmp_path, capsys, "--gpu-gib", "1e-6", "--reserve-gib", "0")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["fits"] is False
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: does not fit:") and "biggest term:" in last


def test_a_passing_config_check_names_the_dry_run_with_its_overrides(capsys):
    from flashcp.titan import config

    argv = ["--check", "llama8b_128k", "--world-size", "8", "--loss.chunk_tokens", "0"]
    assert config.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    job = config.CONFIG_DIR / "llama8b_128k.toml"
    assert last.endswith(f"python -m flashcp.titan.dryrun --config {job} --world-size 8 --loss.chunk_tokens 0")


def test_a_job_with_the_probe_dry_runs_as_without_it(tmp_path, capsys):
    """The probe plans its prompts from token values when the trainer is built, which fake tensors lack
    (the dry run of such a job died in torch.bincount); it scores between steps, below the step's peak."""
    plain = _dry_run(tmp_path, capsys)
    probe = _dry_run(tmp_path, capsys, "--probe.enable", "true", "--probe.lengths", "[256]",
                     "--validation.source", "default")  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert json.loads(probe.stdout)["peak_gib"] == json.loads(plain.stdout)["peak_gib"]


@pytest.mark.parametrize("scope", ["auto", pytest.param("mesh", marks=pytest.mark.slow)])
def test_mesh_scope_dry_runs_as_the_busiest_rank_of_the_mesh_plan(tmp_path, capsys, monkeypatch, scope):
    """[flashcp] scope = "mesh" (or "auto" resolving to it, its threshold lowered to this job's 4096
    tokens): the window is DP x C tokens planned by plan_mesh over the 8 ranks (2 nodes of 4), and the
    rank measured is the one receiving the most K/V rows (here not rank 0): its receive buffer holds
    the rows plan_mesh's plan of the same window gives that rank."""
    from flashcp.plan.mesh import plan_mesh
    from flashcp.titan import mesh_scope
    from flashcp.titan.config import scope as scope_rule
    from flashcp.titan.dryrun.report import format_report, Report

    windows = []
    monkeypatch.setattr(mesh_scope, "plan_mesh", lambda lens, **kw: windows.append(list(lens)) or plan_mesh(lens, **kw))
    monkeypatch.setattr(scope_rule, "MESH_MIN_SEQ_LEN", 4096)
    if scope == "auto":  # a job setting a [data] balance key keeps per-group planning
        monkeypatch.setitem(globals(), "JOB", JOB.replace('balance = "off"\n', ""))
    proc = _dry_run(tmp_path, capsys, "--flashcp.scope", scope, "--flashcp.comm", "needed",
                    "--flashcp.ranks_per_node", "4", "--data.synthetic_lengths", "pile")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    needed = plan_mesh(windows[0], dp=2, cp=4, ranks_per_node=4).needed_tokens()
    busiest = needed.index(max(needed))
    mesh = report["mesh"]
    assert sum(windows[0]) == 2 * 4096 and busiest != 0 and needed[0] < needed[busiest]
    assert (mesh["ranks"], mesh["nodes"], mesh["busiest_rank"], mesh["measured_rank"]) == (8, 2, busiest, busiest)
    assert mesh["kv_recv_rows_per_rank"] == needed and mesh["kv_recv_rows_measured"] == needed[busiest]
    assert 0 < mesh["kv_fabric_share"] < 1
    assert report["plan"]["kv_recv_bytes_per_layer_needed"] == needed[busiest] * mesh["kv_row_bytes"]
    text = format_report(Report.from_json(report))
    assert f"as mesh rank {busiest} (the busiest)" in text and "mesh scope: one plan of 8192 tokens" in text


def test_full_checkpointing_keeps_one_input_per_layer(tmp_path, capsys):
    """A wide, short job whose parameters outweigh its activations: the step's DTensor ops on the
    (fake) parameters must not count as activations, and an added layer adds its bf16 input only
    (without checkpointing it would add its whole working set)."""
    dim, seq_len, cp = 256, 1024, 4
    wide = ["--model.dim", str(dim), "--model.ffn_dim_multiplier", "4", "--training.seq_len", str(seq_len),
            "--loss.chunk_tokens", "0"]  # fmt: skip
    activations = {}
    for layers in (2, 4):
        proc = _dry_run(tmp_path, capsys, *wide, "--model.n_layers", str(layers))
        assert proc.returncode == 0, proc.stderr[-3000:]
        activations[layers] = json.loads(proc.stdout)["by_category"]["activations"] * 2**30
    checkpoint_per_layer = seq_len // cp * dim * 2
    assert 0 <= (activations[4] - activations[2]) / 2 <= 1.5 * checkpoint_per_layer, activations


def test_offload_moves_the_layer_inputs_to_host_memory(tmp_path, capsys):
    """With offload the layer inputs full AC keeps are tracked as host memory (every layer's but the
    last), the GPU's activations at the peak shrink by at most that (where the peak falls decides how
    many of them it held), and the copies' time is modelled."""
    dim, seq_len, cp, layers = 256, 1024, 4, 4
    wide = ["--model.dim", str(dim), "--model.ffn_dim_multiplier", "4", "--training.seq_len", str(seq_len),
            "--loss.chunk_tokens", "0", "--model.n_layers", str(layers)]  # fmt: skip
    reports = {}
    for offload in ("false", "true"):
        proc = _dry_run(tmp_path, capsys, *wide, "--activation_checkpoint.offload", offload)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[offload] = json.loads(proc.stdout)
    layer_input = seq_len // cp * dim * 2
    off, on = reports["false"], reports["true"]
    assert off["host_gib"] == 0 and off["offload"] is None
    assert on["host_gib"] * 2**30 == (layers - 1) * layer_input
    saved = (off["by_category"]["activations"] - on["by_category"]["activations"]) * 2**30
    assert 0 < saved <= (layers - 1) * layer_input, saved
    assert on["offload"]["layer_gib_each_way"] * 2**30 == layer_input and on["offload"]["hides"] in (True, False)
    assert set(on) >= set(off) - {"offload"}  # today's keys kept


def test_cpu_offload_moves_the_sharded_state_to_host_memory(tmp_path, capsys):
    """`[training] enable_cpu_offload` (FSDP2's CPU offload): the sharded fp32 parameters, their gradients
    and AdamW's moments leave the GPU's peak, byte for byte, and are the host memory per rank; the
    gathered parameters, activations and loss stay. The verdict names the host memory a node needs,
    and a host too small for it exits 1 naming --host-gib and the node's total."""
    reports = {}
    for flag in ("false", "true"):
        proc = _dry_run(tmp_path, capsys, "--training.enable_cpu_offload", flag)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[flag] = json.loads(proc.stdout)
    off, on = reports["false"], reports["true"]
    gib = lambda x: round(x * 2**30)  # noqa: E731
    kept, moved, host = off["by_category"], on["by_category"], on["host_by_category"]
    assert off["host_gib"] == 0 and off["cpu_offload"] is None and on["offload"] is None
    assert gib(moved["optimizer_states"]) == 0 and gib(host["optimizer_states"]) == gib(kept["optimizer_states"]) > 0
    assert gib(kept["parameters"]) - gib(moved["parameters"]) == gib(host["parameters"]) > 0  # the shards
    assert gib(host["gradients"]) == gib(host["parameters"])  # every shard's fp32 gradient, at the host's peak
    assert gib(host["layer_inputs"]) == 0 and gib(on["host_gib"]) == sum(map(gib, host.values()))
    shards_at_peak = host["parameters"] + host["optimizer_states"] + kept["gradients"] - moved["gradients"]
    assert gib(off["peak_gib"]) - gib(on["peak_gib"]) == gib(shards_at_peak)
    for name in ("activations", "loss", "flashcp_buffers", "model_buffers"):
        assert moved[name] == kept[name], name
    est_kept, est_moved = off["estimate_gib"], on["estimate_gib"]  # the estimate drops the same terms
    assert est_moved["optimizer_states"] == 0 < est_kept["optimizer_states"]
    assert gib(est_kept["parameters"] - est_moved["parameters"]) == gib(est_kept["optimizer_states"]) // 2
    assert on["ranks_per_node"] == 8 and on["host_gib_per_node"] == 8 * on["host_gib"]
    assert on["cpu_offload"]["down_gib_per_step"] * 2 == on["cpu_offload"]["up_gib_per_step"] > 0
    assert set(on) >= set(off)  # today's keys kept
    too_small = _dry_run(tmp_path, capsys, "--training.enable_cpu_offload", "true", "--ranks-per-node", "4",
                         "--host-gib", f"{on['host_gib'] / 2}")  # fmt: skip
    assert too_small.returncode == 1 and json.loads(too_small.stdout)["host_gib_per_node"] == 4 * on["host_gib"]
    err = too_small.stderr.strip().splitlines()[-1]
    assert err.startswith("error: does not fit: ") and "(--host-gib)" in err and "per node of 4 ranks" in err, err
    assert "enable_cpu_offload = false" in err


def test_the_verdict_names_the_host_memory_a_node_needs(capsys):
    from flashcp.titan.dryrun.report import format_report, Report

    report = Report(config="x", world_size=16, degrees={"cp": 16}, gpu_gib=80, reserve_gib=6, peak_gib=60.0,
                    by_category={"activations": 60.0}, estimate_gib={"peak": 61.0}, plan={}, loss_chunks=1,
                    seconds=1, host_gib=77.5, ranks_per_node=8)  # fmt: skip
    assert format_report(report).splitlines()[-1].endswith(
        "against a 80 GiB GPU; needs 620 GiB of host memory per node of 8 ranks (77.5 GiB per rank, 256 GiB allowed)")


def test_the_dry_run_refuses_cpu_offload_under_pipeline_parallelism(tmp_path, capsys):
    proc = _dry_run(tmp_path, capsys, "--training.enable_cpu_offload", "true", "--parallelism.pipeline_parallel_degree",
                    "2", "--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "2")  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the dry run derives a pipeline's ranks from one stage's GPU memory: not with [training] "
        "enable_cpu_offload (each rank's host shards are not derived)")


@pytest.mark.parametrize("args", [["--gpu-gib", "0"], ["--gpu-gib", "inf"], ["--reserve-gib", "nan"],
                                  ["--host-gib", "-1"], ["--world-size", "0"],
                                  ["--ranks-per-node", "0"]])  # fmt: skip
def test_bad_numbers_are_one_line(args, capsys):
    from flashcp.titan.dryrun import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["--config", "debug_cpu", *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m flashcp.titan.dryrun: error: argument " + args[0])


AC_SETTINGS = [
    {"mode": mode, "mlp_tiles": tiles, "offload": offload}
    for mode in ("none", "selective", "full") for tiles in (0, 16, -1) for offload in ((False, True) if mode == "full" else (False,))
]  # fmt: skip


@pytest.mark.parametrize("ac", AC_SETTINGS, ids=str)
@pytest.mark.parametrize("chunk_tokens", [0, 2048])
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_the_non_fit_line_never_advises_a_setting_the_job_has(ac, chunk_tokens, cpu_offload):
    """Every `[section] key = value` the advice names differs from the job's value, for every term."""
    import re

    from flashcp.titan.dryrun.report import advice

    cfg = {"activation_checkpoint": ac, "loss": {"chunk_tokens": chunk_tokens},
           "model": {"flavor": "custom", "num_experts": None}, "training": {"enable_cpu_offload": cpu_offload}}  # dense
    for category in ("parameters", "gradients", "optimizer_states", "model_buffers", "activations",
                     "flashcp_buffers", "loss", "host"):  # fmt: skip
        line = advice(category, cfg)
        assert line
        for section, key, value in re.findall(r"\[(\w+)\] (\w+) = ('?\w+'?)", line):
            have = cfg[section][key]
            assert str(have).lower() != value.strip("'").lower(), (category, line)
        if ac["offload"] or (ac["mode"] == "full" and ac["mlp_tiles"] not in (0, 1)):
            assert "mode = 'full'" not in line
        if ac["mlp_tiles"] not in (0, 1):
            assert "mlp_tiles" not in line or category != "activations"


MOE = ["--model.name", "qwen3", "--model.num_experts", "8", "--model.num_experts_per_tok", "2",
       "--model.moe_hidden_dim", "32", "--parallelism.expert_parallel_degree", "2"]  # fmt: skip


def test_a_mixture_of_experts_job_counts_every_expert_once_over_its_ranks(tmp_path, capsys):
    """EP 2 x CP 4 x FSDP 2: the experts' parameters live on their own mesh (FSDP2 groups a block's
    parameters twice), which the tracker follows; the AdamW moments of all the experts, sharded over
    the 8 ranks as the dense parameters are, match the estimate's, and the estimate bounds the peak."""
    proc = _dry_run(tmp_path, capsys, *MOE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    tracked, estimate = report["by_category"], report["estimate_gib"]
    assert tracked["optimizer_states"] == pytest.approx(estimate["optimizer_states"], rel=0.02)
    assert 0 < report["peak_gib"] <= estimate["peak"]


def test_a_mixture_of_experts_job_too_big_is_not_told_to_tile_its_experts(tmp_path, capsys):
    from flashcp.titan.config import load_job
    from flashcp.titan.dryrun.report import advice

    job = tmp_path / "tiny.toml"
    job.write_text(JOB)
    dense = load_job(str(job), [])
    moe = load_job(str(job), MOE)
    assert "mlp_tiles" in advice("activations", dense) and "mlp_tiles" not in advice("activations", moe)
    assert "offload = true" in advice("activations", moe)


def test_a_mixture_of_experts_job_in_float32_is_one_line(tmp_path, capsys):
    proc = _dry_run(tmp_path, capsys, *MOE, "--training.mixed_precision_param", "float32")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "mixed_precision_param = 'bfloat16'" in line


MLA = JOB.replace(JOB[JOB.index("[model]") : JOB.index("[data]")], '[model]\nname = "deepseek_v3"\nflavor = "debugmodel"\n')
MLA = MLA.replace("context_parallel_degree = 4\n", "context_parallel_degree = 4\nexpert_parallel_degree = 2\n")


def test_an_mla_job_dry_runs_with_latent_rows_on_the_wire(tmp_path, capsys):
    """DeepSeek-V3's debugmodel (16 heads, kv_lora_rank 512, rope 64; a dense first layer, then experts) at
    CP 4 x EP 2 x FSDP 2: the plan's bytes are latent rows, 576 values a token where the K/V all-gather of
    the same plan moves 16 x (192 + 128); the latent op's buffers are tracked as FlashCP's; the estimate
    bounds the peak."""
    job = tmp_path / "mla.toml"
    job.write_text(MLA)
    from flashcp.titan.dryrun import cli

    capsys.readouterr()
    code = cli.main(["--config", str(job), "--world-size", "8", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    report = json.loads(out.out)
    plan, tracked, estimate = report["plan"], report["by_category"], report["estimate_gib"]
    assert (plan["latent_row_bytes"], plan["kv_row_bytes"]) == (2 * 576, 2 * 16 * 320)
    kv_full = plan["kv_recv_bytes_per_layer_compact"] / plan["comm_compact_over_full"]  # the K/V all-gather's
    assert plan["kv_recv_bytes_per_layer_full"] / kv_full == pytest.approx(576 / (16 * 320))
    assert 0 < tracked["flashcp_buffers"] and estimate["flashcp_buffers"] > 0
    assert 0 < report["peak_gib"] <= estimate["peak"]
    assert tracked["optimizer_states"] == pytest.approx(estimate["optimizer_states"], rel=0.02)


def test_the_estimate_counts_latent_rows_for_mla():
    """The exchanged rows cost (kv_lora_rank + rope) / (heads x (qk + v)) of K/V rows; the key rows the
    latent op up-projects add per-head K and V, which a K/V exchange does not hold twice."""

    from flashcp.titan.dryrun.estimate import exchange_bytes, Layout, ModelShape

    mla = ModelShape(dim=2048, layers=27, heads=16, kv_heads=16, head_dim=192, ffn=10944, vocab=102400,
                     rope_rows=0, rope_row_bytes=0, v_head_dim=128, latent_rank=512, rope_dim=64)  # fmt: skip
    kv = dataclasses.replace(mla, latent_rank=0, rope_dim=0)
    lay = Layout(fsdp=8, tp=1, sequence_parallel=False, tokens=16384, kv_rows=50000, loss_tokens=2048,
                 full_ac=True)
    assert exchange_bytes(mla, lay) / exchange_bytes(kv, lay) == pytest.approx(576 / (16 * 320))
    keys = dataclasses.replace(lay, key_rows=30000)
    assert exchange_bytes(mla, keys) - exchange_bytes(mla, lay) == 2 * 30000 * 16 * (2 * 320 + 128)
    assert exchange_bytes(kv, keys) == exchange_bytes(kv, lay)


def test_the_peak_names_its_largest_tensors(tmp_path, capsys):
    """With a vocabulary of 2^17 the peak is the loss's: a 256-token slice's float32 log-softmax,
    256 x 131072 x 4 bytes = 0.125 GiB, is the largest tensor live there (its gradients as large)."""
    from flashcp.titan.dryrun.report import format_report, Report

    proc = _dry_run(tmp_path, capsys, "--model.vocab_size", "131072")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    top = report["peak_tensors"]
    assert len(top) == 8 and all(t["name"] and t["dtype"] for t in top)
    assert sum(t["gib"] for t in top) <= report["peak_gib"]
    assert [t["gib"] for t in top] == sorted((t["gib"] for t in top), reverse=True)
    first = top[0]
    assert first["shape"] == [256, 131072] and first["dtype"] == "float32" and first["gib"] == 256 * 131072 * 4 / 2**30
    assert "log_softmax" in first["op"] and "loss" in first["name"]
    named = {t["name"]: t for t in top}  # parameters are named by their FQN, their shard's shape
    assert named["tok_embeddings.weight"]["shape"] == [131072 // 8, 64]
    text = format_report(Report.from_json(report))
    assert "largest at the peak" in text and "_log_softmax" in text and "tok_embeddings.weight" in text


@pytest.mark.slow  # two dry runs of 16384 tokens a rank: over two minutes on a 2-core machine
def test_tiled_blocks_keep_the_norms_float32_temporaries_to_a_tile(tmp_path, capsys):
    """mlp_tiles tiles each block's norms with its MLP (flashcp.titan.models.tiled_block): untiled, the
    largest tensors at the peak include a block's RMSNorm float32 temporaries of all of a rank's tokens
    (1 x 16384 x 64); with 4 tiles none is live at the peak, and the activations are fewer."""
    reports = {}
    for tiles in (0, 4):
        proc = _dry_run(tmp_path, capsys, "--training.seq_len", "65536",
                        "--activation_checkpoint.mlp_tiles", str(tiles))  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[tiles] = json.loads(proc.stdout)
    whole = {tiles: [t["name"] for t in r["peak_tensors"] if t["shape"] == [1, 65536 // 4, 64]
                     and t["dtype"] == "float32" and "layers." in t["name"]] for tiles, r in reports.items()}  # fmt: skip
    assert whole[0] and not whole[4], whole
    assert reports[4]["by_category"]["activations"] < reports[0]["by_category"]["activations"]


def test_head_groups_cut_the_attention_working_set_and_prefetch_holds_one_more_exchange(tmp_path, capsys):
    """With 2 head groups a layer's q, k, v, K/V buffer and o exist for one group at a time, so the tracked
    peak falls; with `head_group_prefetch` the next group's exchange (its buffer) is in flight beside the
    group's kernel: the dry run steps it on the fake process group's asynchronous collectives, and its peak
    is not below the one without."""
    reports = {}
    for groups, prefetch in ((1, "false"), (2, "false"), (2, "true")):
        proc = _dry_run(tmp_path, capsys, "--training.seq_len", "65536", "--activation_checkpoint.head_groups",
                        str(groups), "--activation_checkpoint.head_group_prefetch", prefetch)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[groups, prefetch] = json.loads(proc.stdout)["peak_gib"]
    assert reports[2, "false"] < reports[1, "false"], reports
    assert reports[2, "true"] >= reports[2, "false"], reports


def test_the_final_norms_output_is_gone_when_the_layers_backward_runs(tmp_path, capsys, monkeypatch):
    """A chunked loss feeds its lm_head detached slices of the final norm's output, which torch's module
    tracker kept alive to the step's end (its backward hook on leaf inputs): the dry run then counted
    that output in every peak of the backward. It is freed once the loss returns, as in training."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from flashcp.titan.dryrun import run

    alive: list[bool] = []
    measure = run._measure

    def probed(trainer, input_dict, labels):
        model = trainer.model_parts[0]
        outputs: list[StorageWeakRef] = []
        model.norm.register_forward_hook(lambda m, i, out: outputs.append(StorageWeakRef(out.untyped_storage())))
        model.layers["0"].register_full_backward_pre_hook(lambda m, g: alive.append(not outputs[-1].expired()))
        return measure(trainer, input_dict, labels)

    monkeypatch.setattr(run, "_measure", probed)
    proc = _dry_run(tmp_path, capsys, "--training.seq_len", "65536", "--activation_checkpoint.mlp_tiles", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert alive == [False]
