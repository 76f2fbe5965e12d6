"""One direction of traffic between two ranks (:class:`Channel`): the wire format of a value, and
its point-to-point operations, posted and waited for by the thread that computes.

**Why from the compute thread.** Under NCCL a send completes only once its peer posted the matching
receive, a communicator's operations run in the order they were issued, and ``Work.wait()`` makes the
*calling thread's current stream* wait — for any thread, the device's default stream, where the
compute runs. A transfer waited for by a helper thread would stall the compute at an arbitrary point
of its program; one waited for by the compute thread stalls it exactly where the value is needed. So
every operation of a channel is posted (``isend``/``irecv``) and waited for by the rank's one compute
thread, in the order the schedule IR gives; nothing blocks on a send until the step ends.

**Order.** A channel carries one kind (activations or gradients) from one rank to another, on a
process group of its own (an NCCL communicator and stream of its own): it is a FIFO, matched
without tags. The sender posts in its action order; the receiver posts its receives in the *sender's*
order (:class:`gpipe.distributed.channels.ChannelTransport` routes the keys), receiving ahead of
need when a later message comes first, so the two sides always agree. With sends that never block the
sender and receives posted before they are waited for, a schedule that runs in one process (each
worker in order, each action waiting for its inputs) cannot deadlock across ranks either.

**Wire format.** A message is an 8-byte header (0 when the message's layout — dtypes, shapes, the
values that are not tensors, which values need a gradient, the micro-batch's structure — is the one
the channel last carried, else the length of the new layout), the layout if it changed (pickled),
then every tensor's bytes. The header and the layout travel in host memory over gloo (the channel's
group where its backend has gloo for the CPU, else a gloo group of its own): the receiver reads them
without synchronizing a device. The tensors travel on the stage's device (NCCL on CUDA) or over gloo
on the CPU. The next message's header is received ahead, while the tensors arrive.

**Receiving ahead.** Within a step both sides know how many messages a channel carries. Once the
receiver knows message i's layout, it posts message i+1's tensor receives at once, guessed to be of
message i's sizes, on the channel's third group (``ahead_group``): a consumer taking messages back to
back then never waits for a transfer to start. The sender sends message i+1's tensors on that group
when its layout is unchanged; when it changed, it first sends zeros of the guessed sizes there (the
receiver drops them), then the header with the new layout and the tensors on ``group``.

**Waiting.** A host-memory operation (every gloo one) completes only inside ``Work.wait()``, which
cannot be interrupted (and gloo's timed wait closes the connection): a thread per channel waits for
them in the order they were posted — host memory has no stream, so nothing on a device is ordered by
it — and the compute thread waits for that, stopping at once when another rank reports a failure
(``failed``). A CUDA tensor's transfer is waited for by the compute thread with ``Work.wait()``,
which orders the compute stream after it without blocking the host.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import _pytree as pytree

from gpipe import threads
from gpipe.microbatch import Batch, flat_spec, is_flat_spec
from gpipe.runtime.executor import AbortedError

__all__ = ["Channel", "make_channel", "wait_host"]

_HOST = torch.device("cpu")
Value = Batch | tuple[Any, ...]
Failed = Callable[[], str | None]


def layout_of(value: Value) -> tuple[bytes, list[Tensor]]:
    """A value's layout (pickled) and its tensors, in order."""
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


class _Done(threading.Event):
    """Set once an operation completed; ``error``: what it raised."""

    error: BaseException | None = None


class _Waiter:
    """Waits for a channel's host-memory operations, in the order they were posted, on a thread of its
    own: gloo's operations complete only inside ``Work.wait()``, which cannot be interrupted, and its
    timed wait closes the connection. Host memory has no stream: waiting here orders nothing on a
    device. The thread starts on demand and ends once idle for ``idle`` seconds."""

    def __init__(self, name: str, idle: float = 10.0) -> None:
        self.name, self.idle = name, idle
        self._queue: queue.SimpleQueue[tuple[Any, _Done] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = False

    def add(self, work: Any) -> _Done:
        done = _Done()
        with self._lock:
            self._queue.put((work, done))
            if not self._running:
                self._running = True
                threads.start(self._run, name=f"gpipe-wait {self.name}", stop=lambda: self._queue.put(None))
        return done

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.idle)
            except queue.Empty:
                item = None
            if item is None:  # idle, or asked to stop (at exit)
                with self._lock:
                    if self._queue.empty():
                        self._running = False
                        return
                continue
            work, done = item
            try:
                work.wait()
            except BaseException as exc:  # handed to the thread that waits for it
                done.error = exc
            done.set()


