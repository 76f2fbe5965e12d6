"""Schedule generators: pure functions of (K workers, M micro-batches, v virtual stages per worker)
that return a :class:`~gpipe.schedule.ir.Schedule`.

Legend of the tables below: ``F3`` forward of micro-batch 3, ``B`` full backward, ``I`` input-gradient
backward, ``W`` weight-gradient backward, ``.`` idle; one column per unit of time (all costs 1). Where a
worker holds several stages, a letter names which (``F3b``: on its second stage; the last line says
which stage each letter is on each worker).

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

    worker 0 | F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a .   B2b .   B3b B2a B3a
    worker 1 | .   F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a .
    stage of each letter: worker 0 a=0 b=2, worker 1 a=1 b=3

'zb-h1' — zero bubble H1 (Qi et al., 2024): backward split into I and W, the W passes deferred into
what would be bubbles; 1F1B's peak memory (no stage holds more than K micro-batches, as many as
1F1B's first stage) and, with F = I = W, a third of 1F1B's idle time::

    worker 0 | F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3
    worker 1 | .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
    worker 2 | .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3

'zb-h2' — zero bubble H2 (Qi et al., 2024): ZB-H1 with more memory — stage k warms up with
2(K-1-k)+1 forwards and holds up to 2K-1 micro-batches (every stage holds min(M, 2K-1) at its peak),
and the W passes gather at the tail. The step is a parallelogram: with F = I = W, once M >= 2K-1 no
worker idles between its first and its last action, and the idle time left, K-1 units per worker for
any M >= K (bubble (K-1)/(3M+K-1); 2K-1-M units, bubble (2K-1-M)/(2M+2K-1), for M < K), is the
stagger at the two ends, which the next step's warm-up fills once the optimizer step's
synchronisation is bypassed as in the paper. ZB-H1 idles as long with F = I = W but inside the step,
and longer when W is the cheaper pass (K=4, M=8, the paper's figure)::

    worker 0 | F0 F1 F2 F3 F4 F5 F6 I0 W0 F7 I1 W1 I2 W2 I3 W3 I4 W4 I5 W5 I6 W6 I7 W7 .  .  .
    worker 1 | .  F0 F1 F2 F3 F4 I0 F5 I1 F6 I2 W0 F7 I3 W1 I4 W2 I5 W3 I6 W4 I7 W5 W6 W7 .  .
    worker 2 | .  .  F0 F1 F2 I0 F3 I1 F4 I2 F5 I3 F6 I4 W0 F7 I5 W1 I6 W2 I7 W3 W4 W5 W6 W7 .
    worker 3 | .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 F5 I5 F6 I6 W0 F7 I7 W1 W2 W3 W4 W5 W6 W7

'zb-v' — zero bubble V (Qi et al., 2024): 2K stages, two per worker in a V (stages w and 2K-1-w on
worker w, virtual=2), backward split. With F = I = W each worker idles max(K-1, 4K-2-2M) units of its
6M, so from M >= (3K-1)/2 on the bubble is (K-1)/(6M+K-1), only the stagger at the two ends (no
worker can start before the ones upstream), and from M >= 2K-1 on no worker idles between its first and
its last action. Worker w holds at most min(M+1+w, 2M, 2K) (stage, micro-batch) pairs — 2K once
M >= 2K-1: each stage has half a worker's layers, so K micro-batches' worth, 1F1B's peak (K=2, M=4;
each micro-batch appears once per stage)::

    worker 0 | F0a F1a F2a F0b I0b W0b F1b I1b W1b F3a I0a W0a F2b I2b W2b I1a W1a F3b I3b W3b I2a W2a I3a W3a .
    worker 1 | .   F0a F0b F1a F1b I0b W0b F2a I0a W0a F2b I1b W1b F3a I1a W1a F3b I2b W2b I2a I3b I3a W2a W3b W3a
    stage of each letter: worker 0 a=0 b=3, worker 1 a=1 b=2

'dualpipev' — DeepSeek's DualPipeV, DualPipe cut in half (as PyTorch's ``ScheduleDualPipeV``): the
V of ZB-V, whose steady state pairs a forward of one stage with the full backward of the other, the
two meant to overlap (the IR runs them back to back). It needs M >= 2K. With F = I = W = 1 and B = 2
(here B spans two columns) every worker idles K-1 units of its 6M — bubble (K-1)/(6M+K-1); worker w
idles w of them before its first action and the other K-1-w inside the step. Every worker holds at
most 2K+1 (stage, micro-batch) pairs, one more than ZB-V, as each pair's forward is taken before its
backward frees one (K=2, M=4)::

    worker 0 | F0a F1a F2a F0b I0b W0b F1b F3a B1b B1b F2b B0a B0a B2b B2b F3b .   B1a B1a B3b B3b I2a W2a I3a W3a
    worker 1 | .   F0a F0b F1a F1b F2a B0b B0b F2b B0a B0a F3a B1b B1b F3b B1a B1a B2b B2b B2a B2a I3b I3a W3b W3a
    stage of each letter: worker 0 a=0 b=3, worker 1 a=1 b=2

'v-half' and 'v-min' — the memory-controlled V schedules (half and a third of 1F1B's activation
memory), built from a repeated building block in :mod:`gpipe.schedule.controllable`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from gpipe.schedule.controllable import v_half, v_min
from gpipe.schedule.ir import (
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    check_sizes,
    round_robin,
    v_shape,
    validate,
)

__all__ = [
    "SCHEDULES",
    "dualpipe_v",
    "fill_drain",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "v_half",
    "v_min",
    "zb_h1",
    "zb_h2",
    "zb_v",
]


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


def zb_h2(workers: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Zero bubble H2: ZB-H1 given more memory, so that no worker idles between its first and last action.

    Stage k warms up with 2(K-1-k)+1 forwards — as many as fit before the first input gradient can
    come back — then alternates (I, F) until it holds 2K-1 micro-batches, the cap of every stage; from
    then on each cycle (I, W, F) frees one before taking the next. Once the forwards are done it runs
    (I, W) while input gradients remain and ends with the W passes still owed: the first stage's tail
    is (I, W) pairs, the last stage's a run of W passes, and the step is a parallelogram.
    """
    _single("zb-h2", virtual)
    check_sizes(workers, microbatches)
    k, m = workers, microbatches
    acts = []
    for s in range(k):
        seq = _Sequence()
        warmup = min(2 * (k - 1 - s) + 1, m)
        for _ in range(warmup):
            seq.forward(s)
        for _ in range(min(2 * s, m - warmup)):  # up to the cap of 2K-1 held micro-batches
            seq.input(s)
            seq.forward(s)
        while seq.count("F", s) < m:
            seq.input(s)
            seq.weight(s)
            seq.forward(s)
        while seq.count("I", s) < m:
            seq.input(s)
            seq.weight(s)
        while seq.weight(s):
            pass
        acts.append(seq.actions)
    return Schedule("zb-h2", k, m, tuple(acts), round_robin(k, k))


