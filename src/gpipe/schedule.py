"""The schedule IR: a pipeline schedule as plain data.

A schedule says, for every worker (a device in one process, or a rank), the ordered list of actions it
runs in one training step. An action is the forward (F) or the backward (B) of micro-batch ``m`` on
stage ``s``. Dependencies between actions are implied by the model and are the same for every
schedule::

    F(m, s) needs F(m, s-1)             the activation from the previous stage
    B(m, s) needs F(m, s) and B(m, s+1) its own forward, and the gradient from the next stage

Schedules are *generated* (pure functions of K stages and M micro-batches), *validated* (every action
exactly once, no backward before its forward, no dependency that can never be met), *simulated* (a
timeline from per-action costs: makespan, bubble, peak in-flight activations) and then *executed*.
Executors only ever see this IR, so a new schedule never touches an executor.

The fill-drain schedule of the paper (Figure 2c), K=3 stages and M=4 micro-batches, unit costs::

    stage 0 | F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
    stage 1 | .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
    stage 2 | .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

Its bubble — the idle fraction of the step — is (K-1)/(M+K-1).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "dependencies",
    "execution_order",
    "fill_drain",
    "make_schedule",
    "simulate",
    "validate",
]


class ScheduleError(ValueError):
    """A schedule that cannot be run: a missing, duplicate or misplaced action, or a deadlock."""


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, slots=True)
class Action:
    """One step of work on one stage: ``kind`` of micro-batch ``microbatch`` on ``stage``."""

    kind: ActionKind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}@stage{self.stage}"


def F(microbatch: int, stage: int) -> Action:  # noqa: N802 - the paper's letter
    return Action(ActionKind.FORWARD, microbatch, stage)


def B(microbatch: int, stage: int) -> Action:  # noqa: N802
    return Action(ActionKind.BACKWARD, microbatch, stage)


@dataclass(frozen=True)
class Schedule:
    """Per worker, the ordered actions of one step.

    ``actions[w]`` is worker ``w``'s list. Every stage's actions sit on one worker; with one stage per
    worker, stage ``s`` runs on worker ``s``.
    """

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_workers(self) -> int:
        return len(self.actions)

    def worker_of(self) -> dict[int, int]:
        """Which worker runs each stage (from the stages' forward actions)."""
        return {a.stage: w for w, acts in enumerate(self.actions) for a in acts}

    def only(self, kind: ActionKind) -> Schedule:
        """The same schedule with only the actions of ``kind`` (a phase of a fill-drain step)."""
        acts = tuple(tuple(a for a in w if a.kind is kind) for w in self.actions)
        return Schedule(self.name, self.num_stages, self.num_microbatches, acts)


def dependencies(action: Action, num_stages: int) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes."""
    m, s = action.microbatch, action.stage
    if action.kind is ActionKind.FORWARD:
        return (F(m, s - 1),) if s > 0 else ()
    return (F(m, s), B(m, s + 1)) if s < num_stages - 1 else (F(m, s),)


def fill_drain(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe's schedule: every stage runs all forwards, then all backwards in reverse order."""
    _check_sizes(num_stages, num_microbatches)
    ms = range(num_microbatches)
    acts = tuple(tuple(F(m, s) for m in ms) + tuple(B(m, s) for m in reversed(ms)) for s in range(num_stages))
    return Schedule("gpipe", num_stages, num_microbatches, acts)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": fill_drain, "fill-drain": fill_drain}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Generate and validate the schedule called ``name``."""
    try:
        generate = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None
    schedule = generate(num_stages, num_microbatches)
    validate(schedule)
    return schedule


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages <= 0 or num_microbatches <= 0:
        raise ValueError(
            "a schedule needs at least one stage and one micro-batch "
            f"(stages: {num_stages}, micro-batches: {num_microbatches})"
        )


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` pointing at the first offending action, if any."""
    _check_sizes(schedule.num_stages, schedule.num_microbatches)
    seen: dict[Action, tuple[int, int]] = {}
    stage_worker: dict[int, int] = {}
    for w, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            where = f"worker {w}, position {i}"
            if not (0 <= a.stage < schedule.num_stages and 0 <= a.microbatch < schedule.num_microbatches):
                raise ScheduleError(
                    f"{a} at {where} is out of range "
                    f"(stages: {schedule.num_stages}, micro-batches: {schedule.num_microbatches})"
                )
            if a in seen:
                raise ScheduleError(f"{a} at {where} is a duplicate of worker {seen[a][0]}, position {seen[a][1]}")
            if stage_worker.setdefault(a.stage, w) != w:
                raise ScheduleError(f"{a} at {where}: stage {a.stage} already runs on worker {stage_worker[a.stage]}")
            if a.kind is ActionKind.BACKWARD and F(a.microbatch, a.stage) not in seen:
                raise ScheduleError(f"{a} at {where} comes before its forward {F(a.microbatch, a.stage)}")
            seen[a] = (w, i)
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            for a in (F(m, s), B(m, s)):
                if a not in seen:
                    raise ScheduleError(
                        f"schedule {schedule.name!r} has no {a}: every stage needs F and B of every micro-batch"
                    )
    _walk(schedule, lambda a: 1.0)


def _walk(schedule: Schedule, cost: Callable[[Action], float]) -> dict[Action, tuple[float, float]]:
    """Start and end time of every action when each worker runs its list in order and waits for
    dependencies. Dependencies outside the schedule (an earlier phase's) count as done. Raises
    :class:`ScheduleError` on a deadlock."""
    present = {a for acts in schedule.actions for a in acts}
    spans: dict[Action, tuple[float, float]] = {}
    pos = [0] * schedule.num_workers
    free = [0.0] * schedule.num_workers
    progress = True
    while progress:
        progress = False
        for w, acts in enumerate(schedule.actions):
            while pos[w] < len(acts):
                a = acts[pos[w]]
                deps = [d for d in dependencies(a, schedule.num_stages) if d in present]
                if any(d not in spans for d in deps):
                    break
                start = max([free[w], *(spans[d][1] for d in deps)])
                free[w] = start + cost(a)
                spans[a] = (start, free[w])
                pos[w] += 1
                progress = True
    stuck = [
        f"worker {w} at {acts[pos[w]]} (waits for "
        + ", ".join(str(d) for d in dependencies(acts[pos[w]], schedule.num_stages) if d in present and d not in spans)
        + ")"
        for w, acts in enumerate(schedule.actions)
        if pos[w] < len(acts)
    ]
    if stuck:
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))
    return spans


def execution_order(schedule: Schedule) -> list[Action]:
    """All actions in one sequence that respects every dependency and every worker's order (for
    running a schedule, or a phase of one, on a single thread)."""
    spans = _walk(schedule, lambda a: 1.0)
    return sorted(spans, key=lambda a: spans[a])


@dataclass(frozen=True)
class Simulation:
    """A schedule's timeline under given action costs."""

    schedule: Schedule
    spans: dict[Action, tuple[float, float]]
    makespan: float
    busy: tuple[float, ...]
    peak_in_flight: tuple[int, ...]

    @property
    def bubble(self) -> float:
        """Idle fraction of all workers over the step."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def worker_bubble(self) -> tuple[float, ...]:
        return tuple(1.0 - b / self.makespan for b in self.busy)

    def text(self) -> str:
        """The timeline as a small table: one row per worker, one column per unit of time."""
        width = max(len(f"{a.kind.value}{a.microbatch}") for a in self.spans) + 1
        cols = round(self.makespan)
        rows = []
        for w, acts in enumerate(self.schedule.actions):
            cells = [".".ljust(width)] * cols
            for a in acts:
                start, end = self.spans[a]
                for t in range(round(start), round(end)):
                    cells[t] = f"{a.kind.value}{a.microbatch}".ljust(width)
            rows.append(f"worker {w} | " + "".join(cells).rstrip())
        return "\n".join(rows)


def simulate(schedule: Schedule, cost: Callable[[Action], float] | None = None) -> Simulation:
    """Run ``schedule`` on paper: each action takes ``cost(action)`` (1 by default) and starts as
    soon as its worker is free and its dependencies are done."""
    validate(schedule)
    spans = _walk(schedule, cost or (lambda a: 1.0))
    makespan = max(end for _, end in spans.values())
    busy = tuple(sum(spans[a][1] - spans[a][0] for a in acts) for acts in schedule.actions)
    return Simulation(schedule, spans, makespan, busy, tuple(_peak(acts) for acts in schedule.actions))


def _peak(actions: Sequence[Action]) -> int:
    live = peak = 0
    for a in actions:
        live += 1 if a.kind is ActionKind.FORWARD else -1
        peak = max(peak, live)
    return peak
