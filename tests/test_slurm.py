"""examples/slurm/train.sbatch, as far as a machine without Slurm allows: its command lines run with two
local torchrun agents, one per "node" (srun and scontrol stand in for Slurm's: srun starts the line once
per node of the job, every node this machine), meet in torchrun's c10d rendezvous and train as one job
of two data-parallel replicas."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from gpipe.runfile import read_run
from gpipe.saving import find
from tests.dist_harness import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples/slurm/train.sbatch"

SRUN = """#!/bin/bash
# srun: one task per node of the job (SLURM_JOB_NUM_NODES), every node this machine; its options skipped
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "node-$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] || exit 2
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do echo 127.0.0.1; done
"""


def test_the_sbatch_script_trains_one_job_with_an_agent_per_node(tmp_path: Path) -> None:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "GPIPE_PROCS_PER_NODE": "1",
        "GPIPE_PORT": str(free_port()),
        "TORCHRUN": f"{sys.executable} -m torch.distributed.run",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src"),
    }
    env.pop("WORLD_SIZE", None)
    out = tmp_path / "run"
    flags = ["--steps", "2", "--partitions", "1", "--data-parallel", "0", "--no-progress", "--tensorboard", "off"]
    job = subprocess.Popen(["bash", str(SCRIPT), *flags, "--out", str(out)], cwd=tmp_path, env=env,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        _, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:  # (the agents and their workers too: one session)
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    logs = {n: log.read_text() if (log := tmp_path / f"node-{n}.log").exists() else "(no log: srun never ran)"
            for n in (0, 1)}  # fmt: skip
    assert job.returncode == 0, f"{err[-2000:]}\n{logs[0][-3000:]}\n{logs[1][-3000:]}"
    checkpoint = find(out)
    assert checkpoint is not None and checkpoint.name == "step-00000002"
    assert read_run(checkpoint)["config"]["data_parallel"] == 2  # (both agents' ranks: one world)
    assert "step 2: loss" in logs[0] + logs[1]
