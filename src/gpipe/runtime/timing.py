"""When each action of a step ran, measured where it runs.

A :class:`Trace` is a step's (or a decode's) list of :class:`TraceEvent` — worker, action, start and
end in nanoseconds on the host's ``time.perf_counter_ns`` clock — filled by the executor and the
decode loop through :meth:`Trace.stamp` and :meth:`Trace.add`.

What a stamp measures depends on the device of the action's stage:

- **CPU** (and any device other than CUDA): ``time.perf_counter_ns()`` when the host gets there. A
  CPU kernel runs in the calling thread, so the host's time is the kernel's.
- **CUDA**: the host only launches kernels; their time is the device's. A stamp is a
  ``torch.cuda.Event(enable_timing=True)`` recorded on the device's current stream, so an action's
  span is the time from the point its stream reached its start to the point it reached its end
  (the kernels, plus whatever the stream waited for in between). The first stamp on a device also
  records a *reference* event there together with ``perf_counter_ns``; an event is then expressed
  as ``reference_ns + elapsed_time(reference, event)``, on the host's clock like the CPU's stamps,
  so the stages on CPU and CUDA devices of one pipeline share one timeline. (The reference runs
  when the stream reaches it: after the work queued before the step, if any, which shifts the
  device's timeline by as much; durations are exact.)

Events are resolved lazily: nothing waits for the device while the step runs. The first read of a
trace (its events, ``len`` aside) waits for the events recorded so far — one
``cudaEventSynchronize`` per event, all but the latest normally done already — and converts them;
a trace nobody reads (a step whose planner does not measure, no ``last_trace`` read) never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, overload

import torch

from gpipe.schedule.ir import Action

__all__ = ["DeviceEvent", "Stamp", "Trace", "TraceEvent", "cuda_event"]


class TraceEvent(NamedTuple):
    """One executed action: on which worker, and when (nanoseconds of ``time.perf_counter_ns``;
    on a CUDA device, when its stream ran it — see :mod:`gpipe.runtime.timing`)."""

    worker: int
    action: Action
    start_ns: int
    end_ns: int


class DeviceEvent(Protocol):
    """What a stamp on a CUDA device needs of ``torch.cuda.Event``."""

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: DeviceEvent, /) -> float: ...


def cuda_event(device: torch.device) -> DeviceEvent:
    """A timing event recorded now on ``device``'s current stream."""
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event  # type: ignore[return-value]


@dataclass(frozen=True)
class _Reference:
    host_ns: int
    event: DeviceEvent


@dataclass(frozen=True)
class _Mark:
    """A stamp on a CUDA device: its event and its device's reference."""

    reference: _Reference
    event: DeviceEvent

    def ns(self) -> int:
        return self.reference.host_ns + round(self.reference.event.elapsed_time(self.event) * 1e6)


Stamp = int | _Mark
"""A point in time: host nanoseconds, or a device event not yet resolved."""


class _Pending(NamedTuple):
    worker: int
    action: Action
    start: Stamp
    end: Stamp


class Trace(Sequence[TraceEvent]):
    """The events of one step, in the order they were added; device stamps resolved on first read.

    ``event``: how a stamp on a CUDA device is made (default :func:`cuda_event`; tests give a fake).
    Safe to fill from several worker threads.
    """

    def __init__(self, event: Callable[[torch.device], DeviceEvent] = cuda_event) -> None:
        self._event = event
        self._items: list[TraceEvent | _Pending] = []
        self._first_pending: int | None = None
        self._references: dict[torch.device, _Reference] = {}
        self._lock = threading.Lock()

    def stamp(self, device: torch.device) -> Stamp:
        """Now, on ``device``: host nanoseconds, or an event on a CUDA device's current stream."""
        if device.type != "cuda":
            return time.perf_counter_ns()
        reference = self._references.get(device)
        if reference is None:
            with self._lock:
                reference = self._references.get(device)
                if reference is None:
                    host_ns = time.perf_counter_ns()
                    reference = self._references[device] = _Reference(host_ns, self._event(device))
        return _Mark(reference, self._event(device))

    def add(self, worker: int, action: Action, start: Stamp, end: Stamp) -> None:
        """``action`` ran on ``worker`` from ``start`` to ``end`` (stamps of :meth:`stamp`)."""
        with self._lock:
            if isinstance(start, int) and isinstance(end, int):
                self._items.append(TraceEvent(worker, action, start, end))
            else:
                if self._first_pending is None:
                    self._first_pending = len(self._items)
                self._items.append(_Pending(worker, action, start, end))

    def append(self, event: TraceEvent) -> None:
        """Add an event already in nanoseconds."""
        self.add(*event)

    def _resolved(self) -> list[TraceEvent]:
        with self._lock:
            first = self._first_pending
            if first is not None:
                items = self._items
                pending = [(i, item) for i, item in enumerate(items[first:], first) if isinstance(item, _Pending)]
                for _, item in pending:  # wait for the device once: every event before the last is done
                    for stamp in (item.start, item.end):
                        if isinstance(stamp, _Mark):
                            stamp.event.synchronize()
                for i, item in pending:
                    start, end = (s if isinstance(s, int) else s.ns() for s in (item.start, item.end))
                    items[i] = TraceEvent(item.worker, item.action, start, end)
                self._first_pending = None
            return self._items  # type: ignore[return-value]  # every item resolved

    @property
    def pending(self) -> int:
        """How many events still wait for their device (0 once read)."""
        with self._lock:
            return sum(isinstance(item, _Pending) for item in self._items)

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> TraceEvent: ...
    @overload
    def __getitem__(self, index: slice) -> list[TraceEvent]: ...
    def __getitem__(self, index: int | slice) -> TraceEvent | list[TraceEvent]:
        return self._resolved()[index]

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(list(self._resolved()))

    def __repr__(self) -> str:
        return f"Trace({list(self._resolved())!r})"
