"""Non-finite values in a step: gpipe.nonfinite's check (all_finite) and locate, which names the
layer, stage, micro-batch and direction where a NaN or Inf first appeared, for every kind of
schedule and re-materialization."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gpipe import Pipeline
from gpipe.nonfinite import NonFinite, all_finite, locate
from tests.dist_harness import POOL, Pool

ROWS, CHUNKS, WIDTH = 8, 4, 6


class Poison(nn.Module):
    """Identity, except on the rows whose first feature is ``row``: NaN (or ``value``) in the
    forward, or in the backward (the gradient of its input) when ``backward``."""

    def __init__(self, row: float | None = None, value: float = float("nan"), backward: bool = False) -> None:
        super().__init__()
        self.row, self.value, self.backward = row, value, backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row is None:
            return x
        hit = (x[:, :1] == self.row).expand_as(x)
        if self.backward:
            return _PoisonGrad.apply(x, hit, self.value)  # type: ignore[no-any-return]
        return torch.where(hit, torch.full_like(x, self.value), x)  # (the tag too: no matter)


class _PoisonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hit: torch.Tensor, value: float) -> torch.Tensor:
        ctx.save_for_backward(hit)
        ctx.value = value
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (hit,) = ctx.saved_tensors
        return torch.where(hit, torch.full_like(g, ctx.value), g), None, None


class Keep(nn.Module):
    """A linear layer on the features, the rows' tags (column 0) carried along."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :1], self.linear(x[:, 1:])], dim=1)


class Drop(nn.Module):
    """The tags dropped: the features alone, for the loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:]


def model(poison_at: int, poison: Poison) -> nn.Sequential:
    """Global layers 0..5 (Keep, or the poison at ``poison_at``), then 6: Drop."""
    torch.manual_seed(0)
    return nn.Sequential(*(poison if i == poison_at else Keep() for i in range(6)), Drop())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.cat([torch.arange(ROWS, dtype=torch.float32)[:, None], torch.randn(ROWS, WIDTH)], dim=1)
    return x, torch.randn(ROWS, WIDTH)


def pipe(seq: nn.Sequential, **kw: Any) -> Pipeline:
    return Pipeline(seq, [3, 4], chunks=CHUNKS, devices=["cpu", "cpu"], loss_fn=nn.MSELoss(), **kw)


@pytest.mark.parametrize(
    ("schedule", "checkpoint"),
    [("gpipe", "never"), ("1f1b", "always"), ("zb-h1", "except_last"), ("interleaved-1f1b", "never")],
)
def test_a_forward_nan_is_named_at_its_layer_and_micro_batch(schedule: str, checkpoint: str) -> None:
    # rows 2k, 2k+1 form micro-batch k: row 5 is in micro-batch 2; the poison is global layer 4 (stage 1)
    kw: dict[str, Any] = {"schedule": schedule, "checkpoint": checkpoint}
    if schedule == "interleaved-1f1b":
        kw["virtual"] = 2
    seq = model(4, Poison(row=5))
    p = Pipeline(seq, [2, 2, 2, 1], chunks=CHUNKS, devices=["cpu", "cpu"], loss_fn=nn.MSELoss(), **kw) if (
        schedule == "interleaved-1f1b") else pipe(seq, **kw)  # fmt: skip
    x, y = batch()
    loss = float(p.step(x, y))
    assert not all_finite(p, loss)
    found = locate(p, x, y)
    assert found is not None
    assert (found.direction, found.microbatch, found.layer, found.name) == ("forward", 2, 4, "Poison")
    assert found.kind == "NaN"
    assert found.stage == (2 if schedule == "interleaved-1f1b" else 1)
    assert str(found).startswith("NaN in the forward of layer 4 (Poison) of stage")
    assert "micro-batch 2" in str(found)


def test_a_backward_inf_is_named_where_its_gradient_appeared() -> None:
    seq = model(3, Poison(row=6, value=float("inf"), backward=True))
    p = pipe(seq, schedule="1f1b")
    x, y = batch()
    loss = float(p.step(x, y))
    assert torch.isfinite(torch.tensor(loss))  # the forward is finite: only gradients show it
    assert not all_finite(p, loss)
    found = locate(p, x, y)
    assert found == NonFinite("backward", 3, 3, "Poison", 1, 0, "cpu", "Inf", "the gradient of its input")
    said = "Inf in the backward of layer 3 (Poison) of stage 1 (cpu), micro-batch 3: the gradient of its input"
    assert str(found) == said


def test_a_finite_step_passes_and_nothing_is_found() -> None:
    p = pipe(model(3, Poison()))
    x, y = batch()
    loss = float(p.step(x, y))
    assert all_finite(p, loss)
    grads = [q.grad.clone() for q in p.parameters()]
    assert locate(p, x, y) is None
    # the step run again is the same step: the same gradients
    assert all(torch.equal(a, q.grad) for a, q in zip(grads, p.parameters()))
    assert all(stage.watch is None for stage in p.engine.stages)


def test_a_parameter_gradient_alone_is_named_without_a_micro_batch() -> None:
    p = pipe(model(0, Poison()))
    x, y = batch()
    loss = float(p.step(x, y))
    weight = p.partitions["1"][0].linear.weight  # stage 1's first layer: global layer 3
    weight.grad[0, 0] = float("nan")
    assert not all_finite(p, loss)

    hook = weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    try:
        found = locate(p, x, y)
    finally:
        hook.remove()
    assert found is not None
    assert (found.direction, found.microbatch, found.layer, found.stage) == ("backward", None, 3, 1)
    assert found.what == "the gradient of its parameter 'linear.weight'"


# a case of the session's pool (tests/dist_harness.py: a few launches in all)
ACROSS = POOL.add(2, "nonfinite", "nonfinite_across_ranks")


def test_every_rank_finds_it_on_the_rank_where_it_appeared(pool: Pool) -> None:
    ranks = pool(ACROSS)
    said = "Inf in the forward of layer 2 (_InfAt) of stage 1 (rank 1, cpu), micro-batch 2"
    assert ranks == [{"finite": False, "found": said}] * 2
