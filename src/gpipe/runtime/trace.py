"""What a real step did: every action's start and end on every worker.

A :class:`StepTrace` comes from an executed step (``Pipeline.last_trace``). It turns into a timeline
(the same :class:`~gpipe.schedule.Simulation` the simulator produces, so the same bubble, pictures and
numbers apply), into per-action costs to feed the simulator, and into a Chrome/Perfetto trace file
(open it at ``chrome://tracing`` or ui.perfetto.dev).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpipe.runtime.executor import TraceEvent
from gpipe.schedule.ir import Action, Schedule
from gpipe.schedule.simulate import Simulation

__all__ = ["StepTrace"]

_KIND_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "backward (input)",
    "W": "backward (weight)",
    "U": "all-gather",
    "G": "reduce-scatter",
    "R": "reshard",
}


@dataclass(frozen=True)
class StepTrace:
    """The recorded actions of one step of ``schedule``."""

    schedule: Schedule
    events: Sequence[TraceEvent]
    peak_activation_bytes: tuple[int, ...] | None = None
    """Per worker, when the step measured memory (``Pipeline(..., measure_memory=True)``)."""

    @property
    def origin_ns(self) -> int:
        return min(e.start_ns for e in self.events)

    def timeline(self) -> Simulation:
        """The measured timeline, in seconds from the step's first action. Under torch.distributed a
        rank records only its own actions: the timeline then holds this rank's worker alone."""
        t0 = self.origin_ns
        spans = {e.action: ((e.start_ns - t0) / 1e9, (e.end_ns - t0) / 1e9) for e in self.events}
        sched = self.schedule
        recorded = tuple(tuple(a for a in acts if a in spans) for acts in sched.actions)
        workers = [w for w, acts in enumerate(recorded) if acts]
        index = {w: i for i, w in enumerate(workers)}
        placement = tuple(index.get(w, -1) for w in sched.placement)  # (-1: a stage recorded elsewhere)
        schedule = Schedule(sched.name, sched.num_stages, sched.num_microbatches,
                            tuple(recorded[w] for w in workers), placement)  # fmt: skip
        return Simulation(schedule, spans)

    def costs(self) -> dict[Action, float]:
        """Each action's measured duration in seconds: ``simulate(schedule, costs.__getitem__)``
        predicts the step from them."""
        return {e.action: (e.end_ns - e.start_ns) / 1e9 for e in self.events}

    def chrome(self) -> dict[str, object]:
        """The trace in Chrome's trace-event format (one row per worker)."""
        t0 = self.origin_ns
        events: list[dict[str, object]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": w, "args": {"name": f"worker {w}"}}
            for w in range(self.schedule.num_workers)
        ]
        for e in self.events:
            a = e.action
            events.append(
                {
                    "name": f"{a.label} s{a.stage}",
                    "cat": _KIND_NAMES[a.kind.value],
                    "ph": "X",
                    "pid": 0,
                    "tid": e.worker,
                    "ts": (e.start_ns - t0) / 1e3,
                    "dur": (e.end_ns - e.start_ns) / 1e3,
                    "args": {"microbatch": a.microbatch, "stage": a.stage, "kind": a.kind.value},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": self.schedule.name}}

    def save_chrome(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`chrome` as JSON to ``path``."""
        out = Path(path)
        out.write_text(json.dumps(self.chrome()))
        return out
