"""Experts spread over ranks (expert parallelism, GShard's sharded experts): the experts of each
mixture of experts split over ``expert_parallel`` ranks of the data-parallel dimension.

The mesh: the replicas of each stage fall into groups of ``expert_parallel`` consecutive ones (the
``"ep"`` dimension, ``(dp / ep, ep, pp[, tp])``); the j-th rank of a group holds the j-th slice of
every expert layer's experts, as a ``DTensor`` sharded on dim 0 over the group, and the ranks with the
same j in the other groups hold copies of it (the ``"edp"`` dimension).

A step: each replica routes its own micro-batches (so a token's experts, its slot and whether it is
dropped do not depend on where the experts are), fills its (E, C, D) dispatch buffer, and one
all-to-all over the group hands each rank the rows of its experts from every replica (:func:`exchange`);
the experts compute them, and a second all-to-all hands the results back (autograd runs the same
two exchanges backward). Every replica of a group runs the same schedule, so the exchanges of every
layer and micro-batch pair up in the same order on each, forward, re-materialized and backward. The
capacities may differ between the replicas (as their micro-batches' sizes do): they are exchanged first,
as a few integers in host memory over a gloo group, never read from a device.

Gradients: an expert's gradient is whole once the backward's exchange gave it every replica's rows;
it is summed over the ``"edp"`` copies (:class:`gpipe.distributed.RankCollectives`), while the dense
parameters are summed over every replica as before.

A module takes part by defining ``gpipe_split_experts(experts: ExpertGroup)``: it keeps its slice of
its experts (as ``DTensor`` shards of the whole, so that checkpoints load at any degree) and
exchanges through the group. ``gpipe.models.moe.MoEFeedForward`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from gpipe.distributed.failure import collective

__all__ = [
    "ExpertGroup",
    "check_expert_parallel",
    "exchange",
    "expert_group",
    "is_split_expert",
    "split_experts",
    "split_stacked",
]


@dataclass(frozen=True)
class ExpertGroup:
    """The ranks that split each expert layer between them: ``mesh`` (1-D, ``"ep"``), this rank's
    place ``rank`` of ``size``; ``group`` exchanges the tokens, ``sizes`` (gloo) the capacities."""

    mesh: DeviceMesh
    group: Any
    sizes: Any
    rank: int
    size: int

    def capacities(self, capacity: int) -> list[int]:
        """Every rank's ``capacity`` (this rank's given), in group order: a host-memory all-gather."""
        if self.size == 1:
            return [capacity]
        mine = torch.tensor([capacity], dtype=torch.int64)
        found = torch.empty(self.size, dtype=torch.int64)
        with collective("all-gather of the experts' capacities over the expert-parallel group", self.sizes):
            dist.all_gather_single(found, mine, group=self.sizes)
        return [int(c) for c in found.tolist()]


def check_expert_parallel(expert_parallel: int, data_parallel: int, *, distributed: bool) -> None:
    """``Pipeline(expert_parallel=...)`` checked against the layout, refused in one line."""
    if not isinstance(expert_parallel, int) or isinstance(expert_parallel, bool) or expert_parallel <= 0:
        raise ValueError(f"expert_parallel must be a positive integer (expert_parallel: {expert_parallel!r})")
    if expert_parallel == 1:
        return
    if not distributed:
        raise ValueError(
            f"expert_parallel={expert_parallel} splits the experts over data-parallel replicas, which need "
            "torch.distributed: run under torchrun with data_parallel x stages processes"
        )
    if data_parallel % expert_parallel:
        raise ValueError(
            f"expert_parallel must divide data_parallel: the experts are split over groups of that many replicas "
            f"(expert_parallel: {expert_parallel}, data_parallel: {data_parallel})"
        )


def is_split_expert(tensor: Tensor) -> bool:
    """A parameter (or its gradient) of experts split over an expert-parallel group."""
    return isinstance(tensor, DTensor) and tensor.device_mesh.mesh_dim_names == ("ep",)


def expert_group(mesh: DeviceMesh, timeout: float) -> ExpertGroup:
    """The expert-parallel group of ``mesh`` (its ``"ep"`` dimension), with a gloo twin for the
    capacities (the same group where the backend is gloo already)."""
    ep = mesh["ep"]
    group = ep.get_group()
    ranks = dist.get_process_group_ranks(group)
    sizes: Any = group
    if "gloo" not in str(dist.get_backend(group)):
        # (new_group is collective over the world: every rank creates every group's twin, in order)
        sizes = None
        for replicas in _all_ep_groups(mesh):
            made = dist.new_group(replicas, backend="gloo", timeout=timedelta(seconds=timeout))
            if replicas == ranks:
                sizes = made
    return ExpertGroup(ep, group, sizes, ranks.index(dist.get_rank()), len(ranks))


def _all_ep_groups(mesh: DeviceMesh) -> list[list[int]]:
    """Every ``"ep"`` group of the world's mesh, in one order on every rank."""
    names = list(mesh.mesh_dim_names or ())
    grid = mesh.mesh.movedim(names.index("ep"), -1)
    return [row.tolist() for row in grid.reshape(-1, grid.size(-1))]


def split_stacked(module: nn.Module, names: Sequence[str], experts: ExpertGroup) -> None:
    """Keep this rank's slice (``experts.rank`` of ``experts.size`` equal slices, along dim 0) of
    ``module``'s parameters ``names``, each an expert stack, as ``DTensor`` shards of the whole (dim 0
    over ``experts.mesh``): a checkpoint reads and writes them at any number of expert ranks."""
    for name in names:
        param = module.get_parameter(name)
        count = param.size(0)
        if count % experts.size:
            raise ValueError(
                f"{count} experts cannot be split evenly over {experts.size} expert-parallel ranks: give a "
                "number of experts that the expert-parallel degree divides"
            )
        share = count // experts.size
        local = param.detach()[experts.rank * share : (experts.rank + 1) * share].clone()
        whole = DTensor.from_local(local, experts.mesh, [Shard(0)], run_check=False, shape=param.shape,
                                   stride=param.stride())  # fmt: skip
        setattr(module, name, nn.Parameter(whole, requires_grad=param.requires_grad))


def split_experts(partitions: Mapping[int, nn.Module], experts: ExpertGroup) -> int:
    """Split the experts of this rank's stages over ``experts`` (each module with
    ``gpipe_split_experts``); how many modules split."""
    count = 0
    for partition in partitions.values():
        for module in partition.modules():
            split = getattr(module, "gpipe_split_experts", None)
            if callable(split):
                split(experts)
                count += 1
    return count


def exchange(rows: Tensor, experts: ExpertGroup, send: list[int], receive: list[int]) -> Tensor:
    """All-to-all of ``rows`` (R, D) over the expert-parallel group, with autograd: ``send[j]`` rows
    (in order) to rank j, ``receive[j]`` from rank j, concatenated in rank order."""
    from torch.distributed import _functional_collectives as funcol  # (torch's differentiable all-to-all)

    with collective("all-to-all of the tokens over the expert-parallel group", experts.group):
        done = funcol.all_to_all_single_autograd(rows.contiguous(), receive, send, experts.group)
        waited: Tensor = funcol.wait_tensor(done)  # type: ignore[no-untyped-call]
    return waited
