"""The GPU lease's front door (`scripts/gpu_lease.sh` runs this file): every check, the carried
wheels, then `python -m flashcp.gpucheck.lease`.

A lease is rare and what it measures cannot be measured again, so nothing starts until every input
is known good: a bad argument, `--only` / `--skip` that leave no part, an OUTDIR that is a file,
cannot be created or already holds files, a PYTHON without numpy or torch, a wheel site the lease
did not make: each is one line on stderr and exit 2. Standard library only, run as a file: importing
`flashcp.gpucheck` would import torch, and nothing unverified may be on the path yet.

The wheel site goes on PYTHONPATH only verified: a folder of this user's, not writable by group or
others, every entry named in the manifest the lease wrote when it installed them. Anything else
there (a planted `sitecustomize.py`) would run in every python the lease starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import stat
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import NoReturn

PARTS = ("gpucheck", "train", "dryrun", "frontier")
LETTERS = dict(zip("abcd", PARTS))
ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ".flashcp-lease-site"  # in the site: the entries the lease installed, one a line


def refuse(problem: str) -> NoReturn:
    """One line naming the problem, exit 2: a bad input stops the lease before anything starts."""
    print(f"lease: error: {problem}", file=sys.stderr)
    raise SystemExit(2)


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's usage-then-message, as one line
        refuse(message)


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, not {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bash scripts/gpu_lease.sh", description="One GPU lease, fully used (docs/gpucheck.md).")
    p.add_argument("out", type=Path, metavar="OUTDIR", help="results folder, new or empty")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees a GPU")
    p.add_argument("--quick", action="store_true", help="toy sizes: every part in minutes (a rehearsal)")
    p.add_argument("--only", action="append", default=[], metavar="PART",
                   help=f"run only these parts ({', '.join(PARTS)} or a-d; repeat or comma-separate)")
    p.add_argument("--skip", action="append", default=[], metavar="PART", help="leave these parts out")
    p.add_argument("--budget-scale", type=_scale, default=1.0, metavar="X",
                   help="multiply every part's time budget (> 0)")
    return p


def selected(only: list[str], skip: list[str]) -> list[str]:
    """The parts `--only` / `--skip` leave, in the lease's order; refused when that is none."""

    def names(values: list[str]) -> set[str]:
        out = set()
        for item in (i.strip() for value in values for i in value.split(",")):
            if LETTERS.get(item, item) not in PARTS:
                refuse(f"unknown part {item!r}: one of {', '.join(PARTS)} (or a-d)")
            out.add(LETTERS.get(item, item))
        return out

    chosen, left_out = names(only) or set(PARTS), names(skip)
    parts = [p for p in PARTS if p in chosen and p not in left_out]
    if not parts:
        refuse(f"--only {' '.join(only) or '(all)'} with --skip {' '.join(skip)} leaves no part to run")
    return parts


def check_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The arguments and the parts they select, with this python able to run them (numpy, torch)."""
    args = parser().parse_args(argv)
    parts = selected(args.only, args.skip)
    missing = [name for name in ("numpy", "torch") if importlib.util.find_spec(name) is None]
    if missing:
        refuse(f"PYTHON {sys.executable} has no {' and no '.join(missing)}: the lease needs torch and numpy")
    return args, parts


def outdir(path: Path) -> None:
    """Create OUTDIR, or accept it empty: a lease never writes over or beside results already there."""
    try:
        path.mkdir(parents=True)
        return
    except FileExistsError:
        pass
    except OSError as e:
        refuse(f"OUTDIR {path} cannot be created: {e.strerror or e}")
    if not path.is_dir():
        refuse(f"OUTDIR {path} is a file, not a folder")
    try:
        held = sorted(os.listdir(path))
    except OSError as e:
        refuse(f"OUTDIR {path} cannot be read: {e.strerror or e}")
    if held:
        refuse(f"OUTDIR {path} already holds {_few(held)}: a lease writes only into a new or empty "
               "folder, so that no earlier result is replaced")  # fmt: skip


def site_path() -> Path:
    """FLASHCP_LEASE_SITE, else a folder of this user's in the temporary directory (kept for a rerun)."""
    named = os.environ.get("FLASHCP_LEASE_SITE")
    version = "%d.%d" % sys.version_info[:2]
    default = Path(tempfile.gettempdir(), f"flashcp-lease-site-{os.getuid()}-py{version}")
    return Path(named) if named else default


