"""One process per stage over torch.distributed: the distributed executor.

Every rank runs its own list of actions from the same schedule IR, in the calling thread, with the
same code as the local executor; only the hand-over between stages differs. An activation or a
gradient whose consumer lives on another rank travels over a *channel*: one per (source rank,
destination rank, activations|gradients), each with its own two-rank process group, so that every
communicator carries messages one way, in one order (which NCCL needs). A sender thread per outgoing
channel sends as soon as an action has produced (the compute thread never waits for a send); a
receiver thread per incoming channel posts the next receive as soon as the previous one completed,
in the order the producing rank sends (read off the schedule), and leaves what arrives in the
mailbox the actions read from. Communication therefore overlaps compute.

The wire format of a message: an 8-byte header (0 when the message's layout — dtypes, shapes, the
values that are not tensors, which values need a gradient — is the one the channel last carried,
else the length of the new layout), the layout if it changed (pickled), then every tensor's bytes.
Layouts are thus exchanged once and cached per channel, and renegotiated when the input shape
changes. Any dtype travels, as raw bytes.

Failures: a rank whose step raises (or which loses a peer) records the failure in the process
group's store; every other rank watches the store during a step and stops its step with a
:class:`PipelineError` naming the failed rank. Point-to-point operations time out (``timeout``) so
that a hung rank cannot hang the others forever.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.executor import LocalExecutor, StepRun, _AbortedError, _Mailbox
from gpipe.memory import ActivationMeter
from gpipe.microbatch import Batch
from gpipe.schedule.ir import ActionKind, Schedule
from gpipe.stage import Stage, StepContext

__all__ = ["DistributedExecutor", "PipelineError", "init_from_env"]

_FAILURE_KEY = "gpipe/failure"
Key = tuple[str, int, int]


class PipelineError(RuntimeError):
    """A rank of the pipeline failed; raised on every other rank, naming it."""


def init_from_env(timeout: float = 60.0) -> bool:
    """Initialize the default process group from torchrun's environment (``WORLD_SIZE`` > 1), with
    NCCL when there is a GPU and gloo otherwise. Returns whether the process is distributed."""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout))
    atexit.register(_shutdown)
    return True


def _shutdown() -> None:
    """Destroy the process group gpipe created, at interpreter exit."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# The wire format.


def _layout(value: Batch | tuple[Tensor | None, ...]) -> tuple[bytes, list[Tensor]]:
    values = value.values if isinstance(value, Batch) else value
    items: list[tuple[Any, ...]] = []
    tensors: list[Tensor] = []
    for v in values:
        if isinstance(v, Tensor):
            items.append(("t", str(v.dtype).removeprefix("torch."), tuple(v.shape)))
            tensors.append(v)
        else:
            items.append(("v", v))
    atomic, skips, flags = (
        (value.atomic, value.skips, value.needs_grad) if isinstance(value, Batch) else (None, (), None)
    )
    return pickle.dumps((atomic, skips, flags, items)), tensors


