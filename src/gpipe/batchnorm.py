"""Batch normalization as in the paper: statistics per micro-batch, running averages per mini-batch.

In training, :class:`DeferredBatchNorm` normalizes each micro-batch with that micro-batch's own mean
and variance (as a plain BatchNorm would on that micro-batch alone), but defers the update of the
running mean and variance: it accumulates the sums of all micro-batches of the mini-batch and, once
their forwards are done, updates the running statistics once — with exactly what a plain BatchNorm
would have accumulated from the whole mini-batch. Recomputation in backward is not counted.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gpipe.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose running statistics are updated once per mini-batch of micro-batches."""

    sum: Tensor
    sum_squares: Tensor
    count: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True, device=device, dtype=dtype)
        # float64 sums keep the mini-batch variance as exact as plain BatchNorm's.
        self.register_buffer("sum", torch.zeros(num_features, dtype=torch.float64, device=device), persistent=False)
        self.register_buffer("sum_squares", torch.zeros_like(self.sum), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64, device=device), persistent=False)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        if not is_recomputing():
            with torch.no_grad():
                dims = [0, *range(2, input.dim())]
                x = input.detach().double()
                self.sum += x.sum(dims)
                self.sum_squares += (x * x).sum(dims)
                self.count += input.numel() // input.size(1)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the accumulated micro-batches into the running statistics (once per mini-batch)."""
        count = float(self.count)
        if count == 0:
            return
        mean = self.sum / count
        var = (self.sum_squares / count - mean * mean).clamp_(min=0)
        unbiased = var * (count / (count - 1)) if count > 1 else var
        tracked = cast(Tensor, self.num_batches_tracked)
        tracked += 1
        factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
        running_mean = cast(Tensor, self.running_mean)
        running_var = cast(Tensor, self.running_var)
        running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
        running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.count.zero_()

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module) -> nn.Module:
        """Replace every BatchNorm1d/2d/3d in ``module`` (recursively) by a DeferredBatchNorm that
        shares its parameters and running statistics."""
        if isinstance(module, _BatchNorm) and not isinstance(module, cls) and module.track_running_stats:
            new = cls(module.num_features, module.eps, module.momentum, module.affine)
            if module.affine:
                new.weight, new.bias = module.weight, module.bias
            new.running_mean, new.running_var = module.running_mean, module.running_var
            new.num_batches_tracked = module.num_batches_tracked
            ref = cast(Tensor, module.running_mean)
            new.to(device=ref.device)
            new.train(module.training)
            return new
        for name, child in module.named_children():
            module.add_module(name, cls.convert_deferred_batch_norm(child))
        return module
