"""A decode's messages between ranks (:mod:`gpipe.runtime.decoding` under torch.distributed).

Decoding sends each group's step from stage to stage, like a training step's forwards, and the last
stage's choice back to the first stage; how many steps there are is known only at the end. So the
channels carry self-describing messages — what the message tells the stage, the micro-batch and the
stage (plain numbers, which travel in the layout, in host memory), the cached rows to keep, the
stage's input — and each rank, once its worker is done, closes its outgoing channels with a closing
message and reads its incoming ones to theirs. As in a training step, the compute thread posts every
send at once and receives a channel's messages in order when it needs one, keeping those ahead of it
(:mod:`gpipe.distributed.wire`). The channels are the pipeline's
(:class:`~gpipe.distributed.channels.ChannelTransport`), and one from the last stage's rank to the
first stage's, made on the first decode (collectively: every rank decodes alike). Failures are
reported and watched for as in a training step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpipe.distributed.channels import ChannelTransport, PeerMailbox
from gpipe.distributed.failure import PipelineError
from gpipe.distributed.wire import Channel, make_channel
from gpipe.microbatch import Batch
from gpipe.runtime.decoding import DecodeTrace, Message, Streams
from gpipe.runtime.executor import AbortedError, Mailbox

__all__ = ["ChannelStreams"]

_CLOSE = -1
Key = tuple[str, int, int]


def _encode(key: Key, message: Message) -> Batch:
    """A message as a batch whose header values are plain numbers: they travel in the layout, in host
    memory, so reading them synchronizes no device."""
    control, rows, payload = message
    if payload is None:
        return Batch((control, key[1], key[2], False, rows), None)
    return Batch((control, key[1], key[2], True, rows, *payload.values), payload.spec, payload.skips)


def _decode(batch: Batch) -> tuple[Key, int, Message]:
    control, m, s, has, rows = batch.values[:5]
    payload = Batch(batch.values[5:], batch.spec, batch.skips) if has else None
    return ("act", m, s), control, (control, rows, payload)


def _more(values: list[Any]) -> bool:
    """Whether a message follows this one on its channel: any but the closing one."""
    return bool(values[0] != _CLOSE)


class _Outbox(PeerMailbox):
    """A decode's mailbox on one rank: a message for a stage on another rank is posted on the channel
    to that stage's worker at once; one from another rank is received when asked for, reading the
    channel its stage's input comes by in order (the messages ahead of it kept) until it arrives."""

    def __init__(
        self, worker_of: tuple[int, ...], me: int, out: dict[int, Channel], into: dict[int, Channel], lost: Any
    ) -> None:
        super().__init__(lost)
        self.worker_of, self.me, self.out, self.into = worker_of, me, out, into
        self.open = set(into.values())  # the incoming channels whose closing message has not come
        for channel in self.open:
            self._guard(channel.src, channel.expect)

    def put(self, key: Key, value: Any) -> None:
        worker = self.worker_of[key[2]]
        if worker == self.me:
            super().put(key, value)
        else:
            self._guard(self.out[worker].dst, self.out[worker].post, _encode(key, value))

    def get(self, key: Key) -> Any:
        s = key[2]
        channel = self.into.get(self.worker_of[s - 1])  # (stage 0's input comes from the last stage)
        if channel is None or self.worker_of[s - 1] == self.me:
            return super().get(key)
        while key not in self._items:
            if channel not in self.open:
                raise RuntimeError(f"{channel} closed before it brought {key}")
            self._receive(channel)
        return self._items.pop(key)

    def _receive(self, channel: Channel) -> None:
        received = self._guard(channel.src, channel.receive, self._failed, _more)
        assert isinstance(received, Batch)
        key, control, message = _decode(received)
        if control == _CLOSE:
            self.open.discard(channel)
        else:
            self._items[key] = message

    def close(self) -> None:
        """This rank's last message sent: close its channels, read the others to their end, and see
        every send through."""
        for channel in self.out.values():
            self._guard(channel.dst, channel.post, _encode(("act", 0, 0), (_CLOSE, None, None)))
        while self.open:
            self._receive(next(iter(self.open)))
        for channel in self.out.values():
            self._guard(channel.dst, channel.flush, self._failed)


class ChannelStreams(Streams):
    """A decode's messages over ``transport``'s channels (see the module's docstring)."""

    def __init__(self, transport: ChannelTransport) -> None:
        self.transport = transport
        placement = transport.placement
        worker_of = placement.worker_of
        first, last = worker_of[0], worker_of[-1]
        channels = transport._channels
        # the last stage's choice back to the first stage: a channel of its own, unless the pipeline's
        # activations already go that way (told by the placement, alike on every rank: creating is collective)
        stages = range(len(worker_of) - 1)
        if first != last and not any(worker_of[s] == last and worker_of[s + 1] == first for s in stages):
            for ranks in placement.replicas:
                channel = make_channel(ranks[last], ranks[first], "act", transport.device, transport.timeout)
                if channel is not None:
                    channels[(last, first, "act")] = channel

    @staticmethod
    def of(transport: ChannelTransport) -> ChannelStreams:
        """The streams over ``transport`` (made once per pipeline)."""
        found = getattr(transport, "_decode_streams", None)
        if found is None:
            found = ChannelStreams(transport)
            transport._decode_streams = found  # type: ignore[attr-defined]
        return found

    def _links(self) -> tuple[dict[int, Channel], dict[int, Channel]]:
        """This rank's outgoing channels by destination worker, and its incoming ones by source worker."""
        placement = self.transport.placement
        me, worker_of = placement.rank, placement.worker_of
        n = len(worker_of)
        out: dict[int, Channel] = {}
        into: dict[int, Channel] = {}
        for s in range(n):
            nxt = worker_of[(s + 1) % n]
            if worker_of[s] == nxt:
                continue
            channel = self.transport._channels.get((worker_of[s], nxt, "act"))
            if worker_of[s] == me and channel is not None:
                out[nxt] = channel
            elif nxt == me and channel is not None:
                into[worker_of[s]] = channel
        return out, into

    @contextmanager
    def open(self, groups: int, trace: DecodeTrace) -> Iterator[Mailbox]:
        placement = self.transport.placement
        assert placement.rank is not None
        out, into = self._links()
        transport = self.transport
        box: _Outbox | None = None

        def lost(peer: int, exc: Exception) -> str:
            assert box is not None
            return transport._lost(peer, exc, box)

        box = mailbox = _Outbox(placement.worker_of, placement.rank, out, into, lost)
        try:
            with transport._watching(mailbox):
                yield mailbox
                mailbox.close()
        except BaseException as exc:
            transport._report(f"rank {transport._world.rank} failed: {type(exc).__name__}: {exc}", exc)
            mailbox.fail(str(exc))
            if isinstance(exc, AbortedError):
                raise PipelineError(str(exc)) from exc.__cause__
            raise
        failure = transport._failure()
        if failure is not None:
            raise PipelineError(failure)
