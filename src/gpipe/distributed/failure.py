"""The failure watch: failures recorded in the process group's store, the heartbeats that name a
lost rank, the bounded store calls, and :func:`collective`, which turns a collective's transport
error into a :class:`PipelineError`.

Outside the actions — the collectives of a step (the seed's broadcast, the loss's and the
gradients' all-reduces and broadcast) and of setting up — each call runs under :func:`collective`,
which turns a transport error (a peer's socket closed, a timeout) into a :class:`PipelineError`
naming the operation, its ranks and the rank that is lost: the one whose failure the store holds,
else the peers whose *heartbeat* stopped (every process bumps a counter in the store every
``timeout / 20`` s, at most 0.5 s, from a thread of its own: a killed or stopped process stops
bumping it). A step that succeeds runs none of this.

A wait outside gpipe's bounded calls (a checkpoint's collectives, on a group with a long timeout,
for a slow file system) is covered by :func:`watch_peers`: a thread that ends the process, naming the
silent rank, once a peer's heartbeat has not moved for ``timeout`` seconds, since a blocked collective
cannot be interrupted. ``gpipe train`` runs it for the whole run, so that every rank exits and
torchrun's agent can restart the job.

Rank 0 hosts the store (under ``env://``): when it is killed the store's connections close, and
the others name it from that; when it is stopped, a TCPStore client would wait for its reply
forever, so every store call of gpipe's is made by a thread of its own and given up after a bound
(``timeout`` for the watch of a step, 2 s on the failure paths), the silence naming rank 0. After
a failure, rank 0 waits at exit (three heartbeat intervals and 2 s at most) until the others have
left or stopped beating, so that they can still read the store.

What a failure's message needs of the default process group (this rank, the ranks, the store and
its host) is captured when the watch starts, as a :class:`_World` (by the heartbeat, the transport,
each :func:`collective` on entry), never asked of the group when the failure is named: a survivor
may be tearing the group down at that moment (its cleanup after the error, or the exit's) while a
transfer thread or the exit's watch still reports.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from gpipe import threads

__all__ = ["PipelineError", "collective", "lost_ranks", "start_heartbeat", "watch_peers"]

# Under torchrun the agent's store outlives a worker group that it restarts: the keys of each group
# (its restart count, and its world size, which changes without a restart when a node joins) are its own.
_ATTEMPT = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{os.environ.get('WORLD_SIZE', '1')}"
_FAILURE_KEY = f"gpipe/{_ATTEMPT}/failure"
_ALIVE_KEY = f"gpipe/{_ATTEMPT}/alive/"
_LEFT = b"left"


class PipelineError(RuntimeError):
    """A rank of the pipeline failed; raised on every other rank, naming it."""


PipelineError.__module__ = "gpipe.distributed"  # its public name, which tracebacks print

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
        self._calls: queue.SimpleQueue[tuple[Callable[[Any], Any], dict[str, Any], threading.Event] | None]
        self._calls = queue.SimpleQueue()
        self._stopped = False
        threads.start(self._serve, name="gpipe-store", stop=self._stop)

    def __call__(self, call: Callable[[Any], T], seconds: float) -> T:
        if self._stopped:
            raise _StoreSilentError("the process is exiting: its calls to the store have ended")
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

    def _stop(self) -> None:
        self._stopped = True
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, box, done = item
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


def _store_host(store: Any) -> int | None:
    """The rank whose process hosts ``store``, the default one: rank 0 under ``env://`` and
    ``tcp://``, and under torchrun with restarts (:mod:`gpipe.distributed.group`); torchrun's agent
    store lives in the agent instead."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if not isinstance(store, TCPStore):
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    return None if agent and store.port == int(os.environ.get("MASTER_PORT", "-1")) else 0


@dataclass(frozen=True)
class _World:
    """The default process group as the failure watch captured it: this process's rank, the number
    of ranks, the store (the reference keeps it usable once the group is destroyed) and its host."""

    rank: int
    size: int
    store: Any
    host: int | None


def _world() -> _World:
    """The default process group's :class:`_World`, captured now (the heartbeat's, when it beats in
    this group's store). Raises torch's ValueError when there is no group."""
    store = dist.distributed_c10d._get_default_store()
    beat = _heartbeat
    if beat is not None and beat.world.store is store:
        return beat.world
    return _World(dist.get_rank(), dist.get_world_size(), store, _store_host(store))


_COORDINATES: dict[int, str] = {}
"""Each rank's coordinates on the pipeline's device mesh (``dp 1, pp 0``), for the reports, when the
mesh has more than the pipeline dimension (:func:`name_coordinates`)."""


