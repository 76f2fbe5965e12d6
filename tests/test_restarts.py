"""Under `torchrun --max-restarts`, a rank killed (SIGKILL) or frozen (SIGSTOP) mid-run costs at most one
checkpoint interval: the same command line finishes by itself, and every step's loss and evaluation in
metrics.jsonl is bitwise the uninterrupted run's. The two jobs run side by side, beside the reference run
in this process; each is bounded by a timeout, and its processes are killed whatever happens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpipe.cli import main

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--steps", "24", "--checkpoint-every", "8", "--eval-every", "8", "--eval-batches", "1", "--no-progress",
         "--tensorboard", "off"]  # fmt: skip
AFTER = 12  # the fault comes once rank 0 wrote this step's metrics (the checkpoint of step 8 is complete)


def rows(out: Path) -> list[dict[str, Any]]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)


def launch(out: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", "-m", "gpipe", "train", *FLAGS, "--timeout", "4", "--out", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def strip(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if not k.endswith("_per_s")}


def test_a_killed_and_a_frozen_rank_are_restarted_and_the_losses_are_the_uninterrupted_runs(tmp_path: Path) -> None:
    faults = {"killed": signal.SIGKILL, "frozen": signal.SIGSTOP}
    jobs = {name: launch(tmp_path / name) for name in faults}
    try:
        pending, deadline = dict(faults), time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for name, sig in list(pending.items()):
                assert jobs[name].poll() is None, jobs[name].communicate()[0][-3000:]
                if rows(tmp_path / name) and rows(tmp_path / name)[-1]["step"] >= AFTER:
                    (victim,) = [p for p in children(jobs[name].pid) if rank_of(p) == 1]
                    os.kill(victim, sig)
                    del pending[name]
            time.sleep(0.02)
        assert not pending, f"no fault sent to {list(pending)} in time"
        assert main(["train", *FLAGS, "--out", str(tmp_path / "reference")]) == 0  # (while the jobs recover)
        reference = [strip(r) for r in rows(tmp_path / "reference")]
        for name, job in jobs.items():
            output = job.communicate(timeout=240)[0]
            assert job.returncode == 0, output[-4000:]
            assert [strip(r) for r in rows(tmp_path / name)] == reference, name
            (restart,) = [json.loads(line) for line in (tmp_path / name / "restarts.jsonl").read_text().splitlines()]
            assert restart["restart"] == 1 and restart["resumed_from"] in (8, 16), restart
            assert restart["steps_again"] < 8 and restart["seconds"] > 0, restart  # at most one checkpoint interval
            lost = "rank 1 is gone" if name == "killed" else "rank 1 is not responding"
            assert restart["lost"].startswith(lost), restart
            assert f"torchrun restarted the job (restart 1): {lost}" in output
    finally:
        for job in jobs.values():
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.communicate()
