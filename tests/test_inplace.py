"""Layers that change their input in place (``ReLU(inplace=True)``, as torchvision's ResNet starts):
at a stage's start, under a split backward (zb-h1), with re-materialization."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe import GPipe, Pipeline
from tests.helpers import assert_all_close, grads

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]


def relu_net() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(8, 8), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


def plain_grads(model: nn.Sequential, x: Tensor, y: Tensor) -> list[Tensor]:
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    return grads(plain)


@pytest.mark.parametrize(("schedule", "virtual"), SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_inplace_relu_at_stage_starts_equals_plain(schedule: str, virtual: int, checkpoint: str) -> None:
    model = relu_net()
    # Every stage after the first starts with an in-place ReLU.
    balance = [1, 2, 2, 1] if virtual == 2 else [1, 2, 3]
    devices = ["cpu"] * (2 if virtual == 2 else 3)
    g = torch.Generator().manual_seed(1)
    expected = None
    pipe = Pipeline(copy.deepcopy(model), balance, chunks=4, loss_fn=F.mse_loss, schedule=schedule,
                    checkpoint=checkpoint, devices=devices, virtual=virtual)  # fmt: skip
    for _ in range(2):  # the first step learns which inputs to protect, the second relies on it
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        x_before = x.clone()
        expected = plain_grads(model, x.clone(), y)
        pipe.zero_grad()
        pipe.step(x, y)
        assert_all_close(grads(pipe), expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(x, x_before), "the caller's mini-batch must not be modified"
    assert expected is not None


def test_inplace_at_stage_start_through_gpipe_backward() -> None:
    model = relu_net()
    x = torch.randn(8, 8, requires_grad=True)
    gp = GPipe(copy.deepcopy(model), [1, 5], devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    gp(x).sum().backward()
    x_plain = x.detach().clone().requires_grad_()
    plain = copy.deepcopy(model)
    plain(x_plain).sum().backward()
    assert_all_close(grads(gp), grads(plain), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_plain.grad)


def test_inplace_change_that_appears_later_is_named() -> None:
    """A layer that starts changing its input in place only after its first run cannot be protected
    in time: the input its re-materialization starts from is lost. gpipe says so, naming the stage."""

    class Later(nn.Module):
        calls = 0

        def forward(self, x: Tensor) -> Tensor:
            Later.calls += 1
            return x.mul_(2) if Later.calls > 2 else x * 2

    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), Later(), nn.Linear(4, 4)), [1, 2], chunks=1, loss_fn=F.mse_loss,
                    checkpoint="always", devices=["cpu", "cpu"])  # fmt: skip
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    pipe.step(x, y)  # forward, then the recomputation: 2 calls
    with pytest.raises(RuntimeError, match=r"stage 1 modified its input 0 in place.*inplace=False"):
        pipe.step(x, y)
