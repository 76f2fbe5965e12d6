"""NCCL's point-to-point semantics on gloo, for the CPU suite: what a pipeline's transfers would do on
GPUs, proven before a GPU is lent (docs/guides/gpus.md).

:func:`install` (tests/dist_entry.py calls it in every rank it starts, unless ``GPIPE_TEST_P2P=gloo``)
replaces ``torch.distributed``'s ``isend``, ``irecv``, ``send`` and ``recv`` in this process by
operations with NCCL's semantics, carried out over gloo:

- **rendezvous**: a send completes only once its peer posted the matching receive, and a receive only
  once the send was posted;
- **one stream per communicator**: the operations between two ranks on one process group complete in
  the order each rank issued them (a FIFO per group and peer, both directions), matched by that order
  alone, without tags — a receive matched to a send of another size or dtype is an error (on NCCL it
  would read garbage or hang);
- **one issuing thread**: a rank's operations are issued from one thread. Under NCCL, ``Work.wait()``
  makes the calling thread's current stream — the device's default stream, where the compute runs —
  wait; operations issued and waited for by helper threads stall the compute at points its program
  does not know, and NCCL's communicators deadlock when two threads issue on them in orders that differ
  between ranks (pytorch/pytorch#175145). Host-memory waits (``Work.wait()`` on these operations from
  any thread) are allowed: they order nothing on a device.

An operation that waits ``GPIPE_RENDEZVOUS_DEADLOCK`` seconds (default 30) at the head of its FIFO for
its peer fails, saying so: on NCCL it would hang. Collectives are gloo's, unchanged.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RendezvousError", "install", "installed"]

_TOKEN, _DATA = 71, 72  # gloo tags of the two halves of an operation
_REAL: dict[str, Any] = {}
_STATE: _State | None = None


class RendezvousError(RuntimeError):
    """An operation that breaks NCCL's point-to-point semantics (see the module's docstring)."""


class _Work:
    """An emulated operation: done once its FIFO carried it out."""

    def __init__(self, kind: str, tensor: torch.Tensor, peer: int, seq: int) -> None:
        self.kind, self.tensor, self.peer, self.seq = kind, tensor, peer, seq
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"timed out waiting for {self}")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def __repr__(self) -> str:
        return f"{self.kind} #{self.seq} of {self.tensor.numel()} {self.tensor.dtype} with rank {self.peer}"


def _code(t: torch.Tensor) -> list[int]:
    return [t.numel() * t.element_size(), zlib.crc32(str(t.dtype).encode())]


class _Fifo:
    """This rank's operations with one peer on one group, carried out in the order issued."""

    def __init__(self, group: Any, peer: int, deadlock: float) -> None:
        self.group, self.peer, self.deadlock = group, peer, deadlock
        self.queue: queue.SimpleQueue[_Work] = queue.SimpleQueue()
        self.sent = self.received = 0
        threading.Thread(target=self._run, daemon=True, name=f"rendezvous-{peer}").start()

    def _wait(self, work: Any, what: str) -> None:
        """Wait for a gloo operation, failing (as NCCL would hang) once it waited ``deadlock`` s."""
        result: list[BaseException | None] = []

        def wait() -> None:
            try:
                work.wait()
                result.append(None)
            except BaseException as exc:
                result.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(self.deadlock)
        if waiter.is_alive():
            raise RendezvousError(
                f"rank {dist.get_rank()}: {what} waited {self.deadlock:g} s for rank {self.peer} to post its "
                "matching operation at the head of their FIFO: on NCCL this would hang"
            )
        if result[0] is not None:
            raise result[0]

    def _run(self) -> None:
        broken: BaseException | None = None
        while True:
            work = self.queue.get()
            if broken is not None:
                work.finish(broken)
                continue
            try:
                token = torch.tensor([work.seq, *_code(work.tensor)], dtype=torch.int64)
                if work.kind == "recv":  # announce the receive (its size), then take the data
                    announced = _REAL["isend"](token, self.peer, group=self.group, tag=_TOKEN)
                    self._wait(_REAL["irecv"](work.tensor, self.peer, group=self.group, tag=_DATA), repr(work))
                    self._wait(announced, repr(work))
                else:  # wait until the peer posts its receive, then send
                    theirs = torch.empty(3, dtype=torch.int64)
                    self._wait(_REAL["irecv"](theirs, self.peer, group=self.group, tag=_TOKEN), repr(work))
                    if theirs.tolist() != token.tolist():
                        raise RendezvousError(
                            f"rank {dist.get_rank()}: {work!r} met receive #{int(theirs[0])} of "
                            f"{int(theirs[1])} bytes posted by rank {self.peer}: the two ranks' orders of "
                            "operations differ (NCCL matches them by order alone)"
                        )
                    self._wait(_REAL["isend"](work.tensor, self.peer, group=self.group, tag=_DATA), repr(work))
                work.finish()
            except BaseException as exc:
                print(f"rendezvous: {exc}", file=sys.stderr, flush=True)
                broken = exc
                work.finish(exc)


