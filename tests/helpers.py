"""Shared test helpers: run a model plainly and through GPipe, compare outputs and gradients."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gpipe import GPipe
from gpipe.bench.common import intra_op_threads  # noqa: F401 - shared with the tests


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


def assert_close_norm(actual: Tensor, expected: Tensor, rtol: float, *, atol: float = 0.0, msg: str = "") -> None:
    """``‖actual - expected‖ ≤ rtol·‖expected‖ + atol·√numel`` (2-norms over the whole tensor).

    For results that the two sides compute with different CPU kernels (another thread count, another
    batch shape: each sums in its own order), or that another CPU (AVX2 vs AVX-512) rounds its own
    way. Elementwise tolerances fail there without anything being wrong: an element that is a sum of
    terms cancelling to near zero keeps their rounding, large relative to itself. A bug (a wrong
    factor, a lost or doubled micro-batch) moves the whole tensor, far beyond any rtol used here."""
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    error = float((actual.double() - expected.double()).norm())
    scale = float(expected.double().norm())
    bound = rtol * scale + atol * math.sqrt(actual.numel())
    assert error <= bound, f"{msg}: ‖actual - expected‖ = {error:.3g} > {bound:.3g} (‖expected‖ = {scale:.3g})"


def assert_all_close_norm(a: list[Tensor], b: list[Tensor], rtol: float, *, atol: float = 0.0) -> None:
    """:func:`assert_close_norm` for each pair of tensors (e.g. parameter gradients)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_close_norm(x, y, rtol, atol=atol, msg=f"tensor {i}")
