"""GPipe behaves like the Sequential it wraps, with torchgpipe's attributes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe import GPipe


def test_sequential_like_and_attributes() -> None:
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)]
    gp = GPipe(nn.Sequential(*layers), [3, 2], devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    assert len(gp) == 5
    assert list(gp) == layers
    assert gp[0] is layers[0] and gp[-1] is layers[-1] and gp[3] is layers[3]
    with pytest.raises(IndexError):
        gp[5]
    assert gp.balance == [3, 2]
    assert gp.devices == [torch.device("cpu"), torch.device("cpu")]
    assert gp.chunks == 4 and gp.checkpoint == "always"
    assert len(gp.partitions) == 2 and list(gp.partitions[1]) == layers[3:]


def test_default_devices_on_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU default only applies without CUDA")
    gp = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1])
    assert gp.devices == [torch.device("cpu")] * 2


def test_parameters_and_optimizer_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    gp = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    opt = torch.optim.SGD(gp.parameters(), lr=0.1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.mse_loss(gp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9
