"""One process per pipeline worker over torch.distributed: the transport between ranks.

Every rank runs its own list of actions from the same schedule IR, in the calling thread, with the
same executor as one process (:class:`gpipe.runtime.executor.Executor`); only the hand-over between stages
differs, and that is this module's :class:`ChannelTransport`. An activation or a
gradient whose consumer lives on another rank travels over a *channel*: one per (source rank,
destination rank, activations|gradients), each with its own two-rank process group, so that every
communicator carries messages one way, in one order (which NCCL needs). A sender thread per outgoing
channel sends as soon as an action has produced (the compute thread never waits for a send); a
receiver thread per incoming channel posts the next receive as soon as the previous one completed,
in the order the producing rank sends (read off the schedule), and leaves what arrives in the
mailbox the actions read from. Communication therefore overlaps compute.

The wire format of a message: an 8-byte header (0 when the message's layout — dtypes, shapes, the
values that are not tensors, which values need a gradient, the micro-batch's structure (its pytree
spec) — is the one the channel last carried, else the length of the new layout), the layout if it
changed (pickled), then every tensor's bytes.
Layouts are thus exchanged once and cached per channel, and renegotiated when the input shape
changes. Any dtype travels, as raw bytes.

Failures: a rank whose step raises (or which loses a peer) records the failure in the process
group's store; every other rank watches the store during a step and stops its step with a
:class:`PipelineError` naming the failed rank — before its next action, or at its current wait.
Point-to-point operations time out (``timeout``) so that a hung rank cannot hang the others forever.

Outside the actions — the collectives of a step (the seed's broadcast, the loss's and the
gradients' all-reduces and broadcast) and of setting up — each call runs under :func:`collective`,
which turns a transport error (a peer's socket closed, a timeout) into a :class:`PipelineError`
naming the operation, its ranks and the rank that is lost: the one whose failure the store holds,
else the peers whose *heartbeat* stopped (every process bumps a counter in the store every
``timeout / 20`` s, at most 0.5 s, from a thread of its own: a killed or stopped process stops
bumping it). A step that succeeds runs none of this.

Rank 0 hosts the store (under ``env://``): when it is killed the store's connections close, and
the others name it from that; when it is stopped, a TCPStore client would wait for its reply
forever, so every store call of gpipe's is made by a thread of its own and given up after a bound
(``timeout`` for the watch of a step, 2 s on the failure paths), the silence naming rank 0. After
a failure, rank 0 waits at exit (three heartbeat intervals and 2 s at most) until the others have
left or stopped beating, so that they can still read the store.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import _pytree as pytree

from gpipe.microbatch import Batch, batch_size, flat_spec, is_flat_spec, scatter
from gpipe.rng import step_seed
from gpipe.runtime.executor import Mailbox, StepRun, Transport
from gpipe.runtime.placement import Placement
from gpipe.schedule.ir import ActionKind, Schedule
from gpipe.tied import Tie

__all__ = [
    "ChannelTransport",
    "Collectives",
    "PipelineError",
    "RankCollectives",
    "collective",
    "init_from_env",
    "start_heartbeat",
    "tie_name",
]

_FAILURE_KEY = "gpipe/failure"
_ALIVE_KEY = "gpipe/alive/"
_LEFT = b"left"
Key = tuple[str, int, int]


class PipelineError(RuntimeError):
    """A rank of the pipeline failed; raised on every other rank, naming it."""


# Failures and liveness, through the default process group's store.

T = TypeVar("T")


class _StoreSilentError(RuntimeError):
    """The process group's store did not answer in time."""


