"""The greedy list scheduler (see :mod:`gpipe.schedule.auto`'s doc for its heuristic): :func:`_greedy`
builds one step's schedule with a :class:`_Setting`; :func:`_settings` are the settings :func:`plan` tries."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gpipe.schedule.auto.costs import StageCosts
from gpipe.schedule.ir import Action, ActionKind, Schedule

__all__ = ["_EPS", "_Setting", "_greedy", "_settings"]

_EPS = 1e-9


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
    """List-schedule one step over simulated time with ``setting``'s heuristic (see the package's doc)."""
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
