"""`gpipe train` on bad steps: a NaN injected at a chosen step and micro-batch is named exactly and stops
the run (exit status 3) with the checkpoint of the step before; `--on-nonfinite skip` drops that step's
update (the other steps equal a run without it); `--max-skips` ends a run of bad steps; the spike guard."""

from __future__ import annotations

import json
import math
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import gpipe.train.loop as loop
from gpipe.cli import main
from gpipe.train.data import train_batch
from gpipe.train.guard import SpikeTracker

QUICK = ["--batch", "16", "--chunks", "4", "--steps", "6", "--eval-every", "3", "--eval-batches", "1",
         "--checkpoint-every", "2", "--no-progress", "--tensorboard", "off"]  # fmt: skip


class PoisonAt(nn.Module):
    """Layer ``inner``, whose output is NaN for the micro-batches whose source tokens are in ``bad``."""

    def __init__(self, inner: nn.Module, bad: list[torch.Tensor]) -> None:
        super().__init__()
        self.inner, self.bad = inner, bad

    def forward(self, x: Any) -> Any:
        out = self.inner(x)
        tensors = [t for t in tree_leaves(x) if isinstance(t, torch.Tensor) and not t.is_meta]
        tokens = [t for t in tensors if not t.is_floating_point()]
        if self.training and any(t.shape == b.shape and torch.equal(t, b) for t in tokens for b in self.bad):
            if isinstance(out, torch.Tensor):
                return out * math.nan
            return type(out)(o * math.nan if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)
        return out


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``poison((step, micro-batch), ...)``: global layer 0 of the next runs gives NaN there (only there)."""
    where: list[tuple[int, int]] = []
    make = loop.make_model

    def make_model(cfg: Any, data: Any) -> nn.Module:
        model = make(cfg, data)
        rows = cfg.batch // cfg.chunks
        bad = [train_batch(data, cfg, 0, s).inputs[0][m * rows : (m + 1) * rows] for s, m in where]
        model[0] = PoisonAt(model[0], bad)
        return model

    monkeypatch.setattr(loop, "make_model", make_model)
    yield lambda *at: where.__setitem__(slice(None), at)


def optimizer_whose_step(call: int, instead: Callable[[], Any]) -> Callable[[Any, Any], Any]:
    """``gpipe train``'s ``make_optimizer``, but the optimizer's ``call``-th step runs ``instead``."""
    make_optimizer = loop.make_optimizer

    def make(cfg: Any, params: Any) -> Any:
        optimizer = make_optimizer(cfg, params)
        update, calls = optimizer.step, [0]

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return instead() if calls[0] == call else update(*args, **kwargs)

        optimizer.step = types.MethodType(step, optimizer)  # (a method: the scheduler wraps it)
        return optimizer

    return make


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_stops_the_run_naming_where_it_appeared(
    poison: Callable[..., None], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    poison((4, 2))
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "error: step 4: NaN in the forward of layer 0 (PoisonAt) of stage 0 (cpu), micro-batch 2;" in err
    assert "(the checkpoint of step 3 is kept)" in err
    assert [r["step"] for r in rows(out)] == [1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000003"]


def test_skip_drops_the_steps_update_and_the_others_equal_a_run_without_it(
    poison: Callable[..., None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison((3, 1))
    health = ["--health-every", "3"]  # (the bad step's health: what it can say; the numbers are unchanged)
    assert main(["train", *QUICK, "--out", str(tmp_path / "skip"), "--on-nonfinite", "skip", *health]) == 0
    skipped = rows(tmp_path / "skip")
    assert [r["step"] for r in skipped] == [1, 2, 3, 4, 5, 6]
    assert skipped[2]["loss"] is None
    assert skipped[2]["grad_norm"] is skipped[2]["grad_norm_ratio"] is skipped[2]["output_grad/004"] is None
    assert skipped[5]["grad_norm"] > 0 and skipped[5]["grad_norm_ratio"] > 0
    assert skipped[2]["skipped"] == "NaN in the forward of layer 0 (PoisonAt) of stage 0 (cpu), micro-batch 1"
    assert [r.get("skips") for r in skipped] == [None, None, 1, 1, 1, 1]

    # the reference: no NaN, and the optimizer's update of step 3 left out
    poison()  # (no step)
    monkeypatch.setattr(loop, "make_optimizer", optimizer_whose_step(3, lambda: None))
    assert main(["train", *QUICK, "--out", str(tmp_path / "ref")]) == 0
    ref = rows(tmp_path / "ref")
    for a, b in zip(skipped, ref):
        if a["step"] != 3:
            assert (a["loss"], a.get("eval_loss")) == (b["loss"], b.get("eval_loss")), a["step"]


def test_max_skips_in_a_row_stop_the_run(
    poison: Callable[..., None], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    poison((2, 0), (3, 3), (4, 0))
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--out", str(out), "--on-nonfinite", "skip", "--max-skips", "2"]) == 3
    err = capsys.readouterr().err
    assert "error: step 4: NaN in the forward of layer 0 (PoisonAt) of stage 0 (cpu), micro-batch 0;" in err
    assert "3 skipped steps in a row, more than --max-skips 2" in err
    assert [r.get("skipped", "")[:3] for r in rows(out)] == ["", "NaN", "NaN"]


def test_the_spike_tracker_skips_an_outlier_after_its_warmup() -> None:
    tracker = SpikeTracker(warmup=20)
    norms = [1.0 + 0.05 * math.sin(i) for i in range(30)]
    assert [tracker.outlier(n) for n in norms] == [None] * 30
    assert tracker.outlier(1.1) is None  # within 4 sigma
    why = tracker.outlier(50.0)
    assert why is not None and why.startswith("gradient norm 50 is over 4 standard deviations above its moving mean")
    assert tracker.accepted == 31  # the outlier did not enter the averages
    fresh = SpikeTracker(warmup=20)
    assert fresh.outlier(1.0) is None and fresh.outlier(1e6) is None  # no verdict before the warm-up
    restored = SpikeTracker()
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    assert restored.outlier(50.0) == tracker.outlier(50.0)


# Restarts by torchrun's agent, their logic in one process: torchrun's environment (a run id, a restart
# count) with a world of one. tests/test_restarts.py kills and stops real ranks under torchrun.


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``job(n)``: the next runs are restart ``n`` of torchrun's job "job-1"."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return lambda n: monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(n))


def test_a_rank_records_its_failure_at_once_and_then_who_is_lost(job: Callable[[int], None], tmp_path: Path) -> None:
    """torchrun's agent kills a rank a few seconds after its SIGTERM: what the rank knows is written before
    it asks the heartbeats (seconds), then replaced, keeping the failure's time; a final record stays."""
    from gpipe.train.elastic import record_failure

    path = tmp_path / ".failures" / "rank-0.json"
    record_failure(tmp_path, "lost", "rank 0 was stopped by SIGTERM", provisional=True)
    first = json.loads(path.read_text())
    assert first["message"] == "rank 0 was stopped by SIGTERM"
    record_failure(tmp_path, "lost", "rank 1 is gone (rank 0 was stopped by SIGTERM)")
    second = json.loads(path.read_text())
    assert second["message"] == "rank 1 is gone (rank 0 was stopped by SIGTERM)" and second["time"] == first["time"]
    record_failure(tmp_path, "lost", "something later")
    assert json.loads(path.read_text()) == second


