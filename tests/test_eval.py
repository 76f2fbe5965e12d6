"""`gpipe eval`: a run's checkpoints evaluated apart from its training, once or as they come (--watch),
with the numbers training's own evaluation logged."""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpipe.cli import main
from gpipe.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
# Small runs of each kind of model: translation (BLEU per pair), images (accuracy), a causal LM (perplexity,
# a sample), each with a checkpoint and an evaluation at steps 2 and 4.
KINDS: dict[str, dict[str, Any]] = {
    # (its learned weights logged with the evaluations too, and its experts' routing)
    "translation": {"steps": 4, "transparent": True, "experts": 4},
    "images": {"model": "amoebanet", "layers": 3, "filters": 16, "image_size": 16, "batch": 32, "steps": 4},
    "hf": {"model": "hf", "batch": 16, "steps": 4},
}
EVAL_KEYS = {"translation": "bleu/xs-yc", "images": "eval_accuracy", "hf": "eval_perplexity"}


def rows(path: Path) -> dict[int, dict[str, Any]]:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def trained(out: Path, **settings: Any) -> Path:
    train(TrainConfig(out=str(out), progress=False, **{"eval_every": 2, "checkpoint_every": 2, **settings}))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_eval_equals_the_training_evaluation_at_its_step_and_nearly_at_another_k(kind: str, tmp_path: Path) -> None:
    if kind == "hf":
        pytest.importorskip("transformers")
    run = trained(tmp_path / "run", **KINDS[kind])
    assert main(["eval", "--checkpoint", str(run), "--step", "2"]) == 0
    assert main(["eval", "--checkpoint", str(run)]) == 0  # the newest: step 4
    logged, evaluated = rows(run / "metrics.jsonl"), rows(run / "eval" / "metrics.jsonl")
    assert sorted(evaluated) == [2, 4]
    for step in (2, 4):
        assert EVAL_KEYS[kind] in evaluated[step]
        # bitwise: the same keys and numbers (and the same sample text) as the run's own evaluation
        assert evaluated[step] == {k: v for k, v in logged[step].items() if k in evaluated[step]}
        held_out = {k for k in logged[step] if k.startswith(("eval", "bleu", "sample", "transparent/", "moe_"))}
        assert set(evaluated[step]) == {"step"} | held_out
    assert (run / "eval" / "tensorboard").is_dir() and (run / "eval" / "loss.png").is_file()
    # another layout: one stage instead of the run's two, within float rounding
    assert main(["eval", "--checkpoint", str(run), "--partitions", "1", "--out", str(tmp_path / "k1")]) == 0
    one = rows(tmp_path / "k1" / "metrics.jsonl")[4]
    for key, value in one.items():
        if key.startswith("eval_loss") or key == "eval_perplexity":
            assert math.isclose(value, evaluated[4][key], rel_tol=1e-5), key


def test_eval_refuses_what_it_cannot_do_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = trained(tmp_path / "run", steps=4)
    assert main(["eval", "--checkpoint", str(run), "--step", "2"]) == 0
    capsys.readouterr()
    refused = {
        "step 2 is evaluated in": ["--checkpoint", str(run), "--step", "2"],
        "holds evaluations with other settings (--beam 1 there, 3 here)": ["--checkpoint", str(run), "--beam", "3"],
        "holds no checkpoint of step 3 (it holds steps [2, 4])": ["--checkpoint", str(run), "--step", "3"],
        "exceeds the model's": ["--checkpoint", str(run), "--partitions", "99", "--out", str(tmp_path / "o")],
        "--step is for --checkpoint": ["--watch", str(run), "--step", "2"],
        "--all is for --watch": ["--checkpoint", str(run), "--all"],
        "--wait-for-resume is for --watch": ["--checkpoint", str(run), "--wait-for-resume"],
        "--poll must be a positive number": ["--watch", str(run), "--poll", "0"],
        "no such folder": ["--checkpoint", str(tmp_path / "none")],
    }
    for message, flags in refused.items():
        assert main(["eval", *flags]) == 2, message
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted(rows(run / "eval" / "metrics.jsonl")) == [2]  # nothing written by a refused evaluation
    assert main(["eval", "--checkpoint", str(run), "--step", "2", "--overwrite"]) == 0


def test_a_watcher_without_all_evaluates_the_newest_checkpoint_and_stops(tmp_path: Path) -> None:
    run = trained(tmp_path / "run", steps=4, eval_every=0)
    assert "eval_loss" not in "".join((run / "metrics.jsonl").read_text())  # --eval-every 0: never
    assert main(["eval", "--watch", str(run), "--quiet"]) == 0
    assert sorted(rows(run / "eval" / "metrics.jsonl")) == [4]  # it fell behind: the newest, then the last step


