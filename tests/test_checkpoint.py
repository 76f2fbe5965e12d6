"""Re-materialization: which micro-batches are checkpointed, the flags layers see, what is saved."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import gpipe
from gpipe import GPipe


class Probe(nn.Module):
    """Records (micro-batch first value, is_checkpointing, is_recomputing) on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool, bool]] = []
        self.lin = nn.Linear(1, 1)

    def forward(self, x: Tensor) -> Tensor:
        self.calls.append((int(x[0, 0].item()), gpipe.is_checkpointing(), gpipe.is_recomputing()))
        return self.lin(x)


def run(checkpoint: str, train: bool = True, grad: bool = True) -> list[tuple[int, bool, bool]]:
    probe = Probe()
    gp = GPipe(nn.Sequential(nn.Identity(), probe), [1, 1], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    gp.train(train)
    x = torch.arange(8.0).view(8, 1)
    with torch.set_grad_enabled(grad):
        out = gp(x)
    if grad:
        out.sum().backward()
    return probe.calls


def test_except_last() -> None:
    calls = run("except_last")
    forward, recompute = calls[:4], calls[4:]
    assert forward == [(0, True, False), (2, True, False), (4, True, False), (6, False, False)]
    assert sorted(recompute) == [(0, False, True), (2, False, True), (4, False, True)]


def test_always_and_never() -> None:
    assert [c for c in run("always") if c[2]] == [
        (6, False, True),
        (4, False, True),
        (2, False, True),
        (0, False, True),
    ]
    assert run("never") == [(m, False, False) for m in (0, 2, 4, 6)]


@pytest.mark.parametrize(("train", "grad"), [(False, True), (True, False), (False, False)])
def test_no_checkpointing_in_eval_or_without_grad(train: bool, grad: bool) -> None:
    assert run("always", train=train, grad=grad) == [(m, False, False) for m in (0, 2, 4, 6)]


def test_flags_are_off_outside_the_pipeline() -> None:
    assert not gpipe.is_checkpointing() and not gpipe.is_recomputing()


@pytest.mark.parametrize(("checkpoint", "expect_saved"), [("always", False), ("never", True)])
def test_rematerialized_forward_saves_no_activations(checkpoint: str, expect_saved: bool) -> None:
    """Count the tensors autograd saves for backward during the forward phase of each stage."""
    saved = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal saved
        saved += 1
        return t

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return torch.tanh(self.lin(x))

    gp = GPipe(nn.Sequential(Counting(), Counting()), [1, 1], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    # The first forward of a kind of input runs once with autograd on, to learn which outputs need a
    # gradient (its graph is dropped at once); from then on a re-materialized forward saves nothing.
    gp(torch.randn(8, 4)).sum().backward()
    saved = 0
    out = gp(torch.randn(8, 4))
    assert (saved > 0) == expect_saved
    out.sum().backward()
    assert saved > 0  # the recomputation in backward saves what it needs
