"""The same user script in one process and under torchrun, with no code change."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pipeline_train.py"


def losses(cmd: list[str]) -> list[float]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "unwaited collective" not in done.stderr, done.stderr[-3000:]  # (torch's warning at exit)
    return [float(v) for v in re.findall(r"loss ([0-9.]+)", done.stdout)]


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", str(EXAMPLE), *args,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_process() -> list[float]:
    """The example's losses in one process (the same command line for every launch it is compared with)."""
    return losses([sys.executable, str(EXAMPLE), "--steps", "5"])


@pytest.mark.parametrize(("nproc", "extra"), [(2, []), (4, ["--data-parallel", "2"]), (4, ["--tensor-parallel", "2"])])
def test_example_runs_alike_in_one_process_and_under_torchrun(
    one_process: list[float], nproc: int, extra: list[str]
) -> None:
    """The example's losses under torchrun are one process's. With --tensor-parallel 2 (2 stages, each
    block split over 2 ranks) every split block's all-reduce is waited for, a recomputed micro-batch's
    too: torch warns at exit of none left unwaited."""
    one = one_process
    several = losses(torchrun(nproc, "--steps", "5", *extra))
    assert len(one) == len(several) == 5
    assert several == pytest.approx(one, rel=1e-4)
    assert one[-1] < one[0]


def test_gpipe_train_under_torchrun_equals_one_process(tmp_path: Path) -> None:
    """Every number of metrics.jsonl (losses, held-out losses, BLEU, the training health's norms and
    gradient-norm ratio, the learned learning rates of a model with shared layers) bitwise equal, but
    the speed."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    flags = ["train", "--steps", "10", "--no-progress", "--eval-every", "5", "--health-every", "5",
             "--share-layers", "2", "--lr-hypergradient", "0.05"]  # fmt: skip
    runs = {
        "one": [sys.executable, "-m", "gpipe", *flags, "--out", str(tmp_path / "one")],
        "two": [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
            "-m", "gpipe", *flags, "--out", str(tmp_path / "two"),
        ],
    }  # fmt: skip
    for cmd in runs.values():
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    one, two = ((tmp_path / name / "metrics.jsonl").read_text().splitlines() for name in runs)

    def strip(line: str) -> str:  # (the times)
        return re.sub(r'"tokens_per_s": [0-9.e+-]+, |, "elapsed_s": [0-9.e+-]+', "", line)

    assert list(map(strip, two)) == list(map(strip, one))
    # the training health too (reduced across the ranks: bitwise the one process's), every 5 steps
    assert ['"grad_norm_ratio": ' in line for line in two] == [step % 5 == 0 for step in range(1, 11)]
    assert '"lr/000": ' in two[-1]  # (the learned rates, in the lines compared)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "step-00000010").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "guard.json", "learned_rates.json", "manifest.json", "run.json",
        "scheduler.json",
    ]  # fmt: skip
