"""NCCL at world size 1, in a process of its own started as torchrun would (tests/gpu/nccl_world1.py):
the group, a checked step with health, an object collective and a DCP save and load complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.dist_harness import ROOT, free_port
from tests.gpu.common import cuda

pytestmark = cuda

TIMEOUT = 180


def test_nccl_world_one_runs_a_checked_step_collectives_and_dcp(tmp_path: Path, record: Callable[..., Any]) -> None:
    out = tmp_path / "seen.json"
    env = {
        **os.environ,
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }  # fmt: skip
    cmd = [sys.executable, "-m", "tests.gpu.nccl_world1", str(out), str(tmp_path / "ckpt")]
    try:
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        record(completed=False, timeout_s=TIMEOUT)
        raise AssertionError(f"the rank did not finish within {TIMEOUT} s:\n{exc.stdout}\n{exc.stderr}") from None
    seen = json.loads(out.read_text()) if out.exists() else {}
    record(completed=done.returncode == 0, returncode=done.returncode, **seen)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert seen["world"] == 1 and "nccl" in seen["backend"] and seen["all_finite"] and seen["restored"]
    assert seen["broadcast"] == {"step": 3, "note": "from rank 0"}