def name_coordinates(ranks: Sequence[Sequence[Any]] | Any, dims: Sequence[str]) -> None:
    """Have failure reports name each rank with its mesh coordinates (``ranks``: the mesh's ranks, an
    array of ``dims``' sizes), when a dimension besides "pp" has more than one rank."""
    import numpy as np

    grid = np.asarray(ranks)
    _COORDINATES.clear()
    if all(size == 1 for dim, size in zip(dims, grid.shape) if dim != "pp"):
        return
    for index in np.ndindex(*grid.shape):
        _COORDINATES[int(grid[index])] = ", ".join(f"{d} {i}" for d, i in zip(dims, index))


def _rank(r: int, word: str = "rank ") -> str:
    """``rank 3``, or with its mesh coordinates ``rank 3 (dp 1, pp 1)``."""
    where = _COORDINATES.get(r)
    return f"{word}{r} ({where})" if where else f"{word}{r}"


def _first_line(exc: BaseException) -> str:
    """An error's message without the C++ backtrace torch appends to some."""
    return str(exc).split("\nException raised from")[0].strip().splitlines()[0] if str(exc).strip() else repr(exc)


def _store_lost(world: _World, exc: BaseException) -> str:
    """What an error of ``world``'s store says about the ranks: its host is gone (or stopped)."""
    host = world.host
    silent = isinstance(exc, _StoreSilentError)
    state = _first_line(exc) if silent else f"the process group's store is unreachable ({_first_line(exc)})"
    if host is None or host == world.rank:
        return state
    return f"{_rank(host)} is {'not responding' if silent else 'gone'} ({state}; rank {host} hosts it)"


def _report_failure(store: Any, message: str, seconds: float = 2.0) -> None:
    """Record the first failure in the store, for every rank to read."""
    _failing.set()
    with contextlib.suppress(Exception):  # the store may be gone with rank 0; the local error still surfaces
        _bounded(store, lambda st: st.compare_set(_FAILURE_KEY, "", message), seconds)


def _read_failure(world: _World, seconds: float) -> str | None:
    """The failure recorded in ``world``'s store, if any, or what the store's silence says (waiting
    ``seconds`` at most for it)."""

    def read(st: Any) -> str | None:
        return st.get(_FAILURE_KEY).decode() or None if st.check([_FAILURE_KEY]) else None

    try:
        return _bounded(world.store, read, seconds)
    except Exception as exc:
        return _store_lost(world, exc)


class _Heartbeat:
    """This process's heartbeat: a thread bumps a counter in the store every ``interval`` seconds,
    and writes 'left' there when the process exits (a key that vanished would block a reader)."""

    def __init__(self, world: _World, interval: float) -> None:
        self.world, self.store, self.rank, self.interval = world, world.store, world.rank, interval
        self.lost: set[int] = set()  # the ranks found silent
        self._stop = threading.Event()
        self._thread = threads.start(self._beat, name="gpipe-heartbeat", stop=self._stop.set)

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
        others = [r for r in range(self.world.size) if r != self.rank and r not in self.lost]
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
    world = _world()
    if _heartbeat is not None and _heartbeat.world is world and _heartbeat._thread.is_alive():
        _heartbeat.interval = min(_heartbeat.interval, interval)
        return
    if _heartbeat is None:
        atexit.register(_stop_heartbeat)
    else:
        _heartbeat.stop()
    _heartbeat = _Heartbeat(world, interval)


def _stop_heartbeat() -> None:
    """At exit (the process group may be destroyed already): stop beating; after a failure, the rank
    hosting the store lets the others read it."""
    beat = _heartbeat
    if beat is None:
        return
    beat.stop()
    if _failing.is_set() and beat.world.host == beat.rank:
        with contextlib.suppress(Exception):
            beat.linger()


def _silent_ranks(timed_out: bool) -> tuple[str, str] | None:
    """Who the heartbeats say is lost, as ('rank 3 is gone', 'rank 3'): the ranks that stopped
    beating (gone when their connection closed, not responding when it timed out), else those
    that have exited; ``('', '')`` when every rank beats, ``None`` when no heartbeat runs here."""
    beat = _heartbeat
    if beat is None:
        return None
    stuck, left = beat.silent([r for r in range(beat.world.size) if r != beat.rank])
    ranks, state = (stuck, "not responding" if timed_out else "gone") if stuck else (left, "gone")
    if not ranks:
        return "", ""
    who = _rank(ranks[0]) if len(ranks) == 1 else f"ranks {', '.join(_rank(r, '') for r in ranks)}"
    return f"{who} {'is' if len(ranks) == 1 else 'are'} {state}", who


def lost_ranks() -> str | None:
    """Who the heartbeats say is lost (``"rank 1 is gone"``), read within three heartbeat intervals;
    None when every rank beats or no heartbeat runs here. For a rank told to stop (torchrun's agent
    stops the others when a worker fails) to say why."""
    with contextlib.suppress(Exception):
        silent = _silent_ranks(timed_out=False)
        if silent is not None and silent[0]:
            return silent[0]
    return None


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