class _State:
    def __init__(self, deadlock: float) -> None:
        self.deadlock = deadlock
        self.thread: int | None = None
        self.thread_name = ""
        self.fifos: dict[tuple[int, int], _Fifo] = {}
        self.groups: list[Any] = []  # (held: the FIFOs are keyed by their ids)
        self.lock = threading.Lock()

    def post(self, kind: str, tensor: torch.Tensor, peer: int | None, group: Any, tag: int) -> _Work:
        me = threading.current_thread()
        with self.lock:
            if self.thread is None:
                self.thread, self.thread_name = me.ident, me.name
            elif self.thread != me.ident:
                raise RendezvousError(
                    f"rank {dist.get_rank()}: a point-to-point {kind} issued by thread {me.name!r}, while thread "
                    f"{self.thread_name!r} issues this rank's others: on NCCL, operations issued and waited for "
                    "by several threads stall the compute stream where its program does not expect it, and "
                    "deadlock when their orders differ between ranks"
                )
            if tag:
                raise RendezvousError(f"a {kind} with tag {tag}: NCCL has no tags, it matches by order alone")
            if peer is None:
                raise RendezvousError(f"a {kind} without a peer")
            group = group if group is not None else dist.group.WORLD
            key = (id(group), peer)
            fifo = self.fifos.get(key)
            if fifo is None:
                fifo = self.fifos[key] = _Fifo(group, peer, self.deadlock)
                self.groups.append(group)
            if kind == "send":
                fifo.sent += 1
                seq = fifo.sent
            else:
                fifo.received += 1
                seq = fifo.received
            work = _Work(kind, tensor, peer, seq)
            fifo.queue.put(work)
            return work


def _peer(group: Any, rank: int | None, group_rank: int | None) -> int | None:
    if group_rank is not None:
        return int(dist.get_global_rank(group, group_rank))
    return rank


def _isend(
    tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> _Work:
    assert _STATE is not None
    return _STATE.post("send", tensor, _peer(group, dst, group_dst), group, tag)


def _irecv(
    tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> _Work:
    assert _STATE is not None
    return _STATE.post("recv", tensor, _peer(group, src, group_src), group, tag)


def _send(
    tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> None:
    _isend(tensor, dst, group, tag, group_dst).wait()


def _recv(
    tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> int:
    work = _irecv(tensor, src, group, tag, group_src)
    work.wait()
    return work.peer


def install(deadlock: float | None = None) -> None:
    """Give this process's point-to-point operations NCCL's semantics (see the module's docstring)."""
    global _STATE
    if _STATE is not None:
        return
    for name in ("isend", "irecv", "send", "recv"):
        _REAL[name] = getattr(dist, name)
    if deadlock is None:
        deadlock = float(os.environ.get("GPIPE_RENDEZVOUS_DEADLOCK", "30"))
    _STATE = _State(deadlock)
    dist.isend, dist.irecv, dist.send, dist.recv = _isend, _irecv, _send, _recv  # type: ignore[assignment]


def installed() -> bool:
    return _STATE is not None
