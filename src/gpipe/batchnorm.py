"""Batch normalization as in the paper: statistics per micro-batch, running averages per mini-batch.

In training, :class:`DeferredBatchNorm` normalizes each micro-batch with that micro-batch's own mean
and variance (as a plain BatchNorm would on that micro-batch alone), but defers the update of the
running mean and variance: it accumulates the sums of the micro-batches of a mini-batch and then
updates the running statistics once — with exactly what a plain BatchNorm would have accumulated from
the whole mini-batch. Recomputation in backward is not counted.

When is a mini-batch complete? Inside :class:`gpipe.GPipe` or :class:`gpipe.Pipeline` the pipeline
knows: it calls :meth:`DeferredBatchNorm.commit` once the forwards of a step are done, whatever the
number of micro-batches (a short last batch makes fewer). Used on its own, as torchgpipe's is, the
layer commits after every ``chunks`` micro-batches it has tracked::

    bn = DeferredBatchNorm(16, chunks=4)
    for chunk in x.chunk(4):
        bn(chunk)           # the running statistics change after the 4th, as BatchNorm's on x would
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gpipe.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm"]

TModule = TypeVar("TModule", bound=nn.Module)


def _check_chunks(chunks: Any) -> int | None:
    if chunks is None or (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks > 0):
        return chunks
    raise ValueError(
        f"chunks must be a positive int, the micro-batches per mini-batch, or None to commit only when "
        f"commit() is called (chunks: {chunks!r})"
    )


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose running statistics are updated once per mini-batch of micro-batches.

    Args:
        num_features, eps, momentum, affine: as for ``nn.BatchNorm2d`` (running statistics are
            always tracked).
        chunks: the number of micro-batches in a mini-batch: the running statistics are updated
            after this many training forwards (not counting recomputations), or earlier when
            :meth:`commit` is called (a pipeline calls it at the end of each step's forwards).
            ``None``: only :meth:`commit` updates them.

    Unlike torchgpipe's, the running variance is the unbiased one, as plain BatchNorm's; 2D inputs
    (``BatchNorm1d`` on ``(N, C)``) are accepted; and the accumulated sums are not in the state dict
    (torchgpipe's ``sum`` and ``sum_squares`` entries are ignored when loading one).
    """

    sum: Tensor
    sum_squares: Tensor
    count: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        chunks: int | None = 1,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True, device=device, dtype=dtype)
        self.chunks = _check_chunks(chunks)
        #: Micro-batches tracked since the running statistics were last updated.
        self.tracked = 0
        # float64 sums keep the mini-batch variance as exact as plain BatchNorm's.
        self.register_buffer("sum", torch.zeros(num_features, dtype=torch.float64, device=device), persistent=False)
        self.register_buffer("sum_squares", torch.zeros_like(self.sum), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64, device=device), persistent=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunks={self.chunks}"  # type: ignore[no-untyped-call]

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if not is_recomputing():
            self._track(input)
        return output

    @torch.no_grad()
    def _track(self, input: Tensor) -> None:
        dims = [0, *range(2, input.dim())]
        x = input.detach().double()
        self.sum += x.sum(dims)
        self.sum_squares += (x * x).sum(dims)
        self.count += input.numel() // input.size(1)
        self.tracked += 1
        if self.chunks is not None and self.tracked >= self.chunks:
            self.commit()

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the micro-batches tracked so far into the running statistics, as one mini-batch (a
        no-op when there are none)."""
        self.tracked = 0
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

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # torchgpipe saves its accumulators; a checkpoint of a torchgpipe model loads all the same.
        for name in ("sum", "sum_squares"):
            state_dict.pop(prefix + name, None)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    @classmethod
    def convert_deferred_batch_norm(cls, module: TModule, chunks: int | None = 1) -> TModule:
        """Replace ``module`` or, recursively, its BatchNorm layers (``_BatchNorm`` with running
        statistics) by DeferredBatchNorms with ``chunks`` micro-batches per mini-batch, which share
        their parameters and running statistics. Returns the converted module (a new one if
        ``module`` itself is replaced). A DeferredBatchNorm with other ``chunks`` is replaced too; one
        with the same is kept."""
        chunks = _check_chunks(chunks)
        if isinstance(module, cls) and module.chunks == chunks:
            return module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            ref = cast(Tensor, module.running_mean)
            new = cls(module.num_features, module.eps, module.momentum, module.affine, chunks, device=ref.device)
            if module.affine:
                new.register_parameter("weight", module.weight)
                new.register_parameter("bias", module.bias)
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                new.register_buffer(name, getattr(module, name))
            new.train(module.training)
            return cast(TModule, new)
        for name, child in module.named_children():
            module.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return module