def test_a_restarted_job_continues_from_its_checkpoint_with_the_losses_of_an_uninterrupted_run(
    job: Callable[[int], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def lost() -> None:
        raise RuntimeError("a rank was lost")

    make_optimizer = loop.make_optimizer
    out = str(tmp_path / "run")
    job(0)
    monkeypatch.setattr(loop, "make_optimizer", optimizer_whose_step(5, lost))
    with pytest.raises(RuntimeError, match="a rank was lost"):
        main(["train", *QUICK, "--out", out])
    assert json.loads((tmp_path / "run" / ".job.json").read_text())["job"] == "job-1"
    failure = json.loads((tmp_path / "run" / ".failures" / "rank-0.json").read_text())
    assert (failure["kind"], failure["message"]) == ("lost", "RuntimeError: a rank was lost")
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3, 4]
    capsys.readouterr()

    job(1)  # the same command line, restarted: no --resume
    monkeypatch.setattr(loop, "make_optimizer", make_optimizer)
    assert main(["train", *QUICK, "--out", out]) == 0
    said = capsys.readouterr().err
    assert "torchrun restarted the job (restart 1): RuntimeError: a rank was lost; it continues from its checkpoint " \
        "of step 4\n" in said  # fmt: skip
    (logged,) = [json.loads(line) for line in (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()]
    assert (logged["restart"], logged["resumed_from"], logged["steps_again"]) == (1, 4, 0)
    assert logged["lost"] == "RuntimeError: a rank was lost" and logged["seconds"] > 0
    assert not (tmp_path / "run" / ".job.json").exists()  # finished: no longer restartable
    assert not (tmp_path / "run" / ".failures").exists()

    job(0)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # the same run, uninterrupted, in one process
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["train", *QUICK, "--out", str(tmp_path / "ref")]) == 0

    def strip(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if not k.endswith("_per_s") and k != "elapsed_s"}

    assert [strip(r) for r in rows(tmp_path / "run")] == [strip(r) for r in rows(tmp_path / "ref")]


def test_a_new_job_into_a_used_out_is_still_refused(
    job: Callable[[int], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (out / ".job.json").write_text('{"job": "job-0"}\n')  # another job's
    job(1)
    assert main(["train", *QUICK, "--out", str(out)]) == 2
    assert "holds an earlier run" in capsys.readouterr().err


def test_a_job_stopped_on_a_nan_is_not_trained_again_by_a_restart(
    job: Callable[[int], None], poison: Callable[..., None], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    poison((4, 2))
    out = tmp_path / "run"
    job(0)
    assert main(["train", *QUICK, "--out", str(out)]) == 3
    capsys.readouterr()
    before = (out / "metrics.jsonl").read_text()
    job(1)
    assert main(["train", *QUICK, "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "error: step 4: NaN in the forward of layer 0 (PoisonAt) of stage 0 (cpu), micro-batch 2;" in err
    assert "the job stopped there before torchrun restarted it, and the restart does not train it again" in err
    assert "(the checkpoint of step 3 is kept)" in err
    assert (out / "metrics.jsonl").read_text() == before
