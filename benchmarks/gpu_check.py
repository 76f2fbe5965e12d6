"""The GPU checks (``make gpu-check``; ``make gpu-check-multi`` with ``--multi``).

Reproduce (from the repository root)::

    .venv/bin/python benchmarks/gpu_check.py            # the checks marked cuda (tests/gpu)
    .venv/bin/python benchmarks/gpu_check.py --multi    # the checks marked cuda_multi (2 GPUs or more)

Without a CUDA device it says so in one line, proves that tests/gpu is collected
(``pytest tests/gpu --collect-only -q``) and exits 0. With one it runs ``pytest tests/gpu -m cuda``
(each check bounded by pytest-timeout, the whole run by ``--timeout``; a failing check does not stop
the others) and writes ``benchmarks/results/gpu/report.md`` (``report-multi.md``): the environment
(GPU, CUDA, NCCL, torch, the SDPA backends enabled), then each check's outcome and the numbers it
recorded (``tests/gpu/conftest.py``'s ``record``, through ``checks.jsonl``), with pytest's
``junit.xml`` beside it. The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def environment() -> list[tuple[str, str]]:
    """What the checks ran on."""
    rows = [("torch", torch.__version__), ("CUDA (torch built with)", str(torch.version.cuda))]
    count = torch.cuda.device_count()
    rows.append(("GPUs", str(count)))
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        rows.append((f"cuda:{i}", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"))
    try:
        rows.append(("NCCL", ".".join(map(str, torch.cuda.nccl.version()))))  # type: ignore[no-untyped-call]
    except Exception as exc:  # (no NCCL in this build)
        rows.append(("NCCL", f"unavailable ({type(exc).__name__}: {exc})"))
    rows.append(("cuDNN", str(torch.backends.cudnn.version())))
    sdpa = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
    }
    rows.append(("SDPA backends enabled", ", ".join(f"{k}={v}" for k, v in sdpa.items())))
    rows.append(("TF32 (matmul, cuDNN)", f"{torch.backends.cuda.matmul.allow_tf32}, {torch.backends.cudnn.allow_tf32}"))
    return rows


def outcomes(junit: Path) -> list[tuple[str, str, str]]:
    """(node id, passed | failed | error | skipped, message) per test case of pytest's junit XML."""
    if not junit.exists():
        return []
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            child = case.find(kind)
            if child is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (child.get("message") or "").strip().splitlines()[0][:300] if child.get("message") else ""
                break
        found.append((node, outcome, message))
    return found


def numbers(checks: Path) -> dict[str, list[dict[str, Any]]]:
    """The numbers each check recorded, by node id."""
    out: dict[str, list[dict[str, Any]]] = {}
    if checks.exists():
        for line in checks.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row.pop("check"), []).append(row)
    return out


def report(path: Path, marker: str, rc: int, seconds: float, junit: Path, checks: Path) -> None:
    rows = outcomes(junit)
    recorded = numbers(checks)
    counts = {k: sum(1 for _, o, _ in rows if o == k) for k in ("passed", "failed", "error", "skipped")}
    lines = [f"# gpu-check (`pytest tests/gpu -m {marker}`)", ""]
    lines += [f"pytest exit status {rc}, {seconds:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items()), ""]
    lines += ["## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in environment()]
    lines += ["", "## Checks", "", "| check | outcome | message |", "|---|---|---|"]
    lines += [f"| `{node}` | {outcome} | {message.replace('|', '/')} |" for node, outcome, message in rows]
    lines += ["", "## Numbers", ""]
    for node, recs in recorded.items():
        for rec in recs:
            lines.append(f"- `{node}`: " + ", ".join(f"{k}={_fmt(v)}" for k, v in rec.items()))
    if not recorded:
        lines.append("(none recorded)")
    path.write_text("\n".join(lines) + "\n")


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--multi", action="store_true", help="the checks marked cuda_multi (2 GPUs or more)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole pytest run")
    parser.add_argument("--check-timeout", type=int, default=300, help="seconds for one check (pytest-timeout)")
    args = parser.parse_args(argv)
    marker = "cuda_multi" if args.multi else "cuda"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    pytest = [sys.executable, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider"]

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device (torch {torch.__version__} reports torch.cuda.is_available() False): "
            "nothing to check",
            flush=True,
        )
        done = subprocess.run([*pytest, "--collect-only", "-q"], cwd=ROOT, env=env, timeout=120, check=False)
        return done.returncode

    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-multi" if args.multi else ""
    junit, checks = args.out / f"junit{suffix}.xml", args.out / f"checks{suffix}.jsonl"
    for stale in (junit, checks):
        stale.unlink(missing_ok=True)
    env["GPIPE_GPU_RESULTS"] = str(checks)
    cmd = [*pytest, "-m", marker, "-v", f"--junitxml={junit}", f"--timeout={args.check_timeout}"]
    began = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"gpu-check: pytest ran past {args.timeout:.0f} s and was stopped", flush=True)
        rc = 124
    out = args.out / f"report{suffix}.md"
    report(out, marker, rc, time.monotonic() - began, junit, checks)
    print(f"gpu-check: {out}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
