"""Balancing: choose how many layers each partition gets.

Costs per layer (the paper's c_i) come from a measurement or from the user; the exact partitioner
:func:`solve` then splits them into K contiguous cells minimizing the largest one::

    from gpipe.balance import balance_by_time
    balance = balance_by_time(4, model, sample)      # profile each layer, split exactly
    pipe = gpipe.GPipe(model, balance, chunks=8)

    balance = balance_by_flops(4, model, sample)     # from shapes alone: works on the meta device
    balance = balance_by_flops(4, model, sample, state_bytes=16)  # and the memory: an embedding counts
    balance = gpipe.balance.solve(my_costs, 4)       # or your own costs

:func:`balance_by_time` and :func:`balance_by_size` have torchgpipe's signatures. They differ from
torchgpipe's in that the split is the optimal one (torchgpipe's block partitioning is a local search
that can miss it), ``balance_by_size`` also measures on the CPU (the bytes autograd saves), the
default ``device='cuda'`` means the CPU on a machine without CUDA, the sample may be any pytree,
parameters that already have gradients are fine (they are restored), and both take a few keywords of
their own (``chunks``, ``memory_cap``; ``device=None``: where the module is).

Part of the library: imports torch, :mod:`gpipe.memory` and :mod:`gpipe.microbatch`; never the
applications.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpipe.balance import blockpartition
from gpipe.balance.profile import (
    layer_costs,
    layer_flops,
    layer_memory,
    layer_params,
    layer_state,
    layer_times,
    layerwise_sandbox,
    profiling_device,
    sandbox,
)
from gpipe.balance.solver import lightest, solve

__all__ = [
    "balance_by_flops",
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "blockpartition",
    "layer_costs",
    "layer_flops",
    "layer_memory",
    "layer_params",
    "layer_state",
    "layer_times",
    "layerwise_sandbox",
    "lightest",
    "profiling_device",
    "sandbox",
    "solve",
]

Device = torch.device | str | int


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Any,
    *,
    timeout: float = 1.0,
    device: Device | None = torch.device("cuda"),  # noqa: B008 (torchgpipe's default)
    chunks: int = 1,
    memory_cap: float | None = None,
) -> list[int]:
    """Time every layer's forward + backward (in training mode, on a copy where it is not on
    ``device``) and split the layers so that the slowest partition is as fast as possible.

    Args:
        partitions: the number of partitions.
        module: the layers to split.
        sample: an input of the module, of any batch size (or, with ``chunks``, a mini-batch whose
            first micro-batch is timed).
        timeout: keep profiling passes over the layers until this many seconds have passed (at
            least one pass; a layer's time is its median over the passes).
        device: where to profile (default: the current CUDA device, or the CPU without CUDA;
            ``None``: where the module is).
        chunks: time the first of ``chunks`` micro-batches of ``sample`` (not in torchgpipe).
        memory_cap: keep each partition within this many bytes, measured as
            :func:`balance_by_size` does (not in torchgpipe).

    Returns:
        The number of layers in each partition: the ``balance`` of :class:`gpipe.GPipe`.
    """
    times = layer_times(module, sample, chunks=chunks, repeats=1, timeout=timeout, device=device)
    memory = layer_memory(module, sample, chunks=chunks, device=device) if memory_cap is not None else None
    return solve(times, partitions, memory=memory, memory_cap=memory_cap)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: Any,  # (torchgpipe's name)
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Device | None = torch.device("cuda"),  # noqa: B008 (torchgpipe's default)
) -> list[int]:
    """Split the layers so that the partition needing the most memory needs as little as possible.

    A layer's memory is what its forward (in training mode) keeps for backward on one micro-batch of
    the mini-batch ``input`` split into ``chunks`` — on CUDA the allocator's peak, elsewhere the bytes
    autograd saves — plus ``param_scale`` times its parameters' bytes: 2.0 counts the weights and
    their gradients; add the optimizer's state per parameter (SGD with momentum: 3, Adam: 4).
    ``device``: where to measure (default: the current CUDA device, or the CPU without CUDA;
    ``None``: where the module is).
    """
    return solve(layer_memory(module, input, chunks=chunks, param_scale=param_scale, device=device), partitions)


def balance_by_params(partitions: int, module: nn.Sequential | Sequence[nn.Module]) -> list[int]:
    """Split the layers so that the largest partition holds as few parameters as possible."""
    return solve(layer_params(nn.Sequential(*module) if not isinstance(module, nn.Sequential) else module), partitions)


def balance_by_flops(
    partitions: int,
    module: nn.Sequential,
    sample: Any,
    *,
    chunks: int = 1,
    state_bytes: float | None = None,
    slack: float = 0.05,
    memory_cap: float | None = None,
) -> list[int]:
    """Split the layers so that the partition doing the most floating-point work (forward and
    backward on a micro-batch of ``sample``) does as little as possible. Counted from shapes, so
    deterministic and usable on the meta device; a proxy for time where matrix products and
    convolutions dominate.

    With ``state_bytes`` (what a parameter holds for training: weight, gradient and optimizer state;
    float32 with Adam 16, with Adafactor about 8), memory too (:func:`layer_state`): of the splits
    whose slowest partition is within ``slack`` of the fastest split's, the one whose largest
    partition holds the least (:func:`lightest`). A language model's embedding does no
    floating-point work but holds as many parameters as its head: by FLOPs alone the first stage
    gets it and as many blocks as the others. ``memory_cap``: bytes no partition may exceed
    (a :class:`ValueError` when no split fits)."""
    if state_bytes is None:
        if memory_cap is not None:
            raise ValueError("memory_cap needs state_bytes: the bytes a parameter holds, to count each layer's memory")
        return solve(layer_flops(module, sample, chunks=chunks), partitions)
    if not (state_bytes >= 0 and math.isfinite(state_bytes)):
        raise ValueError(f"state_bytes must be a finite number >= 0 (state_bytes: {state_bytes})")
    flops, memory = layer_costs(module, sample, chunks=chunks, state_bytes=state_bytes)
    return lightest(flops, partitions, memory, slack=slack, memory_cap=memory_cap)
