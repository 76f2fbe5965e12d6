"""The cost-adaptive schedule (``schedule='auto'``): the fastest schedule for measured costs, as a pure
function of them.

Inputs are per-stage costs (:class:`StageCosts`: the time of F, I, W and B on every stage, the
activation memory one micro-batch holds there, and the time a hand-over between workers takes), the
number of workers and micro-batches, where the stages live, and optionally a per-worker cap on
activation memory. :func:`plan` builds candidate schedules, simulates each with those costs and keeps
the one with the shortest step that fits the cap; :func:`auto_schedule` returns just that schedule.

The candidates:

* every fixed generator in :data:`~gpipe.schedule.generate.SCHEDULES` (looked up at call time) whose
  placement is the requested one — 'gpipe', '1f1b', 'zb-h1', ... for one stage per worker;
* a greedy list scheduler in the spirit of the automatic scheduler of the zero-bubble paper (Qi et al.,
  2024), run with a few settings of its heuristic. It walks simulated time (hand-overs included);
  whenever a worker is free it picks one of its actions whose inputs have arrived:

  - a forward, while the worker has run fewer than its warm-up's forwards before its first backward
    (1F1B's count, about twice that, or no limit — a setting) and its activation memory stays within
    a budget (1F1B's, zero bubble H1's, about twice 1F1B's, or all the cap allows — a setting);
  - a backward (I, or B where a fused backward is cheaper than I + W) — with both a forward and a
    backward ready, it alternates like 1F1B, or always prefers one kind (a setting);
  - a weight-gradient pass W only when neither is ready: always when memory is at the budget (a W
    frees memory), else whenever the worker would idle, or only when the W ends before the next known
    arrival of an input (a setting).

  Each worker runs the forwards and the backwards of a stage in micro-batch order, and takes a new
  micro-batch only when its memory budget can hold it on all of the worker's stages, which keeps the
  greedy schedule deadlock-free under any cap that holds one micro-batch.

Ties (equal simulated step time) go to the schedule with fewer actions (B rather than I and W), then
the lower peak memory, then the earlier candidate — fixed generators before greedy ones — so the
result is deterministic.

Memory is counted per worker in the unit of :attr:`StageCosts.memory` (1 = one micro-batch's
activations on a stage, by default): a (stage, micro-batch) holds its stage's memory from its F until
its B, or its W after a split backward (:func:`peak_memory`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpipe.schedule import generate
from gpipe.schedule.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    check_sizes,
    round_robin,
    timeline,
    validate,
)
from gpipe.schedule.simulate import Simulation

__all__ = ["Candidate", "Plan", "StageCosts", "auto_schedule", "peak_memory", "plan"]

_EPS = 1e-9


def _check_value(what: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number (got {value!r})") from None
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"{what} must be a finite number >= 0 (got {value!r})")
    return v


def _per_stage(what: str, values: Sequence[float], stages: int) -> tuple[float, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValueError(f"{what} must be a sequence of one number per stage (got {values!r})")
    if len(values) != stages:
        raise ValueError(f"{what} has {len(values)} values but there are {stages} stages: give one per stage")
    return tuple(_check_value(f"{what}[{s}]", v) for s, v in enumerate(values))


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Measured (or assumed) costs of one training step's pieces, per stage.

    ``forward[s]``, ``input[s]``, ``weight[s]`` and ``backward[s]`` are the times of F, I, W and B on
    stage ``s`` (any time unit, the same for all; seconds from a trace). ``backward`` defaults to
    ``input + weight`` (what a split backward costs in all); give it when a fused backward was measured
    and is cheaper. ``memory[s]`` is the activation memory one micro-batch holds on stage ``s``, in any
    unit (default 1.0: "one micro-batch"), the unit of a memory cap. ``transfer`` is the time a
    hand-over (an activation or a gradient) between two workers takes (default 0).

    ``jitter`` is how much an action's time varies around its stage's mean, as a coefficient of
    variation (0: every action takes its mean). With jitter, :func:`plan` ranks candidates by their
    mean step time over random draws of the action times, which favours schedules with slack.

    ``split_estimated[s]`` is true where I and W were not measured but estimated from B (see
    :meth:`from_trace`); it is informational (the estimate is used as the cost).

    Every value must be finite and >= 0; a bad one raises ``ValueError`` naming it.
    """

    forward: tuple[float, ...]
    input: tuple[float, ...]
    weight: tuple[float, ...]
    backward: tuple[float, ...] | None = None
    memory: tuple[float, ...] | None = None
    transfer: float = 0.0
    split_estimated: tuple[bool, ...] | None = None
    jitter: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.forward) if isinstance(self.forward, Sequence) else 0
        if n == 0:
            raise ValueError(f"forward must give one cost per stage, at least one stage (got {self.forward!r})")
        set_ = object.__setattr__
        set_(self, "forward", _per_stage("forward", self.forward, n))
        set_(self, "input", _per_stage("input", self.input, n))
        set_(self, "weight", _per_stage("weight", self.weight, n))
        if self.backward is None:
            set_(self, "backward", tuple(i + w for i, w in zip(self.input, self.weight)))
        else:
            set_(self, "backward", _per_stage("backward", self.backward, n))
        set_(self, "memory", (1.0,) * n if self.memory is None else _per_stage("memory", self.memory, n))
        set_(self, "transfer", _check_value("transfer", self.transfer))
        set_(self, "jitter", _check_value("jitter", self.jitter))
        if self.split_estimated is None:
            set_(self, "split_estimated", (False,) * n)
        elif len(self.split_estimated) != n:
            raise ValueError(f"split_estimated has {len(self.split_estimated)} values but there are {n} stages")
        else:
            set_(self, "split_estimated", tuple(bool(x) for x in self.split_estimated))

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @property
    def fused(self) -> tuple[float, ...]:
        """B per stage (``backward`` with its default filled in)."""
        assert self.backward is not None  # filled in by __post_init__
        return self.backward

    @property
    def activation(self) -> tuple[float, ...]:
        """Activation memory per stage (``memory`` with its default filled in)."""
        assert self.memory is not None  # filled in by __post_init__
        return self.memory

    @classmethod
    def uniform(
        cls,
        stages: int,
        *,
        F: float = 1.0,  # noqa: N803 - the paper's letters
        I: float = 1.0,  # noqa: N803, E741
        W: float = 1.0,  # noqa: N803
        B: float | None = None,  # noqa: N803
        memory: float = 1.0,
        transfer: float = 0.0,
    ) -> StageCosts:
        """The same costs on every stage; B defaults to I + W."""
        if not isinstance(stages, int) or stages <= 0:
            raise ValueError(f"stages must be a positive integer (got {stages!r})")
        return cls(
            forward=(F,) * stages,
            input=(I,) * stages,
            weight=(W,) * stages,
            backward=None if B is None else (B,) * stages,
            memory=(memory,) * stages,
            transfer=transfer,
        )

    @classmethod
    def from_trace(
        cls,
        costs: Mapping[Action, float],
        num_stages: int,
        *,
        input_share: float = 0.5,
        memory: Sequence[float] | None = None,
        transfer: float = 0.0,
    ) -> StageCosts:
        """The median of measured durations (``StepTrace.costs()``: action → seconds) per stage and kind.

        Every stage needs its F, and its I and W or its B. Where I and W were both measured they are
        used (and B, if it was measured too, is kept as the fused backward's cost; else B = I + W).
        Where only B was measured — a trace of a schedule without split backwards — B is kept as
        measured and the split is estimated: ``I = input_share * B``, ``W = (1 - input_share) * B``
        (default half and half, the zero-bubble paper's F ≈ I ≈ W); ``split_estimated`` marks those
        stages. Planning then treats a split backward as costing what the fused one did; the next
        trace, of the split schedule, measures the real I and W.
        """
        if not isinstance(num_stages, int) or num_stages <= 0:
            raise ValueError(f"num_stages must be a positive integer (got {num_stages!r})")
        share = _check_value("input_share", input_share)
        if share > 1:
            raise ValueError(f"input_share is the fraction of B that I takes, in [0, 1] (got {input_share!r})")
        sums: dict[tuple[int, str], list[float]] = {}
        for action, seconds in costs.items():
            if not 0 <= action.stage < num_stages:
                raise ValueError(f"the trace has {action} but there are {num_stages} stages")
            value = _check_value(f"the cost of {action}", seconds)
            sums.setdefault((action.stage, action.kind.value), []).append(value)
        # The median: robust to the slow first calls of a step (a stage learning its layers, caches).
        mean = {key: statistics.median(v) for key, v in sums.items()}
        fwd, inp, wgt, bwd, estimated = [], [], [], [], []
        jitter = _jitter(sums, mean)
        for s in range(num_stages):
            if (s, "F") not in mean:
                raise ValueError(f"the trace has no forward (F) of stage {s}: give a trace of a whole step")
            has_split = (s, "I") in mean and (s, "W") in mean
            if not has_split and (s, "B") not in mean:
                missing = "W" if (s, "I") in mean else "I" if (s, "W") in mean else "B, or I and W"
                raise ValueError(f"the trace has no {missing} of stage {s}: give a trace of a whole step")
            fwd.append(mean[s, "F"])
            if has_split:
                inp.append(mean[s, "I"])
                wgt.append(mean[s, "W"])
                bwd.append(mean.get((s, "B"), mean[s, "I"] + mean[s, "W"]))
            else:
                b = mean[s, "B"]
                inp.append(share * b)
                wgt.append(b - share * b)
                bwd.append(b)
            estimated.append(not has_split)
        return cls(
            forward=tuple(fwd),
            input=tuple(inp),
            weight=tuple(wgt),
            backward=tuple(bwd),
            memory=None if memory is None else tuple(memory),
            transfer=transfer,
            split_estimated=tuple(estimated),
            jitter=jitter,
        )

    def cost(self, action: Action) -> float:
        """The time of ``action`` (a cost function for :func:`~gpipe.schedule.simulate.simulate`)."""
        s, kind = action.stage, action.kind
        if kind is ActionKind.FORWARD:
            return self.forward[s]
        if kind is ActionKind.BACKWARD_INPUT:
            return self.input[s]
        if kind is ActionKind.BACKWARD_WEIGHT:
            return self.weight[s]
        return self.fused[s]

    def describe(self) -> str:
        """One line, e.g. ``F=1, I=1, W=2, B=3, transfer=0`` (per stage lists where stages differ)."""

        def fmt(values: Sequence[float]) -> str:
            return f"{values[0]:g}" if len(set(values)) == 1 else "[" + ", ".join(f"{v:g}" for v in values) + "]"

        parts = [
            f"F={fmt(self.forward)}",
            f"I={fmt(self.input)}",
            f"W={fmt(self.weight)}",
            f"B={fmt(self.fused)}",
            f"transfer={self.transfer:g}",
        ]
        if self.jitter:
            parts.append(f"jitter={self.jitter:.2g}")
        if len(set(self.activation)) > 1 or self.activation[0] != 1.0:
            parts.append(f"memory={fmt(self.activation)}")
        return ", ".join(parts)