def zb_v(workers: int, microbatches: int, virtual: int = 2) -> Schedule:
    """ZB-V: zero bubble on a V — worker w holds stages w (going down) and 2K-1-w (coming back up).

    Worker w warms up with 2(K-w)-1 forwards down and w pairs (F up, F down), then K-w triples
    (F up, I up, W up); the steady state runs [F down], I down, W down, F up, I up, W up; the
    cool-down runs w pairs (I down, I up), K-w pairs (I down, W down), then the owed W passes. The
    order is laid out for max(M, 2K-1) micro-batches; with fewer, the actions of the missing ones are
    dropped (still valid: a micro-batch's actions depend only on that micro-batch's).
    """
    _two("zb-v", virtual)
    check_sizes(workers, microbatches)
    k, m = workers, microbatches
    n = max(m, 2 * k - 1)
    acts = []
    for w in range(k):
        down, up = w, 2 * k - 1 - w
        seq = _Sequence()
        for _ in range(2 * (k - w) - 1):
            seq.forward(down)
        for _ in range(w):
            seq.forward(up)
            seq.forward(down)
        for _ in range(k - w):
            seq.forward(up)
            seq.input(up)
            seq.weight(up)
        for _ in range(n - k):
            if seq.count("F", down) < n:
                seq.forward(down)
            seq.input(down)
            seq.weight(down)
            seq.forward(up)
            seq.input(up)
            seq.weight(up)
        for _ in range(w):
            seq.input(down)
            seq.input(up)
        for _ in range(k - w):
            seq.input(down)
            seq.weight(down)
        while seq.weight(up) or seq.weight(down):
            pass
        acts.append(tuple(a for a in seq.actions if a.microbatch < m))
    return Schedule("zb-v", 2 * k, m, tuple(acts), v_shape(k))


