"""Traces of real steps: Chrome trace export, and the simulator's prediction from measured costs."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from gpipe.schedule import simulate


def blocks(n: int, width: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[m for _ in range(n) for m in (nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))]
    )


def test_chrome_trace_has_every_action(tmp_path: Path) -> None:
    pipe = Pipeline(blocks(2, 8, 16), [3, 3], chunks=4, schedule="zb-h1", loss_fn=F.mse_loss)
    pipe.step(torch.randn(8, 8), torch.randn(8, 8))
    assert pipe.last_trace is not None
    path = pipe.last_trace.save_chrome(tmp_path / "step.json")
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 2 * 4 * 3  # F, I, W per micro-batch and stage
    assert {(e["args"]["kind"], e["args"]["microbatch"], e["args"]["stage"]) for e in spans} == {
        (k, m, s) for k in "FIW" for m in range(4) for s in range(2)
    }
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert {e["tid"] for e in spans} == {0, 1}
    # per worker, actions run one at a time, in the schedule's order
    for w, acts in enumerate(pipe.last_trace.schedule.actions):
        mine = sorted((e for e in spans if e["tid"] == w), key=lambda e: e["ts"])
        assert [(e["args"]["kind"], e["args"]["microbatch"]) for e in mine] == [
            (a.kind.value, a.microbatch) for a in acts
        ]
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in itertools.pairwise(mine))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_simulator_predicts_a_real_step_within_ten_percent(schedule: str) -> None:
    pipe = Pipeline(
        blocks(4, 256, 1024), [6, 6], chunks=4, schedule=schedule, loss_fn=F.mse_loss, devices=["cpu", "cpu"]
    )
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    pipe.step(x, y)  # warm-up
    errors = []
    for _ in range(5):
        pipe.step(x, y)
        trace = pipe.last_trace
        assert trace is not None
        measured = trace.timeline().makespan
        predicted = simulate(trace.schedule, trace.costs().__getitem__).makespan
        errors.append(abs(measured - predicted) / measured)
    assert statistics.median(errors) < 0.10, errors
