"""The hand-over between ranks: the wire layout of values, :class:`_Channel` (one direction of
traffic between two ranks), the routed mailbox, and :class:`ChannelTransport` with its sender and
receiver threads.

The wire format of a message: an 8-byte header (0 when the message's layout — dtypes, shapes, the
values that are not tensors, which values need a gradient, the micro-batch's structure (its pytree
spec) — is the one the channel last carried, else the length of the new layout), the layout if it
changed (pickled), then every tensor's bytes.
Layouts are thus exchanged once and cached per channel, and renegotiated when the input shape
changes. Any dtype travels, as raw bytes.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import _pytree as pytree

from gpipe.distributed.failure import (
    PipelineError,
    _failing,
    _first_line,
    _rank,
    _read_failure,
    _report_failure,
    _silent_ranks,
    _timed_out,
    _world,
)
from gpipe.microbatch import Batch, flat_spec, is_flat_spec
from gpipe.runtime.executor import Mailbox, StepRun, Transport
from gpipe.runtime.placement import Placement
from gpipe.schedule.ir import ActionKind, Schedule

__all__ = ["ChannelTransport"]

Key = tuple[str, int, int]


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
    if not isinstance(value, Batch):
        return pickle.dumps((False, None, (), None, items)), tensors
    # The structure travels as a TreeSpec (its node types pickle by reference, as the receiver has
    # the same code); a plain tuple of leaves as its length, the cheap common case.
    spec = value.spec
    structure = None if spec is None else spec.num_leaves if is_flat_spec(spec) else spec
    try:
        return pickle.dumps((True, structure, value.skips, value.needs_grad, items)), tensors
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"cannot send a micro-batch between ranks: its structure "
            f"({'a tensor' if spec is None else pytree.treespec_pprint(spec)}) or one of its values that "
            f"is not a tensor ({', '.join(type(v[1]).__name__ for v in items if v[0] == 'v') or 'none'}) "
            f"does not pickle ({e}); define their classes at module level"
        ) from e


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
        batch, structure, skips, flags, items = pickle.loads(self.received_layout)
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
        if not batch:
            return tuple(values)
        spec = flat_spec(structure) if isinstance(structure, int) else structure
        return Batch(tuple(values), spec, skips, flags)


class _RoutedMailbox(Mailbox):
    """A mailbox whose letters for stages on other ranks leave through a channel's sender."""

    def __init__(
        self,
        outgoing: dict[Key, queue.Queue[tuple[Key, Any] | None]],
        queues: dict[_Channel, queue.Queue[tuple[Key, Any] | None]],
    ) -> None:
        super().__init__()
        self._outgoing = outgoing
        self.queues = queues

    def put(self, key: Key, value: Any) -> None:
        out = self._outgoing.get(key)
        if out is None:
            super().put(key, value)
        else:
            out.put((key, value))


