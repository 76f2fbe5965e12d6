"""Several nodes on this machine: two torchrun agents (`--nnodes 1:2`, a rendezvous on 127.0.0.1) train as
one agent with the same world does, bitwise; when one agent is killed with its worker, the other goes on
alone from the newest checkpoint, on the layout derived again (`--data-parallel 0`: one replica instead of
two), with the losses of the uninterrupted run up to the rounding of the data-parallel sum."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.dist_harness import free_port
from tests.test_restarts import ROOT, children, rows, strip

FLAGS = ["-m", "gpipe", "train", "--partitions", "1", "--data-parallel", "0", "--steps", "24",
         "--checkpoint-every", "8", "--eval-every", "8", "--eval-batches", "1", "--no-progress", "--tensorboard", "off",
         "--timeout", "5"]  # fmt: skip
TOLERANCE = 1e-4  # measured: 2e-5 relative, over 40 steps (benchmarks/results/faults)


def torchrun(*args: str, out: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, *FLAGS, "--out", str(out)]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def test_two_agents_train_as_one_and_the_survivor_of_a_lost_node_goes_on_alone(tmp_path: Path) -> None:
    port = free_port()
    node = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "nodes-test", "--max-restarts", "2", "--rdzv-conf",
            "last_call_timeout=3"]  # fmt: skip
    jobs = {"first": torchrun(*node, out=tmp_path / "nodes")}
    time.sleep(0.5)  # (the first agent hosts the rendezvous: the second is the node that is lost)
    jobs["second"] = torchrun(*node, out=tmp_path / "nodes")
    jobs["one agent"] = torchrun("--standalone", "--nproc-per-node", "2", out=tmp_path / "one")
    try:
        deadline = time.monotonic() + 120
        while not rows(tmp_path / "nodes") or rows(tmp_path / "nodes")[-1]["step"] < 12:
            assert time.monotonic() < deadline and jobs["first"].poll() is None, jobs["first"].communicate()[0][-3000:]
            time.sleep(0.02)
        for worker in children(jobs["second"].pid):  # the node: its agent and its worker
            os.kill(worker, signal.SIGKILL)
        os.killpg(jobs["second"].pid, signal.SIGKILL)
        outputs = {name: jobs[name].communicate(timeout=240)[0] for name in ("first", "one agent")}
        for name, output in outputs.items():
            assert jobs[name].returncode == 0, output[-4000:]
        nodes, one = rows(tmp_path / "nodes"), rows(tmp_path / "one")
        (restart,) = [json.loads(line) for line in (tmp_path / "nodes" / "restarts.jsonl").read_text().splitlines()]
        assert restart["lost"].startswith("rank 1 (dp 1, pp 0) is gone"), restart
        resumed = restart["resumed_from"]
        assert resumed in (8, 16) and restart["steps_again"] <= 8, restart
        # two agents as one: every step before the loss, bitwise
        assert [strip(r) for r in nodes[:resumed]] == [strip(r) for r in one[:resumed]]
        # then one replica instead of two: the same losses up to the rounding of the data-parallel sum
        assert [r["step"] for r in nodes] == list(range(1, 25))
        for a, b in zip(nodes, one):
            for key in ("loss", "eval_loss"):
                if key in b:
                    assert abs(a[key] - b[key]) <= TOLERANCE * abs(b[key]), (a, b)
        assert "torchrun restarted the job (restart 1): rank 1 (dp 1, pp 0) is gone" in outputs["first"]
    finally:
        for job in jobs.values():
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.communicate()
