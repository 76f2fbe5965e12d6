"""Failures inside workers: the exception reaches the caller, nothing hangs, no thread survives."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import traceback
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gpipe import GPipe


class Boom(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise_from_layer()
        return x


def raise_from_layer() -> None:
    raise ArithmeticError("boom inside a layer")


class BoomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise LookupError("boom inside backward")


class BackwardBoom(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return BoomInBackward.apply(x)  # type: ignore[no-untyped-call,no-any-return]


def _workers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("gpipe-worker")]


@pytest.mark.parametrize("position", [0, 1, 3])
def test_exception_in_forward_reaches_caller_with_traceback(position: int) -> None:
    layers: list[nn.Module] = [nn.Linear(3, 3) for _ in range(4)]
    layers[position] = Boom()
    gp = GPipe(nn.Sequential(*layers), [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4)
    with pytest.raises(ArithmeticError, match="boom inside a layer") as info:
        gp(torch.randn(8, 3))
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "raise_from_layer" in frames
    assert any(f"@stage{position}" in note for note in info.value.__notes__)
    assert not _workers()


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_exception_in_backward_reaches_caller(checkpoint: str) -> None:
    gp = GPipe(
        nn.Sequential(nn.Linear(3, 3), BackwardBoom(), nn.Linear(3, 3)),
        [1, 1, 1],
        devices=["cpu"] * 3,
        chunks=4,
        checkpoint=checkpoint,
    )
    out = gp(torch.randn(8, 3))
    with pytest.raises(LookupError, match="boom inside backward"):
        out.sum().backward()
    assert not _workers()


class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fail = True

    def forward(self, x: Tensor) -> Tensor:
        if self.fail:
            raise ArithmeticError("flaky")
        return x


def test_pipeline_still_works_after_a_failure() -> None:
    flaky = Flaky()
    gp = GPipe(nn.Sequential(nn.Linear(3, 3), flaky), [1, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(ArithmeticError):
        gp(torch.randn(4, 3))
    flaky.fail = False
    gp(torch.randn(4, 3)).sum().backward()
    assert all(p.grad is not None for p in gp.parameters())


def test_failure_does_not_block_interpreter_exit() -> None:
    script = textwrap.dedent(
        """
        import torch
        from torch import nn
        from gpipe import GPipe

        class Boom(nn.Module):
            def forward(self, x):
                raise ValueError("boom")

        gp = GPipe(nn.Sequential(nn.Linear(3, 3), Boom(), nn.Linear(3, 3)), [1, 1, 1], devices=["cpu"] * 3, chunks=4)
        try:
            gp(torch.randn(8, 3))
        except ValueError:
            print("caught")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "caught"


def test_threads_are_joined_after_success() -> None:
    before = threading.active_count()
    gp = GPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), [1, 1], devices=["cpu", "cpu"], chunks=2)
    gp(torch.randn(4, 3)).sum().backward()
    assert threading.active_count() == before


def test_thread_count_restored() -> None:
    before = torch.get_num_threads()
    gp = GPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), [1, 1], devices=["cpu", "cpu"], chunks=2, cpu_threads=1)
    gp(torch.randn(4, 3)).sum().backward()
    assert torch.get_num_threads() == before