def wait_host(done: _Done, failed: Failed) -> None:
    """Wait for a host-memory operation; a failure elsewhere (``failed()`` says why) stops the wait
    with :class:`AbortedError`; the operation's own error is raised here."""
    while not done.wait(0.02):
        reason = failed()
        if reason is not None:
            raise AbortedError(reason)
    if done.error is not None:
        raise done.error


class Channel:
    """One direction of traffic between two ranks (global ``src`` and ``dst``): ``group`` carries its
    tensors on ``device``, ``host_group`` (gloo) its headers and layouts. See the module's docstring."""

    def __init__(
        self, src: int, dst: int, kind: str, group: Any, host_group: Any, device: torch.device, ahead: Any = None
    ) -> None:
        self.src, self.dst, self.kind, self.device = src, dst, kind, device
        self.group, self.host_group, self.ahead_group = group, host_group, group if ahead is None else ahead
        self.sent_layout: bytes | None = None
        self.received_layout: bytes | None = None
        self._waiter = _Waiter(repr(self))  # the tensors' operations
        self._host_waiter = _Waiter(f"{self!r} headers")  # headers and layouts: seen as they arrive
        self._sending: deque[tuple[_Done | Any, Tensor]] = deque()  # posted sends, with what they send
        self._header: tuple[_Done, Tensor] | None = None  # the next message's header, received ahead
        self._started: deque[tuple[list[_Done | Any], Value]] = deque()  # messages whose tensors are posted
        self._ahead: list[tuple[_Done | Any, Tensor]] | None = None  # the next message's tensors, guessed
        self._ahead_sizes: list[int] | None = None  # (sending) the byte sizes the receiver guessed

    def __repr__(self) -> str:
        return f"channel {self.kind} rank {self.src} -> rank {self.dst}"

    def _post(
        self, op: Any, t: Tensor, group: Any, peer: int, *, header: bool = False, direct: bool = False
    ) -> _Done | Any:
        """Post ``op`` (isend or irecv) of ``t``: the work, waited for by the caller (a device's, or
        ``direct``), or the completion of a host operation that a waiter thread waits for."""
        work = op(t, peer, group=group)
        if direct or t.device.type == "cuda":
            return work
        return (self._host_waiter if header else self._waiter).add(work)

    def _empty(self, item: tuple[Any, ...]) -> Tensor:
        """A tensor for a layout's item ``('t', dtype, shape)``, on the channel's device."""
        return torch.empty(item[2], dtype=getattr(torch, item[1]), device=self.device)

    @staticmethod
    def _wait(pending: _Done | Any, failed: Failed) -> None:
        if isinstance(pending, _Done):
            wait_host(pending, failed)
        else:  # on a device, the current (compute) stream waits and the host goes on; gloo's, the host
            pending.wait()

    # The sending side.

    def post(self, value: Value, *, guessed: bool = False, more: bool = False) -> None:
        """Send ``value``: post its operations and return (their buffers are held until they complete).
        ``guessed``: the receiver posted this message's tensors' receives ahead, with the sizes of the
        last message's (:meth:`start`'s ``guess``); ``more``: it will do so for the next one."""
        layout, tensors = layout_of(value)
        changed = layout != self.sent_layout
        sending = [_as_bytes(t.to(self.device)) for t in tensors if t.numel()]
        if guessed and changed:  # what the receiver guessed, met with nothing (it reads the new layout)
            assert self._ahead_sizes is not None
            for size in self._ahead_sizes:
                self._send(torch.zeros(size, dtype=torch.uint8, device=self.device), self.ahead_group)
        self._send(torch.tensor([len(layout) if changed else 0], dtype=torch.int64), self.host_group)
        if changed:
            self._send(torch.frombuffer(bytearray(layout), dtype=torch.uint8), self.host_group)
            self.sent_layout = layout
        for t in sending:
            self._send(t, self.ahead_group if guessed and not changed else self.group)
        self._ahead_sizes = [t.numel() for t in sending] if more else None
        while self._sending:  # let go of what was delivered
            pending = self._sending[0][0]
            if not (pending.is_set() if isinstance(pending, _Done) else pending.is_completed()):
                break
            self._sending.popleft()
            if isinstance(pending, _Done) and pending.error is not None:
                raise pending.error

    def _send(self, t: Tensor, group: Any) -> None:
        self._sending.append((self._post(dist.isend, t, group, self.dst), t))

    def flush(self, failed: Failed) -> None:
        """Wait until every message posted was delivered (a CUDA tensor's: ordered on the stream)."""
        while self._sending:
            pending, _ = self._sending.popleft()
            self._wait(pending, failed)

    # The receiving side.

    def expect(self) -> None:
        """Post the next message's header receive, ahead of need."""
        if self._header is None:
            header = torch.empty(1, dtype=torch.int64)
            self._header = (self._post(dist.irecv, header, self.host_group, self.src, header=True), header)

    def arrived(self) -> bool:
        """Whether the next message's header, received ahead, is here (its tensors can be received)."""
        return self._header is not None and isinstance(self._header[0], _Done) and self._header[0].is_set()

    def start(self, failed: Failed, more: Callable[[list[Any]], bool], *, guess: bool = False) -> None:
        """Take the next message's header and layout, and post its tensors' receives. ``more(values)``:
        whether another message follows this one (its values, tensors not yet received), whose header
        is then received ahead while they arrive; with ``guess`` its tensors' receives too, with this
        message's sizes, on the channel's third group (its sender sends them there when its layout is
        unchanged, else something of those sizes)."""
        self.expect()
        assert self._header is not None
        pending, header = self._header
        self._header = None
        self._wait(pending, failed)
        size = int(header[0])  # (host memory: no device is synchronized)
        guessed, self._ahead = self._ahead, None
        if guessed is not None and size:  # the guess was wrong: what came instead is dropped
            for work, _ in guessed:
                self._wait(work, failed)
            guessed = None
        if size:
            raw = torch.empty(size, dtype=torch.uint8)
            self._wait(self._post(dist.irecv, raw, self.host_group, self.src, header=True), failed)
            self.received_layout = raw.numpy().tobytes()
        if self.received_layout is None:
            raise RuntimeError(f"{self}: the first message carried no layout")
        batch, structure, skips, flags, items = pickle.loads(self.received_layout)
        values: list[Any] = []
        posted: list[_Done | Any] = []
        right = iter(guessed) if guessed is not None else None  # the guess was right: its tensors are these
        for item in items:
            if item[0] == "v":
                values.append(item[1])
                continue
            t = self._empty(item)
            if t.numel():
                if right is not None:
                    work, t = next(right)
                else:  # (its header is here: the sender posted these sends with it, so they come unless it
                    # dies, which closes the connection; waited for directly, without a thread's hand-over)
                    work = self._post(dist.irecv, _as_bytes(t), self.group, self.src, direct=True)
                posted.append(work)
            values.append(t)
        if more(values):
            if guess:  # the next message's tensors, guessed to be of these sizes
                ahead = [self._empty(item) for item in items if item[0] == "t"]
                self._ahead = [
                    (self._post(dist.irecv, _as_bytes(t), self.ahead_group, self.src, direct=True), t)
                    for t in ahead
                    if t.numel()
                ]
            self.expect()
        if batch:
            spec = flat_spec(structure) if isinstance(structure, int) else structure
            value: Value = Batch(tuple(values), spec, skips, flags)
        else:
            value = tuple(values)
        self._started.append((posted, value))

    def finish(self, failed: Failed) -> Value:
        """The oldest message started: once its tensors are here (on a device: ordered on the stream)."""
        posted, value = self._started.popleft()
        for pending in posted:
            self._wait(pending, failed)
        return value

    def receive(self, failed: Failed, more: Callable[[list[Any]], bool]) -> Value:
        """The channel's next message (see :meth:`start`)."""
        if not self._started:
            self.start(failed, more)
        return self.finish(failed)


