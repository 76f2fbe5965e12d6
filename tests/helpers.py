"""Shared test helpers: run a model plainly and through GPipe, compare outputs and gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gpipe import GPipe


def even(layers: int, partitions: int) -> list[int]:
    base, extra = divmod(layers, partitions)
    return [base + (1 if k < extra else 0) for k in range(partitions)]


def loss_of(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output.float().mean()
    return sum((t.float().mean() for t in output if isinstance(t, Tensor) and t.is_floating_point()), torch.zeros(()))


def grads(module: nn.Module) -> list[Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def step(model: nn.Module, inputs: Any, loss: Callable[[Any], Tensor] = loss_of) -> tuple[Any, list[Tensor]]:
    model.zero_grad()
    out = model(inputs)
    loss(out).backward()
    return out, grads(model)


def pipe(model: nn.Sequential, partitions: int, **kwargs: Any) -> GPipe:
    kwargs.setdefault("devices", ["cpu"] * partitions)
    return GPipe(copy.deepcopy(model), even(len(model), partitions), **kwargs)


def assert_all_close(a: list[Tensor], b: list[Tensor], **tol: float) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, msg=lambda m, i=i: f"tensor {i}: {m}", **tol)  # type: ignore[misc]


def assert_all_equal(a: list[Tensor], b: list[Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} differs (max abs diff {(x - y).abs().max().item()})"