class _StoreCalls:
    """Calls to a store made by a thread of their own, so that the caller can give up: a TCPStore
    client waits forever for the reply of a stopped server. Once a call was given up on, the next
    ones give up at once, until the store answers again."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.silent = threading.Event()
        self._calls: queue.SimpleQueue[tuple[Callable[[Any], Any], dict[str, Any], threading.Event]]
        self._calls = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="gpipe-store").start()

    def __call__(self, call: Callable[[Any], T], seconds: float) -> T:
        if self.silent.is_set():
            raise _StoreSilentError("the process group's store has not answered an earlier call")
        box: dict[str, Any] = {}
        done = threading.Event()
        self._calls.put((call, box, done))
        if not done.wait(seconds):
            self.silent.set()
            raise _StoreSilentError(f"the process group's store did not answer within {seconds:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]

    def _serve(self) -> None:
        while True:
            call, box, done = self._calls.get()
            try:
                box["value"] = call(self.store)
            except BaseException as exc:
                box["error"] = exc
            done.set()
            self.silent.clear()


_store_calls: dict[int, _StoreCalls] = {}  # by id(store); each keeps its store alive
_store_calls_lock = threading.Lock()


def _bounded(store: Any, call: Callable[[Any], T], seconds: float) -> T:
    """``call(store)``, given up after ``seconds`` with :class:`_StoreSilentError`."""
    with _store_calls_lock:
        calls = _store_calls.get(id(store))
        if calls is None:
            calls = _store_calls[id(store)] = _StoreCalls(store)
    return calls(call, seconds)


def _store_host() -> int | None:
    """The rank whose process hosts the default store: rank 0 under ``env://`` and ``tcp://``
    (torchrun's agent store lives in the agent instead)."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return None
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return 0 if isinstance(store, TCPStore) else None


def _first_line(exc: BaseException) -> str:
    """An error's message without the C++ backtrace torch appends to some."""
    return str(exc).split("\nException raised from")[0].strip().splitlines()[0] if str(exc).strip() else repr(exc)


def _store_lost(exc: BaseException) -> str:
    """What a store error says about the ranks: its host is gone (or stopped)."""
    host = _store_host()
    silent = isinstance(exc, _StoreSilentError)
    state = _first_line(exc) if silent else f"the process group's store is unreachable ({_first_line(exc)})"
    if host is None or host == dist.get_rank():
        return state
    return f"rank {host} is {'not responding' if silent else 'gone'} ({state}; rank {host} hosts it)"


def _report_failure(store: Any, message: str, seconds: float = 2.0) -> None:
    """Record the first failure in the store, for every rank to read."""
    _failing.set()
    with contextlib.suppress(Exception):  # the store may be gone with rank 0; the local error still surfaces
        _bounded(store, lambda st: st.compare_set(_FAILURE_KEY, "", message), seconds)


def _read_failure(store: Any, seconds: float) -> str | None:
    """The failure recorded in the store, if any, or what the store's silence says (waiting
    ``seconds`` at most for it)."""

    def read(st: Any) -> str | None:
        return st.get(_FAILURE_KEY).decode() or None if st.check([_FAILURE_KEY]) else None

    try:
        return _bounded(store, read, seconds)
    except Exception as exc:
        return _store_lost(exc)


class _Heartbeat:
    """This process's heartbeat: a thread bumps a counter in the store every ``interval`` seconds,
    and writes 'left' there when the process exits (a key that vanished would block a reader)."""

    def __init__(self, store: Any, rank: int, world: int, interval: float) -> None:
        self.store, self.rank, self.world, self.interval = store, rank, world, interval
        self.lost: set[int] = set()  # the ranks found silent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="gpipe-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        beats = 0
        while True:
            beats += 1
            try:
                self.store.set(f"{_ALIVE_KEY}{self.rank}", str(beats))
            except Exception:  # the store is gone (with rank 0, or at exit): nothing left to tell
                return
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(0.1)  # it may wait on a store that no longer answers
        with contextlib.suppress(Exception):
            _bounded(self.store, lambda st: st.set(f"{_ALIVE_KEY}{self.rank}", _LEFT), 0.5)

    def read(self, ranks: Sequence[int]) -> dict[int, bytes | None]:
        """Every rank's heartbeat (``None``: none yet), waiting 2 s at most for the store."""
        keys = [f"{_ALIVE_KEY}{r}" for r in ranks]

        def read(st: Any) -> dict[int, bytes | None]:
            if st.check(keys):  # one round trip for all
                return dict(zip(ranks, st.multi_get(keys)))
            return {r: st.get(k) if st.check([k]) else None for r, k in zip(ranks, keys)}

        return _bounded(self.store, read, 2.0)

    def silent(self, ranks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Those of ``ranks`` whose heartbeat does not move within three intervals: the ones that
        stopped beating (killed, stopped, hung), and the ones whose process has exited."""
        first = last = self.read(ranks)
        moved = set[int]()
        deadline = time.monotonic() + 3 * self.interval
        while time.monotonic() < deadline and len(moved) < len(ranks):
            time.sleep(self.interval / 2)
            last = self.read(ranks)
            moved |= {r for r, beats in last.items() if beats not in (None, _LEFT, first[r])}
        quiet = [r for r in ranks if r not in moved]
        self.lost.update(quiet)
        return [r for r in quiet if last[r] != _LEFT], [r for r in quiet if last[r] == _LEFT]

    def linger(self) -> None:
        """Wait (at most three intervals and 2 s) until every other rank has left or stopped
        beating: the store lives in this process, and they read it to name who failed."""
        others = [r for r in range(self.world) if r != self.rank and r not in self.lost]
        if not others:
            return
        last, changed = self.read(others), dict.fromkeys(others, time.monotonic())
        deadline = time.monotonic() + 3 * self.interval + 2.0
        while time.monotonic() < deadline:
            time.sleep(self.interval / 2)
            now, beats = time.monotonic(), self.read(others)
            changed.update({r: now for r in others if beats[r] != last[r]})
            last = beats
            if all(beats[r] in (None, _LEFT) or now - changed[r] > 2 * self.interval for r in others):
                return


_heartbeat: _Heartbeat | None = None
_failing = threading.Event()  # this process has seen its pipeline fail


def start_heartbeat(timeout: float) -> None:
    """Start this process's heartbeat in the default process group's store (once; a shorter
    ``timeout`` makes it beat faster: every ``timeout / 20`` s, at most 0.5 s)."""
    global _heartbeat
    interval = min(0.5, max(0.05, timeout / 20))
    store = dist.distributed_c10d._get_default_store()
    if _heartbeat is not None and _heartbeat.store is store and _heartbeat._thread.is_alive():
        _heartbeat.interval = min(_heartbeat.interval, interval)
        return
    if _heartbeat is None:
        atexit.register(_stop_heartbeat)
    else:
        _heartbeat.stop()
    _heartbeat = _Heartbeat(store, dist.get_rank(), dist.get_world_size(), interval)


def _stop_heartbeat() -> None:
    """At exit: stop beating; after a failure, the rank hosting the store lets the others read it."""
    beat = _heartbeat
    if beat is None:
        return
    beat.stop()
    if _failing.is_set() and _store_host() == beat.rank:
        with contextlib.suppress(Exception):
            beat.linger()


def _silent_ranks(timed_out: bool) -> tuple[str, str] | None:
    """Who the heartbeats say is lost, as ('rank 3 is gone', 'rank 3'): the ranks that stopped
    beating (gone when their connection closed, not responding when it timed out), else those
    that have exited; ``('', '')`` when every rank beats, ``None`` when no heartbeat runs here."""
    beat = _heartbeat
    if beat is None:
        return None
    stuck, left = beat.silent([r for r in range(beat.world) if r != beat.rank])
    ranks, state = (stuck, "not responding" if timed_out else "gone") if stuck else (left, "gone")
    if not ranks:
        return "", ""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"{who} {'is' if len(ranks) == 1 else 'are'} {state}", who


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


@contextmanager
def collective(operation: str, group: Any = None) -> Iterator[None]:
    """Run a collective of ``group`` (default: all ranks): a transport error in it (a peer's socket
    closed, a timeout) becomes a :class:`PipelineError` that names the lost rank when the store or
    the heartbeats tell, else the operation and its peers; the raw error is its ``__cause__`` and
    its message's tail. Costs nothing unless the collective fails."""
    try:
        yield
    except PipelineError:
        _failing.set()
        raise
    except RuntimeError as exc:  # DistBackendError, DistNetworkError, DistStoreError, gloo's RuntimeError
        _failing.set()
        raise PipelineError(_lost_in(operation, group, exc)) from exc


def _lost_in(operation: str, group: Any, exc: BaseException) -> str:
    """What to say when ``operation`` failed with ``exc``: the failure the store holds, else who is
    lost by the heartbeats, read within a bounded time (a stopped rank 0 stops the store it hosts)."""
    me = dist.get_rank()
    ranks = sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    peers = [r for r in ranks if r != me]
    raw = f"{type(exc).__name__}: {_first_line(exc)}"
    timed_out = _timed_out(exc)
    where = f"the {operation} over ranks {ranks} {'timed out' if timed_out else 'failed'} on rank {me}"
    store = dist.distributed_c10d._get_default_store()
    try:
        failure = _read_failure(store, 2.0)
        if failure is None:
            silent = _silent_ranks(timed_out)
            failure = _read_failure(store, 2.0)  # another rank may have named it meanwhile
    except Exception as err:
        return f"{_store_lost(err)}: {where}: {raw}"
    if failure is not None:
        return f"{failure} ({where}: {raw})"
    if silent is None:
        return f"{where}; one of ranks {peers} is lost: {raw}"
    lost, who = silent
    if not lost:
        return (
            f"{where}, and every rank still beats: one of ranks {peers} "
            f"{'did not take part in time' if timed_out else 'closed its connection'}: {raw}"
        )
    _report_failure(store, f"{lost} (no heartbeat; rank {me} lost it in the {operation})")
    return f"{lost}: {where} (no heartbeat from {who}): {raw}"


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
        me = dist.get_rank()
        self._store = dist.distributed_c10d._get_default_store()
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
                    raise PipelineError(f"rank {dist.get_rank()}: a transfer did not finish in {self.timeout:g} s")
        except BaseException as exc:
            self._report(f"rank {dist.get_rank()} failed: {type(exc).__name__}: {exc}", exc)
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
        a rank it waits for, is stuck: the heartbeats tell which)."""
        lost = f"rank {peer} is gone"
        if _timed_out(exc):
            silent = None
            with contextlib.suppress(Exception):  # the store is gone: what it holds says so below
                silent = _silent_ranks(timed_out=True)
            lost = silent[0] if silent and silent[0] else f"rank {peer} is not responding"
        me = dist.get_rank()
        self._report(f"{lost} (rank {me} lost its connection to rank {peer}: {_first_line(exc)})", exc)
        run.mailbox.fail(_read_failure(self._store, min(self.timeout, 2.0)) or lost)

    def _report(self, message: str, exc: BaseException | None = None) -> None:
        """Record the first failure of the step in the store, for every rank to read (waiting for
        the store at most 2 s: a stopped rank 0 stops the store it hosts)."""
        _failing.set()
        if isinstance(exc, PipelineError):  # someone else's, already recorded
            return
        _report_failure(self._store, message, min(self.timeout, 2.0))

    def _failure(self) -> str | None:
        """The failure another rank recorded, if any (waiting ``timeout`` at most for the store)."""
        return _read_failure(self._store, self.timeout)

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


# The collectives of a step.


def tie_name(tie: Tie) -> str:
    return "/".join(f"{i}.{path}" for i, path in tie.members)


class Collectives:
    """What a step exchanges outside its actions, in one process: nothing; the step's seed is
    drawn here, tied copies' gradients summed here."""

    data_parallel = 1
    dp_rank = 0

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

    def reduce_gradients(self, grads: Sequence[Tensor]) -> None:
        """Sum gradients over the data-parallel replicas."""

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
        self, placement: Placement, device: torch.device, *, dp_group: Any, pp_group: Any, data_parallel: int
    ) -> None:
        self.placement, self.device = placement, device
        self.dp_group, self.pp_group = dp_group, pp_group
        self.data_parallel, self.dp_rank = data_parallel, placement.replica
        self._comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    def seed(self) -> int:
        t = torch.tensor([step_seed()], dtype=torch.int64, device=self._comm_device)
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

    def reduce_gradients(self, grads: Sequence[Tensor]) -> None:
        """Sum a stage's gradients over its replicas in one collective (each replica's loss is
        already scaled by its share of the global mini-batch)."""
        if self.dp_group is None or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        with collective("all-reduce of the gradients over the data-parallel replicas", self.dp_group):
            dist.all_reduce(flat, group=self.dp_group)
        for g, reduced in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))

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
