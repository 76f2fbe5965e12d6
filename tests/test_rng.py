"""Random numbers follow (layer, micro-batch), not partitions, schedule order or checkpoint mode."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gpipe.rng import Seeded, derive_seed
from tests.helpers import assert_all_equal, pipe, step
from tests.test_transparency import conv_stack


def test_dropout_bitwise_across_partitions_and_checkpoint_modes() -> None:
    torch.manual_seed(0)
    model = conv_stack(dropout=0.3)
    x = torch.randn(16, 1, 8, 8)
    results = {}
    for k in (1, 2, 4):
        for mode in ("always", "except_last", "never"):
            torch.manual_seed(123)
            out, g = step(pipe(model, k, chunks=8, checkpoint=mode, cpu_threads=1), x)
            results[(k, mode)] = (out, g)
    ref_out, ref_g = results[(1, "never")]
    for key, (out, g) in results.items():
        assert torch.equal(out, ref_out), key
        assert_all_equal(g, ref_g)
    # Not vacuous: another seed draws other masks and so other gradients.
    torch.manual_seed(124)
    _, other = step(pipe(model, 2, chunks=8, cpu_threads=1), x)
    assert not all(torch.equal(a, b) for a, b in zip(other, ref_g))


def test_dropout_masks_actually_drop_and_vary_per_microbatch_and_step() -> None:
    model = nn.Sequential(nn.Identity(), nn.Dropout(0.5))
    gp = pipe(model, 2, chunks=4)
    x = torch.ones(8, 1000)
    torch.manual_seed(0)
    a = gp(x)
    b = gp(x)
    assert (a == 0).float().mean().item() == pytest.approx(0.5, abs=0.05)
    assert not torch.equal(a[:2], a[2:4]), "micro-batches must draw different masks"
    assert not torch.equal(a, b), "successive steps must draw fresh masks"
    torch.manual_seed(0)
    assert torch.equal(gp(x), a), "torch.manual_seed must make a step reproducible"


def test_recomputation_replays_forward_randomness() -> None:
    """With re-materialization the backward must see the same mask as the forward: the gradient of
    sum(dropout(x)) w.r.t. x is exactly the mask scaled by 1/(1-p)."""
    x = torch.ones(8, 64, requires_grad=True)
    gp = pipe(nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)), 1, chunks=4, checkpoint="always")
    nn.init.eye_(gp[0].weight)
    nn.init.zeros_(gp[0].bias)
    out = gp(x)
    out.sum().backward()
    expected = (out != 0).float() * 2.0
    assert torch.equal(x.grad, expected)  # type: ignore[arg-type]


def test_any_random_op_is_seeded_per_layer() -> None:
    class Noise(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x + torch.rand(x.shape) + torch.randn_like(x) + torch.randperm(x.size(1)).float()

    model = nn.Sequential(Noise(), Noise(), Noise(), Noise())
    x = torch.zeros(6, 5)
    outs = []
    for k in (1, 2, 4):
        torch.manual_seed(7)
        outs.append(pipe(model, k, chunks=3)(x))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_seeded_replays_and_restores_the_default_generator() -> None:
    torch.manual_seed(1)
    expected_after = torch.rand(3)
    torch.manual_seed(1)
    cpu = torch.device("cpu")
    with Seeded(cpu, derive_seed(5, 1, 2), probe=True) as seeded:
        a = torch.rand(4)
        b = torch.empty(4).bernoulli_(0.5)
    assert seeded.drew
    with Seeded(cpu, derive_seed(5, 1, 2)):
        assert torch.equal(torch.rand(4), a)
        assert torch.equal(torch.empty(4).bernoulli_(0.5), b)
    with Seeded(cpu, derive_seed(5, 1, 3)):
        assert not torch.equal(torch.rand(4), a)
    with Seeded(cpu, 1, probe=True) as quiet:
        torch.ones(3).mul(2)
    assert not quiet.drew
    assert torch.equal(torch.rand(3), expected_after), "the user's generator stream must be untouched"


def test_derived_seeds_differ() -> None:
    seeds = {derive_seed(s, layer, m) for s in range(3) for layer in range(10) for m in range(10)}
    assert len(seeds) == 300
    assert all(0 <= s < 2**63 for s in seeds)


class FunctionalDropout(nn.Module):
    """Draws through a functional call, with a probability that may be raised later."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.p = 0.0

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.dropout(self.lin(x), self.p, self.training)


def test_layer_that_starts_drawing_later_is_noticed_then_seeded() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(FunctionalDropout(), FunctionalDropout(), FunctionalDropout(), FunctionalDropout())
    x = torch.randn(8, 6)
    pipes = [pipe(model, k, chunks=4, cpu_threads=1) for k in (1, 2)]
    for gp in pipes:
        torch.manual_seed(1)
        step(gp, x)  # p = 0: no layer draws; the stages learn that
        for layer in gp:
            layer.p = 0.5
        with pytest.warns(RuntimeWarning, match="drew random numbers on cpu unseeded"):
            step(gp, x)
    results = []
    for gp in pipes:
        torch.manual_seed(2)
        results.append(step(gp, x))
    assert torch.equal(results[0][0], results[1][0])
    assert_all_equal(results[0][1], results[1][1])
    assert (results[0][0] == 0).any(), "dropout is on"


def test_layers_that_draw_nothing_are_not_lent_a_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """After their first call, layers that draw nothing are called plainly: no seeding, no lock."""
    from gpipe import rng
    from gpipe.runtime import stage

    lent: list[int] = []
    real = rng.Seeded

    class Counting(real):  # type: ignore[misc, valid-type]
        def __enter__(self) -> rng.Seeded:
            lent.append(self.seed)
            return super().__enter__()

    monkeypatch.setattr(stage, "Seeded", Counting)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4), nn.Tanh())
    gp = pipe(model, 2, chunks=4, checkpoint="never")
    x = torch.randn(8, 4)
    step(gp, x)
    assert len(lent) == 4 + 3, "the dropout on every micro-batch, and each other layer once to find out"
    lent.clear()
    step(gp, x)
    assert len(lent) == 4, "only the dropout layer, once per micro-batch"