def make_channel(src: int, dst: int, kind: str, device: torch.device, timeout: float) -> Channel | None:
    """A channel from global rank ``src`` to ``dst``, its process groups created (collectively: every
    rank calls this alike, in the same order); ``None`` on the other ranks. The tensors travel on
    ``device`` where the group's backend moves them (NCCL for CUDA), else on the CPU."""
    ranks = sorted({src, dst})
    wait = timedelta(seconds=timeout)
    group = dist.new_group(ranks, timeout=wait)
    backend = str(dist.get_backend())  # (the group's, which every rank knows alike)
    host_group = group if "gloo" in backend else dist.new_group(ranks, timeout=wait, backend="gloo")
    ahead = dist.new_group(ranks, timeout=wait)  # the tensors of a message whose receives were posted ahead
    me = dist.get_rank()
    if me not in (src, dst):
        return None
    on_device = device.type == "cuda" and "nccl" in backend
    channel = Channel(src, dst, kind, group, host_group, device if on_device else _HOST, ahead)
    # A first transfer now, while every rank creates the channels in the same order: NCCL creates a
    # pair's communicator at its first operation, blocking both sides until the other comes, which in
    # the middle of a step could wait for a receive the peer posts only later.
    token = torch.zeros(1, device=channel.device)
    for g in (group, ahead):
        work = dist.isend(token, dst, group=g) if me == src else dist.irecv(token, src, group=g)
        assert work is not None  # (a member of the group)
        work.wait()
    return channel
