"""The GPU lease's front door (`scripts/gpu_lease.sh`, `flashcp/gpucheck/lease_start.py`): each bad input
is one line and exit 2 before anything starts, a used OUTDIR is left byte for byte as it was, and the
wheel site goes on PYTHONPATH only when the lease made it and it holds only what the lease installed.
Every run has TMPDIR (the default site's parent) inside the test's folder."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from flashcp.gpucheck import lease, lease_start

ROOT = Path(__file__).resolve().parents[1]
VERSION = "%d.%d" % sys.version_info[:2]
# Writes a file beside its own folder whenever a python starts with that folder on its path.
PLANT = "import pathlib; pathlib.Path(__file__).resolve().parent.with_name('planted-ran').touch()\n"


def gpu_lease(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`bash scripts/gpu_lease.sh ARGS` as other tooling calls it, TMPDIR in `tmp_path`."""
    base = {k: v for k, v in os.environ.items() if k != "FLASHCP_LEASE_SITE"}
    env = {**base, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), **env}
    script = str(ROOT / "scripts" / "gpu_lease.sh")
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env, timeout=600)


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every path under `folder` with its bytes and modification time (folders: empty bytes)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"", p.lstat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and not proc.stdout and len(lines) == 1, (proc.returncode, proc.stdout, lines)
    assert lines[0].startswith("lease: error: ") and all(w in lines[0] for w in words), lines


def test_parts_are_chosen_by_name_or_letter() -> None:
    assert lease_start.selected([], []) == list(lease.PARTS)
    assert lease_start.selected(["b,c"], []) == ["train", "dryrun"]
    assert lease_start.selected(["gpucheck", "d"], []) == ["gpucheck", "frontier"]
    assert lease_start.selected([], ["a", "frontier"]) == ["train", "dryrun"]