@contextmanager
def collective(operation: str, group: Any = None) -> Iterator[None]:
    """Run a collective of ``group`` (default: all ranks): a transport error in it (a peer's socket
    closed, a timeout) becomes a :class:`PipelineError` that names the lost rank when the store or
    the heartbeats tell, else the operation and its peers; the raw error is its ``__cause__`` and
    its message's tail. The ranks and the store are looked up on entry, so that the message can be
    built even once the group is being torn down; the rest costs nothing unless the collective fails."""
    world = _world()
    ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(world.size))
    try:
        yield
    except PipelineError:
        _failing.set()
        raise
    except RuntimeError as exc:  # DistBackendError, DistNetworkError, DistStoreError, gloo's RuntimeError
        _failing.set()
        raise PipelineError(_lost_in(operation, world, ranks, exc)) from exc


def _lost_in(operation: str, world: _World, ranks: list[int], exc: BaseException) -> str:
    """What to say when ``operation`` over ``ranks`` failed with ``exc``: the failure the store holds,
    else who is lost by the heartbeats, read within a bounded time (a stopped rank 0 stops the store
    it hosts)."""
    me = world.rank
    peers = [r for r in ranks if r != me]
    raw = f"{type(exc).__name__}: {_first_line(exc)}"
    timed_out = _timed_out(exc)
    where = f"the {operation} over ranks {ranks} {'timed out' if timed_out else 'failed'} on rank {me}"
    try:
        failure = _read_failure(world, 2.0)
        if failure is None:
            silent = _silent_ranks(timed_out)
            failure = _read_failure(world, 2.0)  # another rank may have named it meanwhile
    except Exception as err:
        return f"{_store_lost(world, err)}: {where}: {raw}"
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
    _report_failure(world.store, f"{lost} (no heartbeat; rank {me} lost it in the {operation})")
    return f"{lost}: {where} (no heartbeat from {who}): {raw}"


class _PeerWatch:
    """The thread of :func:`watch_peers`."""

    def __init__(self, timeout: float, on_lost: Callable[[str], None] | None) -> None:
        self.timeout, self.on_lost = timeout, on_lost
        self._stop = threading.Event()
        self._thread = threads.start(self._watch, name="gpipe-peer-watch", stop=self._stop.set)

    def _watch(self) -> None:
        while (beat := _heartbeat) is None or not beat._thread.is_alive():  # (until a pipeline starts it)
            if self._stop.wait(0.5):
                return
        if beat.world.size < 2:
            return
        period = max(beat.interval, min(5.0, self.timeout / 10))
        peers = [r for r in range(beat.world.size) if r != beat.rank]
        last: dict[int, bytes | None] = {}
        moved = dict.fromkeys(peers, time.monotonic())
        answered = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            try:
                beats = beat.read(peers)
            except Exception as exc:  # the store's host is stopped or gone
                if now - answered > self.timeout:
                    self._lost(beat, _store_lost(beat.world, exc))
                    return
                continue
            answered = now
            for r in peers:
                if beats[r] != last.get(r) or beats[r] in (None, _LEFT):  # (not started yet, or done)
                    moved[r] = now
            last = beats
            silent = [r for r in peers if now - moved[r] > self.timeout]
            if silent:
                who = ", ".join(_rank(r) for r in silent)
                self._lost(beat, f"{who} {'is' if len(silent) == 1 else 'are'} not responding (no heartbeat for "
                                 f"{self.timeout:g} s)")  # fmt: skip
                return

    def _lost(self, beat: _Heartbeat, message: str) -> None:
        if self._stop.is_set():
            return
        _report_failure(beat.store, f"{message} (rank {beat.rank} noticed it)")
        with contextlib.suppress(Exception):
            if self.on_lost is not None:
                self.on_lost(message)
        with contextlib.suppress(Exception):
            print(f"error: {message}: rank {beat.rank} exits, so that the job can be restarted", flush=True,
                  file=sys.stderr)  # fmt: skip
        os._exit(1)

    def stop(self) -> None:
        self._stop.set()


@contextmanager
def watch_peers(timeout: float, on_lost: Callable[[str], None] | None = None) -> Iterator[None]:
    """While the block runs, end this process (status 1) once another rank's heartbeat has not moved
    for ``timeout`` seconds (stopped, or hung in a way that stops its threads), after recording the
    failure in the store and calling ``on_lost(message)``. A rank that left (exited) or has not
    started beating is not silent. The watch begins when the heartbeat does (a distributed
    :class:`gpipe.Pipeline` starts it, perhaps inside the block); in one process it never does."""
    watch = _PeerWatch(timeout, on_lost)
    try:
        yield
    finally:
        watch.stop()
