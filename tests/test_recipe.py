"""The recipe's pieces against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gpipe.recipe import (
    clip_grad_norm_per_parameter,
    clip_logits,
    inverse_sqrt_lr,
    inverse_sqrt_schedule,
    label_smoothing_loss,
    rmsprop,
    temperature_sampling,
)


def test_temperature_sampling() -> None:
    sizes = [800, 150, 50]  # p = 0.8, 0.15, 0.05
    assert temperature_sampling(sizes, 1) == pytest.approx([0.8, 0.15, 0.05])
    # T=5: 0.8^0.2 = 0.95635, 0.15^0.2 = 0.68425, 0.05^0.2 = 0.54928; sum 2.18988
    assert temperature_sampling(sizes, 5) == pytest.approx([0.43671, 0.31246, 0.25083], abs=1e-4)
    # T=100: almost uniform
    assert temperature_sampling(sizes, 100) == pytest.approx([0.3385, 0.3331, 0.3284], abs=1e-3)
    with pytest.raises(ValueError, match="temperature: 0"):
        temperature_sampling(sizes, 0)
    with pytest.raises(ValueError, match="positive sum"):
        temperature_sampling([0, 0], 5)


def test_inverse_sqrt_learning_rate() -> None:
    peak, warmup = 3.0, 40_000
    assert inverse_sqrt_lr(1, peak, warmup) == pytest.approx(3.0 / 40_000)
    assert inverse_sqrt_lr(20_000, peak, warmup) == pytest.approx(1.5)  # half way up
    assert inverse_sqrt_lr(40_000, peak, warmup) == pytest.approx(3.0)  # the peak
    assert inverse_sqrt_lr(160_000, peak, warmup) == pytest.approx(1.5)  # sqrt(40K/160K) = 1/2
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=123.0)
    sched = inverse_sqrt_schedule(opt, 2.0, 4)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(
        [0.5, 1.0, 1.5, 2.0, 2.0 * math.sqrt(4 / 5), 2.0 * math.sqrt(4 / 6), 2.0 * math.sqrt(4 / 7), 1.0 * math.sqrt(2)]
    )


def test_label_smoothing() -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0]])
    logp = torch.log_softmax(logits, -1)[0]
    # 0.1 spread over 3 classes: target distribution (0.9 + 0.1/3, 0.1/3, 0.1/3)
    expected = -((0.9 + 0.1 / 3) * logp[0] + 0.1 / 3 * logp[1] + 0.1 / 3 * logp[2])
    assert label_smoothing_loss(logits, torch.tensor([0]), 0.1).item() == pytest.approx(expected.item())
    assert label_smoothing_loss(logits, torch.tensor([0]), 0.0).item() == pytest.approx(-logp[0].item())


def test_logit_clipping() -> None:
    x = torch.tensor([-50.0, -3.0, 0.0, 7.0, 80.0])
    assert torch.equal(clip_logits(x, 10.0), torch.tensor([-10.0, -3.0, 0.0, 7.0, 10.0]))
    assert clip_logits(x, None) is x


def test_per_parameter_clipping_and_rmsprop() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.3, 0.4])  # norms 5 and 0.5
    assert clip_grad_norm_per_parameter([a, b], 1.0) == 1
    assert float(a.grad.norm()) == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(b.grad, torch.tensor([0.3, 0.4]))
    opt = rmsprop([a], lr=0.01)
    assert opt.defaults["alpha"] == 0.9 and opt.defaults["eps"] == 0.1 and opt.defaults["weight_decay"] == 4e-5


def test_adafactor_trains() -> None:
    from gpipe.recipe import adafactor

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = adafactor(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