@pytest.mark.parametrize(("args", "words"), [
    ([], ["required: OUTDIR"]),
    (["{out}", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["{out}", "--device", "tpu"], ["--device", "invalid choice: 'tpu'"]),
    *((["{out}", "--only", "a", f"--budget-scale={x}"], ["--budget-scale", "positive finite", repr(x)])
      for x in ("0", "-1", "nan", "inf", "-inf", "1e400", "two")),
    (["{out}", "--only", "e"], ["unknown part 'e'"]),
    (["{out}", "--skip", "b,,c"], ["unknown part ''"]),
    (["{out}", "--only", "a", "--skip", "gpucheck"], ["leaves no part to run"]),
    (["{out}", "--skip", "a,b", "--skip", "dryrun,d"], ["leaves no part to run"]),
    (["{file}"], ["is a file, not a folder"]),
    (["{file}/sub"], ["cannot be created", "Not a directory"]),
])  # fmt: skip
def test_each_bad_argument_is_one_line_and_exit_2_before_anything_starts(tmp_path, args, words) -> None:
    """Nothing is created: no OUTDIR, no wheel site; nothing in the folder changes."""
    (tmp_path / "file").write_text("a file\n")
    before = snapshot(tmp_path)
    proc = gpu_lease(tmp_path, *(a.format(out=tmp_path / "out", file=tmp_path / "file") for a in args))
    assert_refused(proc, *words)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("missing", ["numpy", "torch"])
def test_a_python_without_numpy_or_torch_is_refused(tmp_path, missing) -> None:
    """PYTHON sees no site-packages (-S), only a stand-in for the other library: the missing one is named."""
    present = {"numpy", "torch"} - {missing}
    for name in present:
        (tmp_path / "lib" / name).mkdir(parents=True)
        (tmp_path / "lib" / name / "__init__.py").write_text("")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    proc = gpu_lease(tmp_path, str(tmp_path / "out"), PYTHON=str(python), PYTHONPATH=str(tmp_path / "lib"))
    assert_refused(proc, f"has no {missing}:")
    assert f"has no {present.pop()}" not in proc.stderr and not (tmp_path / "out").exists()


def test_a_python_that_is_not_a_command_is_refused(tmp_path) -> None:
    proc = gpu_lease(tmp_path, str(tmp_path / "out"), PYTHON=str(tmp_path / "nope"))
    assert_refused(proc, "is not a command")


def used_outdir(out: Path, cut_off: bool) -> None:
    """What a lease leaves: its 7 packed files, or (cut off by the command's limit) its work folder."""
    if cut_off:
        (out / lease.WORK / "gpucheck").mkdir(parents=True)
        (out / lease.WORK / "gpucheck" / "exactness.csv").write_text("case,error\nfp16,1e-3\n")
        (out / lease.WORK / "train.log").write_text("step 3 loss 9.1\n")
        return
    out.mkdir()
    for name in ("summary.md", "lease.json", "train.json", "dryrun.json", "frontier.json"):
        (out / name).write_text(f"{name} of the earlier lease\n")
    for name in ("gpucheck.tar.gz", "logs.tar.gz"):
        (out / name).write_bytes(os.urandom(256))


@pytest.mark.parametrize("cut_off", [False, True], ids=["finished", "cut-off"])
def test_a_rerun_into_a_used_outdir_leaves_every_earlier_file_as_it_was(tmp_path, capsys, cut_off) -> None:
    """Through the script and through `python -m flashcp.gpucheck.lease`'s main: refused in one line,
    every earlier file byte-identical (and untouched), nothing added."""
    out = tmp_path / "lease"
    used_outdir(out, cut_off)
    before = snapshot(out)
    # were it not refused: a lease of seconds (one part, killed at once), not minutes
    args = [str(out), "--device", "cpu", "--quick", "--only", "a", "--budget-scale", "0.001"]
    assert_refused(gpu_lease(tmp_path, *args), "already holds", str(out))
    assert snapshot(out) == before
    with pytest.raises(SystemExit) as stop:
        lease.main(args)
    assert stop.value.code == 2 and "already holds" in capsys.readouterr().err
    assert snapshot(out) == before


def plant(site: Path) -> None:
    site.mkdir(mode=0o700, parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(PLANT)


def test_a_sitecustomize_planted_in_the_old_default_site_does_not_run(tmp_path) -> None:
    """The old default ($TMPDIR/flashcp-lease-site-pyX.Y) was put on PYTHONPATH unchecked. Neither
    `--help` nor a lease (one part, its budget cut so that it is killed at once) starts a python with it."""
    site, ran = tmp_path / f"flashcp-lease-site-py{VERSION}", tmp_path / "planted-ran"
    plant(site)
    subprocess.run([sys.executable, "-c", "pass"], env={**os.environ, "PYTHONPATH": str(site)}, check=True)
    assert ran.exists(), "the planted file runs in a python with its folder on the path"
    ran.unlink()
    proc = gpu_lease(tmp_path, "--help")
    assert proc.returncode == 0 and "usage: bash scripts/gpu_lease.sh" in proc.stdout, proc.stderr
    proc = gpu_lease(tmp_path, str(tmp_path / "out"), "--device", "cpu", "--quick", "--only", "a",
                     "--budget-scale", "0.001")  # fmt: skip
    assert proc.returncode == 1 and "| gpucheck | timed out" in proc.stdout, proc.stdout[-3000:] + proc.stderr
    assert not ran.exists()
    assert not (tmp_path / f"flashcp-lease-site-{os.getuid()}-py{VERSION}").exists()  # no wheel to install


def lease_site(site: Path) -> None:
    """A site as the lease leaves it: owner-only, one package, the manifest naming it."""
    site.mkdir(mode=0o700)
    (site / "toy").mkdir()
    (site / lease_start.MANIFEST).write_text("toy\n")


@pytest.mark.parametrize(("where", "make", "words"), [
    ("default", plant, [f"has no {lease_start.MANIFEST}"]),
    ("named", lambda s: (lease_site(s), plant(s)), ["did not install: sitecustomize.py"]),
    ("named", lambda s: (lease_site(s), s.chmod(0o777)), ["writable by group or others", "777"]),
    ("named", lambda s: (lease_site(s.with_name("real")), s.symlink_to("real")), ["a link or a file"]),
])  # fmt: skip
def test_a_wheel_site_the_lease_did_not_make_is_refused(tmp_path, where, make, words) -> None:
    """The default site's place or FLASHCP_LEASE_SITE: refused before OUTDIR is made, nothing of it run."""
    if where == "default":
        site, env = tmp_path / f"flashcp-lease-site-{os.getuid()}-py{VERSION}", {}
    else:
        site = tmp_path / "site"
        env = {"FLASHCP_LEASE_SITE": str(site)}
    make(site)
    assert_refused(gpu_lease(tmp_path, str(tmp_path / "out"), **env), "wheel site", str(site), *words)
    assert not (tmp_path / "planted-ran").exists() and not (tmp_path / "out").exists()


def test_a_site_of_another_user_is_refused(tmp_path, monkeypatch) -> None:
    lease_site(tmp_path / "site")
    assert lease_start.site_problem(tmp_path / "site") is None
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path / "site").st_uid + 1)
    assert "is owned by uid" in lease_start.site_problem(tmp_path / "site")


def toy_wheel(folder: Path) -> Path:
    """A one-module wheel, as pip installs it: a package and its dist-info."""
    path = folder / "leasetoy-0.1-py3-none-any.whl"
    info = "leasetoy-0.1.dist-info"
    files = {"leasetoy/__init__.py": "",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: leasetoy\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    return path


def test_the_site_the_lease_installs_into_is_owner_only_and_passes_its_own_check(tmp_path) -> None:
    """install() makes the site 0700 and names what pip put there: verified as is (the wheel's
    distribution found in it), refused once a file is added, accepted again once it is gone."""
    site = tmp_path / "site"
    lease_start.install(site, False, [toy_wheel(tmp_path)])
    assert site.stat().st_mode & 0o777 == 0o700 and (site / "leasetoy" / "__init__.py").is_file()
    assert lease_start.site_problem(site) is None
    assert [d.metadata["Name"] for d in metadata.distributions(path=[str(site)])] == ["leasetoy"]
    plant(site)
    assert "did not install: sitecustomize.py" in lease_start.site_problem(site)
    (site / "sitecustomize.py").unlink()
    assert lease_start.site_problem(site) is None
