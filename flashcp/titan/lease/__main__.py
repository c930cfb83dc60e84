"""`python -m flashcp.titan.lease {train,dryrun,frontier} --out DIR --device cuda|cpu [--quick] [--deadline T]
[--run-cap S]`:
one TorchTitan part of the GPU lease (see flashcp.titan.lease)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashcp.titan.lease")
    p.add_argument("part", choices=("train", "dryrun", "frontier"))
    p.add_argument("--out", type=Path, required=True, help="the lease's folder (OUTDIR)")
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--quick", action="store_true", help="toy sizes")
    p.add_argument("--deadline", type=float, default=None,
                   help="when the part must be done (seconds since the epoch; default: 10 minutes from now)")
    p.add_argument("--run-cap", type=float, default=150.0,
                   help="at most this many seconds for one trained run (the lease scales it with its budgets)")
    args = p.parse_args(argv)
    if not args.run_cap > 0:
        p.error(f"--run-cap must be positive, not {args.run_cap}")
    deadline = args.deadline if args.deadline is not None else time.time() + 600
    import flashcp.titan  # noqa: F401  (the version shims before TorchTitan is imported)

    if args.part == "dryrun":
        from flashcp.titan.lease.memory import run

        return run(args.out, args.device, args.quick, deadline)
    if args.part == "train":
        from flashcp.titan.lease.train import run
    else:
        from flashcp.titan.lease.frontier import run
    return run(args.out, args.device, args.quick, deadline, args.run_cap)


if __name__ == "__main__":
    sys.exit(main())
