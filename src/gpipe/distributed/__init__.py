"""One process per pipeline worker over torch.distributed: the transport between ranks.

Every rank runs its own list of actions from the same schedule IR, in the calling thread, with the
same executor as one process (:class:`gpipe.runtime.executor.Executor`); only the hand-over between stages
differs, and that is this package's :class:`ChannelTransport`. An activation or a
gradient whose consumer lives on another rank travels over a *channel*: one per (source rank,
destination rank, activations|gradients), each with its own two-rank process group, so that every
communicator carries messages one way, in one order (which NCCL needs). The compute thread posts a
send as soon as an action has produced (``isend``: it never waits for it before the step ends), and
receives a channel's messages in the order the producing rank sends them (read off the schedule),
posting the next header's receive ahead: every operation is issued and waited for by the one thread
that computes, in the schedule's order, as NCCL requires (:mod:`gpipe.distributed.wire`, which also
describes the wire format). Transfers overlap compute in the backend (gloo's I/O threads, NCCL's
streams).

Failures: a rank whose step raises (or which loses a peer) records the failure in the process
group's store; every other rank watches the store during a step and stops its step with a
:class:`PipelineError` naming the failed rank — before its next action, or at its current wait.
Point-to-point operations time out (``timeout``) so that a hung rank cannot hang the others forever.
The collectives outside the actions, the heartbeats and the store's host are described in
:mod:`gpipe.distributed.failure`.

Part of the library: imports torch and gpipe's library modules, never the applications (train,
data, models, ...). Modules: ``failure`` (the failure watch), ``wire`` (a channel: its wire format and
operations), ``channels`` (the transport),
``collectives`` (the collectives of a step), ``group`` (the default process group), ``streams`` (a
decode's messages), ``sharding`` (stages sharded over their data-parallel group: FSDP),
``tensor_parallel`` (layers split over the tp group), ``experts`` (experts split over an expert-parallel
group: the all-to-all of a mixture's tokens), ``devices`` (a rank's device and the device of its
collectives; the devices of ``--devices``).
"""

from gpipe.distributed.channels import ChannelTransport
from gpipe.distributed.collectives import Collectives, RankCollectives, tie_name
from gpipe.distributed.devices import choose_devices, comm_device, rank_device
from gpipe.distributed.failure import PipelineError, collective, start_heartbeat, watch_peers
from gpipe.distributed.group import init_from_env
from gpipe.distributed.sharding import StageSharding
from gpipe.distributed.tensor_parallel import TpPlan

__all__ = [
    "ChannelTransport",
    "Collectives",
    "PipelineError",
    "RankCollectives",
    "StageSharding",
    "TpPlan",
    "choose_devices",
    "collective",
    "comm_device",
    "init_from_env",
    "rank_device",
    "start_heartbeat",
    "tie_name",
    "watch_peers",
]
