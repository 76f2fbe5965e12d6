"""The package as a user installs it (``make wheel-check``): ``python -m build`` (an sdist, then the wheel
built from it), a fresh virtual environment with nothing but torch (pinned) and that wheel with its
dependencies (``constraints.txt``), and in an empty folder, far from the checkout: ``gpipe schedule``,
``gpipe train --config t2-256-4`` (a configuration shipped as package data) and ``gpipe demo``.

Reproduce (from the repository root)::

    .venv/bin/python benchmarks/wheel_check.py            # report in benchmarks/results/wheel/report.md

The distribution is ``gpipe-pytorch`` (``gpipe`` in the package index is an unrelated project); the
import name and the command stay ``gpipe``. Each step is bounded by ``--timeout`` seconds; the exit
status is 1 when one fails. Needs the package index (or its mirror) for the dependencies.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, float, str]:
    """``cmd``'s exit status, seconds and the tail of its output (-1: it ran past ``timeout``)."""
    began = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status, output = -1, f"ran past {timeout:g} s: {exc.output or ''}"
    return status, time.perf_counter() - began, output.strip()[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=900, help="seconds per step (default: 900)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/wheel/report.md"), help="the report")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpipe-wheel-"))
    venv, empty, dist = work / "venv", work / "run", work / "dist"
    empty.mkdir()
    python, gpipe = venv / "bin/python", venv / "bin/gpipe"
    constraints = str(ROOT / "constraints.txt")
    steps: list[tuple[str, list[str], Path]] = [
        ("python -m build", [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], work),
        ("a fresh venv", [sys.executable, "-m", "venv", str(venv)], work),
        (
            "pip install torch==2.13.0",
            [str(python), "-m", "pip", "install", "-q", "-c", constraints, "torch==2.13.0"],
            work,
        ),
        ("pip install the wheel", [str(python), "-m", "pip", "install", "-q", "-c", constraints, "WHEEL"], work),
        ("gpipe schedule", [str(gpipe), "schedule"], empty),
        (
            "gpipe train --config t2-256-4",
            [str(gpipe), "train", "--config", "t2-256-4", "--steps", "20", "--no-progress", "--out", str(empty / "t2")],
            empty,
        ),
        ("gpipe demo", [str(gpipe), "demo"], empty),
        ("import gpipe: from the venv", [str(python), "-c", "import gpipe; print(gpipe.__file__)"], empty),
    ]
    rows, wheel, failed = [], None, False
    for name, cmd, cwd in steps:
        if wheel is not None:
            cmd = [str(wheel) if c == "WHEEL" else c for c in cmd]
        status, seconds, output = run(cmd, cwd, args.timeout)
        last = output.splitlines()[-1] if output else ""
        print(f"{name}: exit {status} in {seconds:.1f} s  {last[:120]}", flush=True)
        rows.append((name, status, seconds, last))
        if name == "python -m build" and status == 0:
            wheel = next(iter(sorted(dist.glob("*.whl"))), None)
        if name.startswith("import gpipe") and status == 0 and not last.startswith(str(venv)):
            status, failed = 1, True
            rows[-1] = (name, 1, seconds, f"imported from {last}, not the venv")
        if status != 0:
            failed = True
            print(output, file=sys.stderr)
            break
    lines = [
        "# The wheel, installed as a user installs it",
        "",
        "Reproduce: `make wheel-check` (`.venv/bin/python benchmarks/wheel_check.py`), on "
        f"{time.strftime('%Y-%m-%d')}, Python {sys.version.split()[0]}.",
        "",
    ]
    if wheel is not None:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
        configs = sum(1 for n in names if n.startswith("gpipe/configs/"))
        lines += [f"Wheel: `{wheel.name}`, {wheel.stat().st_size / 1e6:.1f} MB, {len(names)} files "
                  f"({configs} of them the configurations in `gpipe/configs/`).", ""]  # fmt: skip
    lines += ["| step | exit status | seconds | last line of its output |", "|---|---|---|---|"]
    lines += [f"| {n} | {s} | {t:.1f} | {last.replace('|', '/')[:100]} |" for n, s, t, last in rows]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"report: {out}")
    if args.keep:
        print(f"kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
