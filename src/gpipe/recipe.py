"""The paper's training recipe, piece by piece (§5 and the supplementary material).

- :func:`temperature_sampling`: data set l drawn with probability ∝ p_l^(1/T), p_l = D_l / ΣD.
- :func:`inverse_sqrt_schedule`: linear warm-up to a peak, then decay with the inverse square root of
  the step — the paper's "(3.0, 40K)" is ``inverse_sqrt_schedule(optimizer, 3.0, 40_000)``.
- :func:`label_smoothing_loss`: cross entropy against smoothed targets; :class:`count_tokens` makes a
  pipeline's loss the mini-batch's token mean whatever the padding.
- :func:`clip_logits`: logit clipping of the softmax pre-activations.
- :func:`rmsprop`: the image-classification optimizer settings (decay 0.9, ε 0.1, L2 4e-5).
- :func:`adafactor`: ``torch.optim.Adafactor``, as for the translation models (:class:`ShardedAdafactor`:
  also on sharded parameters).
- :func:`clip_grad_norm_per_parameter`: every parameter's gradient norm clipped on its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from gpipe.health import grad_norms  # (the library's: the health metrics' global norm is made of them too)

__all__ = [
    "ShardedAdafactor",
    "adafactor",
    "clip_grad_norm_per_parameter",
    "clip_logits",
    "count_tokens",
    "grad_norms",
    "inverse_sqrt_lr",
    "inverse_sqrt_schedule",
    "label_smoothing_loss",
    "rmsprop",
    "temperature_sampling",
]


def temperature_sampling(sizes: Sequence[float], temperature: float) -> list[float]:
    """Sampling probabilities of data sets of ``sizes`` at ``temperature`` T: p_l^(1/T), normalized.
    T=1 keeps the true distribution, large T tends to uniform."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive (temperature: {temperature})")
    if not sizes or any(s < 0 for s in sizes) or sum(sizes) <= 0:
        raise ValueError(f"sizes must be non-negative with a positive sum (sizes: {list(sizes)})")
    total = sum(sizes)
    weights = [(s / total) ** (1.0 / temperature) if s else 0.0 for s in sizes]
    norm = sum(weights)
    return [w / norm for w in weights]


def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """The learning rate at ``step`` (counted from 1): ``peak * step / warmup`` during warm-up, then
    ``peak * sqrt(warmup / step)``."""
    if warmup <= 0:
        raise ValueError(f"warmup must be positive (warmup: {warmup})")
    step = max(step, 1)
    return peak * step / warmup if step <= warmup else peak * math.sqrt(warmup / step)