class ChannelTransport(Transport):
    """Moves what a stage on another rank consumes over torch.distributed channels; watches the
    other ranks for failures during a step. Built by every rank alike (creating the channels'
    process groups is collective): one channel per pair of workers and direction that hand-overs
    between consecutive stages cross, in every replica."""

    def __init__(self, placement: Placement, device: torch.device, *, timeout: float = 60.0) -> None:
        if not placement.is_distributed:
            raise ValueError("ChannelTransport moves values between ranks: give it a placement over ranks")
        self.placement = placement
        self.timeout = timeout
        self._world = _world()  # the rank and the store its failure reports name, even after a teardown
        me = self._world.rank
        self._channels: dict[tuple[int, int, str], _Channel] = {}
        comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
        worker_of = placement.worker_of
        # new_group is collective over all ranks: every rank creates every replica's groups, in order.
        for ranks in placement.replicas:
            made: set[tuple[int, int, str]] = set()
            for s in range(placement.num_stages - 1):
                a, b = worker_of[s], worker_of[s + 1]
                for src, dst, kind in ((a, b, "act"), (b, a, "grad")):
                    if src == dst or (src, dst, kind) in made:
                        continue
                    made.add((src, dst, kind))
                    group = dist.new_group(sorted({ranks[src], ranks[dst]}), timeout=timedelta(seconds=timeout))
                    if me in ranks:
                        self._channels[(src, dst, kind)] = _Channel(ranks[src], ranks[dst], kind, group, comm_device)
        self._routes: dict[int, tuple[Schedule, dict[_Channel, list[Key]], dict[_Channel, list[Key]]]] = {}

    def _route(self, schedule: Schedule) -> tuple[dict[_Channel, list[Key]], dict[_Channel, list[Key]]]:
        """Per channel, the keys this rank sends and receives over it, in the order they travel."""
        found = self._routes.get(id(schedule))  # (a step's schedule is a cached object: no hashing of it)
        if found is not None and found[0] is schedule:
            return found[1], found[2]
        sends: dict[_Channel, list[Key]] = {}
        recvs: dict[_Channel, list[Key]] = {}
        me, worker_of, last = self.placement.rank, schedule.placement, schedule.num_stages - 1
        for w, actions in enumerate(schedule.actions):
            for a in actions:
                if a.kind is ActionKind.FORWARD and a.stage < last:
                    key, dst, kind = ("act", a.microbatch, a.stage + 1), worker_of[a.stage + 1], "act"
                elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and a.stage > 0:
                    key, dst, kind = ("grad", a.microbatch, a.stage - 1), worker_of[a.stage - 1], "grad"
                else:
                    continue
                if dst == w:
                    continue
                channel = self._channels[(w, dst, kind)]
                if w == me:
                    sends.setdefault(channel, []).append(key)
                elif dst == me:
                    recvs.setdefault(channel, []).append(key)
        if len(self._routes) > 32:  # a few (schedule, phase) pairs per pipeline
            self._routes.clear()
        self._routes[id(schedule)] = schedule, sends, recvs
        return sends, recvs

    def mailbox(self, schedule: Schedule) -> Mailbox:
        sends, _ = self._route(schedule)
        queues = {channel: queue.Queue[tuple[Key, Any] | None]() for channel in sends}
        outgoing = {key: queues[channel] for channel, keys in sends.items() for key in keys}
        return _RoutedMailbox(outgoing, queues)

    def stopped(self, reason: str) -> BaseException:
        return PipelineError(reason)

    @contextmanager
    def running(self, schedule: Schedule, run: StepRun) -> Iterator[None]:
        """Start the step's senders and receivers, watch the store for another rank's failure, and
        report this rank's own."""
        if schedule.num_workers != self.placement.num_workers:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_workers} workers, "
                f"the pipeline {self.placement.num_workers} ranks"
            )
        sends, recvs = self._route(schedule)
        mailbox = run.mailbox
        assert isinstance(mailbox, _RoutedMailbox)
        threads = [
            threading.Thread(target=self._sender, args=(c, q, len(sends[c]), run), daemon=True, name="gpipe-send")
            for c, q in mailbox.queues.items()
        ] + [
            threading.Thread(target=self._receiver, args=(c, keys, run), daemon=True, name="gpipe-recv")
            for c, keys in recvs.items()
        ]
        for t in threads:
            t.start()
        try:
            with self._watching(run):
                yield
            for t in threads:
                t.join(self.timeout)
                if t.is_alive():
                    raise PipelineError(f"rank {self._world.rank}: a transfer did not finish in {self.timeout:g} s")
        except BaseException as exc:
            self._report(f"rank {self._world.rank} failed: {type(exc).__name__}: {exc}", exc)
            run.mailbox.fail(str(exc))
            raise
        failure = self._failure()
        if failure is not None:
            raise PipelineError(failure)

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
        """A transfer with ``peer`` failed: its socket closed (it is gone), or it timed out (it, or
        a rank it waits for, is stuck: the heartbeats tell which). This may run after the step
        failed, while the process group is torn down: nothing here asks the group."""
        lost = f"{_rank(peer)} is gone"
        if _timed_out(exc):
            silent = None
            with contextlib.suppress(Exception):  # the store is gone: what it holds says so below
                silent = _silent_ranks(timed_out=True)
            lost = silent[0] if silent and silent[0] else f"{_rank(peer)} is not responding"
        me = self._world.rank
        self._report(f"{lost} (rank {me} lost its connection to rank {peer}: {_first_line(exc)})", exc)
        run.mailbox.fail(_read_failure(self._world, min(self.timeout, 2.0)) or lost)

    def _report(self, message: str, exc: BaseException | None = None) -> None:
        """Record the first failure of the step in the store, for every rank to read (waiting for
        the store at most 2 s: a stopped rank 0 stops the store it hosts)."""
        _failing.set()
        if isinstance(exc, PipelineError):  # someone else's, already recorded
            return
        _report_failure(self._world.store, message, min(self.timeout, 2.0))

    def _failure(self) -> str | None:
        """The failure another rank recorded, if any (waiting ``timeout`` at most for the store)."""
        return _read_failure(self._world, self.timeout)

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
