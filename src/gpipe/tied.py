"""Tied weights across stages: one parameter used by layers on different stages (an input embedding
and the output projection, say).

Each stage keeps its own copy of the parameter; the copies start equal, and after every step their
gradients are summed (within the process, and over a process group of the ranks that hold copies)
and the sum given to every copy. An optimizer then takes the same step on every copy, so they stay
bitwise identical, and the gradient is the one the shared parameter gets in the plain model.

Ties are named by global layer index and parameter name: ``tied=[["0.weight", "11.weight"]]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Tie", "layer_at", "local_ties", "names", "shared", "untie", "with_shared"]


def _parse(name: str, layers: int) -> tuple[int, str]:
    index, _, path = name.partition(".")
    if not index.isdigit() or not path or not int(index) < layers:
        raise ValueError(
            f"tied parameter {name!r} is not '<layer index>.<parameter name>' of a model of {layers} layers "
            "(e.g. '0.weight')"
        )
    return int(index), path


def _set_parameter(layer: nn.Module, path: str, value: nn.Parameter) -> None:
    owner, _, leaf = path.rpartition(".")
    setattr(layer.get_submodule(owner) if owner else layer, leaf, value)


def untie(
    model: nn.Sequential, tied: Sequence[Sequence[str]], absent: frozenset[int] = frozenset()
) -> list[list[tuple[int, str]]]:
    """Give every tied parameter after the first of its group a copy of its own (so that stages do
    not share objects); returns the groups as (layer, parameter name) lists. Layers in ``absent``
    are built by other processes and are not checked here."""
    groups = []
    for names in tied:
        if isinstance(names, str) or len(names) < 2:
            raise ValueError(f"a tie needs at least two parameters (tied: {names!r})")
        members = [_parse(n, len(model)) for n in names]
        params: list[tuple[int, str, nn.Parameter]] = []
        for (i, path), name in zip(members, names):
            if i in absent:
                continue
            try:
                params.append((i, path, model[i].get_parameter(path)))
            except AttributeError:
                raise ValueError(f"tied parameter {name!r}: layer {i} has no parameter {path!r}") from None
        shapes = {tuple(p.shape) for _, _, p in params}
        if len(shapes) > 1:
            raise ValueError(f"tied parameters {list(names)} have different shapes {sorted(shapes)}")
        for i, path, p in params:
            if (i, path) != members[0]:
                copy = p.detach().clone() if not p.is_meta else torch.empty_like(p)
                _set_parameter(model[i], path, nn.Parameter(copy, requires_grad=p.requires_grad))
        groups.append(members)
    return groups


def names(tied: Sequence[Sequence[str]]) -> list[list[tuple[int, str]]]:
    """The groups of ``tied`` as (layer, parameter name) lists (checked by :func:`untie` before)."""
    return [[(int(n.partition(".")[0]), n.partition(".")[2]) for n in group] for group in tied]


@dataclass
class Tie:
    """One tied parameter as this process sees it: its local copies, and the ranks holding others."""

    members: list[tuple[int, str]]
    local: list[nn.Parameter] = field(default_factory=list)
    group: Any = None  # the process group of the ranks holding copies (None: all copies are here)
    owner: int | None = None  # the global rank holding the first member

    def sync_values(self) -> None:
        """Make every copy equal the first member's value."""
        if not self.local:
            return
        with torch.no_grad():
            if self.group is not None:  # (split or sharded copies: each holder has the same shard of each)
                first = self.local[0].detach()
                dist.broadcast(first.to_local() if isinstance(first, DTensor) else first, src=self.owner,
                               group=self.group)  # fmt: skip
            for p in self.local[1:]:
                p.copy_(self.local[0].to(p.device))

    def sync_grads(self) -> None:
        """Give every copy the sum of all copies' gradients; a frozen tied parameter (``requires_grad``
        False, as the base weights of LoRA: alike on every rank) gets none."""
        if not self.local or not self.local[0].requires_grad:
            return
        first = self.local[0]
        total = torch.zeros_like(first)
        for p in self.local:
            if p.grad is not None:
                total += p.grad.to(first.device)
        if self.group is not None:  # sharded copies (fsdp): the same shard of each, summed
            dist.all_reduce(total.to_local() if isinstance(total, DTensor) else total, group=self.group)
        for p in self.local:
            if p.grad is None:
                p.grad = total.to(p.device)
            else:
                p.grad.copy_(total)


def shared(model: nn.Sequential, balance: Sequence[int]) -> list[list[str]]:
    """The ties gpipe makes itself: parameters that several layers hold as the same object (a
    language model's token embedding and its output projection), named as ``tied`` names them.

    Layers on one stage are untied too: each layer then accumulates its own gradient over the
    micro-batches and the tie adds the layers' sums in one order, so the gradient is bitwise the
    same whatever the partitioning (one shared tensor would add the layers' micro-batch
    gradients interleaved). Layers given as factories cannot be compared and are not looked at.
    """
    if not isinstance(model, nn.Sequential):
        return []
    holders: dict[int, list[tuple[int, str]]] = {}
    owners: dict[int, dict[int, int]] = {}  # per parameter: each module holding it -> its layer
    shared_module: set[int] = set()  # parameters of a module that several layers hold
    for i, layer in enumerate(model):
        if i >= sum(balance):
            break
        for name, p in layer.named_parameters(remove_duplicate=False):
            owner = id(layer.get_submodule(name.rpartition(".")[0]))
            if owners.setdefault(id(p), {}).setdefault(owner, i) != i:
                shared_module.add(id(p))
            found = holders.setdefault(id(p), [])
            if all(j != i for j, _ in found):
                found.append((i, name))
    # A module in several layers is not a tie: it stays one (on one stage) or is refused.
    return [
        [f"{i}.{name}" for i, name in found]
        for key, found in holders.items()
        if len(found) > 1 and key not in shared_module
    ]


def with_shared(model: Any, balance: Sequence[int], tied: Sequence[Sequence[str]]) -> list[list[str]]:
    """``tied`` and the shared parameters it does not name already."""
    named = {n for group in tied for n in group}
    return [list(group) for group in tied] + [g for g in shared(model, balance) if not named & set(g)]


def layer_at(partitions: Sequence[nn.Sequential], balance: Sequence[int], index: int) -> tuple[int, nn.Module]:
    """The stage holding global layer ``index``, and the layer."""
    first = 0
    for s, count in enumerate(balance):
        if index < first + count:
            return s, partitions[s][index - first]
        first += count
    raise IndexError(index)


def local_ties(partitions: Sequence[nn.Sequential], balance: Sequence[int], tied: Sequence[Sequence[str]]) -> list[Tie]:
    """The ties of a pipeline in one process, their copies made equal to the first member."""
    ties = []
    for members in names(tied):
        tie = Tie(members, [layer_at(partitions, balance, i)[1].get_parameter(path) for i, path in members])
        tie.sync_values()
        ties.append(tie)
    return ties
