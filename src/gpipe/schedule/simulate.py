"""The simulator: a schedule's timeline from per-action costs.

Each worker runs its actions in order; an action starts as soon as its worker is free and the actions
it depends on have ended. From the timeline: the makespan, every worker's busy and idle time, the
bubble (the idle fraction of the step), and the peak number of micro-batches whose activations a
worker holds (counted from a forward to the backward that frees them: B, or W after a split backward;
in a decode, which keeps no activations, the key/value caches a worker holds instead). A sharded
schedule's stage-wide actions (U, G, R: :func:`gpipe.schedule.ir.sharded`) cost nothing unless a cost
names them, so it simulates as its unsharded schedule does; :attr:`Simulation.collectives` counts them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpipe.schedule.ir import RELEASES, STAGE_WIDE, Action, ActionKind, Schedule, Transfer, timeline, validate

__all__ = ["Simulation", "kind_cost", "simulate", "unit_cost"]

Cost = Callable[[Action], float]


def unit_cost(action: Action) -> float:
    """Every action takes one unit of time; a stage-wide one (U, G, R) none."""
    return 0.0 if action.kind in STAGE_WIDE else 1.0


def kind_cost(**costs: float) -> Cost:
    """Costs by kind, e.g. ``kind_cost(F=1, B=2, I=1, W=1)`` or ``kind_cost(U=0.5, G=0.5)``; a kind
    not named costs 1, a stage-wide one (U, G, R) 0."""
    return lambda a: float(costs.get(a.kind.value, 0.0 if a.kind in STAGE_WIDE else 1.0))


@dataclass(frozen=True)
class Simulation:
    """A schedule's timeline under given action costs (``spans``: action → (start, end))."""

    schedule: Schedule
    spans: Mapping[Action, tuple[float, float]]

    @property
    def makespan(self) -> float:
        return max(end for _, end in self.spans.values()) - min(start for start, _ in self.spans.values())

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(sum(self.spans[a][1] - self.spans[a][0] for a in acts) for acts in self.schedule.actions)

    @property
    def idle(self) -> tuple[float, ...]:
        """Idle time of each worker within the step (the bubble's size)."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> float:
        """Idle fraction of all workers over the step."""
        return sum(self.idle) / (len(self.busy) * self.makespan)

    @property
    def worker_bubble(self) -> tuple[float, ...]:
        return tuple(i / self.makespan for i in self.idle)

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Per worker, the most micro-batches (over all its stages) holding activations at once.

        A decode's forwards keep no activations (no backward will want them), but each group keeps a
        key/value cache on every stage from its first step to its last: there it is the caches a
        worker holds, one per group on each of its stages (``G`` with one stage per worker)."""
        fb = self.schedule.feedback
        if fb:
            return tuple(
                len({(a.microbatch % fb, a.stage) for a in acts if a.kind not in STAGE_WIDE})
                for acts in self.schedule.actions
            )
        return tuple(peak_in_flight(acts) for acts in self.schedule.actions)

    @property
    def collectives(self) -> tuple[tuple[int, int], ...]:
        """Per worker, its (all-gathers, reduce-scatters) of a step: the U and G actions of a sharded
        schedule, one each per stage it holds (no G in a forward-only step); (0, 0) unsharded."""
        return tuple(
            (
                sum(a.kind is ActionKind.UNSHARD for a in acts),
                sum(a.kind is ActionKind.REDUCE_GRAD for a in acts),
            )
            for acts in self.schedule.actions
        )

    def text(self) -> str:
        """The timeline as a small table: one row per worker, one column per unit of time (for
        schedules simulated with integer costs). A cell is an action and its micro-batch (``F3``), in
        a decode the group and its step (``g1t3``, :meth:`Schedule.label`); where a worker holds
        several stages, also the stage's letter on that worker (``F3b``: its second stage), and a last
        line says which stages the letters are. An action that takes no time (a stage-wide one at no
        cost) takes no cell."""
        origin = min(start for start, _ in self.spans.values())
        sched = self.schedule
        held = [sched.stages_of(w) for w in range(sched.num_workers)]
        several = any(len(stages) > 1 for stages in held)
        labels = {
            a: sched.label(a) + (_letter(held[w].index(a.stage)) if several else "")
            for w, acts in enumerate(sched.actions)
            for a in acts
        }
        width = max(map(len, labels.values())) + 1
        rows = []
        for w, acts in enumerate(sched.actions):
            cells = [".".ljust(width)] * round(self.makespan)
            for a in acts:
                start, end = self.spans[a]
                for t in range(round(start - origin), round(end - origin)):
                    cells[t] = labels[a].ljust(width)
            rows.append(f"worker {w} | " + "".join(cells).rstrip())
        if several:
            named = (" ".join(f"{_letter(i)}={s}" for i, s in enumerate(stages)) for stages in held)
            rows.append("stage of each letter: " + ", ".join(f"worker {w} {n}" for w, n in enumerate(named)))
        return "\n".join(rows)


def _letter(i: int) -> str:
    """The name of a worker's ``i``-th stage in a text timeline: a, b, ..., z, aa, ab, ..."""
    name = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        name = chr(ord("a") + r) + name
    return name


def peak_in_flight(actions: Sequence[Action]) -> int:
    live = peak = 0
    for a in actions:
        if a.kind is ActionKind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind in RELEASES:
            live -= 1
    return peak


def simulate(schedule: Schedule, cost: Cost | None = None, *, transfer: Transfer = 0.0) -> Simulation:
    """Run ``schedule`` on paper with ``cost(action)`` per action (1 by default).

    ``transfer`` is the latency of a hand-over between workers: an action waits that much longer
    for a dependency computed on another worker (an activation or a gradient sent between stages
    placed apart). A number, or a function of (producer, consumer) called only for such
    dependencies; 0 by default (hand-overs are free).
    """
    if not callable(transfer) and not (transfer >= 0 and math.isfinite(transfer)):
        raise ValueError(f"transfer time must be a finite number >= 0 (got {transfer!r})")
    validate(schedule)
    return Simulation(schedule, timeline(schedule, cost or unit_cost, transfer))