def _gpipe(*args: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "gpipe", *args], stdout=f, stderr=subprocess.STDOUT, env=env)


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_watcher_started_before_the_run_evaluates_each_checkpoint_once_across_its_restart(tmp_path: Path) -> None:
    run, logs = tmp_path / "run", [tmp_path / "watch-1.log", tmp_path / "watch-2.log"]
    watcher = _gpipe("eval", "--watch", str(run), "--all", "--poll", "1", log=logs[0])
    trainer = None
    try:
        time.sleep(2)  # (waiting for a run that has not started)
        trainer = _gpipe("train", "--out", str(run), "--steps", "30", "--checkpoint-every", "10", "--eval-every", "0",
                         "--no-progress", "--threads", "1", log=tmp_path / "train.log")  # fmt: skip
        _wait_for(lambda: "step 10: eval loss" in logs[0].read_text(), 120, "the first evaluation")
        watcher.send_signal(signal.SIGKILL)  # lost with nothing said; started again, it goes on
        watcher.wait(timeout=30)
        watcher = _gpipe("eval", "--watch", str(run), "--all", "--poll", "1", log=logs[1])
        assert trainer.wait(timeout=240) == 0, (tmp_path / "train.log").read_text()[-3000:]
        ended = time.monotonic()
        assert watcher.wait(timeout=120) == 0, logs[1].read_text()[-3000:]
        assert time.monotonic() - ended < 60  # it stopped by itself soon after the run's last checkpoint
    finally:
        for process in (watcher, trainer):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    evaluated = run / "eval" / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in evaluated.read_text().splitlines()] == [10, 20, 30]
    first, second = (log.read_text() for log in logs)
    for step in (10, 20, 30):  # none evaluated again by the watcher started again
        said = f"step {step}: eval loss"
        assert first.count(said) + second.count(said) <= 1, (first, second)
    assert "step 10: eval loss" in first and "step 30: eval loss" in second
    assert "the run's last step, 30, is evaluated; stopping" in second


def test_a_watcher_of_a_run_killed_for_good_stops_and_one_waiting_for_its_resume_sees_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed (SIGKILL) after its first checkpoints: the watcher evaluates what it left, gives it
    STARTUP_GRACE seconds to start again (2 s here), says that it is not running and stops; started again
    with its resume, the watcher looks before the resume takes the lock and follows it (a grace of 120 s
    here: however slowly the resume starts); with --wait-for-resume a watcher waits for the resume, and
    follows it."""
    from gpipe.saving import complete

    watch = importlib.import_module("gpipe.evaluator.watch")  # (the module: gpipe.evaluator.watch is a function)

    run, dead = tmp_path / "run", tmp_path / "dead"
    trainer = _gpipe("train", "--out", str(run), "--steps", "100000", "--checkpoint-every", "2", "--eval-every", "0",
                     "--no-progress", "--tensorboard", "off", log=tmp_path / "train.log")  # fmt: skip
    waiting = None
    try:
        _wait_for(lambda: len(complete(run / "checkpoints")) > 1, 120, "two checkpoints")
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        newest = int(complete(run / "checkpoints")[0].name.removeprefix("step-"))
        passed = len(complete(run / "checkpoints")) - 1  # (without --all: the newest alone is evaluated)
        waiting = _gpipe("eval", "--watch", str(run), "--wait-for-resume", "--poll", "1", "--out",
                         str(tmp_path / "waited"), log=tmp_path / "waiting.log")  # fmt: skip
        capsys.readouterr()
        monkeypatch.setattr(watch, "STARTUP_GRACE", 2.0)
        assert main(["eval", "--watch", str(run), "--poll", "1", "--out", str(dead)]) == 0
        err = capsys.readouterr().err
        assert f"the run in {run} is not running (" in err and f"checkpoint is of step {newest} of 100000" in err, err
        assert f"and its newest checkpoint is evaluated ({passed} older passed over: --all evaluates" in err, err
        assert "it may be starting: the watch ends unless it runs again within 2 s" in err, err
        assert sorted(rows(dead / "metrics.jsonl")) == [newest]
        assert waiting.poll() is None  # (still waiting for the resume)
        trainer = _gpipe("train", "--out", str(run), "--resume", "--steps", str(newest + 2), "--no-progress",
                         log=tmp_path / "train.log")  # fmt: skip
        monkeypatch.setattr(watch, "STARTUP_GRACE", 120.0)
        assert main(["eval", "--watch", str(run), "--poll", "1", "--out", str(dead)]) == 0  # (before its lock)
        err = capsys.readouterr().err
        assert f"the run's last step, {newest + 2}, is evaluated; stopping" in err and "(no live" not in err, err
        assert sorted(rows(dead / "metrics.jsonl")) == [newest, newest + 2]
        assert trainer.wait(timeout=120) == 0, (tmp_path / "train.log").read_text()[-3000:]
        assert waiting.wait(timeout=120) == 0, (tmp_path / "waiting.log").read_text()[-3000:]
    finally:
        for process in (trainer, waiting):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    said = (tmp_path / "waiting.log").read_text()
    assert f"the run's last step, {newest + 2}, is evaluated; stopping" in said and "not running" not in said, said
    assert max(rows(tmp_path / "waited" / "metrics.jsonl")) == newest + 2
