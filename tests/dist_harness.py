"""Run a function of tests/dist_cases.py in several processes over torch.distributed (gloo on CPU),
the way torchrun would start them, each bounded by a timeout; collect what each rank returns."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RanksFailedError(AssertionError):
    def __init__(self, message: str, returncodes: list[int | None], outputs: list[str]) -> None:
        super().__init__(message + "\n" + "\n".join(f"--- rank {r} ---\n{o[-3000:]}" for r, o in enumerate(outputs)))
        self.returncodes = returncodes
        self.outputs = outputs


def start(case: str, world: int, out_dir: Path, **kwargs: Any) -> list[subprocess.Popen[str]]:
    port = free_port()
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),  # this checkout's gpipe and tests
        }
        out = out_dir / f"rank{rank}.pt"
        cmd = [sys.executable, "-m", "tests.dist_entry", case, str(out), json.dumps(kwargs)]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return procs


def wait(procs: list[subprocess.Popen[str]], timeout: float) -> tuple[list[int | None], list[str], float]:
    """Wait for every process (killing all of them at the deadline); return codes, outputs, seconds."""
    start_time = time.monotonic()
    deadline = start_time + timeout
    outputs = [""] * len(procs)
    for i, p in enumerate(procs):
        try:
            outputs[i], _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.send_signal(signal.SIGKILL)
            for j, q in enumerate(procs):
                out, _ = q.communicate()
                outputs[j] = outputs[j] or out
            break
    return [p.returncode for p in procs], outputs, time.monotonic() - start_time


def run_ranks(case: str, world: int, out_dir: Path, *, timeout: float = 180, **kwargs: Any) -> list[Any]:
    """Run ``case`` on ``world`` ranks; every rank must succeed within ``timeout`` seconds."""
    codes, outputs, _ = wait(start(case, world, out_dir, **kwargs), timeout)
    if any(c != 0 for c in codes):
        raise RanksFailedError(f"{case} on {world} ranks failed (exit codes {codes})", codes, outputs)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
