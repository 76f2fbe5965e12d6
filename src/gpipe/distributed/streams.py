"""A decode's messages between ranks (:mod:`gpipe.runtime.decoding` under torch.distributed).

Decoding sends each group's step from stage to stage, like a training step's forwards, and the last
stage's choice back to the first stage; how many steps there are is known only at the end. So the
channels carry self-describing messages — a header (what the message tells the stage, the
micro-batch, the stage), the cached rows to keep, the stage's input — and a sender stops after the
last message of its worker, with a closing message its receiver stops at. The channels are the
pipeline's (:class:`~gpipe.distributed.channels.ChannelTransport`), and one from the last stage's
rank to the first stage's, made on the first decode (collectively: every rank decodes alike).
Failures are reported and watched for as in a training step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpipe.distributed.channels import ChannelTransport, _Channel
from gpipe.distributed.failure import PipelineError
from gpipe.microbatch import Batch
from gpipe.runtime.decoding import DecodeTrace, Message, Streams
from gpipe.runtime.executor import Mailbox

__all__ = ["ChannelStreams"]

_CLOSE = -1
Key = tuple[str, int, int]


@dataclass
class _Run:  # what the transport's failure handling needs of a step
    mailbox: Mailbox


class _Outbox(Mailbox):
    """A mailbox whose messages for stages on other ranks leave through a channel's sender."""

    def __init__(self, worker_of: tuple[int, ...], me: int, queues: dict[int, queue.Queue[Any]]) -> None:
        super().__init__()
        self.worker_of, self.me, self.queues = worker_of, me, queues

    def put(self, key: Key, value: Any) -> None:
        worker = self.worker_of[key[2]]
        if worker == self.me:
            super().put(key, value)
        else:
            self.queues[worker].put((key, value))


def _encode(key: Key, message: Message) -> Batch:
    control, rows, payload = message
    header = torch.tensor([control, key[1], key[2], payload is not None], dtype=torch.long)
    if payload is None:
        return Batch((header, rows), None)
    return Batch((header, rows, *payload.values), payload.spec, payload.skips)


def _decode(batch: Batch) -> tuple[Key, int, Message]:
    header, rows = batch.values[0], batch.values[1]
    control, m, s, has = (int(v) for v in header.tolist())
    payload = Batch(batch.values[2:], batch.spec, batch.skips) if has else None
    return ("act", m, s), control, (control, rows, payload)


class ChannelStreams(Streams):
    """A decode's messages over ``transport``'s channels (see the module's docstring)."""

    def __init__(self, transport: ChannelTransport) -> None:
        self.transport = transport
        placement = transport.placement
        worker_of = placement.worker_of
        first, last = worker_of[0], worker_of[-1]
        channels = transport._channels
        if first != last:  # the last stage's choice back to the first stage
            me = dist.get_rank()
            for ranks in placement.replicas:
                if (last, first, "act") in channels:
                    break
                group = dist.new_group(
                    sorted({ranks[last], ranks[first]}), timeout=timedelta(seconds=transport.timeout)
                )
                if me in ranks:
                    device = next(iter(channels.values())).device if channels else torch.device("cpu")
                    channels[(last, first, "act")] = _Channel(ranks[last], ranks[first], "act", group, device)

    @staticmethod
    def of(transport: ChannelTransport) -> ChannelStreams:
        """The streams over ``transport`` (made once per pipeline)."""
        found = getattr(transport, "_decode_streams", None)
        if found is None:
            found = ChannelStreams(transport)
            transport._decode_streams = found  # type: ignore[attr-defined]
        return found

    def _links(self) -> tuple[dict[int, _Channel], list[_Channel]]:
        """This rank's outgoing channels by destination worker, and its incoming ones."""
        placement = self.transport.placement
        me, worker_of = placement.rank, placement.worker_of
        n = len(worker_of)
        out: dict[int, _Channel] = {}
        into: dict[int, _Channel] = {}
        for s in range(n):
            nxt = worker_of[(s + 1) % n]
            if worker_of[s] == nxt:
                continue
            channel = self.transport._channels.get((worker_of[s], nxt, "act"))
            if worker_of[s] == me and channel is not None:
                out[nxt] = channel
            elif nxt == me and channel is not None:
                into[worker_of[s]] = channel
        return out, list(into.values())

    @contextmanager
    def open(self, groups: int, trace: DecodeTrace) -> Iterator[Mailbox]:
        placement = self.transport.placement
        assert placement.rank is not None
        out, into = self._links()
        queues: dict[int, queue.Queue[Any]] = {w: queue.Queue() for w in out}
        mailbox = _Outbox(placement.worker_of, placement.rank, queues)
        run = _Run(mailbox)
        threads = [
            threading.Thread(target=self._sender, args=(out[w], queues[w], run), daemon=True, name="gpipe-send")
            for w in out
        ] + [threading.Thread(target=self._receiver, args=(c, run), daemon=True, name="gpipe-recv") for c in into]
        for t in threads:
            t.start()
        transport = self.transport
        try:
            with transport._watching(run):  # type: ignore[arg-type]
                yield mailbox
            for t in threads:
                t.join(transport.timeout)
                if t.is_alive():
                    raise PipelineError(
                        f"rank {transport._world.rank}: a transfer did not finish in {transport.timeout:g} s"
                    )
        except BaseException as exc:
            transport._report(f"rank {transport._world.rank} failed: {type(exc).__name__}: {exc}", exc)
            mailbox.fail(str(exc))
            for q in queues.values():
                q.put(None)
            raise
        failure = transport._failure()
        if failure is not None:
            raise PipelineError(failure)

    def finished(self, worker: int, mailbox: Mailbox) -> None:
        assert isinstance(mailbox, _Outbox)
        for q in mailbox.queues.values():
            q.put(None)

    def _sender(self, channel: _Channel, q: queue.Queue[Any], run: _Run) -> None:
        try:
            while True:
                item = q.get()
                if item is None:
                    if run.mailbox.failed is None:
                        channel.send(_encode(("act", 0, 0), (_CLOSE, None, None)))
                    return
                channel.send(_encode(*item))
        except Exception as exc:  # the peer is gone
            self.transport._lost(channel.dst, exc, run)  # type: ignore[arg-type]

    def _receiver(self, channel: _Channel, run: _Run) -> None:
        try:
            while True:
                received = channel.recv()
                assert isinstance(received, Batch)
                key, control, message = _decode(received)
                if control == _CLOSE:
                    return
                run.mailbox.put(key, message)
        except Exception as exc:
            self.transport._lost(channel.src, exc, run)  # type: ignore[arg-type]
