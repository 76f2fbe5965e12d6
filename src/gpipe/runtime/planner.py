"""Which schedule a step runs: a fixed generator's, or ``'auto'``'s, planned from measured costs.

A fixed schedule is generated once per number of micro-batches M. ``schedule='auto'`` (or an
:class:`AutoSchedule` with options) is the zero-bubble paper's answer to uneven costs, made at run
time: the first step at a given M runs a schedule planned for equal costs within the memory cap, its
actions timed; from that trace — every rank's under torch.distributed, gathered so that all ranks
plan from the same numbers and build the same schedule — come each stage's median F, I, W and B, the
hand-over time (how long an action waited past the end of the action on another worker it needed,
when nothing else held it up), how much action times vary (``jitter``) and, for a cap in bytes, each
stage's activation bytes per micro-batch (measured with the activation meter).
:func:`gpipe.schedule.auto.plan` then builds the fastest schedule that fits the cap. Costs are
measured again after the second step (without the first step's one-time costs) and every
``replan_every`` steps after; a new plan is made when some stage's cost moved by more than
``drift``. A measuring step runs its schedule with the backward of even micro-batches fused (B) and
of odd ones split (I, W) — :func:`mixed_backwards`, no more memory — so that both kinds of backward
stay measured, whichever the plan prefers.

With ``sharded=True`` (FSDP-sharded stages) every schedule a planner hands out is
:func:`gpipe.schedule.ir.sharded` of the one it would hand out otherwise: each stage's parameters
gathered once (U) and its gradients reduce-scattered once (G) per step, then freed (R). Plans are made,
and costs measured, without them (a trace's U, G and R are left out of the costs).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpipe.memory import ActivationMeter
from gpipe.runtime.executor import TraceEvent
from gpipe.schedule.auto import Plan, StageCosts, plan
from gpipe.schedule.generate import make_schedule
from gpipe.schedule.ir import STAGE_WIDE, Action, ActionKind, Schedule, dependencies, validate
from gpipe.schedule.ir import sharded as shard_stages

Span = tuple[int, Action, int, int]
"""An executed action: (worker, action, start, end), in nanoseconds of ``time.perf_counter_ns``."""

__all__ = ["AutoPlanner", "AutoSchedule", "FixedPlanner", "Planner", "mixed_backwards", "parse_memory_cap"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory_cap(cap: int | str | None) -> tuple[str, float] | None:
    """``('microbatches', n)`` for an int, ``('bytes', n)`` for a size such as ``'512MiB'`` or
    ``'2GB'``; None for no cap."""
    if cap is None:
        return None
    if isinstance(cap, int) and not isinstance(cap, bool):
        if cap <= 0:
            raise ValueError(f"memory_cap must be positive (memory_cap: {cap}): micro-batches a worker may hold")
        return "microbatches", float(cap)
    if isinstance(cap, str):
        found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", cap.lower())
        if found and found.group(2) in _UNITS and float(found.group(1)) > 0:
            return "bytes", float(found.group(1)) * _UNITS[found.group(2)]
    raise ValueError(
        f"memory_cap must be a number of micro-batches (an int) or a size in bytes such as '512MiB' or '2GB' "
        f"(memory_cap: {cap!r})"
    )


@dataclass(frozen=True, kw_only=True)
class AutoSchedule:
    """Options of ``schedule='auto'``.

    Args:
        memory_cap: per worker, the most activation memory a step may hold: micro-batches (an int:
            one micro-batch's activations on one stage counts 1) or bytes (``'512MiB'``, ``'2GB'``,
            measured as ``Pipeline(measure_memory=True)`` does). None: no cap.
        costs: plan from these costs (e.g. what ``gpipe schedule --auto`` was given) instead of
            measuring them; the schedule then never changes.
        replan_every: steps between measurements after the second step.
        drift: the relative change of a stage's cost that makes a new plan.
    """

    memory_cap: int | str | None = None
    costs: StageCosts | None = None
    replan_every: int = 50
    drift: float = 0.25

    def __post_init__(self) -> None:
        parse_memory_cap(self.memory_cap)
        if self.costs is not None and not isinstance(self.costs, StageCosts):
            raise TypeError(f"costs must be a gpipe.schedule.StageCosts (costs: {self.costs!r})")
        if not isinstance(self.replan_every, int) or self.replan_every <= 0:
            raise ValueError(f"replan_every must be a positive integer (replan_every: {self.replan_every!r})")
        if not isinstance(self.drift, (int, float)) or not self.drift >= 0:
            raise ValueError(f"drift must be a fraction >= 0 (drift: {self.drift!r})")


class Planner:
    """The schedule of each step (an interface: see :class:`FixedPlanner` and :class:`AutoPlanner`)."""

    name: str

    def schedule_for(self, microbatches: int) -> Schedule:
        raise NotImplementedError

    def measures_memory(self, microbatches: int) -> bool:
        """Whether the next step at ``microbatches`` should meter activation memory for the plan."""
        return False

    def observe(
        self, microbatches: int, schedule: Schedule, events: Sequence[TraceEvent], meter: ActivationMeter | None
    ) -> None:
        """A step at ``microbatches`` ran ``schedule``: its trace, and its meter where it measured memory."""


def _sharded(schedule: Schedule) -> Schedule:
    """``schedule`` with its stages sharded (U, G, R per stage), validated."""
    out = shard_stages(schedule)
    validate(out)
    return out


class FixedPlanner(Planner):
    """A generator's schedule, made once per number of micro-batches (``sharded``: with its stages
    sharded, :func:`gpipe.schedule.ir.sharded`)."""

    def __init__(self, name: str, workers: int, virtual: int, *, sharded: bool = False) -> None:
        self.name, self.workers, self.virtual, self.sharded = name, workers, virtual, sharded

    @functools.lru_cache(maxsize=16)  # noqa: B019 - a few M per pipeline
    def schedule_for(self, microbatches: int) -> Schedule:
        schedule = make_schedule(self.name, self.workers, microbatches, self.virtual)
        return _sharded(schedule) if self.sharded else schedule


class AutoPlanner(Planner):
    """``schedule='auto'``: plans from the costs measured at each number of micro-batches.

    ``gather(value)`` returns every rank's value (in rank order; ``[value]`` in one process);
    ``replica`` is this process's data-parallel replica; ``sharded``: every schedule handed out has its
    stages sharded (:func:`gpipe.schedule.ir.sharded`; the plans have not)."""

    name = "auto"

    def __init__(
        self,
        workers: int,
        placement: Sequence[int],
        options: AutoSchedule,
        gather: Callable[[Any], list[Any]],
        replica: int = 0,
        *,
        sharded: bool = False,
    ) -> None:
        self.workers, self.placement, self.options, self.gather = workers, tuple(placement), options, gather
        self.replica, self.sharded = replica, sharded
        self._handed: dict[int, tuple[Schedule, Schedule]] = {}  # id(plan's schedule) -> (it, sharded)
        self.cap = parse_memory_cap(options.memory_cap)
        self.num_stages = len(self.placement)
        self.costs: dict[int, StageCosts] = {}
        self.plans: dict[int, Plan] = {}
        self.steps: dict[int, int] = {}
        self.replans = 0
        self.last_plan: Plan | None = None
        """The plan of the latest step's schedule."""

    def _minimum(self) -> tuple[float, ...]:
        return tuple(float(self.placement.count(w)) for w in range(self.workers))

    def schedule_for(self, microbatches: int) -> Schedule:
        found = self.plans.get(microbatches)
        if found is None:
            costs = self.options.costs or self.costs.get(microbatches)
            cap: float | tuple[float, ...] | None = None
            probe = costs is None
            if costs is None:  # not measured yet: plan for equal costs
                costs = StageCosts.uniform(self.num_stages)
                if self.cap is not None:  # a cap in bytes is not known in micro-batches yet: the least memory
                    cap = self.cap[1] if self.cap[0] == "microbatches" else self._minimum()
            elif self.cap is not None:
                cap = self.cap[1]
            found = plan(self.workers, microbatches, costs, memory_cap=cap, placement=self.placement)
            if probe:  # measure the fused and the split backward alike
                chosen = f"{found.chosen} for equal costs, backwards half fused, half split (measuring)"
                found = dataclasses.replace(found, schedule=mixed_backwards(found.schedule), chosen=chosen)
            self.plans[microbatches] = found
        self.last_plan = found
        step = self.steps.get(microbatches, 0) + 1
        if step > 1 and self.options.costs is None and self._measuring(step):
            # A measuring step measures the fused and the split backward alike, whatever the plan runs.
            return self._hand_out(mixed_backwards(found.schedule))
        return self._hand_out(found.schedule)

    def _hand_out(self, schedule: Schedule) -> Schedule:
        """``schedule``, or with its stages sharded: made once per schedule, so that a step gets the
        same object each time (the transports key their routes by it)."""
        if not self.sharded:
            return schedule
        found = self._handed.get(id(schedule))
        if found is None or found[0] is not schedule:
            if len(self._handed) > 16:  # a plan's and a measuring step's per M, a few M
                self._handed.clear()
            found = self._handed[id(schedule)] = (schedule, _sharded(schedule))
        return found[1]

    def measures_memory(self, microbatches: int) -> bool:
        return (
            self.cap is not None
            and self.cap[0] == "bytes"
            and self.options.costs is None
            and self._measuring(self.steps.get(microbatches, 0) + 1)
        )

    def _measuring(self, step: int) -> bool:
        return step in (1, 2) or step % self.options.replan_every == 0

    def observe(
        self, microbatches: int, schedule: Schedule, events: Sequence[TraceEvent], meter: ActivationMeter | None
    ) -> None:
        step = self.steps[microbatches] = self.steps.get(microbatches, 0) + 1
        if self.options.costs is not None or not self._measuring(step):
            return
        spans = [(e.worker, e.action, e.start_ns, e.end_ns) for e in events]
        found = self.gather((self.replica, spans, dict(meter.stage_peak) if meter is not None else None))
        old = self.costs.get(microbatches)
        kinds = {(a.stage, a.kind) for _, spans, _ in found for _, a, _, _ in spans}
        costs = self._merged(self._measured(found, schedule), kinds, old)
        if old is not None and old.memory is not None and costs.memory is not None:
            # the most bytes a micro-batch held: a split backward holds more than a fused one
            costs = dataclasses.replace(costs, memory=tuple(map(max, old.activation, costs.activation)))
        if old is None or _drift(old, costs) > self.options.drift or costs.activation != old.activation:
            self.costs[microbatches] = costs
            self.plans.pop(microbatches, None)
            self.replans += 1

    def _measured(self, found: list[tuple[int, list[Span], dict[int, int] | None]], schedule: Schedule) -> StageCosts:
        """Costs from every rank's (replica, spans, per-stage bytes): durations averaged over the
        replicas, hand-over waits taken within each replica (its ranks' clocks are compared)."""
        durations: dict[Action, list[float]] = {}
        peaks: dict[int, int] = {}
        by_replica: dict[int, list[Span]] = {}
        for replica, spans, stage_peak in found:
            for _, action, start, end in spans:
                durations.setdefault(action, []).append((end - start) / 1e9)
            by_replica.setdefault(replica, []).extend(spans)
            for s, b in (stage_peak or {}).items():
                peaks[s] = max(peaks.get(s, 0), b)
        waits = [w for spans in by_replica.values() for w in _handover_waits(spans, schedule)]
        mean = {a: sum(v) / len(v) for a, v in durations.items()}
        memory = None
        if self.cap is not None and self.cap[0] == "bytes" and peaks:
            memory = [float(peaks.get(s, max(peaks.values()))) for s in range(self.num_stages)]
        transfer = statistics.median(waits) if waits else 0.0
        return StageCosts.from_trace(mean, self.num_stages, memory=memory, transfer=transfer)

    def _merged(self, new: StageCosts, trace: set[tuple[int, ActionKind]], old: StageCosts | None) -> StageCosts:
        """``new``, with what its trace did not measure (a fused B where every backward was split,
        I and W where none was) taken from ``old``'s measurement."""
        if old is None:
            return new
        fused, inputs, weights = list(new.fused), list(new.input), list(new.weight)
        estimated = list(new.split_estimated or ())
        for s in range(self.num_stages):
            if (s, ActionKind.BACKWARD) not in trace:
                fused[s] = old.fused[s]
            if estimated[s] and old.split_estimated is not None and not old.split_estimated[s]:
                inputs[s], weights[s], estimated[s] = old.input[s], old.weight[s], False
        return dataclasses.replace(
            new, input=tuple(inputs), weight=tuple(weights), backward=tuple(fused), split_estimated=tuple(estimated)
        )


