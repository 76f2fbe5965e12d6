"""Traces of real steps: Chrome trace export, the schedule's order kept, and the simulator as a lower bound."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from gpipe.schedule import dependencies, simulate


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
def test_a_real_step_keeps_the_schedule_and_the_simulator_bounds_it(schedule: str) -> None:
    """What holds however loaded the machine is: no action starts before the actions whose results it
    consumes have ended, and the simulator fed the step's own action durations (no hand-over time)
    predicts no more than the step took — a lower bound. How close the two are is a timing, measured in
    ``gpipe bench`` (its runtime-overhead section), not asserted here."""
    pipe = Pipeline(blocks(4, 64, 256), [6, 6], chunks=4, schedule=schedule, loss_fn=F.mse_loss, devices=["cpu", "cpu"])
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    for _ in range(3):
        pipe.step(x, y)
        trace = pipe.last_trace
        assert trace is not None
        measured = trace.timeline()
        for action in trace.schedule:
            start, _ = measured.spans[action]
            for dep in dependencies(action, trace.schedule):
                assert measured.spans[dep][1] <= start + 1e-6, (action, dep, measured.spans[dep], start)
        predicted = simulate(trace.schedule, trace.costs().__getitem__)
        assert 0 < predicted.makespan <= measured.makespan + 1e-6, (predicted.makespan, measured.makespan)