def inverse_sqrt_schedule(
    optimizer: torch.optim.Optimizer, peak: float, warmup: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler giving :func:`inverse_sqrt_lr`; set the optimizer's lr to 1.0 (it is a factor),
    and call ``scheduler.step()`` after each optimizer step."""
    for group in optimizer.param_groups:
        group["lr"] = 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: inverse_sqrt_lr(i + 1, peak, warmup))


def label_smoothing_loss(
    logits: Tensor, target: Tensor, smoothing: float = 0.1, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """Cross entropy against targets smoothed by ``smoothing`` (1 - ε on the label, ε spread
    uniformly over all classes), over the last dimension of ``logits``; tokens whose target is
    ``ignore_index`` do not count. ``reduction``: 'mean' over the counted tokens, or 'sum' (with
    ``Pipeline(loss_count=count_tokens(ignore_index))``, the mini-batch's token mean).

    Computed in float32 at least: logits of a lower precision (bf16 or fp16, of a model run under
    autocast) are cast to float32 first, so that the softmax, the loss and its gradient keep its precision."""
    if logits.is_floating_point() and torch.finfo(logits.dtype).bits < 32:
        logits = logits.float()
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        target.reshape(-1),
        label_smoothing=smoothing,
        ignore_index=ignore_index,
        reduction=reduction,
    )


class count_tokens:  # noqa: N801 - used like a function: Pipeline(loss_count=count_tokens(pad))
    """``count_tokens(ignore_index)(target)``: how many targets are not ``ignore_index`` — the
    ``loss_count`` of a token loss summed over its tokens, so that a pipeline step's loss is the
    mini-batch's token mean however padding falls into micro-batches."""

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = ignore_index

    def __call__(self, target: Tensor) -> Tensor:
        return (target != self.ignore_index).sum()

    def __repr__(self) -> str:
        return f"count_tokens(ignore_index={self.ignore_index})"


def clip_logits(logits: Tensor, threshold: float | None) -> Tensor:
    """Clip the softmax pre-activations to [-threshold, threshold] (no clipping with ``None``)."""
    return logits if threshold is None else logits.clamp(-threshold, threshold)


def rmsprop(params: Iterable[nn.Parameter], lr: float, *, weight_decay: float = 4e-5) -> torch.optim.RMSprop:
    """RMSProp as in the paper's image classification: decay 0.9, ε = 0.1, L2 ``weight_decay``."""
    return torch.optim.RMSprop(params, lr=lr, alpha=0.9, eps=0.1, weight_decay=weight_decay)


def adafactor(params: Iterable[nn.Parameter], lr: float = 1e-2, **kwargs: Any) -> torch.optim.Adafactor:
    """torch's Adafactor (factored second moments), for the Transformer recipe; parameters that are
    ``DTensor`` shards (``--fsdp``, ``--tensor-parallel``, ``--expert-parallel``) step as the whole
    parameter would (:class:`ShardedAdafactor`)."""
    return ShardedAdafactor(params, lr=lr, **kwargs)


class ShardedAdafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor``, whose step fails on ``DTensor`` parameters (an in-place op on a
    partial norm), also for parameters sharded over a 1-D mesh: their step is the whole parameter's,
    computed on each rank's shard, with an all-reduce for each statistic that spans shards (the norms
    of the parameter and of its update; a factored moment's mean over the sharded dimension). Its
    state has torch's keys and whole shapes, as ``DTensor`` shards (a checkpoint loads in any layout).
    Plain parameters step through torch's own code (the same numbers as before). No host read."""

    gpipe_state_like = torch.optim.Adafactor  # (checkpoints: its state is torch's, and loads in either)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        held = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and isinstance(p, DTensor):
                    self._sharded_step(p, group)
                    held.append((p, p.grad))
                    p.grad = None  # (torch's step skips it)
        try:
            super().step()  # type: ignore[no-untyped-call]
        finally:
            for p, grad in held:
                p.grad = grad
        return loss

    def _sharded_step(self, p: DTensor, group: dict[str, Any]) -> None:
        mesh, n, d = p.device_mesh, p.dim(), group["d"]
        shards = [pl.dim % n for pl in p.placements if isinstance(pl, Shard)]
        dim = shards[0] if shards else None  # the sharded dimension (None: replicated)
        over = mesh.get_group()
        reduce = (lambda t: _summed(t, over)) if dim is not None else (lambda t: t)
        param, grad = p.to_local(), p.grad.to_local()  # type: ignore[union-attr]
        grad = -grad if group["maximize"] else grad
        state = self.state[p]
        if not state:  # (torch's keys and whole shapes; the factored dimension is never the sharded one's)
            state["step"] = torch.tensor(0.0)
            if n > 1:
                state["row_var"] = _zeros(param, p.shape, -1, mesh, None if dim == n - 1 else dim)
                state["col_var"] = _zeros(param, p.shape, -2, mesh, None if dim == n - 2 else dim)
            else:
                state["variance"] = _zeros(param, p.shape, None, mesh, dim)
        state["step"] += 1
        step = float(state["step"])  # (a CPU tensor, as torch's)
        beta2 = step ** group["beta2_decay"]
        lr = float(group["lr"])
        eps1, eps2 = group["eps"]
        eps1 = eps1 if eps1 is not None else torch.finfo(param.dtype).eps
        alpha = (reduce(param.pow(2).sum()) / p.numel()).sqrt().clamp(min=eps2) * min(lr, 1 / step**0.5)
        if group["weight_decay"]:
            param.mul_(1 - lr * group["weight_decay"])
        if n > 1:
            row_var, col_var = state["row_var"].to_local(), state["col_var"].to_local()
            squared = grad * grad
            rows, cols = squared.sum(-1, keepdim=True), squared.sum(-2, keepdim=True)
            row_var.lerp_((reduce(rows) if dim == n - 1 else rows) / p.size(-1), beta2)
            col_var.lerp_((reduce(cols) if dim == n - 2 else cols) / p.size(-2), beta2)
            mean = row_var.sum(-2, keepdim=True)
            mean = (reduce(mean) if dim == n - 2 else mean) / p.size(-2)
            estimate = (row_var @ col_var) / mean.clamp(min=eps1)
        else:
            variance = state["variance"].to_local()
            variance.lerp_(grad * grad, beta2)
            estimate = variance.clone()
        update = estimate.clamp(min=eps1 * eps1).rsqrt() * grad
        denom = ((reduce(update.pow(2).sum()) / p.numel()).sqrt() / d).clamp(min=1.0)
        param.sub_(update * (alpha / denom))


def _zeros(local: Tensor, shape: Sequence[int], factored: int | None, mesh: Any, dim: int | None) -> DTensor:
    """A moment's zeros: the whole ``shape`` with dimension ``factored`` 1, as shards on ``mesh`` like
    ``local``'s (of the parameter: dimension ``dim``), or replicated (``dim`` None)."""
    whole, mine = list(shape), list(local.shape)
    if factored is not None:
        whole[factored] = mine[factored] = 1
    if dim is None:
        return DTensor.from_local(local.new_zeros(whole), mesh, [Replicate()], run_check=False)
    empty = torch.empty(whole, device="meta")
    return DTensor.from_local(local.new_zeros(mine), mesh, [Shard(dim)], run_check=False, shape=empty.shape,
                              stride=empty.stride())  # fmt: skip


def _summed(t: Tensor, group: Any) -> Tensor:
    """``t`` summed over ``group`` (a copy)."""
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def clip_grad_norm_per_parameter(
    params: Iterable[nn.Parameter], max_norm: float = 1.0, *, norms: list[tuple[nn.Parameter, float]] | None = None
) -> int:
    """Clip every parameter's gradient to norm ``max_norm`` on its own (the paper's per-parameter
    clipping); returns how many were clipped. A sharded parameter's gradient is clipped by the norm of
    the whole gradient, not by its own shard's. ``norms``: :func:`grad_norms` of ``params``, if
    already computed (``gpipe train`` checks them for NaN and Inf first)."""
    clipped = 0
    for p, norm in grad_norms(params) if norms is None else norms:
        if norm > max_norm:
            p.grad.mul_(max_norm / (norm + 1e-6))  # type: ignore[union-attr]
            clipped += 1
    return clipped
