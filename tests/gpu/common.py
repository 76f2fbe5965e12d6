"""What the checks of tests/gpu share: a small MLP, its data, the plain model's step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

BATCH, WIDTH, LAYERS = 32, 64, 8

NO_CUDA = f"no CUDA device: torch {torch.__version__} reports torch.cuda.is_available() False"
cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
"""A module's ``pytestmark`` for checks on one CUDA device."""
cuda_multi = [
    pytest.mark.cuda_multi,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="fewer than 2 CUDA devices (torch.cuda.device_count() < 2)",
    ),
]
"""A module's ``pytestmark`` for checks on two CUDA devices or more."""


def mlp(dropout: float = 0.0) -> nn.Sequential:
    """LAYERS x (Linear(WIDTH, WIDTH), Tanh or Dropout), seeded."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Dropout(dropout) if dropout else nn.Tanh()]
    return nn.Sequential(*layers)


def data(device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    return x.to(device), y.to(device)


def plain_step(model: nn.Module, x: Tensor, y: Tensor, m: int) -> tuple[Tensor, list[Tensor]]:
    """The plain model (a copy) on the pipeline's ``m`` micro-batches: the sum of each micro-batch's
    mean loss weighted by its share of the batch; the loss and the parameters' gradients."""
    model = copy.deepcopy(model)
    total = torch.zeros((), device=x.device, dtype=x.dtype)
    for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
        loss = F.mse_loss(model(xs), ys) * (xs.size(0) / x.size(0))
        loss.backward()
        total = total + loss.detach()
    return total, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def max_diff(a: list[Tensor], b: list[Tensor]) -> float:
    """The largest absolute difference between pairs of tensors (compared on the CPU, in float64)."""
    return max(
        float((x.detach().cpu().double() - y.detach().cpu().double()).abs().max()) for x, y in zip(a, b, strict=True)
    )