def _handover_waits(spans: Sequence[Span], schedule: Schedule) -> list[float]:
    """For every action that needed an action of another worker and was held up by nothing else
    (its worker was idle when the other ended): how long after that end it started, in seconds."""
    where = {a: (w, start, end) for w, a, start, end in spans}
    previous_end: dict[Action, int] = {}
    for w in {w for w, _, _, _ in spans}:
        mine = sorted(((start, end, a) for v, a, start, end in spans if v == w), key=lambda t: (t[0], t[1]))
        for (_, end, _), (_, _, a) in itertools.pairwise(mine):
            previous_end[a] = end
    waits = []
    placement, present = schedule.placement, set(schedule)
    for a, (_, start, _) in where.items():
        if a.kind is ActionKind.BACKWARD_WEIGHT:
            continue
        for d in dependencies(a, schedule, present):
            if d in where and placement[d.stage] != placement[a.stage]:
                _, _, produced = where[d]
                if previous_end.get(a, 0) <= produced <= start:
                    waits.append((start - produced) / 1e9)
    return waits


def mixed_backwards(schedule: Schedule) -> Schedule:
    """``schedule`` with the backward of even micro-batches fused (B) and of odd ones split (I, then
    W at once, or where the schedule had it): a step that measures both kinds of backward, holding
    no more memory than ``schedule`` (a fused backward frees a micro-batch no later than its W). A
    sharded schedule's U, G and R stay where they are (G, R after the stage's last B or W still)."""
    odd = {(a.microbatch, a.stage) for a in schedule if a.microbatch % 2 and a.kind not in STAGE_WIDE}
    out = []
    for acts in schedule.actions:
        seq: list[Action] = []
        has_w = {(a.microbatch, a.stage) for a in acts if a.kind is ActionKind.BACKWARD_WEIGHT}
        for a in acts:
            key = (a.microbatch, a.stage)
            if a.kind is ActionKind.BACKWARD and key in odd:
                seq += [Action(ActionKind.BACKWARD_INPUT, *key), Action(ActionKind.BACKWARD_WEIGHT, *key)]
            elif a.kind is ActionKind.BACKWARD_INPUT and key not in odd:
                seq.append(Action(ActionKind.BACKWARD, *key))
            elif a.kind is ActionKind.BACKWARD_INPUT and key not in has_w:
                seq += [a, Action(ActionKind.BACKWARD_WEIGHT, *key)]
            elif not (a.kind is ActionKind.BACKWARD_WEIGHT and key not in odd):
                seq.append(a)
        out.append(tuple(seq))
    mixed = Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, tuple(out), schedule.placement)
    validate(mixed)
    return mixed


def _drift(old: StageCosts, new: StageCosts) -> float:
    """The largest relative change of a stage's F, I, W or B."""
    worst = 0.0
    for a, b in zip(old.forward + old.input + old.weight + old.fused, new.forward + new.input + new.weight + new.fused):
        worst = max(worst, abs(b - a) / max(a, 1e-12))
    return worst
