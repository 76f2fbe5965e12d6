"""``make gpu-check`` here, without a GPU: benchmarks/gpu_check.py says so, proves tests/gpu is
collected and exits 0; tests/gpu's checks skip in the normal suite; the report is written from
pytest's junit XML and the checks' numbers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device: make gpu-check runs the checks")


def test_gpu_check_without_cuda_says_so_and_collects() -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    said = f"torch {torch.__version__} reports torch.cuda.is_available() False"
    assert first == f"gpu-check: no CUDA device ({said}): nothing to check"
    assert "tests/gpu/test_nccl.py::test_nccl_world_one_runs_a_checked_step_collectives_and_dcp" in done.stdout
    assert "13 tests collected" in done.stdout


def test_the_checks_skip_here_and_the_report_says_so(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/gpu",
        "-m",
        "cuda",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "12 skipped" in done.stdout and "1 deselected" in done.stdout  # cuda_multi's check deselected

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    checks = tmp_path / "checks.jsonl"
    node = "tests/gpu/test_engine_cuda.py::test_k1_engine_matches_a_plain_loop"
    checks.write_text(json.dumps({"check": node, "engine_ms": 1.5, "step_host_syncs": 2}) + "\n")
    out = tmp_path / "report.md"
    gpu_check.report(out, "cuda", 0, 3.0, junit, checks)
    text = out.read_text()
    assert "0 passed, 0 failed, 0 error, 12 skipped" in text
    assert f"| `{node}` | skipped | no CUDA device" in text
    assert f"- `{node}`: engine_ms=1.5, step_host_syncs=2" in text
    assert f"| torch | {torch.__version__} |" in text and "SDPA backends enabled" in text
