"""CPU time per training step of a job eager and with `[compile] enable`, runs interleaved.

    python benchmarks/compile_step.py [--config debug_cpu] [--steps 25] [--warmup 5] [--repeats 2]

Each run starts the job's ranks (gloo, one process per rank, as `./run_train.sh` would) for
`--steps` steps with checkpoints and TensorBoard off; each rank measures the CPU time its process
spends in every `train_step` (`time.process_time`: all its threads, the loader's included; on a
shared machine this is steadier than wall time). A run's figure is the median over the steps after
`--warmup` (compiling happens in the first step) of the mean over ranks; runs alternate eager,
compiled, eager, compiled, ... so that a change in the machine's load hits both. Also printed:
the graphs dynamo compiled per rank (1: both blocks share one graph, no window recompiles it) and the
loss of the last step in each mode. All figures are measured; nothing is modelled. Writes
`benchmarks/results/compile_step_cpu.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

RESULTS = Path(__file__).parent / "results" / "compile_step_cpu.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, config: str, overrides: list[str], out) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    import flashcp.titan  # noqa: F401  (TorchTitan shims before TorchTitan is imported)
    from torch._dynamo.utils import counters

    from flashcp.titan.config import check_layout, load_job, resolve_config_path
    from flashcp.titan.launch.job import trainer_config
    from flashcp.titan.trainer import FlashCPTrainer

    cfg = load_job(resolve_config_path(config), overrides)
    check_layout(cfg, world, has_cuda=False)
    trainer = FlashCPTrainer(trainer_config(cfg))
    cpu: list[float] = []
    losses: list[float] = []
    step, log = trainer.train_step, trainer.metrics_processor.log

    def timed_step(*args, **kwargs):
        start = time.process_time()
        result = step(*args, **kwargs)
        cpu.append(time.process_time() - start)
        return result

    def record(step_no, loss, *args, **kwargs):
        losses.append(loss)
        return log(step_no, loss, *args, **kwargs)

    trainer.train_step, trainer.metrics_processor.log = timed_step, record
    try:
        trainer.train()
    finally:
        trainer.close()
    out.put((rank, cpu, losses, counters["stats"]["unique_graphs"]))


def run(config: str, world: int, compiled: bool, steps: int, dump: str) -> dict:
    overrides = ["--training.steps", str(steps), "--checkpoint.enable", "false", "--metrics.enable_tensorboard",
                 "false", "--compile.enable", str(compiled).lower(), "--job.dump_folder", dump]  # fmt: skip
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, config, overrides, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    per_step = [statistics.mean(r[1][s] for r in results) for s in range(steps)]
    return {"per_step_cpu_s": per_step, "last_loss": results[0][2][-1], "graphs": [r[3] for r in results]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="debug_cpu")
    parser.add_argument("--world", type=int, default=4, help="ranks (the job's layout must fit)")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out (compilation, caches)")
    parser.add_argument("--repeats", type=int, default=2, help="eager / compiled pairs, interleaved")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for mode in runs:
                r = run(args.config, args.world, mode == "compiled", args.steps, f"{tmp}/{mode}{i}")
                r["median_cpu_s"] = statistics.median(r["per_step_cpu_s"][args.warmup:])
                runs[mode].append(r)
                print(f"run {i + 1} {mode:8s}: median CPU per step (mean over {args.world} ranks) "
                      f"{1e3 * r['median_cpu_s']:.1f} ms, first step {1e3 * r['per_step_cpu_s'][0]:.0f} ms, "
                      f"graphs compiled per rank {r['graphs']}, last loss {r['last_loss']:.4f}", flush=True)  # fmt: skip
    summary = {mode: statistics.median(r["median_cpu_s"] for r in rs) for mode, rs in runs.items()}
    print(f"measured, {args.config}, steps {args.warmup + 1}-{args.steps}, median of {args.repeats} runs: eager "
          f"{1e3 * summary['eager']:.1f} ms, compiled {1e3 * summary['compiled']:.1f} ms CPU per step per rank "
          f"(compiled / eager {summary['compiled'] / summary['eager']:.2f}); the machine may be shared")  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"config": args.config, "steps": args.steps, "warmup": args.warmup,
                                   "median_cpu_s_per_step": summary, "runs": runs}, indent=1) + "\n")  # fmt: skip
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
