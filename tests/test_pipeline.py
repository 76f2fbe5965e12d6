"""The step API: every schedule trains exactly like the plain model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe import Pipeline
from tests.helpers import assert_all_close, even

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def mlp(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(6, 6), nn.Dropout(dropout) if dropout else nn.Tanh()]
    return nn.Sequential(*layers)


def build(model: nn.Sequential, schedule: str, k: int, m: int, **kwargs: Any) -> Pipeline:
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    return Pipeline(
        copy.deepcopy(model),
        even(len(model), k * virtual),
        chunks=m,
        schedule=schedule,
        loss_fn=F.mse_loss,
        virtual=virtual,
        devices=["cpu"] * k,
        **kwargs,
    )


def plain_step(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, list[Tensor]]:
    model = copy.deepcopy(model)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]  # type: ignore[misc]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_loss_and_gradients_equal_plain(schedule: str, k: int, m: int) -> None:
    model = mlp()
    x, y = torch.randn(16, 6), torch.randn(16, 6)
    loss_plain, grads_plain = plain_step(model, x, y)
    pipe = build(model, schedule, k, m)
    loss = pipe.step(x, y)
    torch.testing.assert_close(loss, loss_plain)
    assert_all_close([p.grad for p in pipe.parameters()], grads_plain)  # type: ignore[misc]


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_dropout_follows_layer_and_microbatch_not_schedule(checkpoint: str) -> None:
    model = mlp(dropout=0.3)
    x, y = torch.randn(16, 6), torch.randn(16, 6)
    results = []
    for schedule in SCHEDULES:
        torch.manual_seed(11)
        pipe = build(model, schedule, 2, 4, checkpoint=checkpoint)
        loss = pipe.step(x, y)
        results.append((schedule, loss, [p.grad for p in pipe.parameters()]))
    _, ref_loss, ref_grads = results[0]
    for _, loss, g in results[1:]:
        torch.testing.assert_close(loss, ref_loss)
        assert_all_close(g, ref_grads)  # type: ignore[arg-type]
    torch.manual_seed(12)
    other = build(model, "gpipe", 2, 4, checkpoint=checkpoint).step(x, y)
    assert not torch.equal(other, ref_loss), "another seed must draw other masks"


def test_uneven_batch_mean_loss() -> None:
    model = mlp()
    x, y = torch.randn(10, 6), torch.randn(10, 6)
    loss_plain, grads_plain = plain_step(model, x, y)
    pipe = build(model, "1f1b", 2, 4)
    torch.testing.assert_close(pipe.step(x, y), loss_plain)
    assert_all_close([p.grad for p in pipe.parameters()], grads_plain)  # type: ignore[misc]


def test_gradients_accumulate_across_steps_until_zeroed() -> None:
    model = mlp()
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe = build(model, "zb-h1", 2, 4)
    pipe.step(x, y)
    once = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    pipe.step(x, y)
    assert_all_close([p.grad for p in pipe.parameters()], [2 * g for g in once])  # type: ignore[misc]


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize(("checkpoint", "calls"), [("never", 4), ("always", 8)])
def test_split_backward_does_not_run_forward_twice(checkpoint: str, calls: int) -> None:
    counters = [Counter() for _ in range(4)]
    pipe = Pipeline(
        nn.Sequential(*counters), [2, 2], chunks=4, schedule="zb-h1", loss_fn=F.mse_loss, checkpoint=checkpoint
    )
    pipe.step(torch.randn(8, 6), torch.randn(8, 6))
    assert [c.calls for c in counters] == [calls] * 4  # one forward (+ one recomputation) per micro-batch


def test_forward_for_evaluation() -> None:
    model = mlp()
    pipe = build(model, "1f1b", 2, 4)
    x = torch.randn(12, 6)
    out = pipe(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x))
    assert all(p.grad is None for p in pipe.parameters())


def test_module_api() -> None:
    pipe = build(mlp(), "gpipe", 2, 4)
    assert len(list(pipe.parameters())) == 16
    assert set(pipe.state_dict()) == {
        f"partitions.{k}.{i}.{w}"
        for k, r in ((0, range(0, 8)), (1, range(8, 16)))
        for i in r
        if i % 2 == 0
        for w in ("weight", "bias")
    }
    pipe.eval()
    assert not any(m.training for m in pipe.modules())


def test_measure_memory() -> None:
    model = mlp()
    x, y = torch.randn(16, 6), torch.randn(16, 6)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = build(model, schedule, 2, 8, checkpoint="never", measure_memory=True)
        pipe.step(x, y)
        assert pipe.last_trace is not None and pipe.last_trace.peak_activation_bytes is not None
        peaks[schedule] = pipe.last_trace.peak_activation_bytes
    assert all(p > 0 for p in peaks["gpipe"])
    # 1F1B holds at most 2 and 1 micro-batches on its stages; fill-drain holds all 8.
    assert peaks["1f1b"][0] < peaks["gpipe"][0] / 2 and peaks["1f1b"][1] < peaks["gpipe"][1] / 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"schedule": "zigzag"}, ValueError, "unknown schedule 'zigzag'"),
        ({"schedule": "gpipe", "virtual": 2}, ValueError, r"'gpipe' runs one stage per worker \(virtual: 2\)"),
        ({"balance": [5, 5, 6], "virtual": 2}, ValueError, r"stages: 3, virtual: 2"),
        ({"chunks": 0}, ValueError, "chunks: 0"),
        ({"loss_fn": "mse"}, TypeError, "loss_fn must be callable"),
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"balance": [8, 8], "chunks": 4, "loss_fn": F.mse_loss, **kwargs}
    with pytest.raises(error, match=match):
        Pipeline(mlp(), args.pop("balance"), **args)


def test_step_errors() -> None:
    pipe = build(mlp(), "1f1b", 2, 4)
    with pytest.raises(ValueError, match=r"different micro-batches \(inputs: \[2, 2, 2, 2\], target: \[2, 2, 2, 1\]\)"):
        pipe.step(torch.randn(8, 6), torch.randn(7, 6))
    bad = Pipeline(mlp(), [8, 8], chunks=2, loss_fn=lambda out, target: (out - target) ** 2)
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar tensor \(got \(2, 6\)\)"):
        bad.step(torch.randn(4, 6), torch.randn(4, 6))
