"""Where every stage lives: the schedule's stage → worker map, and each worker's device or rank.

A schedule says which worker holds each stage (``Schedule.placement``); a :class:`Placement` adds
what a worker is here — a device of this process, or a rank of torch.distributed (with the ranks of
every data-parallel replica). It is derived once, when a pipeline is built, and read by everything
that places stages: partitioning (which layers to materialize where), tied parameters (which ranks
hold copies), saving (which stages this process writes) and the executor's transports (which hand-
overs cross a process). No other module knows a rule such as "stage ``s`` on worker ``s mod K``".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Placement"]

_META = torch.device("meta")


@dataclass(frozen=True)
class Placement:
    """``worker_of[s]``: the worker of stage ``s``; ``devices[w]``: worker ``w``'s device in this
    process (``'meta'`` for a worker another process runs).

    Under torch.distributed ``replicas`` lists, per data-parallel replica, the global rank of each
    worker, and ``rank`` is this process's worker; in one process ``replicas`` is empty and every
    worker runs here; ``replica`` is this process's replica."""

    worker_of: tuple[int, ...]
    devices: tuple[torch.device, ...]
    replicas: tuple[tuple[int, ...], ...] = ()
    rank: int | None = None
    replica: int = 0

    @staticmethod
    def distributed(
        worker_of: Sequence[int], device: torch.device, replicas: Sequence[Sequence[int]], global_rank: int
    ) -> Placement:
        """This process runs the worker whose global rank is ``global_rank`` in its replica, on
        ``device``; ``replicas`` lists each replica's rank of every worker."""
        ranks = tuple(tuple(r) for r in replicas)
        workers = max(worker_of) + 1
        mine = [r for r in ranks if global_rank in r]
        if len(mine) != 1 or any(len(r) != workers for r in ranks):
            raise ValueError(
                f"rank {global_rank}: the replicas {ranks} do not each list the ranks of the {workers} "
                "workers the schedule places stages on"
            )
        rank = mine[0].index(global_rank)
        devices = tuple(device if w == rank else _META for w in range(workers))
        return Placement(tuple(worker_of), devices, ranks, rank, ranks.index(mine[0]))

    @property
    def num_stages(self) -> int:
        return len(self.worker_of)

    @property
    def num_workers(self) -> int:
        return len(self.devices)

    @property
    def is_distributed(self) -> bool:
        return self.rank is not None

    @property
    def local_workers(self) -> tuple[int, ...]:
        """The workers this process runs."""
        return (self.rank,) if self.rank is not None else tuple(range(self.num_workers))

    @property
    def local_stages(self) -> tuple[int, ...]:
        """The stages this process holds, in pipeline order."""
        workers = set(self.local_workers)
        return tuple(s for s, w in enumerate(self.worker_of) if w in workers)

    def holds(self, stage: int) -> bool:
        return self.worker_of[stage] in self.local_workers

    def device_of(self, stage: int) -> torch.device:
        """The device of stage ``stage`` here (``'meta'`` when another process holds it)."""
        return self.devices[self.worker_of[stage]]

    @property
    def stage_devices(self) -> list[torch.device]:
        return [self.device_of(s) for s in range(self.num_stages)]

    @property
    def pipeline_ranks(self) -> tuple[int, ...]:
        """This replica's global rank of every worker (under torch.distributed)."""
        if self.rank is None:
            raise ValueError("a pipeline in one process has no ranks")
        return self.replicas[self.replica]

    def rank_of(self, stage: int, replica: Sequence[int] | None = None) -> int:
        """The global rank holding ``stage`` (in ``replica``, by default this process's)."""
        return (replica if replica is not None else self.pipeline_ranks)[self.worker_of[stage]]
