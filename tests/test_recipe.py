"""The recipe's pieces against hand-computed values."""

from __future__ import annotations

import math
from typing import Any

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
from tests.dist_harness import POOL, Pool


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
    from gpipe.saving.keys import _optimizer_kind

    params = [nn.Parameter(torch.zeros(2))]  # (a checkpoint of torch's Adafactor loads in gpipe's, and back)
    assert _optimizer_kind(adafactor(params)) == _optimizer_kind(torch.optim.Adafactor(params))

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


# Shapes and the dimension each is sharded on over 2 ranks (5 rows: uneven shards; a 1-row dimension:
# one empty shard), for the sharded Adafactor.
SHARDED = [((5, 6), 0), ((6, 5), 1), ((4, 3, 6), 0), ((4, 5, 6), 1), ((7,), 0), ((1, 4), 0)]


def _adafactor_steps(make: Any) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Three steps of ``make(params)`` over the shapes of :data:`SHARDED` (weight decay on), each step's
    gradients drawn alike everywhere; the parameters and states after them."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape, _ in SHARDED]
    optimizer, params = make(params)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p, (shape, dim) in zip(params, SHARDED):
            p.grad = optimizer.shard(torch.randn(shape, generator=g) * (step + 1), dim)
        optimizer.step()
    return [optimizer.whole(p) for p in params], [
        {k: optimizer.whole(v) for k, v in optimizer.state[p].items()} for p in params
    ]


def sharded_adafactor() -> dict[str, Any]:
    """A pool case (2 ranks): :class:`ShardedAdafactor` on DTensor shards of the shapes of
    :data:`SHARDED`; the whole parameters and states after three steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gpipe.recipe import adafactor

    mesh = init_device_mesh("cpu", (2,))

    def make(params: list[nn.Parameter]) -> Any:
        sharded = [
            nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(dim)])) for p, (_, dim) in zip(params, SHARDED)
        ]
        optimizer = adafactor(sharded, lr=1e-2, weight_decay=0.1)
        optimizer.shard = lambda t, dim: distribute_tensor(t, mesh, [Shard(dim)])  # type: ignore[attr-defined]
        optimizer.whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[attr-defined]
        return optimizer, sharded

    params, states = _adafactor_steps(make)
    return {"params": params, "states": states}


SHARDED_ADAFACTOR = POOL.add(2, "sharded adafactor", "test_recipe:sharded_adafactor")


def test_adafactor_steps_a_sharded_parameter_as_the_whole_one(pool: Pool) -> None:
    """gpipe's Adafactor on DTensor shards (--fsdp, --tensor-parallel, --expert-parallel; torch's fails
    on them) gives every rank the whole parameter's step of torch's Adafactor, with its state's keys
    and shapes, for parameters sharded on any dimension, unevenly or with an empty shard."""

    def make(params: list[nn.Parameter]) -> Any:
        optimizer = torch.optim.Adafactor(params, lr=1e-2, weight_decay=0.1)
        optimizer.shard = lambda t, dim: t  # type: ignore[attr-defined]
        optimizer.whole = lambda t: t  # type: ignore[attr-defined]
        return optimizer, params

    want_params, want_states = _adafactor_steps(make)
    for rank in pool(SHARDED_ADAFACTOR):
        for got, want in zip(rank["params"], want_params):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
        for got, want in zip(rank["states"], want_states):
            assert sorted(got) == sorted(want)
            for key in want:
                assert got[key].shape == want[key].shape and torch.allclose(got[key], want[key], rtol=1e-5, atol=1e-9)
