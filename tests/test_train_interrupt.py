"""gpipe train under interruption: a checkpoint written on Ctrl-C or SIGTERM holds the update of the
step it is labelled with, so --resume reproduces the uninterrupted run bitwise; one run per --out;
a torn last metrics line (a crash while writing it) is dropped on resume."""

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

import pytest
from torch.optim.optimizer import register_optimizer_step_post_hook

from gpipe.saving import verify
from gpipe.train import ConfigError, TrainConfig, main, one_run, train

SMALL = {"steps": 6, "batch": 8, "chunks": 2, "dim": 32, "hidden": 64, "heads": 2, "layers": 1,
         "eval_every": 100, "checkpoint_every": 100, "progress": False}  # fmt: skip


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("whole")
    train(TrainConfig(out=str(out), **SMALL))
    return losses(out)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_right_after_the_update_then_resume_is_exact(
    tmp_path: Path, uninterrupted: dict[int, float], sig: signal.Signals
) -> None:
    """The signal is sent from inside the run the instant optimizer.step() returns at step 3."""
    calls = 0

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            os.kill(os.getpid(), sig)

    handle = register_optimizer_step_post_hook(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(TrainConfig(out=str(tmp_path), **SMALL))
    finally:
        handle.remove()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the run puts the handlers back"
    assert (tmp_path / "checkpoints" / "step-00000003").is_dir(), "labelled with the step whose update it holds"
    assert sorted(losses(tmp_path)) == [1, 2, 3]
    train(TrainConfig(out=str(tmp_path), resume=True, **SMALL))
    assert losses(tmp_path) == uninterrupted


def test_torn_last_metrics_line_is_dropped_on_resume(tmp_path: Path, uninterrupted: dict[int, float]) -> None:
    train(TrainConfig(out=str(tmp_path), **{**SMALL, "steps": 3}))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # a crash while the next line was written
    train(TrainConfig(out=str(tmp_path), resume=True, **SMALL))
    assert losses(tmp_path) == uninterrupted


def _flip(path: Path) -> bytes:
    """Flip a bit in the middle of the file; returns what it held."""
    before = path.read_bytes()
    data = bytearray(before)
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return before


def test_resume_passes_a_damaged_checkpoint_over_for_the_one_before(
    tmp_path: Path, uninterrupted: dict[int, float], capsys: pytest.CaptureFixture[str]
) -> None:
    """A bit flipped in the last checkpoint's data file: the run is not finished; --resume names the
    file, resumes from the checkpoint before and gives the uninterrupted run's losses; --keep 1
    does not delete the checkpoint it resumed from."""
    every = {**SMALL, "checkpoint_every": 2}
    train(TrainConfig(out=str(tmp_path), **{**every, "steps": 4}))
    checkpoints = tmp_path / "checkpoints"
    bad = checkpoints / "step-00000004" / "__0_0.distcp"
    _flip(bad)
    # None intact: refused, naming each, and nothing changed.
    older = _flip(checkpoints / "step-00000002" / ".metadata")
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"--resume: no checkpoint in .* loads \(step-00000004: .*__0_0\.distcp: "
                       r"corrupt: .*; step-00000002: .*\.metadata: corrupt: its sha256 differs"):  # fmt: skip
        train(TrainConfig(out=str(tmp_path), resume=True, **{**every, "steps": 4}))
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    (checkpoints / "step-00000002" / ".metadata").write_bytes(older)
    capsys.readouterr()
    train(TrainConfig(out=str(tmp_path), resume=True, keep=1, **{**every, "steps": 4}))
    err = capsys.readouterr().err
    assert (
        f"warning: checkpoint step-00000004 is damaged ({bad}: corrupt: its sha256 differs from the manifest's); "
        "resuming from step-00000002 instead\n"
    ) in err, err
    assert losses(tmp_path) == {step: loss for step, loss in uninterrupted.items() if step <= 4}
    # step 4 saved again, over the damaged one; step 2 kept whatever --keep
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002", "step-00000004"]
    assert verify(checkpoints / "step-00000004") == []
    train(TrainConfig(out=str(tmp_path), resume=True, keep=1, **every))  # from step 4, intact: as before
    assert losses(tmp_path) == uninterrupted
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000006"]


def test_second_run_on_a_live_out_is_refused_naming_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, pathlib; from gpipe.train import one_run\n"
         "with one_run(pathlib.Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "locked"
        code = main(["--out", str(tmp_path), "--steps", "1", "--no-progress"])
        assert code == 2
        err = capsys.readouterr().err
        assert f"PID {first.pid} on {socket.gethostname()}" in err and "another gpipe train" in err
    finally:
        first.kill()
        first.wait()
    # The kernel released the lock with the process: a new run takes it.
    with one_run(tmp_path):
        assert (tmp_path / ".lock").read_text().split() == [str(os.getpid()), socket.gethostname()]  # (PID HOST)
    start = time.monotonic()
    with one_run(tmp_path):
        pass
    assert time.monotonic() - start < 5


def test_out_naming_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"), one_run(tmp_path / "f"):
        pass


KILLED_DURING_A_BACKGROUND_SAVE = r"""
import json, sys, threading, time
from pathlib import Path
import torch
from gpipe.train import TrainConfig, train
out, mark, small = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
real_save = torch.save
def slow(obj, f):
    # DCP's writes in the background, once a first checkpoint is complete: the second save hangs mid-write
    if threading.current_thread() is not threading.main_thread() and (out / "checkpoints" / "latest").exists():
        mark.touch()
        time.sleep(600)  # killed here
    real_save(obj, f)
torch.save = slow
train(TrainConfig(out=str(out), **small))
"""


def test_killed_during_a_background_checkpoint_resumes_from_the_one_before(
    tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    small = {**SMALL, "checkpoint_every": 2, "async_checkpoint": True}
    mark = tmp_path / "mark"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_DURING_A_BACKGROUND_SAVE, str(tmp_path / "run"), str(mark), json.dumps(small)],
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), f"the second checkpoint never started writing (exit code {proc.poll()})"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step-00000002"
    assert (checkpoints / ".step-00000004.tmp").is_dir()  # the killed save's leftovers
    train(TrainConfig(out=str(tmp_path / "run"), resume=True, **{**SMALL, "checkpoint_every": 2}))
    assert losses(tmp_path / "run") == uninterrupted
    assert not (checkpoints / ".step-00000004.tmp").exists()  # cleaned by the next save