def dualpipe_v(workers: int, microbatches: int, virtual: int = 2) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe cut in half): a V like ZB-V, whose steady state pairs the forward
    of one stage with the full backward of the other, for the two to overlap (computation with the
    other's communication). The IR has no fused action: a pair is the forward then the backward, back
    to back. Worker w runs, in turn:

    =========================  ==================================================================
    2(K-1-w)                   forwards down
    w+1                        (F down, F up)
    K-1-w                      (I up, W, F up)
    M-2K+1+w                   (F down, B up), (F up, B down) — the last worker's first F down and
                               B up are the one pair not meant to overlap
    K-1-w                      B up, (F up, B down)
    w+1                        (up, down) backwards: B, and from the middle on I
    K-1-w                      (W, I or B down)
    w+1                        W
    =========================  ==================================================================

    where W is always the oldest weight-gradient pass owed. It needs M >= 2K (as DeepSeek's and
    PyTorch's do): the steady state must have a pair to run on every worker.
    """
    _two("dualpipev", virtual)
    check_sizes(workers, microbatches)
    k, m = workers, microbatches
    if m < 2 * k:
        raise ValueError(
            f"schedule 'dualpipev' needs at least 2K = {2 * k} micro-batches on {k} workers (micro-batches: {m})"
        )
    acts = []
    for w in range(k):
        down, up = w, 2 * k - 1 - w
        seq = _Sequence()
        for _ in range(2 * (k - 1 - w)):
            seq.forward(down)
        for _ in range(w + 1):
            seq.forward(down)
            seq.forward(up)
        for _ in range(k - 1 - w):
            seq.input(up)
            seq.weight()
            seq.forward(up)
        for _ in range(m - 2 * k + 1 + w):
            seq.forward(down)
            seq.backward(up)
            seq.forward(up)
            seq.backward(down)
        for _ in range(k - 1 - w):
            seq.backward(up)
            seq.forward(up)
            seq.backward(down)
        split = False  # the second half of these backwards is split, for the W passes to fill the tail
        for i in range(w + 1):
            split = split or (i == (w + 1) // 2 and w % 2 == 1)
            (seq.input if split else seq.backward)(up)
            split = split or (i == (w + 1) // 2 and w % 2 == 0)
            (seq.input if split else seq.backward)(down)
        for _ in range(k - 1 - w):
            seq.weight()
            (seq.input if split else seq.backward)(down)
        while seq.weight():
            pass
        acts.append(seq.actions)
    return Schedule("dualpipev", 2 * k, m, tuple(acts), v_shape(k))


def _two(name: str, virtual: int) -> None:
    if virtual != 2:
        raise ValueError(f"schedule {name!r} runs two stages per worker, in a V (virtual: {virtual}); use virtual=2")


class _Sequence:
    """One worker's actions, appended phase by phase: each call takes the next micro-batch of its kind
    on its stage in order; :meth:`input` leaves a W pass owed, :meth:`weight` pays the oldest."""

    def __init__(self) -> None:
        self._actions: list[Action] = []
        self._next: Counter[tuple[str, int]] = Counter()
        self._owed: list[Action] = []

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(self._actions)

    def count(self, kind: str, stage: int) -> int:
        """How many ``kind`` (``"F"``, or ``"I"`` for any backward) of ``stage`` were appended."""
        return self._next[kind, stage]

    def _take(self, kind: str, stage: int) -> int:
        self._next[kind, stage] += 1
        return self._next[kind, stage] - 1

    def forward(self, stage: int) -> None:
        self._actions.append(F(self._take("F", stage), stage))

    def backward(self, stage: int) -> None:
        self._actions.append(B(self._take("I", stage), stage))

    def input(self, stage: int) -> None:
        m = self._take("I", stage)
        self._actions.append(I(m, stage))
        self._owed.append(W(m, stage))

    def weight(self, stage: int | None = None) -> bool:
        """Append the oldest W pass owed (on ``stage``, if given); False if none is owed."""
        owed = [a for a in self._owed if stage is None or a.stage == stage]
        if owed:
            self._owed.remove(owed[0])
            self._actions.append(owed[0])
        return bool(owed)


Generator = Callable[[int, int, int], Schedule]

SCHEDULES: dict[str, Generator] = {
    "gpipe": fill_drain,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zb-v": zb_v,
    "dualpipev": dualpipe_v,
    "v-half": v_half,  # the memory-controlled V schedules: gpipe.schedule.controllable
    "v-min": v_min,
}
"""The generators by name: ``SCHEDULES[name](K, M, v)`` is the :class:`Schedule` of K workers, M micro-batches
and v stages per worker; :func:`make_schedule` looks it up and validates it."""


def make_schedule(name: str, workers: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Generate and validate the schedule called ``name``."""
    try:
        generate = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None
    schedule = generate(workers, microbatches, virtual)
    validate(schedule)
    return schedule
