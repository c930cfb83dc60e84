"""Where the latent exchange up-projects keys: all key rows in one matmul, or local and received rows apart.

    python benchmarks/mla_upproject.py            # modelled rows at 128K, CP 8-64; measured CPU at 16K, CP 4

`cp_latent_attention` gathers every local shard's key rows (document prefix and shard) as latent
rows and up-projects them in one matmul ("gathered": local and received rows together). The
alternative ("apart") up-projects the T local rows (which could start before the exchange lands)
and the received buffer's rows in two matmuls, then gathers K and V. Per rank:

- modelled, for the GPU: the rows each variant up-projects, on the busiest rank of FlashCP plans
  of wlbllm and Pile windows (128K, CP 8-64, compact and needed), and the up-projection's FLOPs
  (2 x rows x kv_lora_rank x heads x (qk_nope + v) forward, twice that backward) and the bytes of
  the K/V the "apart" variant holds besides the kernel's inputs, at Moonlight's and DeepSeek-V3's
  shapes (bf16);
- measured, on the CPU reference path: one rank's forward + backward (up-projection, gathers and
  the reference kernel; the received rows are random, no collective) of the busiest rank of the
  FlashCP plan of a 16K Pile window at CP 4, at a small MLA shape (4 heads, kv_lora_rank 64, rope
  16, qk_nope 32, v 32, float32, one thread): CPU time (least of `--repeats`) and peak resident
  memory above the start in a fresh process per variant.

Results go to benchmarks/results/mla_upproject.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"moonlight": (512, 64, 16, 128, 128), "deepseek_v3": (512, 64, 128, 128, 128)}  # R, rope, H, nope, v
SMALL = (64, 16, 4, 32, 32)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rank_rows(plan, comm: str) -> list[dict]:
    """Per rank: local rows T, received buffer rows, gathered key rows."""
    from flashcp import build_dispatch

    out = []
    for rank in range(plan.cp_size):
        d = build_dispatch(plan, rank, comm)
        out.append({"local": plan.tokens_per_rank, "recv": d.recv_size, "keys": d.kv_index.numel()})
    return out


def modelled(context: int, cps: list[int], windows: int) -> list[dict]:
    from flashcp import plan_shards
    from flashcp.data import length_sampler, pack_windows

    rows = []
    for dist in ("wlbllm", "pile"):
        lens_list = pack_windows(length_sampler(dist, seed=0), context, windows)
        for cp in cps:
            for comm in ("compact", "needed"):
                gathered, apart = [], []
                for lens in lens_list:
                    per = rank_rows(plan_shards(lens, cp, "flashcp"), comm)
                    gathered.append(max(r["keys"] for r in per))
                    apart.append(max(r["local"] + r["recv"] for r in per))
                g, a = sum(gathered) / windows, sum(apart) / windows
                row = {"dist": dist, "context": context, "cp": cp, "comm": comm, "tokens_per_rank": context // cp,
                       "rows_gathered": g, "rows_apart": a}  # fmt: skip
                for name, (r, rope, h, nope, v) in SHAPES.items():
                    per_row = 2 * r * h * (nope + v) * 3  # forward + backward
                    row[f"{name}_gflop_gathered"] = g * per_row / 1e9
                    row[f"{name}_gflop_apart"] = a * per_row / 1e9
                    row[f"{name}_apart_extra_kv_mib"] = a * h * (nope + rope + v) * 2 / 2**20
                rows.append(row)
    return rows


def make_step(variant: str, problem: dict):
    import torch

    from flashcp.attention import varlen_attention
    from flashcp.attention.latent import up_project

    r, rope, h, nope, v = SMALL
    g = torch.Generator().manual_seed(0)
    t, recv = problem["local"], problem["recv"]
    kv_index = torch.tensor(problem["kv_index"])
    cu_q, cu_k = torch.tensor(problem["cu_q"], dtype=torch.int32), torch.tensor(problem["cu_k"], dtype=torch.int32)
    q = torch.randn(t, h, nope + rope, generator=g, requires_grad=True)
    latent = torch.randn(recv + t, r, generator=g, requires_grad=True)  # [received | local]
    pe = torch.randn(recv + t, rope, generator=g, requires_grad=True)
    wkv_b = torch.randn(h * (nope + v), r, generator=g, requires_grad=True)
    weight = torch.randn(t, h, v, generator=g)
    lens = (int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max()))

    def step() -> float:
        t0 = time.process_time()
        if variant == "gathered":
            k, vv = up_project(latent[kv_index], pe[kv_index], wkv_b, h, nope)
        else:
            k_rec, v_rec = up_project(latent[:recv], pe[:recv], wkv_b, h, nope)
            k_loc, v_loc = up_project(latent[recv:], pe[recv:], wkv_b, h, nope)
            k, vv = torch.cat([k_rec, k_loc])[kv_index], torch.cat([v_rec, v_loc])[kv_index]
        out = varlen_attention(q, k, vv, cu_q, cu_k, *lens, backend="reference")
        (out * weight).sum().backward()
        return time.process_time() - t0

    return step


def worker(variant: str, problem: dict, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    step = make_step(variant, problem)
    base = _rss_mib()
    times = [step()]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times += [step() for _ in range(repeats)]
    return {"variant": variant, "peak_above_base_mib": peak - base, "cpu_s": min(times[1:]), "cpu_s_runs": times}


def measured(repeats: int) -> dict:
    from flashcp import build_dispatch, plan_shards
    from flashcp.data import length_sampler, pack_windows

    lens = pack_windows(length_sampler("pile", seed=0), 16384, 1)[0]
    plan = plan_shards(lens, 4, "flashcp")
    out = {"window": "pile 16K", "cp": 4, "shape": dict(zip(("kv_lora_rank", "rope", "heads", "qk_nope", "v"), SMALL))}
    for comm in ("compact", "needed"):
        ds = [build_dispatch(plan, r, comm) for r in range(4)]
        d = max(ds, key=lambda d: d.kv_index.numel())
        problem = {"local": plan.tokens_per_rank, "recv": d.recv_size, "kv_index": d.kv_index.tolist(),
                   "cu_q": d.cu_seqlens_q.tolist(), "cu_k": d.cu_seqlens_k.tolist()}  # fmt: skip
        res = {"rank": d.rank, "rows_gathered": d.kv_index.numel(), "rows_apart": d.recv_size + plan.tokens_per_rank}
        for variant in ("gathered", "apart"):
            cmd = [sys.executable, __file__, "--worker", variant, json.dumps(problem), str(repeats)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        out[comm] = res
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--cp", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--windows", type=int, default=3, help="packed windows per distribution (modelled rows)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (after a first one)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mla_upproject.json")
    args = p.parse_args()
    result = {"modelled": modelled(args.context, args.cp, args.windows), "measured": measured(args.repeats)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["modelled"]:
        print(f"{row['dist']:7s} CP {row['cp']:2d} {row['comm']:7s} T {row['tokens_per_rank']:6d}  rows gathered "
              f"{row['rows_gathered']:8.0f} apart {row['rows_apart']:8.0f}  DSv3 GFLOP {row['deepseek_v3_gflop_gathered']:7.0f}"
              f" / {row['deepseek_v3_gflop_apart']:7.0f}  apart extra K/V MiB {row['deepseek_v3_apart_extra_kv_mib']:7.0f}")
    m = result["measured"]
    for comm in ("compact", "needed"):
        r = m[comm]
        print(f"measured {m['window']} CP {m['cp']} {comm}: rows {r['rows_gathered']} / {r['rows_apart']}; "
              f"CPU s {r['gathered']['cpu_s']:.3f} / {r['apart']['cpu_s']:.3f}; peak MiB "
              f"{r['gathered']['peak_above_base_mib']:.0f} / {r['apart']['peak_above_base_mib']:.0f} (gathered / apart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