def _as_bytes(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class _Channel:
    """One direction of traffic between two ranks, with its own process group."""

    def __init__(self, src: int, dst: int, kind: str, group: Any, device: torch.device) -> None:
        self.src, self.dst, self.kind, self.group, self.device = src, dst, kind, group, device
        self.sent_layout: bytes | None = None
        self.received_layout: bytes | None = None

    def __repr__(self) -> str:
        return f"channel {self.kind} rank {self.src} -> rank {self.dst}"

    def send(self, value: Batch | tuple[Tensor | None, ...]) -> None:
        layout, tensors = _layout(value)
        changed = layout != self.sent_layout
        header = torch.tensor([len(layout) if changed else 0], dtype=torch.int64, device=self.device)
        dist.send(header, self.dst, group=self.group)
        if changed:
            dist.send(
                torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(self.device), self.dst, group=self.group
            )
            self.sent_layout = layout
        for t in tensors:
            if t.numel():
                dist.send(_as_bytes(t.to(self.device)), self.dst, group=self.group)

    def recv(self) -> Batch | tuple[Tensor | None, ...]:
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(header, self.src, group=self.group)
        if int(header.item()):
            raw = torch.empty(int(header.item()), dtype=torch.uint8, device=self.device)
            dist.recv(raw, self.src, group=self.group)
            self.received_layout = raw.cpu().numpy().tobytes()
        if self.received_layout is None:
            raise RuntimeError(f"{self}: first message carried no layout")
        atomic, skips, flags, items = pickle.loads(self.received_layout)
        values: list[Any] = []
        for item in items:
            if item[0] == "v":
                values.append(item[1])
                continue
            dtype, shape = getattr(torch, item[1]), item[2]
            t = torch.empty(shape, dtype=dtype, device=self.device)
            if t.numel():
                dist.recv(_as_bytes(t), self.src, group=self.group)
            values.append(t)
        return tuple(values) if atomic is None else Batch(tuple(values), atomic, skips, flags)


class _RoutedMailbox(_Mailbox):
    """A mailbox whose letters for stages on other ranks leave through a channel's sender."""

    def __init__(self, outgoing: dict[Key, queue.Queue[tuple[Key, Any] | None]]) -> None:
        super().__init__()
        self._outgoing = outgoing

    def put(self, key: Key, value: Any) -> None:
        out = self._outgoing.get(key)
        if out is None:
            super().put(key, value)
        else:
            out.put((key, value))


@dataclass
class _Topology:
    rank: int  # this rank's place in the pipeline (its worker index)
    ranks: Sequence[int]  # global rank of every worker


class DistributedExecutor(LocalExecutor):
    """Runs this rank's part of a schedule; ``stages`` are the stages this rank holds, among
    ``num_stages``; stage ``s`` runs on pipeline rank ``s mod K``."""

    def __init__(
        self,
        stages: Sequence[Stage],
        num_stages: int,
        *,
        replicas: Sequence[Sequence[int]],
        device: torch.device,
        timeout: float = 60.0,
    ) -> None:
        """``replicas`` lists, for every data-parallel replica of the pipeline, the global ranks of
        its K workers in pipeline order (one replica without data parallelism)."""
        super().__init__(stages)
        self.num_stages = num_stages
        self.device = device
        self.timeout = timeout
        me = dist.get_rank()
        (self.pipeline_ranks,) = [list(r) for r in replicas if me in r]
        self.rank = self.pipeline_ranks.index(me)
        self._store = dist.distributed_c10d._get_default_store()
        self._channels: dict[tuple[int, int, str], _Channel] = {}
        comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
        # new_group is collective over all ranks: every rank creates every replica's groups, in order.
        for ranks in replicas:
            k = len(ranks)
            made: set[tuple[int, int, str]] = set()
            for s in range(num_stages - 1):
                a, b = s % k, (s + 1) % k
                for src, dst, kind in ((a, b, "act"), (b, a, "grad")):
                    if src == dst or (src, dst, kind) in made:
                        continue
                    made.add((src, dst, kind))
                    group = dist.new_group(sorted({ranks[src], ranks[dst]}), timeout=timedelta(seconds=timeout))
                    if me in ranks:
                        self._channels[(src, dst, kind)] = _Channel(ranks[src], ranks[dst], kind, group, comm_device)

    def worker_of(self, stage: int) -> int:
        return stage % len(self.pipeline_ranks)

    def _route(self, schedule: Schedule) -> tuple[dict[_Channel, list[Key]], dict[_Channel, list[Key]]]:
        """Per channel, the keys this rank sends and receives over it, in the order they travel."""
        sends: dict[_Channel, list[Key]] = {}
        recvs: dict[_Channel, list[Key]] = {}
        for w, actions in enumerate(schedule.actions):
            for a in actions:
                if a.kind is ActionKind.FORWARD and a.stage + 1 < self.num_stages:
                    key, dst, kind = ("act", a.microbatch, a.stage + 1), self.worker_of(a.stage + 1), "act"
                elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and a.stage > 0:
                    key, dst, kind = ("grad", a.microbatch, a.stage - 1), self.worker_of(a.stage - 1), "grad"
                else:
                    continue
                if dst == w:
                    continue
                channel = self._channels[(w, dst, kind)]
                if w == self.rank:
                    sends.setdefault(channel, []).append(key)
                elif dst == self.rank:
                    recvs.setdefault(channel, []).append(key)
        return sends, recvs

    def run(self, schedule: Schedule, run: StepRun, *, inline: bool = False) -> None:
        """Run this rank's actions of ``schedule``, exchanging with the other ranks."""
        if schedule.num_workers != len(self.pipeline_ranks):
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_workers} workers, "
                f"the pipeline {len(self.pipeline_ranks)} ranks"
            )
        actions = schedule.actions[self.rank]
        with self._watching(run), self.watching_randomness(), run.ctx.applied(self.device):
            for action in actions:
                try:
                    self._execute(self.rank, action, run)
                except _AbortedError as exc:
                    raise PipelineError(str(exc)) from None
            self._finish(actions, run)

    def step(
        self, schedule: Schedule, batches: Sequence[Batch], ctx: StepContext, *, measure_memory: bool = False
    ) -> tuple[StepRun, list[Batch]]:
        """This rank's part of a training step; the (scaled) losses on the last stage's rank, else []."""
        meter = self.meter_for(schedule) if measure_memory else None
        return self._step(schedule, batches, ctx, split=self.split_of(schedule), meter=meter)

    def forward(self, schedule: Schedule, batches: Sequence[Batch], ctx: StepContext) -> tuple[StepRun, list[Batch]]:
        """This rank's forwards; the last stage's outputs on its rank, else []."""
        return self._step(schedule.only(ActionKind.FORWARD), batches, ctx, split=frozenset(), meter=None)

    def _step(
        self,
        schedule: Schedule,
        batches: Sequence[Batch],
        ctx: StepContext,
        *,
        split: frozenset[tuple[int, int]],
        meter: ActivationMeter | None,
    ) -> tuple[StepRun, list[Batch]]:
        sends, recvs = self._route(schedule)
        queues = {channel: queue.Queue[tuple[Key, Any] | None]() for channel in sends}
        outgoing = {key: queues[channel] for channel, keys in sends.items() for key in keys}
        run = StepRun(ctx, split=split, meter=meter, mailbox=_RoutedMailbox(outgoing))
        if any(a.kind is not ActionKind.FORWARD for a in schedule):
            self._seed(run, batches)
        elif 0 in self.stages:
            for m, batch in enumerate(batches):
                run.mailbox.put(("act", m, 0), batch)
        threads = [
            threading.Thread(target=self._sender, args=(c, q, len(sends[c]), run), daemon=True, name="gpipe-send")
            for c, q in queues.items()
        ] + [
            threading.Thread(target=self._receiver, args=(c, keys, run), daemon=True, name="gpipe-recv")
            for c, keys in recvs.items()
        ]
        for t in threads:
            t.start()
        try:
            self.run(schedule, run)
            for t in threads:
                t.join(self.timeout)
                if t.is_alive():
                    raise PipelineError(f"rank {dist.get_rank()}: a transfer did not finish in {self.timeout:g} s")
        except BaseException as exc:
            self._report(f"rank {dist.get_rank()} failed: {type(exc).__name__}: {exc}", exc)
            run.mailbox.fail(str(exc))
            raise
        failure = self._failure()
        if failure is not None:
            raise PipelineError(failure)
        if self.num_stages - 1 not in self.stages:
            return run, []
        return run, [run.mailbox.get(("act", m, self.num_stages)) for m in range(len(batches))]

    # Threads of a step.

    def _sender(self, channel: _Channel, q: queue.Queue[tuple[Key, Any] | None], count: int, run: StepRun) -> None:
        try:
            for _ in range(count):
                item = q.get()
                if item is None:
                    return
                channel.send(item[1])
        except Exception as exc:  # the peer is gone
            self._lost(channel.dst, exc, run)

    def _receiver(self, channel: _Channel, keys: list[Key], run: StepRun) -> None:
        try:
            for key in keys:
                run.mailbox.put(key, channel.recv())
        except Exception as exc:
            self._lost(channel.src, exc, run)

    def _lost(self, peer: int, exc: Exception, run: StepRun) -> None:
        self._report(f"rank {peer} is gone (rank {dist.get_rank()} lost its connection: {exc})", exc)
        run.mailbox.fail(self._failure() or f"rank {peer} is gone")

    def _report(self, message: str, exc: BaseException | None = None) -> None:
        """Record the first failure of the step in the store, for every rank to read."""
        if isinstance(exc, PipelineError):  # someone else's, already recorded
            return
        with contextlib.suppress(Exception):  # the store may be gone with rank 0; the local error still surfaces
            self._store.compare_set(_FAILURE_KEY, "", message)

    def _failure(self) -> str | None:
        try:
            if self._store.check([_FAILURE_KEY]):
                value = self._store.get(_FAILURE_KEY).decode()
                return value or None
        except Exception as exc:
            return f"the process group's store is unreachable ({exc}); rank 0 may have died"
        return None

    @contextmanager
    def _watching(self, run: StepRun) -> Iterator[None]:
        """While the step runs, watch the store for another rank's failure."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.2):
                failure = self._failure()
                if failure is not None:
                    run.mailbox.fail(failure)
                    return

        watcher = threading.Thread(target=watch, daemon=True, name="gpipe-watchdog")
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()
