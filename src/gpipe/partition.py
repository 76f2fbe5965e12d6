"""Cutting an ``nn.Sequential`` into partitions (cells) by a balance, with the checks that make the
cut safe: every layer in exactly one partition, no module or parameter shared between partitions."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpipe.batchnorm import DeferredBatchNorm

__all__ = ["check_balance", "resolve_devices", "split_module"]

_BALANCE_HINT = (
    "give one positive layer count per partition, summing to the number of layers, "
    "e.g. balance=[2, 2] for a 4-layer model on 2 partitions"
)


def check_balance(module: nn.Sequential, balance: Any) -> list[int]:
    if balance is None:
        raise ValueError(f"balance is required: {_BALANCE_HINT}")
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a sequence of ints (balance: {balance!r}); {_BALANCE_HINT}")
    if not balance:
        raise ValueError(f"balance is empty: {_BALANCE_HINT}")
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in balance):
        raise TypeError(f"balance must contain ints (balance: {list(balance)!r})")
    if any(b <= 0 for b in balance):
        raise ValueError(f"all balance entries must be positive (balance: {list(balance)})")
    if sum(balance) != len(module):
        raise ValueError(
            "module and sum of balance have different length "
            f"(module: {len(module)}, sum of balance: {sum(balance)}); {_BALANCE_HINT}"
        )
    return list(balance)


def resolve_devices(devices: Sequence[Any] | None, partitions: int) -> list[torch.device]:
    """The first ``partitions`` devices; by default every CUDA device, or ``'cpu'`` for each
    partition when there is no GPU."""
    if devices is None:
        if torch.cuda.is_available():
            devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        else:
            devices = ["cpu"] * partitions
    resolved = [torch.device(d) for d in devices]
    if len(resolved) < partitions:
        raise IndexError(
            f"too few devices to hold given partitions (devices: {len(resolved)}, partitions: {partitions}); "
            "pass devices=[...] with one device per partition (a device may repeat, e.g. ['cpu', 'cpu'])"
        )
    return resolved[:partitions]


def split_module(module: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device]) -> list[nn.Sequential]:
    """Partition ``module`` by ``balance``, each partition moved to its device. Child names are
    kept, so a partition's state-dict keys are the original ones."""
    names = list(module._modules)
    layers = list(module)
    owner: dict[int, tuple[int, str]] = {}
    params: dict[int, tuple[int, str]] = {}
    partitions: list[nn.Sequential] = []
    start = 0
    for k, count in enumerate(balance):
        children: OrderedDict[str, nn.Module] = OrderedDict()
        for name, layer in zip(names[start : start + count], layers[start : start + count]):
            _claim(owner, id(layer), k, f"layer {name!r}", "module")
            for pname, p in layer.named_parameters():
                _claim(params, id(p), k, f"parameter {name}.{pname}", "parameter")
            children[name] = layer
        partitions.append(nn.Sequential(children).to(devices[k]))
        start += count
    return partitions


def _claim(table: dict[int, tuple[int, str]], key: int, k: int, what: str, kind: str) -> None:
    if key in table and table[key][0] != k:
        other_k, other = table[key]
        raise ValueError(
            f"the same {kind} is in partitions {other_k} and {k} ({other} and {what}); "
            "a module or parameter may not be shared between partitions"
        )
    table.setdefault(key, (k, what))


def check_chunks(chunks: Any) -> int:
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks <= 0:
        raise ValueError(f"number of chunks must be a positive integer (chunks: {chunks!r})")
    return chunks


def partition(
    module: nn.Sequential,
    balance: Any,
    devices: Sequence[Any] | None,
    *,
    virtual: int = 1,
    deferred_batch_norm: bool = False,
) -> tuple[list[int], list[torch.device], list[nn.Sequential]]:
    """Check and cut ``module`` into ``len(balance)`` stages over ``len(balance) // virtual`` devices
    (stage ``s`` on device ``s mod K``). Returns the balance, the K devices and the stages."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module must be nn.Sequential to be partitioned (module: {type(module).__name__}); "
            "list its layers in an nn.Sequential"
        )
    balance = check_balance(module, balance)
    if not isinstance(virtual, int) or virtual <= 0 or len(balance) % virtual:
        raise ValueError(
            f"the number of stages must be a multiple of the virtual stages per device "
            f"(stages: {len(balance)}, virtual: {virtual}); give one balance entry per stage"
        )
    workers = resolve_devices(devices, len(balance) // virtual)
    if deferred_batch_norm:
        DeferredBatchNorm.convert_deferred_batch_norm(module)
    stage_devices = [workers[s % len(workers)] for s in range(len(balance))]
    return balance, workers, split_module(module, balance, stage_devices)
