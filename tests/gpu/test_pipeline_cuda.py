"""Schedules on CUDA: stages on one GPU (four workers) and across a GPU and the CPU, against the plain
model, under ``torch.use_deterministic_algorithms(True)``; a step repeated is bitwise the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gpipe import Pipeline
from tests.gpu.common import cuda, data, max_diff, mlp, plain_step
from tests.helpers import even

pytestmark = cuda

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1}
"""Each schedule with its stages per worker."""
LAYOUTS = {"cuda0x4": ["cuda:0"] * 4, "cuda0+cpu": ["cuda:0", "cpu"]}
CHUNKS = 8
RTOL, ATOL = 1e-5, 1e-6
"""Pipeline against the plain model in float64 on the CPU: float32's rounding, summed per micro-batch."""


def build(schedule: str, devices: list[str]) -> Pipeline:
    model = mlp()
    virtual = SCHEDULES[schedule]
    return Pipeline(model, even(len(model), len(devices) * virtual), devices=devices, chunks=CHUNKS,
                    schedule=schedule, loss_fn=F.mse_loss, virtual=virtual)  # fmt: skip


def one_step(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    pipe.zero_grad()
    loss = pipe.step(x, y)
    return loss.detach().cpu(), [p.grad.detach().cpu().clone() for p in pipe.parameters() if p.grad is not None]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_the_plain_model_and_repeats_bitwise(
    schedule: str, layout: str, deterministic: None, record: Callable[..., Any]
) -> None:
    pipe = build(schedule, LAYOUTS[layout])
    x, y = data(pipe.devices[0])
    loss, grads = one_step(pipe, x, y)
    plain_loss, plain = plain_step(mlp().double(), x.cpu().double(), y.cpu().double(), CHUNKS)
    assert len(grads) == len(plain)
    loss_diff, grad_diff = abs(float(loss) - float(plain_loss)), max_diff(grads, plain)
    torch.testing.assert_close(loss.double(), plain_loss, rtol=RTOL, atol=ATOL)
    for g, p in zip(grads, plain, strict=True):
        torch.testing.assert_close(g.double(), p, rtol=RTOL, atol=ATOL)
    differing = 0
    for _ in range(20):
        again, again_grads = one_step(pipe, x, y)
        same = torch.equal(again, loss) and all(torch.equal(a, b) for a, b in zip(again_grads, grads, strict=True))
        differing += not same
    events = pipe.last_trace.events
    record(schedule=schedule, layout=layout, loss=float(loss), loss_diff=loss_diff, max_grad_diff=grad_diff,
           repeats_differing=differing, trace_events=len(events),
           busy_ms=sum(e.end_ns - e.start_ns for e in events) / 1e6)  # fmt: skip
    assert differing == 0, f"{differing} of 20 repeated steps differ from the first"
    assert all(e.end_ns >= e.start_ns for e in events)