def peak_memory(schedule: Schedule, costs: StageCosts) -> tuple[float, ...]:
    """Per worker, the most activation memory it holds at once (in ``costs.memory``'s unit): a
    (stage, micro-batch) holds its stage's memory from its F until its B, or its W."""
    if costs.num_stages != schedule.num_stages:
        raise ValueError(f"the costs are for {costs.num_stages} stages but the schedule has {schedule.num_stages}")
    mem = costs.activation
    peaks = []
    for acts in schedule.actions:
        live = peak = 0.0
        for a in acts:
            if a.kind is ActionKind.FORWARD:
                live += mem[a.stage]
                peak = max(peak, live)
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                live -= mem[a.stage]
        peaks.append(peak)
    return tuple(peaks)


@dataclass(frozen=True)
class Candidate:
    """One schedule :func:`plan` considered: its name (a generator's, or ``greedy(...)`` with the
    heuristic's settings), simulated step time and bubble, peak memory per worker, and whether it fits
    the memory cap."""

    name: str
    makespan: float
    bubble: float
    peak_memory: tuple[float, ...]
    fits: bool
    schedule: Schedule = field(repr=False, compare=False)
    expected: float = math.nan
    """The mean step time over random draws of the action times (``costs.jitter``; the makespan
    without jitter, NaN for a candidate too slow to be drawn for)."""

    @property
    def num_actions(self) -> int:
        return sum(len(acts) for acts in self.schedule.actions)


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` chose and why: the schedule (named 'auto'), the candidate it came from, its
    simulation under the given costs, its peak memory per worker, the cap, and every candidate."""

    schedule: Schedule
    chosen: str
    simulation: Simulation
    peak_memory: tuple[float, ...]
    memory_cap: tuple[float, ...] | None
    costs: StageCosts
    candidates: tuple[Candidate, ...]

    @property
    def makespan(self) -> float:
        return self.simulation.makespan

    @property
    def bubble(self) -> float:
        return self.simulation.bubble

    def table(self) -> str:
        """The candidates as a text table, fastest first (the chosen one marked ``*``)."""
        rows = sorted(self.candidates, key=_rank)
        width = max(len("candidate"), *(len(c.name) for c in rows))
        jitter = self.costs.jitter > 0
        head = f"  {'candidate':<{width}}  {'makespan':>10}  " + (f"{'expected':>10}  " if jitter else "")
        lines = [head + f"{'bubble':>7}  {'peak memory':>11}  fits cap"]
        for c in rows:
            mark = "*" if c.name == self.chosen else " "
            expected = ("" if math.isnan(c.expected) else f"{c.expected:.4g}") if jitter else None
            lines.append(
                f"{mark} {c.name:<{width}}  {c.makespan:>10.4g}  "
                + (f"{expected:>10}  " if expected is not None else "")
                + f"{c.bubble:>7.2%}  {max(c.peak_memory):>11.4g}  "
                + ("yes" if c.fits else "no")
            )
        return "\n".join(lines)

    def explain(self) -> str:
        """Several lines: the costs and cap, what was chosen, its step time, bubble and memory, and the
        table of candidates."""
        cap = "none" if self.memory_cap is None else ", ".join(f"{c:g}" for c in self.memory_cap)
        return "\n".join(
            [
                f"costs {self.costs.describe()}; memory cap per worker: {cap}",
                f"chose {self.chosen}: makespan {self.makespan:.6g}, bubble {self.bubble:.4f} "
                f"({self.bubble:.1%}), peak memory per worker " + ", ".join(f"{p:g}" for p in self.peak_memory),
                f"{len(self.candidates)} candidates:",
                self.table(),
            ]
        )


def _jitter(sums: Mapping[tuple[int, str], Sequence[float]], median: Mapping[tuple[int, str], float]) -> float:
    """How much action times vary: per stage and kind a robust coefficient of variation (1.4826 x
    the median absolute deviation over the median: a slow first call does not count), pooled as a
    root mean square weighted by the group's time (a long, jittery W matters more than a short F)."""
    weighted, total = 0.0, 0.0
    for key, values in sums.items():
        mid = median[key]
        if mid <= 0 or len(values) < 3:
            continue
        cv = 1.4826 * statistics.median(abs(x - mid) for x in values) / mid
        weighted += cv**2 * mid * len(values)
        total += mid * len(values)
    return math.sqrt(weighted / total) if total else 0.0


def _time(c: Candidate) -> float:
    """What a candidate is ranked by: its expected step time under jitter, else its makespan."""
    return c.makespan if math.isnan(c.expected) else c.expected


def _rank(c: Candidate) -> tuple[float, float, int, float]:
    return (_time(c) if not math.isnan(c.expected) else math.inf, c.makespan, c.num_actions, max(c.peak_memory))


def _best(candidates: Sequence[Candidate]) -> Candidate:
    """The fastest (expected step time under jitter, else makespan); among those as fast (within 1%
    under jitter, the draws' own precision; else to float noise), the one with the fewest actions,
    then the lowest peak memory, then the first considered."""
    drawn = [c for c in candidates if not math.isnan(c.expected)] or list(candidates)
    fastest = min(_time(c) for c in drawn)
    # Draws of jittered costs estimate a mean to about a percent: closer than that is a tie.
    tolerance = _TIE_UNDER_JITTER if any(c.expected != c.makespan for c in drawn) else 1e-9
    tied = [c for c in drawn if _time(c) <= fastest * (1 + tolerance) + 1e-12]
    return min(tied, key=lambda c: (c.num_actions, max(c.peak_memory)))  # min keeps the first of equals


_DRAWS = 24
_TIE_UNDER_JITTER = 0.01
_DRAWN_WITHIN = 1.15  # candidates whose makespan is this close to the best are drawn for


def _expected(candidates: list[Candidate], costs: StageCosts, microbatches: int) -> list[Candidate]:
    """The candidates with their mean step time over ``_DRAWS`` draws of every action's time
    (log-normal around its cost, coefficient of variation ``costs.jitter``; the same draws for every
    candidate, from a fixed seed, so every rank plans alike)."""
    if costs.jitter == 0 or not candidates:
        return [replace(c, expected=c.makespan) for c in candidates]
    best = min(c.makespan for c in candidates)
    sigma = math.sqrt(math.log1p(costs.jitter**2))
    rng = random.Random(0)
    kinds = list(ActionKind)
    draws = [
        {
            (k, m, s): rng.lognormvariate(-(sigma**2) / 2, sigma)
            for k in kinds
            for m in range(microbatches)
            for s in range(costs.num_stages)
        }
        for _ in range(_DRAWS)
    ]
    out = []
    for c in candidates:
        if c.makespan > best * _DRAWN_WITHIN:
            out.append(c)
            continue
        total = 0.0
        for draw in draws:

            def cost(a: Action, draw: dict[tuple[ActionKind, int, int], float] = draw) -> float:
                return costs.cost(a) * draw[a.kind, a.microbatch, a.stage]

            spans = timeline(c.schedule, cost, costs.transfer)
            total += max(end for _, end in spans.values()) - min(start for start, _ in spans.values())
        out.append(replace(c, expected=total / _DRAWS))
    return out


def _caps(memory_cap: float | Sequence[float] | None, workers: int) -> tuple[float, ...] | None:
    if memory_cap is None:
        return None
    if isinstance(memory_cap, int | float):
        cap = _check_value("memory_cap", memory_cap)
        return (cap,) * workers
    if isinstance(memory_cap, str | bytes) or not isinstance(memory_cap, Sequence):
        raise ValueError(f"memory_cap must be a number or one number per worker (got {memory_cap!r})")
    if len(memory_cap) != workers:
        raise ValueError(
            f"memory_cap has {len(memory_cap)} values but there are {workers} workers: give one per worker"
        )
    return tuple(_check_value(f"memory_cap[{w}]", c) for w, c in enumerate(memory_cap))


def _placement(workers: int, costs: StageCosts, placement: Sequence[int] | None) -> tuple[int, ...]:
    if placement is None:
        if costs.num_stages < workers:
            raise ValueError(
                f"the costs are for {costs.num_stages} stages, fewer than the {workers} workers: give one cost "
                "per stage, at least one stage per worker"
            )
        return round_robin(costs.num_stages, workers)
    place = tuple(placement)
    if len(place) != costs.num_stages:
        raise ValueError(
            f"placement places {len(place)} stages but the costs are for {costs.num_stages}: give one worker per stage"
        )
    bad = [s for s, w in enumerate(place) if not (isinstance(w, int) and 0 <= w < workers)]
    if bad:
        raise ValueError(
            f"placement puts stage {bad[0]} on worker {place[bad[0]]!r}, but there are workers 0..{workers - 1}"
        )
    idle = [w for w in range(workers) if w not in place]
    if idle:
        raise ValueError(f"placement puts no stage on worker {idle[0]}: every worker needs a stage")
    return place


# -- the greedy list scheduler ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Setting:
    warmup: str  # forwards before a worker's first backward: '1f1b', '2x' or 'max' (see _count)
    budget: str  # memory a worker may hold: '1f1b', 'h1', '2x' (see _count) or 'cap' (what the cap allows)
    order: str  # with both ready: 'alt' (the other kind than last time, 1F1B's rhythm), 'B' or 'F' first
    fill: str  # 'idle': W whenever the worker would idle; 'gap': only if W ends before the next known arrival
    split: bool  # I and W (True) or B (False)

    @property
    def name(self) -> str:
        bwd = "I" if self.split else "B"
        order = {"alt": f"F/{bwd}", "B": f"{bwd}>F", "F": f"F>{bwd}"}[self.order]
        fill = f", W={self.fill}" if self.split else ""
        return f"greedy(warmup={self.warmup}, mem={self.budget}, {order}{fill})"


def _count(rule: str, stages: int, s: int) -> float:
    """How many micro-batches a rule allows on stage ``s``: '1f1b' as many as stages from ``s`` to the end
    (1F1B's), 'h1' as many as stages (1F1B's first stage's, everywhere: zero bubble H1's), '2x' about
    twice 1F1B's (H2's), anything else no limit."""
    if rule == "1f1b":
        return stages - s
    if rule == "h1":
        return stages
    if rule == "2x":
        return 2 * (stages - s) - 1
    return math.inf


def _greedy(
    workers: int,
    microbatches: int,
    costs: StageCosts,
    place: tuple[int, ...],
    caps: tuple[float, ...] | None,
    setting: _Setting,
) -> Schedule:
    """List-schedule one step over simulated time with ``setting``'s heuristic (see the module's doc)."""
    stages, m_count = len(place), microbatches
    mem, tr = costs.activation, costs.transfer
    fwd, inp, wgt, fused = costs.forward, costs.input, costs.weight, costs.fused
    bwd_cost = inp if setting.split else fused
    bkind = ActionKind.BACKWARD_INPUT if setting.split else ActionKind.BACKWARD
    stages_of = [[s for s in range(stages) if place[s] == w] for w in range(workers)]
    first = [ss[0] for ss in stages_of]
    one = [sum(mem[s] for s in ss) for ss in stages_of]
    # The memory a worker may commit: the setting's budget within the cap, but never less than one
    # micro-batch on all its stages (below that nothing could run; the cap is checked to allow it).
    budget = [sum(mem[s] * _count(setting.budget, stages, s) for s in ss) for ss in stages_of]
    budget = [max(one[w], min(budget[w], math.inf if caps is None else caps[w])) for w in range(workers)]
    # How many micro-batches a worker takes in before its first backward (counted at its first stage).
    warmup = [_count(setting.warmup, stages, first[w]) for w in range(workers)]
    lag = [0.0] + [tr if place[s - 1] != place[s] else 0.0 for s in range(1, stages)]  # into s from s-1
    back_lag = [tr if s + 1 < stages and place[s + 1] != place[s] else 0.0 for s in range(stages)]  # from s+1

    f_end = [[math.nan] * stages for _ in range(m_count)]
    b_end = [[math.nan] * stages for _ in range(m_count)]
    next_f, next_b = [0] * stages, [0] * stages
    committed = [0.0] * workers  # memory held or reserved for admitted micro-batches
    admitted = [0] * workers  # micro-batches taken in so far
    backwards = [0] * workers
    last_forward = [False] * workers  # whether the last F/I/B the worker ran was an F
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(workers)]
    free = [0.0] * workers
    out: list[list[Action]] = [[] for _ in range(workers)]
    left = [len(ss) * m_count * (3 if setting.split else 2) for ss in stages_of]
    remaining = sum(left)

    def f_ready(s: int) -> float:  # when F(next_f[s], s) may start
        return 0.0 if s == 0 else f_end[next_f[s]][s - 1] + lag[s]

    def b_ready(s: int) -> float:  # when the next backward of s may start (nan: an input is not scheduled)
        m = next_b[s]
        own = f_end[m][s]
        if s == stages - 1 or math.isnan(own):
            return own
        return max(own, b_end[m][s + 1] + back_lag[s]) if not math.isnan(b_end[m][s + 1]) else math.nan

    t = 0.0
    while remaining:
        progressed = False
        for w in range(workers):
            if left[w] == 0 or free[w] > t + _EPS:
                continue
            ready_f: tuple[int, int] | None = None  # (microbatch, -stage) of the best ready forward
            ready_b: tuple[int, int] | None = None  # (microbatch, stage) of the best ready backward
            blocked = False  # a new micro-batch waits for memory
            upcoming = math.inf  # the next known arrival of a forward's or a backward's input
            warmed_up = backwards[w] == 0 and admitted[w] >= warmup[w]  # no new micro-batch until a backward
            for s in stages_of[w]:
                m = next_f[s]
                if m < m_count and not (s == first[w] and warmed_up):
                    if s == first[w] and committed[w] + one[w] > budget[w] + _EPS:
                        blocked = True
                    else:
                        r = f_ready(s)
                        if r <= t + _EPS:
                            if ready_f is None or (m, -s) < ready_f:
                                ready_f = (m, -s)
                        elif r < upcoming:
                            upcoming = r
                if next_b[s] < m_count:
                    r = b_ready(s)
                    if r <= t + _EPS:
                        if ready_b is None or (next_b[s], s) < ready_b:
                            ready_b = (next_b[s], s)
                    elif r < upcoming:  # False for nan
                        upcoming = r
            backward_first = setting.order == "B" or (setting.order == "alt" and last_forward[w])
            choice: Action | None = None
            if ready_b is not None and (backward_first or ready_f is None):
                choice = Action(bkind, ready_b[0], ready_b[1])
            elif ready_f is not None:
                choice = Action(ActionKind.FORWARD, ready_f[0], -ready_f[1])
            elif pending_w[w]:
                m, s = pending_w[w][0]
                if blocked or setting.fill == "idle" or t + wgt[s] <= upcoming + _EPS:
                    choice = Action(ActionKind.BACKWARD_WEIGHT, m, s)
            if choice is None:
                continue
            m, s, kind = choice.microbatch, choice.stage, choice.kind
            if kind is ActionKind.FORWARD:
                if s == first[w]:
                    committed[w] += one[w]
                    admitted[w] += 1
                end = t + fwd[s]
                f_end[m][s] = end
                next_f[s] += 1
                last_forward[w] = True
            elif kind is ActionKind.BACKWARD_WEIGHT:
                pending_w[w].popleft()
                committed[w] -= mem[s]
                end = t + wgt[s]
            else:
                end = t + bwd_cost[s]
                b_end[m][s] = end
                next_b[s] += 1
                backwards[w] += 1
                last_forward[w] = False
                if setting.split:
                    pending_w[w].append((m, s))
                else:
                    committed[w] -= mem[s]
            out[w].append(choice)
            free[w] = end
            left[w] -= 1
            remaining -= 1
            progressed = True
        if progressed:
            continue
        # Nothing started at t: move to the next moment something can change — a worker frees up or
        # an input arrives at an idle worker.
        nxt = math.inf
        for w in range(workers):
            if left[w] == 0:
                continue
            if free[w] > t + _EPS:
                nxt = min(nxt, free[w])
                continue
            for s in stages_of[w]:
                arrivals = [f_ready(s)] if next_f[s] < m_count else []
                if next_b[s] < m_count:
                    arrivals.append(b_ready(s))
                for r in arrivals:
                    if r > t + _EPS:  # False for nan
                        nxt = min(nxt, r)
        if nxt == math.inf:
            raise AssertionError(f"the greedy scheduler is stuck at time {t} ({setting.name}): a bug")
        t = nxt
    return Schedule("auto", stages, m_count, tuple(tuple(acts) for acts in out), place)


# The heuristic's settings tried (warm-up, memory budget, order), each with both W fills: chosen to
# cover the best of a larger product on a sweep of sizes, cost mixes, caps and transfer times.
_SPLIT = [
    ("1f1b", "1f1b", "alt"),  # 1F1B's rhythm and memory, W deferred only within it
    ("1f1b", "h1", "alt"),  # zero bubble H1's
    ("2x", "h1", "alt"),
    ("2x", "cap", "alt"),  # zero bubble H2's warm-up, then all the memory the cap allows
    ("1f1b", "cap", "alt"),
    ("max", "cap", "alt"),
    ("1f1b", "h1", "B"),  # input gradients first (the critical path)
    ("2x", "cap", "F"),  # forwards first
    ("max", "cap", "F"),  # fill-drain's forwards, then the backwards as they come
]


def _settings(costs: StageCosts) -> list[_Setting]:
    out = []
    for warmup, budget, order in _SPLIT:
        for fill in ("idle", "gap"):
            out.append(_Setting(warmup, budget, order, fill, True))
    # A fused B is worth trying only where it is cheaper than I + W (else a split does as well).
    if any(b < i + w - _EPS for b, i, w in zip(costs.fused, costs.input, costs.weight)):
        for warmup, budget, order in _SPLIT:
            out.append(_Setting(warmup, budget, order, "idle", False))
    return out


# -- planning -----------------------------------------------------------------------------------------


def _fixed(workers: int, microbatches: int, place: tuple[int, ...]) -> Iterable[tuple[str, Schedule]]:
    """The fixed generators' schedules for this placement (looked up in SCHEDULES at call time)."""
    stages = len(place)
    tries = dict.fromkeys((max(1, stages // workers), 1, 2))
    for name, generator in list(generate.SCHEDULES.items()):
        for virtual in tries:
            try:
                schedule = generator(workers, microbatches, virtual)
            except ValueError:
                continue
            if schedule.num_stages == stages and tuple(schedule.placement) == place:
                yield name, schedule
                break


def _minimum_cap(workers: int, place: tuple[int, ...], costs: StageCosts) -> tuple[float, ...]:
    mem = costs.activation
    return tuple(sum(mem[s] for s in range(len(place)) if place[s] == w) for w in range(workers))


def plan(
    workers: int,
    microbatches: int,
    costs: StageCosts,
    *,
    memory_cap: float | Sequence[float] | None = None,
    placement: Sequence[int] | None = None,
) -> Plan:
    """The fastest schedule for ``costs`` that fits ``memory_cap``, with the candidates considered.

    ``workers`` K, ``microbatches`` M; ``costs`` per stage (their number of stages is the pipeline's);
    ``memory_cap`` a number, or one per worker, in ``costs.memory``'s unit (None: no cap);
    ``placement[s]`` the worker of stage s (default ``round_robin(stages, K)``: one stage per worker
    when there are K stages). Raises ``ValueError`` for bad arguments, and when no schedule fits the cap
    (naming the smallest cap that does).
    """
    if not isinstance(costs, StageCosts):
        raise ValueError(f"costs must be a StageCosts (got {type(costs).__name__})")
    for what, n in (("workers", workers), ("microbatches", microbatches)):
        if not isinstance(n, int) or isinstance(n, bool):
            raise ValueError(f"{what} must be an integer (got {n!r})")
    check_sizes(workers, microbatches)
    place = _placement(workers, costs, placement)
    caps = _caps(memory_cap, workers)
    minimum = _minimum_cap(workers, place, costs)
    if caps is not None:
        short = [w for w in range(workers) if caps[w] < minimum[w] - _EPS]
        if short:
            w = short[0]
            held = [str(s) for s in range(len(place)) if place[s] == w]
            where = f"stage {held[0]}" if len(held) == 1 else f"stages {', '.join(held)}"
            raise ValueError(
                f"no schedule fits memory cap {caps[w]:g} on worker {w}: a micro-batch's activations on "
                f"{where} take {minimum[w]:g} there at once; the smallest cap that works is "
                + ", ".join(f"{c:g}" for c in minimum)
                + " per worker (one micro-batch in flight): raise the cap, or make the micro-batches smaller "
                "(more of them) or the stages smaller (more of them)"
            )

    def fits(peaks: tuple[float, ...]) -> bool:
        return caps is None or all(p <= c + _EPS for p, c in zip(peaks, caps))

    candidates: list[Candidate] = []
    spans_of: dict[str, dict[Action, tuple[float, float]]] = {}
    seen: set[tuple[tuple[Action, ...], ...]] = set()

    def consider(name: str, schedule: Schedule) -> None:
        if schedule.actions in seen:  # another setting built the same schedule
            return
        seen.add(schedule.actions)
        spans = timeline(schedule, costs.cost, costs.transfer)
        sim = Simulation(schedule, spans)
        peaks = peak_memory(schedule, costs)
        candidates.append(Candidate(name, sim.makespan, sim.bubble, peaks, fits(peaks), schedule))
        spans_of[name] = spans

    for name, schedule in _fixed(workers, microbatches, place):
        try:
            validate(schedule)
        except ScheduleError:  # a generator that cannot do these sizes: not a candidate
            continue
        consider(name, schedule)
    for setting in _settings(costs):
        consider(setting.name, _greedy(workers, microbatches, costs, place, caps, setting))

    fitting = _expected([c for c in candidates if c.fits], costs, microbatches)
    if not fitting:  # cannot happen: the greedy scheduler holds any cap >= the minimum checked above
        raise ScheduleError(f"no candidate schedule fits the memory cap {caps}: a bug")
    best = _best(fitting)
    schedule = Schedule("auto", best.schedule.num_stages, microbatches, best.schedule.actions, place)
    validate(schedule)
    sim = Simulation(schedule, spans_of[best.name])
    drawn = {c.name: c for c in fitting}
    return Plan(
        schedule, best.name, sim, best.peak_memory, caps, costs, tuple(drawn.get(c.name, c) for c in candidates)
    )


def auto_schedule(
    workers: int,
    microbatches: int,
    costs: StageCosts,
    *,
    memory_cap: float | Sequence[float] | None = None,
    placement: Sequence[int] | None = None,
) -> Schedule:
    """The schedule named 'auto': the fastest for ``costs`` within ``memory_cap`` (see :func:`plan`)."""
    return plan(workers, microbatches, costs, memory_cap=memory_cap, placement=placement).schedule
