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

Part of the library: imports only the standard library and the modules of :mod:`gpipe.schedule`
(``ir``, ``generate``, ``simulate``), never torch or the applications. Its parts: :mod:`.costs` (the
costs and peak memory), :mod:`.greedy` (the list scheduler), :mod:`.ranking` (candidates and the choice).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import gpipe.schedule.generate as generate
from gpipe.schedule.auto.costs import StageCosts, _check_value, peak_memory
from gpipe.schedule.auto.greedy import _EPS, _greedy, _settings
from gpipe.schedule.auto.ranking import Candidate, Plan, _best, _expected
from gpipe.schedule.ir import Action, Schedule, ScheduleError, check_sizes, round_robin, timeline, validate
from gpipe.schedule.simulate import Simulation

__all__ = ["Candidate", "Plan", "StageCosts", "auto_schedule", "peak_memory", "plan"]


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
