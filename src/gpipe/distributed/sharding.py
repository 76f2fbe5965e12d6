"""Sharded data parallelism for a pipeline's stages: each stage's parameters, gradients and optimizer
state split over its data-parallel group by torch's ``fully_shard`` (FSDP2), instead of replicated.

Between steps a stage holds only its shard of every parameter (a ``DTensor`` sharded on dim 0 over
the ``"dp"`` dimension of the pipeline's mesh); the optimizer, built from ``Pipeline.parameters()``,
keeps state for the shard alone. The step's schedule says when the whole parameters exist: its
stage-wide actions (:data:`gpipe.schedule.ir.STAGE_WIDE`), placed by :func:`gpipe.schedule.ir.sharded`:

- ``U(s)`` before the stage's first action: one all-gather of the stage's parameters (all of them in
  one FSDP parameter group), once per step, not once per micro-batch;
- ``G(s)`` after its last backward (B, or W under a zero-bubble schedule): one reduce-scatter of the
  gradients every micro-batch accumulated into the gathered parameters, summed (each replica's loss
  is already scaled by its share of the global mini-batch) into the shards' ``.grad``;
- ``R(s)`` after that: the gathered parameters freed, the shards registered again.

FSDP normally drives itself from hooks around the module's forward. A stage runs its layers one by
one (see :mod:`gpipe.runtime.stage`), so the sharded module here is a *holder* of the partition that
is never called: no FSDP hook ever fires, and the schedule's actions call FSDP's own unshard,
post-backward and reshard instead (the same entry points ``torch.distributed.pipelining`` calls for
its UNSHARD / REDUCE_GRAD / RESHARD actions; two of them are private, named in one place here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from gpipe.distributed.experts import is_split_expert
from gpipe.distributed.failure import collective
from gpipe.schedule.ir import Action, ActionKind

__all__ = ["StageSharding"]


class _Holder(nn.Module):
    """The unit FSDP shards: one stage's partition, never called."""

    def __init__(self, partition: nn.Module) -> None:
        super().__init__()
        self.partition = partition


class StageSharding:
    """This rank's stages sharded over the data-parallel mesh ``mesh`` (1-D), run by the schedule's
    U, G and R actions (:meth:`run`)."""

    def __init__(
        self, partitions: Mapping[int, nn.Module], mesh: DeviceMesh, *, materialize: Callable[[], None] | None = None
    ) -> None:
        """``materialize``: for partitions left on the meta device, called once they are sharded
        (their parameters DTensors of this rank's shards), to give them storage and values. Experts
        split over an expert-parallel group (:mod:`gpipe.distributed.experts`) are split already:
        FSDP leaves them alone."""
        self._group = mesh.get_group()
        self._holders: dict[int, FSDPModule] = {}
        for s, partition in partitions.items():
            split = {p for p in partition.parameters() if is_split_expert(p)}
            if not any(p not in split for p in partition.parameters()):
                continue  # nothing to shard: U, G and R are no-ops for it
            holder = fully_shard(_Holder(partition), mesh=mesh, reshard_after_forward=False, ignored_params=split)
            # A sum (the losses are scaled already), reduced as a plain SUM (gloo has no PREMUL_SUM).
            holder.set_gradient_divide_factor(1.0)
            holder.set_force_sum_reduction_for_comms(True)
            self._holders[s] = holder
        if materialize is not None:
            materialize()
        for holder in self._holders.values():
            state: Any = fully_shard.state(holder)  # type: ignore[attr-defined]
            state._lazy_init()  # what FSDP's first forward would do (its root pre-forward)

    def run(self, action: Action) -> None:
        """Run a stage-wide action of the schedule."""
        holder = self._holders.get(action.stage)
        if holder is None:
            return
        if action.kind is ActionKind.UNSHARD:
            with collective(
                f"all-gather of stage {action.stage}'s parameters over its data-parallel group", self._group
            ):
                holder.unshard()
        elif action.kind is ActionKind.REDUCE_GRAD:
            holder.set_requires_gradient_sync(True)
            holder.set_is_last_backward(True)
            holder.set_reshard_after_backward(False)  # R frees them
            state: Any = fully_shard.state(holder)  # type: ignore[attr-defined]
            with collective(
                f"reduce-scatter of stage {action.stage}'s gradients over its data-parallel group", self._group
            ):
                state._root_post_backward_final_callback()
        elif action.kind is ActionKind.RESHARD:
            holder.reshard()
        else:
            raise ValueError(f"{action} is not a stage-wide action (U, G or R)")
