"""gpipe.runtime.timing: host stamps on the CPU; on CUDA, events resolved lazily against a reference.

CUDA cannot run here: the CUDA path's resolution is checked with a fake event class whose device
times the test sets (``torch.cuda.Event``'s ``synchronize`` and ``elapsed_time``, in milliseconds).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import ClassVar

import pytest
import torch

from gpipe.runtime.timing import Trace, TraceEvent
from gpipe.schedule.ir import Action, ActionKind

CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


def fwd(m: int, s: int) -> Action:
    return Action(ActionKind.FORWARD, m, s)


class FakeEvent:
    """A recorded event whose device time (ms) the test sets; counts the host's waits."""

    made: ClassVar[list[FakeEvent]] = []

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.device_ms: float | None = None  # None: the stream has not reached it yet
        self.waits = 0
        FakeEvent.made.append(self)

    def synchronize(self) -> None:
        self.waits += 1
        assert self.device_ms is not None, "waited for an event the device never reaches"

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.device_ms is not None and end_event.device_ms is not None, "elapsed_time before completion"
        assert self.device == end_event.device
        return end_event.device_ms - self.device_ms


@pytest.fixture
def events() -> list[FakeEvent]:
    FakeEvent.made = []
    return FakeEvent.made


def test_cpu_stamps_are_host_nanoseconds() -> None:
    trace = Trace(event=lambda d: pytest.fail("a CPU stamp made a device event"))
    before = time.perf_counter_ns()
    start = trace.stamp(CPU)
    end = trace.stamp(CPU)
    after = time.perf_counter_ns()
    assert isinstance(start, int) and isinstance(end, int)
    assert before <= start <= end <= after
    trace.add(0, fwd(0, 0), start, end)
    trace.append(TraceEvent(1, fwd(0, 1), end, after))
    assert trace.pending == 0
    assert list(trace) == [TraceEvent(0, fwd(0, 0), start, end), TraceEvent(1, fwd(0, 1), end, after)]
    assert trace[1].start_ns == end and trace[-1].end_ns == after and len(trace) == 2


def test_cuda_events_resolve_against_the_reference(events: list[FakeEvent]) -> None:
    trace = Trace(event=FakeEvent)
    before = time.perf_counter_ns()
    start = trace.stamp(CUDA0)  # the first stamp on a device records its reference first
    end = trace.stamp(CUDA0)
    after = time.perf_counter_ns()
    reference, e_start, e_end = events
    trace.add(2, fwd(3, 1), start, end)
    # the device's times: the reference at 10 ms, the action from 10.5 ms to 12.25 ms
    reference.device_ms, e_start.device_ms, e_end.device_ms = 10.0, 10.5, 12.25
    assert len(trace) == 1 and trace.pending == 1  # len does not wait
    assert all(e.waits == 0 for e in events)
    (event,) = list(trace)
    assert event.worker == 2 and event.action == fwd(3, 1)
    assert event.end_ns - event.start_ns == 1_750_000  # the device's duration, not the host's
    assert before <= event.start_ns - 500_000 <= after  # the reference: host time when recorded
    assert trace.pending == 0


def test_resolution_waits_once_per_event_and_only_when_read(events: list[FakeEvent]) -> None:
    trace = Trace(event=FakeEvent)
    for m in range(3):
        trace.add(0, fwd(m, 0), trace.stamp(CUDA0), trace.stamp(CUDA0))
    for i, e in enumerate(events):
        e.device_ms = float(i)
    assert sum(e.waits for e in events) == 0  # nobody read it: no wait
    first = [(e.start_ns, e.end_ns) for e in trace]
    waits = [e.waits for e in events]
    assert waits[0] == 0 and waits[1:] == [1] * 6  # each action's events once; the reference not at all
    assert [(e.start_ns, e.end_ns) for e in trace] == first  # read again: no further wait
    assert [e.waits for e in events] == waits
    assert [e - s for s, e in first] == [1_000_000] * 3
    assert [s2 - s1 for (s1, _), (s2, _) in itertools.pairwise(first)] == [2_000_000] * 2


def test_mixed_devices_keep_their_order_and_one_reference_per_device(events: list[FakeEvent]) -> None:
    trace = Trace(event=FakeEvent)
    trace.add(0, fwd(0, 0), trace.stamp(CUDA0), trace.stamp(CUDA0))  # 3 events (reference + 2)
    trace.add(1, fwd(0, 1), trace.stamp(CPU), trace.stamp(CPU))
    trace.add(2, fwd(0, 2), trace.stamp(CUDA1), trace.stamp(CUDA1))  # 3 more (its own reference)
    trace.add(0, fwd(1, 0), trace.stamp(CUDA0), trace.stamp(CUDA0))  # 2 more
    assert len(events) == 8
    assert [e.device for e in events].count(CUDA1) == 3
    for e in events:
        e.device_ms = 4.0
    assert trace.pending == 3
    assert [(e.worker, e.action) for e in trace] == [(0, fwd(0, 0)), (1, fwd(0, 1)), (2, fwd(0, 2)), (0, fwd(1, 0))]
    assert all(e.end_ns >= e.start_ns for e in trace)


def test_events_added_after_a_read_are_resolved_at_the_next(events: list[FakeEvent]) -> None:
    trace = Trace(event=FakeEvent)
    trace.add(0, fwd(0, 0), trace.stamp(CUDA0), trace.stamp(CUDA0))
    for e in events:
        e.device_ms = 1.0
    assert trace[0].end_ns == trace[0].start_ns
    trace.add(0, fwd(1, 0), trace.stamp(CUDA0), trace.stamp(CUDA0))
    events[-2].device_ms, events[-1].device_ms = 2.0, 5.0
    assert trace[1].end_ns - trace[1].start_ns == 3_000_000
    assert trace[1].start_ns - trace[0].start_ns == 1_000_000


def test_threads_share_one_reference_per_device(events: list[FakeEvent]) -> None:
    trace = Trace(event=FakeEvent)
    barrier = threading.Barrier(4)

    def work(w: int) -> None:
        barrier.wait()
        for m in range(50):
            trace.add(w, fwd(m, w), trace.stamp(CUDA0), trace.stamp(CUDA0))

    pool = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert len(events) == 1 + 4 * 50 * 2
    for e in events:
        e.device_ms = 0.0
    assert len(list(trace)) == 200 and {e.action for e in trace} == {fwd(m, w) for m in range(50) for w in range(4)}


def test_a_pipeline_step_on_cpu_records_host_times() -> None:
    import gpipe

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    pipe = gpipe.Pipeline(model, [2, 1], devices=["cpu", "cpu"], chunks=2, loss_fn=torch.nn.functional.mse_loss)
    before = time.perf_counter_ns()
    pipe.step(torch.randn(4, 4), torch.randn(4, 2))
    after = time.perf_counter_ns()
    events = pipe.last_trace.events
    assert isinstance(events, Trace) and events.pending == 0 and len(events) == 8
    assert all(before <= e.start_ns <= e.end_ns <= after for e in events)
