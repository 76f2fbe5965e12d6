"""Schedule generators: pure functions of (K workers, M micro-batches, v virtual stages per worker)
that return a :class:`~gpipe.schedule.ir.Schedule`.

Legend of the tables below: ``F3`` forward of micro-batch 3, ``B`` full backward, ``I`` input-gradient
backward, ``W`` weight-gradient backward, ``.`` idle; one column per unit of time (all costs 1).

'gpipe' — fill-drain, the paper's schedule (bubble (K-1)/(M+K-1); every stage holds M micro-batches)::

    worker 0 | F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
    worker 1 | .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
    worker 2 | .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

'1f1b' — one forward, one backward, with a flush: the same bubble, but stage k holds at most K-k::

    worker 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    worker 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
    worker 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

'interleaved-1f1b' — Megatron's: v model chunks per worker (stage s on worker s mod K), micro-batches
in groups of K; the bubble shrinks by about v (K=2, v=2, M=4; each micro-batch
appears once per model chunk)::

    worker 0 | F0 F1 F0 F1 F2 B0 F3 B1 F2 B0 F3 B1 .  B2 .  B3 B2 B3
    worker 1 | .  F0 F1 F0 B0 F1 B1 F2 B0 F3 B1 F2 B2 F3 B3 B2 B3 .

'zb-h1' — zero bubble H1 (Qi et al., 2024): backward split into I and W, the W passes deferred into
what would be bubbles; 1F1B's peak memory (no stage holds more than K micro-batches, as many as
1F1B's first stage) and, with F = I = W, a third of 1F1B's idle time::

    worker 0 | F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3
    worker 1 | .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
    worker 2 | .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3
"""

from __future__ import annotations

from collections.abc import Callable

from gpipe.schedule.ir import B, F, I, Schedule, ScheduleError, W, check_sizes, round_robin, validate

__all__ = ["SCHEDULES", "fill_drain", "interleaved_1f1b", "make_schedule", "one_f_one_b", "zb_h1"]


def _single(name: str, virtual: int) -> None:
    if virtual != 1:
        raise ValueError(f"schedule {name!r} runs one stage per worker (virtual: {virtual}); use 'interleaved-1f1b'")


def fill_drain(workers: int, microbatches: int, virtual: int = 1) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards in reverse order."""
    _single("gpipe", virtual)
    check_sizes(workers, microbatches)
    ms = range(microbatches)
    acts = tuple(tuple(F(m, s) for m in ms) + tuple(B(m, s) for m in reversed(ms)) for s in range(workers))
    return Schedule("gpipe", workers, microbatches, acts, round_robin(workers, workers))


def one_f_one_b(workers: int, microbatches: int, virtual: int = 1) -> Schedule:
    """1F1B with a flush (PipeDream-flush): K-1-k warm-up forwards on stage k, then alternate."""
    _single("1f1b", virtual)
    check_sizes(workers, microbatches)
    acts = []
    for s in range(workers):
        warmup = min(workers - s - 1, microbatches)
        seq = [F(m, s) for m in range(warmup)]
        for i in range(microbatches - warmup):
            seq += [F(warmup + i, s), B(i, s)]
        seq += [B(m, s) for m in range(microbatches - warmup, microbatches)]
        acts.append(tuple(seq))
    return Schedule("1f1b", workers, microbatches, tuple(acts), round_robin(workers, workers))


def interleaved_1f1b(workers: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: worker w holds stages w, w+K, ..., w+(v-1)K."""
    check_sizes(workers, microbatches)
    if virtual <= 0:
        raise ValueError(f"virtual stages per worker must be positive (virtual: {virtual})")
    k, v = workers, virtual

    def order(w: int, backward: bool) -> list[tuple[int, int]]:
        seq = []
        for first in range(0, microbatches, k):
            group = range(first, min(first + k, microbatches))
            for c in reversed(range(v)) if backward else range(v):
                seq += [(m, c * k + w) for m in group]
        return seq

    def build(extra: int) -> Schedule:
        acts = []
        for w in range(k):
            fwd, bwd = order(w, False), order(w, True)
            warmup = (k - w - 1) if v == 1 else (k - w - 1) * 2 + (v - 1) * k
            warmup = min(len(fwd), warmup + extra)
            seq = [F(*a) for a in fwd[:warmup]]
            for i in range(len(fwd) - warmup):
                seq += [F(*fwd[warmup + i]), B(*bwd[i])]
            seq += [B(*a) for a in bwd[len(fwd) - warmup :]]
            acts.append(tuple(seq))
        return Schedule("interleaved-1f1b", k * v, microbatches, tuple(acts), round_robin(k * v, k))

    # Megatron's warm-up assumes M divisible by K; for a partial last group, warm up a little more
    # until the schedule is deadlock-free (at worst all forwards first, which always is).
    for extra in range(microbatches * v + 1):
        schedule = build(extra)
        try:
            validate(schedule)
        except ScheduleError:
            continue
        return schedule
    raise AssertionError("unreachable: an all-forwards-first schedule is always valid")


def zb_h1(workers: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Zero bubble H1: 1F1B's forwards and input-gradient passes, with weight-gradient passes held back.

    Stage k warms up with K-1-k forwards like 1F1B, then runs (F, I) pairs; only from its k-th pair
    on does each pair bring a W (of the oldest micro-batch still waiting). The cooldown runs (I, W),
    and the k W passes still pending fill the tail that 1F1B leaves idle. Every stage then holds at
    most K micro-batches — 1F1B's peak — and with F = I = W each stage idles K-1 units instead of
    1F1B's 3(K-1).
    """
    _single("zb-h1", virtual)
    check_sizes(workers, microbatches)
    acts = []
    for s in range(workers):
        warmup = min(workers - s - 1, microbatches)
        seq = [F(m, s) for m in range(warmup)]
        weights = iter(range(microbatches))
        for i in range(microbatches - warmup):
            seq += [F(warmup + i, s), I(i, s)]
            if i >= s:
                seq.append(W(next(weights), s))
        for m in range(microbatches - warmup, microbatches):
            seq += [I(m, s), W(next(weights), s)]
        seq += [W(m, s) for m in weights]
        acts.append(tuple(seq))
    return Schedule("zb-h1", workers, microbatches, tuple(acts), round_robin(workers, workers))


Generator = Callable[[int, int, int], Schedule]

SCHEDULES: dict[str, Generator] = {
    "gpipe": fill_drain,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def make_schedule(name: str, workers: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Generate and validate the schedule called ``name``."""
    try:
        generate = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None
    schedule = generate(workers, microbatches, virtual)
    validate(schedule)
    return schedule
