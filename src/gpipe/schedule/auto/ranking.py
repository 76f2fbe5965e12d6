"""Ranking the candidates of :func:`plan`: :class:`Candidate` and :class:`Plan` (its table and
explanation), the expected step time under jitter (:func:`_expected`) and choosing the best (:func:`_best`)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from gpipe.schedule.auto.costs import StageCosts
from gpipe.schedule.auto.greedy import _EPS
from gpipe.schedule.ir import STAGE_WIDE, Action, ActionKind, Schedule, timeline
from gpipe.schedule.simulate import Simulation

__all__ = ["Candidate", "Plan", "_best", "_expected"]


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
        """The candidates as a text table, fastest first (the chosen one marked ``*``), with each one's
        peak memory per worker and, for one that does not fit the cap, the workers over their cap."""
        rows = sorted(self.candidates, key=_rank)
        width = max(len("candidate"), *(len(c.name) for c in rows))
        peaks = {c.name: ", ".join(f"{p:.4g}" for p in c.peak_memory) for c in rows}
        peak_width = max(len("peak memory per worker"), *map(len, peaks.values()))
        jitter = self.costs.jitter > 0
        head = f"  {'candidate':<{width}}  {'makespan':>10}  " + (f"{'expected':>10}  " if jitter else "")
        lines = [head + f"{'bubble':>7}  {'peak memory per worker':<{peak_width}}  fits cap"]
        for c in rows:
            mark = "*" if c.name == self.chosen else " "
            expected = ("" if math.isnan(c.expected) else f"{c.expected:.4g}") if jitter else None
            lines.append(
                f"{mark} {c.name:<{width}}  {c.makespan:>10.4g}  "
                + (f"{expected:>10}  " if expected is not None else "")
                + f"{c.bubble:>7.2%}  {peaks[c.name]:<{peak_width}}  "
                + ("yes" if c.fits else f"no ({self._over_cap(c)})")
            )
        return "\n".join(lines)

    def _over_cap(self, c: Candidate) -> str:
        """The workers whose peak memory in ``c`` is over their cap, e.g. ``worker 1: 2 > 1``."""
        caps = self.memory_cap or ()
        over = [(w, p, cap) for w, (p, cap) in enumerate(zip(c.peak_memory, caps)) if p > cap + _EPS]
        return ", ".join(f"worker {w}: {p:.4g} > {cap:.4g}" for w, p, cap in over)

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
    kinds = [k for k in ActionKind if k not in STAGE_WIDE]  # (candidates are unsharded; same draws as ever)
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
                return costs.cost(a) * draw.get((a.kind, a.microbatch, a.stage), 1.0)

            spans = timeline(c.schedule, cost, costs.transfer)
            total += max(end for _, end in spans.values()) - min(start for start, _ in spans.values())
        out.append(replace(c, expected=total / _DRAWS))
    return out
