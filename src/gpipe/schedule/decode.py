"""Decode schedules: forwards only, in a loop, several groups of sequences in flight.

Generating tokens with the key/value caches kept in the stages runs forwards only, and each step's
input is what the previous step chose: the last stage's output of a group's step gives the group's
next tokens, which enter stage 0 as its next step. One group alone leaves every worker but one idle;
with ``G`` groups in flight, step ``t`` of group ``g`` is micro-batch ``m = t*G + g`` and ``F(m, 0)``
waits for ``F(m-G, S-1)`` (the IR's ``feedback``), so while one group's step is on one stage the
others' are on the others. With one stage per worker the pipeline is full once ``G >= S``: in
steady state a worker idles ``1 - G/S`` of the time for fewer groups (:func:`decode_bubble`).

Every worker runs its forwards in one fixed order, :func:`decode_order`: by ``m + s`` (the time a
forward would start were every stage one unit and never kept waiting), the later stage first. It is
an infinite generator because a decode runs until its groups are done, a number of steps nobody
knows in advance; :func:`decode` is its first ``T`` steps as a :class:`Schedule` (the order with
every ``m >= T*G`` left out), to validate, simulate and draw. Where a worker holds several stages
the order deadlocks with too few groups (a V placement: ``F(G, 0)`` comes before ``F(0, S-1)`` on
worker 0, but needs it); :func:`min_groups` says how many it needs and both functions refuse fewer.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from fractions import Fraction

from gpipe.schedule.ir import Action, Schedule, validate
from gpipe.schedule.ir import F as _F

__all__ = ["decode", "decode_bubble", "decode_order", "decode_period", "min_groups"]


def _check_placement(placement: Sequence[int]) -> tuple[int, ...]:
    place = tuple(placement)
    if not place:
        raise ValueError("a decode needs at least one stage: give placement[s], the worker of each stage s")
    if not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in place):
        raise ValueError(f"placement {list(place)} must hold worker numbers >= 0, one per stage")
    missing = sorted(set(range(max(place) + 1)) - set(place))
    if missing:
        raise ValueError(
            f"placement {list(place)} puts no stage on worker {missing[0]}: "
            f"number the workers 0..K-1 and give each at least one stage"
        )
    return place


def _check_groups(groups: int) -> None:
    if not (isinstance(groups, int) and groups >= 1):
        raise ValueError(f"groups must be an integer >= 1 (got {groups!r}): the groups of sequences in flight")


def min_groups(placement: Sequence[int]) -> int:
    """The fewest groups with which :func:`decode_order` never deadlocks on ``placement``.

    A deadlock is a cycle of waits. Give every forward its place ``t = m + s`` in the order: a
    dependency on the previous stage is one later, a worker's next action is as late or later (one
    later to go to a higher stage of the worker, as late to go down, since the later stage runs
    first), and the feedback edge ``F(m-G, S-1) -> F(m, 0)`` is ``G - (S-1)`` later. A cycle comes
    back to its start, so its steps add up to 0; it exists iff going round the loop once, from stage 0
    to stage ``S-1`` by the cheapest path ``d`` of those steps and back by the feedback edge, adds up
    to at most 0: ``G <= S-1-d``. So the order needs ``G >= S - d`` groups (1 with one stage per
    worker, where ``d = S-1``; ``S-1`` on a V, where worker 0 holds both ends and ``d = 1``).
    """
    place = _check_placement(placement)
    stages = len(place)
    held: dict[int, list[int]] = {}
    for s, w in enumerate(place):
        held.setdefault(w, []).append(s)
    # Dijkstra from stage 0 over: s -> s+1 (1), s -> a higher stage of its worker (1), -> a lower one (0).
    dist = {0: 0}
    queue = [(0, 0)]
    while queue:
        d, s = heapq.heappop(queue)
        if d > dist.get(s, stages):
            continue
        steps = [(s + 1, 1)] if s + 1 < stages else []
        steps += [(o, int(o > s)) for o in held[place[s]] if o != s]
        for o, cost in steps:
            if d + cost < dist.get(o, stages):
                dist[o] = d + cost
                heapq.heappush(queue, (d + cost, o))
    return max(1, stages - dist[stages - 1])


def _check_enough(place: tuple[int, ...], groups: int) -> None:
    _check_groups(groups)
    need = min_groups(place)
    if groups < need:
        raise ValueError(
            f"{groups} group(s) in flight deadlock the decode order on placement {list(place)}: a worker would "
            f"wait for a group's tokens that a later forward of its own computes; keep at least {need} groups "
            "in flight (or hold fewer stages per worker)"
        )


def decode_order(placement: Sequence[int], groups: int, worker: int) -> Iterator[Action]:
    """Worker ``worker``'s forwards, in order, forever: every ``F(m, s)`` of a stage ``s`` it holds, for
    ``m = 0, 1, 2, ...``, sorted by ``m + s`` and then the later stage first.

    Prefix-stable (what an executor consumes step by step, however long the decode runs): the first
    ``n`` actions are the same however many are taken after them; :func:`decode`'s actions for ``T``
    steps are these with ``m < T*G``, in this order. Refuses ``groups`` too few for ``placement``
    (:func:`min_groups`).
    """
    place = _check_placement(placement)
    _check_enough(place, groups)
    if not (isinstance(worker, int) and 0 <= worker <= max(place)):
        raise ValueError(f"worker {worker!r} is not one of the placement's workers 0..{max(place)}")
    stages = sorted((s for s, w in enumerate(place) if w == worker), reverse=True)
    return (_F(t - s, s) for t in itertools.count() for s in stages if t >= s)


def decode(placement: Sequence[int], groups: int, steps: int) -> Schedule:
    """The first ``steps`` steps of ``groups`` groups decoded on ``placement`` (``placement[s]``: the
    worker of stage ``s``), validated: micro-batch ``m = t*groups + g`` is step ``t`` of group ``g``,
    each worker's actions are :func:`decode_order`'s with ``m < steps*groups``, in its order."""
    place = _check_placement(placement)
    _check_enough(place, groups)
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1 (got {steps!r}): how many tokens each group decodes")
    total = steps * groups
    acts = []
    for w in range(max(place) + 1):
        # Each of the worker's stages has ``total`` forwards with m < total; the order holds them all.
        wanted = total * place.count(w)
        acts.append(
            tuple(itertools.islice((a for a in decode_order(place, groups, w) if a.microbatch < total), wanted))
        )
    schedule = Schedule("decode", len(place), total, tuple(acts), place, feedback=groups)
    validate(schedule)
    return schedule


def decode_period(placement: Sequence[int], groups: int) -> Fraction:
    """Time per micro-batch (one group's step) in steady state, every forward one unit long.

    Each worker runs its order as fast as its inputs come, so the decode settles into a period set by
    its slowest cycle of waits: a worker's next action after its previous one, a stage after the one
    before, stage 0 of a group's step after stage ``S-1`` of its last. Walking such a cycle once from
    a forward of some stage back to a forward of the same stage runs ``n`` forwards (one unit each)
    and moves on ``d`` micro-batches, so a micro-batch takes at least ``n/d``; the largest ratio over
    the cycles is the period (a max-plus eigenvalue; the largest is always a simple cycle, ``n <= S``).
    """
    place = _check_placement(placement)
    _check_enough(place, groups)
    stages = len(place)
    # Edges (to, micro-batches moved on): the stage after, the feedback loop, a worker's next action.
    edges: list[list[tuple[int, int]]] = [[] for _ in range(stages)]
    for s in range(stages - 1):
        edges[s].append((s + 1, 0))
    edges[stages - 1].append((0, groups))
    for w in range(max(place) + 1):
        held = sorted((s for s, o in enumerate(place) if o == w), reverse=True)
        for hi, lo in itertools.pairwise(held):
            edges[hi].append((lo, hi - lo))  # F(t-hi, hi) then F(t-lo, lo)
        edges[held[-1]].append((held[0], 1 - held[0] + held[-1]))  # the lowest at t, the highest at t+1
    period = Fraction(0)
    for start in range(stages):
        reach = {start: 0}  # the fewest micro-batches moved on by a walk of n edges, per stage reached
        for n in range(1, stages + 1):
            nxt: dict[int, int] = {}
            for s, d in reach.items():
                for o, step in edges[s]:
                    nxt[o] = min(nxt.get(o, d + step), d + step)
            reach = nxt
            if start in reach:
                assert reach[start] > 0, "min_groups admitted a deadlock"
                period = max(period, Fraction(n, reach[start]))
    return period


def decode_bubble(placement: Sequence[int], groups: int) -> float:
    """The fraction of time the workers idle in steady state, every forward one unit long: the ``S``
    units of a micro-batch's forwards spread over ``K`` workers in :func:`decode_period` each.

    With one stage per worker, ``max(0, 1 - G/S)``: a step goes round all ``S`` stages, so ``G``
    groups take turns once every ``max(S, G)`` units. Where a worker holds several stages the fixed
    order costs more than its ``G/K`` work (e.g. an interleaved placement just above
    :func:`min_groups`)."""
    place = _check_placement(placement)
    workers = max(place) + 1
    return float(1 - Fraction(len(place)) / (workers * decode_period(place, groups)))
