"""The hand-over between ranks: :class:`ChannelTransport`, which routes each key a step hands over
to the :class:`~gpipe.distributed.wire.Channel` that carries it, and the mailbox through which the
compute thread posts and receives them (see :mod:`gpipe.distributed.wire` for the wire format and why
every operation is posted and waited for by the compute thread, in the schedule's order).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

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
from gpipe.distributed.wire import Channel, make_channel
from gpipe.runtime.executor import AbortedError, Mailbox, StepRun, Transport
from gpipe.runtime.placement import Placement
from gpipe.schedule.ir import Schedule
from gpipe.schedule.wire import check_wire, links

__all__ = ["ChannelTransport"]

Key = tuple[str, int, int]
_Send = tuple[Channel, int, int]  # a key's channel, its place among the step's messages there, their number


class PeerMailbox(Mailbox):
    """A mailbox whose letters travel between ranks: a transfer that fails stops the step, naming the
    peer lost (``lost(peer, exception)`` reports it and says why); a failure elsewhere stops its waits."""

    def __init__(self, lost: Any) -> None:
        super().__init__()
        self._lost = lost

    def _failed(self) -> str | None:
        return self.failed

    def _guard(self, peer: int, call: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except AbortedError:
            raise
        except Exception as exc:  # the peer is gone, or timed out
            raise AbortedError(self._lost(peer, exc)) from exc


class _WireMailbox(PeerMailbox):
    """A step's mailbox on one rank: a letter for a stage on another rank is posted on its channel at
    once; a letter from another rank is received when asked for, each channel's messages in the
    sender's order (``order``), those ahead of the one asked for kept until their turn."""

    def __init__(
        self,
        outgoing: dict[Key, _Send],
        order: dict[Channel, list[Key]],
        lost: Any,
    ) -> None:
        super().__init__(lost)
        self._outgoing = outgoing
        self._order = order
        self._incoming = {key: channel for channel, keys in order.items() for key in keys}
        self._next = dict.fromkeys(order, 0)  # per incoming channel: messages finished
        self._started = dict.fromkeys(order, 0)  # messages whose tensors' receives are posted
        for channel in order:  # the first header of each, ahead of need
            self._guard(channel.src, channel.expect)

    def put(self, key: Key, value: Any) -> None:
        send = self._outgoing.get(key)
        if send is None:
            super().put(key, value)
        else:  # (its receiver posted the tensors' receives ahead, with the sizes of the one before, if any)
            channel, i, count = send
            self._guard(channel.dst, channel.post, value, guessed=i > 0, more=i + 1 < count)
        self._start_arrived()

    def get(self, key: Key) -> Any:
        channel = self._incoming.get(key)
        if channel is None:
            return super().get(key)
        keys = self._order[channel]
        while key not in self._items:
            i = self._next[channel]
            if self._started[channel] == i:
                self._start(channel)
            self._start_arrived()  # later messages whose headers are here: they arrive meanwhile
            self._items[keys[i]] = self._guard(channel.src, channel.finish, self._failed)
            self._next[channel] = i + 1
        self._start_arrived()
        return self._items.pop(key)

    def _start(self, channel: Channel) -> None:
        i = self._started[channel]
        more = i + 1 < len(self._order[channel])
        self._guard(channel.src, channel.start, self._failed, lambda _: more, guess=True)
        self._started[channel] = i + 1

    def _start_arrived(self) -> None:
        """Post the tensors' receives of every message whose header is here, ahead of need: the
        transfer overlaps what this rank computes until it needs them."""
        for channel, keys in self._order.items():
            while self._started[channel] < len(keys) and channel.arrived():
                self._start(channel)

    def finish(self) -> None:
        """After this rank's actions: every message received, every send delivered."""
        for channel, keys in self._order.items():
            if self._next[channel] != len(keys):
                raise RuntimeError(f"{channel}: the step consumed {self._next[channel]} of its {len(keys)} messages")
        for channel in {send[0] for send in self._outgoing.values()}:
            self._guard(channel.dst, channel.flush, self._failed)


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
        self.device = device
        self._world = _world()  # the rank and the store its failure reports name, even after a teardown
        self._channels: dict[tuple[int, int, str], Channel] = {}
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
                    channel = make_channel(ranks[src], ranks[dst], kind, device, timeout)
                    if channel is not None:
                        self._channels[(src, dst, kind)] = channel
        self._routes: dict[int, tuple[Schedule, dict[Key, _Send], dict[Channel, list[Key]]]] = {}

    def _route(self, schedule: Schedule) -> tuple[dict[Key, _Send], dict[Channel, list[Key]]]:
        """The channel of each key this rank sends, and per incoming channel the keys it carries, in
        the order they travel (the sender's order of actions: :func:`gpipe.schedule.wire.links`),
        the schedule checked once under NCCL's semantics (:func:`gpipe.schedule.wire.check_wire`)."""
        found = self._routes.get(id(schedule))  # (a step's schedule is a cached object: no hashing of it)
        if found is not None and found[0] is schedule:
            return found[1], found[2]
        check_wire(schedule)
        sends: dict[Key, _Send] = {}
        recvs: dict[Channel, list[Key]] = {}
        me = self.placement.rank
        for (src, dst, kind), keys in links(schedule).items():
            if src == me:
                channel = self._channels[(src, dst, kind)]
                sends.update({key: (channel, i, len(keys)) for i, key in enumerate(keys)})
            elif dst == me:
                recvs[self._channels[(src, dst, kind)]] = list(keys)
        if len(self._routes) > 32:  # a few (schedule, phase) pairs per pipeline
            self._routes.clear()
        self._routes[id(schedule)] = schedule, sends, recvs
        return sends, recvs

    def mailbox(self, schedule: Schedule) -> Mailbox:
        if schedule.num_workers != self.placement.num_workers:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_workers} workers, "
                f"the pipeline {self.placement.num_workers} ranks"
            )
        sends, recvs = self._route(schedule)
        box: _WireMailbox | None = None

        def lost(peer: int, exc: Exception) -> str:
            assert box is not None
            return self._lost(peer, exc, box)

        box = _WireMailbox(sends, recvs, lost)
        return box

    def stopped(self, reason: str) -> BaseException:
        return PipelineError(reason)

    @contextmanager
    def running(self, schedule: Schedule, run: StepRun) -> Iterator[None]:
        """Watch the store for another rank's failure while this rank's actions run (they post and
        receive through the step's mailbox); then see every message through; report this rank's
        own failure."""
        mailbox = run.mailbox
        assert isinstance(mailbox, _WireMailbox)
        try:
            with self._watching(mailbox):
                yield
                mailbox.finish()
        except BaseException as exc:
            self._report(f"rank {self._world.rank} failed: {type(exc).__name__}: {exc}", exc)
            mailbox.fail(str(exc))
            if isinstance(exc, AbortedError):  # a transfer failed, or another rank did: named already
                raise PipelineError(str(exc)) from exc.__cause__
            raise
        failure = self._failure()
        if failure is not None:
            raise PipelineError(failure)

    def _lost(self, peer: int, exc: Exception, mailbox: Mailbox) -> str:
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
        reason = _read_failure(self._world, min(self.timeout, 2.0)) or lost
        mailbox.fail(reason)
        return reason

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
    def _watching(self, mailbox: Mailbox) -> Iterator[None]:
        """While the step runs, watch the store for another rank's failure."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.2):
                failure = self._failure()
                if failure is not None:
                    mailbox.fail(failure)
                    return

        watcher = threading.Thread(target=watch, daemon=True, name="gpipe-watchdog")
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()
