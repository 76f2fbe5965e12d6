"""The collectives of a step: :class:`Collectives` (in one process: nothing to exchange) and
:class:`RankCollectives` (as one rank of a pipeline and of its data-parallel replicas)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from gpipe.distributed.devices import comm_device
from gpipe.distributed.experts import is_split_expert
from gpipe.distributed.failure import collective
from gpipe.microbatch import batch_size, scatter
from gpipe.rng import step_seed
from gpipe.runtime.placement import Placement
from gpipe.tied import Tie

__all__ = ["Collectives", "RankCollectives", "tie_name"]


def tie_name(tie: Tie) -> str:
    return "/".join(f"{i}.{path}" for i, path in tie.members)


class Collectives:
    """What a step exchanges outside its actions, in one process: nothing; the step's seed is
    drawn here, tied copies' gradients summed here."""

    data_parallel = 1
    dp_rank = 0
    expert_parallel = 1

    def seed(self) -> int:
        """The step's seed (the same on every rank)."""
        return step_seed()

    def share(self, value: Any) -> Any:
        """This replica's share of a global mini-batch (all of it without data parallelism)."""
        return value

    def sync_ties(self, ties: Sequence[Tie]) -> None:
        """Give every copy of a tied parameter the sum of the copies' gradients."""
        for tie in ties:
            tie.sync_grads()

    def reduce_gradients(self, grads: Sequence[Tensor], *, dense: bool = True) -> None:
        """Sum gradients over the data-parallel replicas (``dense=False``: the split experts' alone)."""

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        return [value]

    def loss(self, value: Tensor | None) -> Tensor:
        """The mini-batch loss on every rank, from the last stage's (summed over the replicas)."""
        return self.from_last_stage(value)

    def from_last_stage(self, value: Tensor | None, shape: tuple[int, ...] = ()) -> Tensor:
        """A float tensor of ``shape`` known where the last stage is (``None`` elsewhere), on every
        rank (across ranks as float32; in one process as it is)."""
        if value is None:
            raise ValueError("the last stage runs in this process but gave no value")
        return _shaped(value, shape)


def _shaped(value: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``value`` (detached) as ``shape``, which must hold as many elements."""
    if value.numel() != math.prod(shape):
        raise ValueError(f"from_last_stage: a value of shape {tuple(value.shape)} where {shape} was announced")
    return value.detach().reshape(shape)


class RankCollectives(Collectives):
    """The collectives of a step as one rank of a pipeline (and of its data-parallel replicas)."""

    def __init__(
        self,
        placement: Placement,
        device: torch.device,
        *,
        dp_group: Any,
        pp_group: Any,
        data_parallel: int,
        dp_rank: int | None = None,
        expert_parallel: int = 1,
        expert_dp_group: Any = None,
    ) -> None:
        self.placement, self.device = placement, device
        self.dp_group, self.pp_group = dp_group, pp_group
        # (experts split over an expert-parallel group: their copies are on the ranks of this group)
        self.expert_parallel, self.expert_dp_group = expert_parallel, expert_dp_group
        # (with tensor parallelism a pipeline per (dp, tp) coordinate: the replica is not the dp rank)
        self.data_parallel, self.dp_rank = data_parallel, placement.replica if dp_rank is None else dp_rank
        self._comm_device = comm_device(device)  # (the loss's: where it is, under NCCL)
        # the step's seed in host memory where the group has gloo for it: its read syncs no device
        self._seed_device = torch.device("cpu") if "gloo" in str(dist.get_backend()) else self._comm_device

    def seed(self) -> int:
        t = torch.tensor([step_seed()], dtype=torch.int64, device=self._seed_device)
        with collective("broadcast of the step's seed from rank 0"):
            dist.broadcast(t, src=0)
            return int(t.item())

    def share(self, value: Any) -> Any:
        if self.data_parallel == 1:
            return value
        shares = scatter(value, self.data_parallel)
        if len(shares) < self.data_parallel:
            raise ValueError(
                f"a mini-batch of {batch_size(shares[0]) * len(shares)} cannot be shared by "
                f"{self.data_parallel} data-parallel replicas"
            )
        return shares[self.dp_rank].value

    def sync_ties(self, ties: Sequence[Tie]) -> None:
        for tie in ties:
            with collective(f"all-reduce of tied parameter {tie_name(tie)}'s gradients", tie.group):
                tie.sync_grads()

    def gather(self, value: Any) -> list[Any]:
        found: list[Any] = [None] * dist.get_world_size()
        with collective("all-gather of the measured costs for schedule='auto'"):
            dist.all_gather_object(found, value)
        return found

    def reduce_gradients(self, grads: Sequence[Tensor], *, dense: bool = True) -> None:
        """Sum a stage's gradients over its replicas in one collective (each replica's loss is
        already scaled by its share of the global mini-batch); split experts' over the replicas
        holding the same experts (their all-to-all already brought in the others' tokens).
        ``dense=False``: the split experts' alone (FSDP reduced the others)."""
        experts = [g for g in grads if is_split_expert(g)]
        if dense:
            what = "all-reduce of the gradients over the data-parallel replicas"
            _sum([g for g in grads if not is_split_expert(g)], self.dp_group, what)
        _sum(experts, self.expert_dp_group, "all-reduce of the experts' gradients over their copies")

    def loss(self, value: Tensor | None) -> Tensor:
        if value is not None and self.dp_group is not None:
            value = value.detach().reshape(1).to(self._comm_device)
            with collective("all-reduce of the loss over the data-parallel replicas", self.dp_group):
                dist.all_reduce(value, group=self.dp_group)
            value = value[0]
        return self.from_last_stage(value)

    def from_last_stage(self, value: Tensor | None, shape: tuple[int, ...] = ()) -> Tensor:
        buf = torch.zeros(shape, device=self._comm_device)
        if value is not None:
            buf.copy_(_shaped(value, shape))
        last = self.placement.rank_of(self.placement.num_stages - 1)
        with collective(f"broadcast from the last stage's rank {last}", self.pp_group):
            dist.broadcast(buf, src=last, group=self.pp_group)
            return buf.to(self.device)


def _sum(grads: Sequence[Tensor], group: Any, what: str) -> None:
    """Sum ``grads`` over ``group`` in one all-reduce (none without a group)."""
    if group is None or not grads:
        return
    # Split layers' gradients (tensor parallelism) are DTensors: a replica's peers hold the same shards.
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with collective(what, group):
        dist.all_reduce(flat, group=group)
    for g, reduced in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))