def site_problem(site: Path) -> str | None:
    """Why `site` (which exists) may not go on PYTHONPATH, or None when the lease made it and it holds
    only what the lease installed."""
    st = site.lstat()
    if not stat.S_ISDIR(st.st_mode):
        return "is a link or a file, not a folder"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    manifest = site / MANIFEST
    if manifest.is_symlink() or not manifest.is_file():
        return f"has no {MANIFEST}: the lease did not make it"
    foreign = sorted(set(os.listdir(site)) - set(manifest.read_text().splitlines()) - {MANIFEST})
    if foreign:
        return f"holds what the lease did not install: {_few(foreign)}"
    return None


def checked_site(site: Path) -> bool:
    """Whether `site` exists (then verified, else refused)."""
    if not os.path.lexists(site):
        return False
    problem = site_problem(site)
    if problem:
        refuse(f"wheel site {site} {problem}; remove it or name another with FLASHCP_LEASE_SITE")
    return True


def missing_wheels(site: Path | None) -> list[Path]:
    """The carried wheels (.gpu_wheels/) whose distribution neither this python nor `site` has."""
    lines = (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    pins = [line.split("==")[0] for line in lines if re.match(r"^[A-Za-z0-9_.-]+==", line)]
    wheels = {_norm(w.name.split("-")[0]): w for w in (ROOT / ".gpu_wheels").glob("*.whl")}
    path = [*([str(site)] if site else []), *sys.path]
    have = {_norm(d.metadata["Name"] or "") for d in metadata.distributions(path=path)}
    missing = [name for name in pins if _norm(name) not in have]
    for name in (n for n in missing if _norm(n) not in wheels):
        print(f"lease: warning: {name} is missing and {ROOT / '.gpu_wheels'} has no wheel for it "
              "(run scripts/gpu_wheels.sh where there is a network)", file=sys.stderr)  # fmt: skip
    return [wheels[_norm(n)] for n in missing if _norm(n) in wheels]


def install(site: Path, present: bool, wheels: list[Path]) -> None:
    """`wheels` into `site` (created owner-only where absent), each entry they add named in its manifest."""
    if not present:
        try:
            site.mkdir(mode=0o700, parents=True)
        except OSError as e:
            refuse(f"wheel site {site} cannot be created: {e.strerror or e}")
        (site / MANIFEST).write_text("")
    print(f"lease: installing {len(wheels)} carried wheels into {site}", flush=True)
    code = subprocess.call([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--no-index", "--no-deps", "--target", str(site), *map(str, wheels)])  # fmt: skip
    (site / MANIFEST).write_text("".join(f"{name}\n" for name in sorted(set(os.listdir(site)) - {MANIFEST})))
    if code:
        raise SystemExit(f"lease: error: pip could not install the carried wheels into {site} (exit {code})")


def main(argv: list[str]) -> NoReturn:
    """Check everything, create OUTDIR, install what is missing, then become the lease."""
    args, _ = check_args(argv)
    site = site_path()
    present = checked_site(site)
    outdir(args.out)
    wheels = missing_wheels(site if present else None)
    if wheels:
        install(site, present, wheels)
    path = [str(ROOT), *([str(site)] if present or wheels else []), os.environ.get("PYTHONPATH", "")]
    os.execve(sys.executable, [sys.executable, "-m", "flashcp.gpucheck.lease", *argv],
              {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))})  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
