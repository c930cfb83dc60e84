"""What the plan-level sweeps (window rows, linear state, MLA exchange) share: the calibration tables'
folder and their grid's arguments, so every sweep reads the same flags the same way."""

from __future__ import annotations

import argparse
from pathlib import Path

SHARED_PROFILES = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu_profiles"


def sweep_parser(description: str, windows: int) -> argparse.ArgumentParser:
    """The grid (contexts x CP degrees x length distributions, `windows` packed windows per setting) and
    the calibration tables; each sweep adds its own output flags."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--cp", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--datasets", nargs="+", default=["wlbllm", "pile"])
    p.add_argument("--windows", type=int, default=windows, help=f"packed windows per setting (default {windows})")
    p.add_argument("--profiles", type=Path, default=SHARED_PROFILES, help="calibration tables (nccl-tests, FA profile)")
    return p
