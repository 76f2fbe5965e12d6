"""Memory-controlled V schedules: V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable
Memory", 2024), generators like those of :mod:`gpipe.schedule.generate`, where they are registered.

Both run on ZB-V's V (2K stages, stages w and 2K-1-w on worker w, ``virtual=2``) with the backward
split into I and W, and both are a *building block* repeated once per micro-batch: with F = I = W each
worker has six actions per micro-batch, and micro-batch j's actions sit 6j slots after micro-batch 0's,
so that in the steady state no worker idles. What a block fixes is when micro-batch 0 reaches each
worker on its way down (F of stage w), back up (F of stage 2K-1-w), down again (I of stage 2K-1-w) and
up again (I of stage w). A worker holds a (stage, micro-batch) pair from its F to its W, so the time
micro-batch 0 takes to come back to a worker decides how many pairs it holds: a worker holds stage w
from the first visit to the fourth and stage 2K-1-w from the second to the third, together the whole
*loop* of the micro-batch, L slots plus the W passes; at one micro-batch every 6 slots that is about
L/6 pairs. 1F1B's first worker holds K micro-batches of a worker's layers, 2K pairs of V stages.

'v-min' — the shortest loop, L = 4K: every hand-over in the next slot (micro-batch 0's F of stage w in
slot w, F of 2K-1-w in slot 2K-1-w, I of 2K-1-w in slot 2K+g+w, I of w in slot 4K-1+g-w; g = 2 when 3
divides K, else 0, for no two of a worker's slots to meet modulo 6). About 2K/3 pairs, a third of
1F1B's activation memory (K=2, M=3)::

    worker 0 | F0a .   .   F0b I0b W0b F1a I0a W0a F1b I1b W1b F2a I1a W1a F2b I2b W2b .   I2a W2a
    worker 1 | .   F0a F0b .   .   I0b I0a F1a F1b W0b W0a I1b I1a F2a F2b W1b W1a I2b I2a W2b W2a
    stage of each letter: worker 0 a=0 b=3, worker 1 a=1 b=2

'v-half' — a loop of 6K: the legs away from worker 0 (F down, I of the upper stages) take two slots a
hop, the legs back towards it one (F of stage w in slot 2w, of 2K-1-w in slot 3K-2-w, I of 2K-1-w in
slot 3K-1+g+2w, I of w in slot 6K-2+g-w; g = 3 for even K, else 0). About K pairs, half of 1F1B's; the
spare slot of every other hop is slack that absorbs unequal F, I and W costs (K=2, M=3)::

    worker 0 | F0a .   .   F0b F1a I0b W0b F1b F2a .   I0a I1b W0a F2b W1b .   I1a I2b W1a W2b .   I2a W2a
    worker 1 | .   F0a F0b .   .   F1a F1b I0b W0b I0a W0a F2a F2b I1b W1b I1a W1a .   I2b W2b I2a W2a .
    stage of each letter: worker 0 a=0 b=3, worker 1 a=1 b=2

A worker runs its F and I passes in the order of their slots; a W pass takes a slot no F or I uses (the
oldest W owed, two free slots in every six), and the W passes still owed at the end follow. The order is
a valid one for any M (every action's slot comes after those of the actions it needs); the timeline
then starts each action as early as its worker and its inputs allow.

What the simulator (:func:`gpipe.schedule.simulate`) gives, verified for K = 2..13, M >= K (tests):

=========  =====================================  ==========================================
schedule   peak pairs per worker (F = I = W)       idle per worker with F = I = W (of 6M + idle)
=========  =====================================  ==========================================
v-min      2·floor((K+4)/3)                        4K - 5 + g   (g = 2 if 3 | K, else 0)
v-half     2·floor((K+2)/2)                        (7K - 4)/2 for even K, (7K - 7)/2 for odd K
=========  =====================================  ==========================================

so the bubble is idle/(6M + idle): about 2K/(3M) for V-Min and 7K/(12M) for V-Half, between ZB-V's
(K-1)/(6M+K-1) and 1F1B's (K-1)/(M+K-1), and the peak is the paper's: (K+4)//3 and (K+2)//2 of
1F1B's K micro-batches (a pair is half of a 1F1B micro-batch). Fewer micro-batches hold at most
2M pairs. The paper also squeezes the warm-up and cool-down of its blocks further (V-Half's bubble
there is about K/(2M)); these keep the block's own order, so with F = I = W the greedy candidates of
'auto' can beat V-Half at its own memory, while under a cap between V-Min's peak and V-Half's, V-Min
is the fastest candidate that fits.

With unequal costs (the order, hence the peak, is the same): when W is cheaper than F and I (about
half, as the zero-bubble paper measured), V-Half's slack lets its steady state run faster than one
micro-batch per six unit slots, and its bubble stays between ZB-V's and 1F1B's from K = 3 on; V-Min's
loop holds no W pass and no slack, so its step is the unit step less only the last W's saving
(makespan(W=w) = makespan(W=1) - (1-w) with F = I = 1), and its bubble is above 1F1B's once
M >= 2K: its third of the memory is paid for in time unless the passes cost alike.
"""

from __future__ import annotations

from collections import deque

from gpipe.schedule.ir import Action, ActionKind, I, Schedule, W, check_sizes, v_shape
from gpipe.schedule.ir import F as Fwd

__all__ = ["BLOCK", "block_slots", "v_half", "v_min"]

BLOCK = 6
"""Slots per micro-batch in a worker's building block: F, I and W on each of its two stages."""


def block_slots(name: str, workers: int, worker: int) -> tuple[int, int, int, int]:
    """Micro-batch 0's slots on ``worker`` in schedule ``name``'s block: F of its down stage, F of its
    up stage, I of its up stage, I of its down stage (micro-batch j's are 6j later)."""
    k, w = workers, worker
    if name == "v-min":
        g = 2 if k % 3 == 0 else 0
        return w, 2 * k - 1 - w, 2 * k + g + w, 4 * k - 1 + g - w
    if name == "v-half":
        g = 3 if k % 2 == 0 else 0
        return 2 * w, 3 * k - 2 - w, 3 * k - 1 + g + 2 * w, 6 * k - 2 + g - w
    raise ValueError(f"no building block named {name!r}: choose 'v-min' or 'v-half'")


def v_min(workers: int, microbatches: int, virtual: int = 2) -> Schedule:
    """V-Min: the V's building block of the shortest loop, about a third of 1F1B's activation memory."""
    return _from_block("v-min", workers, microbatches, virtual)


def v_half(workers: int, microbatches: int, virtual: int = 2) -> Schedule:
    """V-Half: the V's building block with a loop of 6K slots, about half of 1F1B's activation memory."""
    return _from_block("v-half", workers, microbatches, virtual)


def _from_block(name: str, workers: int, microbatches: int, virtual: int) -> Schedule:
    if virtual != 2:
        raise ValueError(f"schedule {name!r} runs two stages per worker, in a V (virtual: {virtual}); use virtual=2")
    check_sizes(workers, microbatches)
    k, m = workers, microbatches
    acts = []
    for w in range(k):
        down, up = w, 2 * k - 1 - w
        first = block_slots(name, k, w)
        slots: dict[int, Action] = {}
        for j in range(m):
            for offset, action in zip(first, (Fwd(j, down), Fwd(j, up), I(j, up), I(j, down))):
                slots[offset + BLOCK * j] = action
        order: list[Action] = []
        owed: deque[Action] = deque()
        for t in range(max(slots) + 1):
            a = slots.get(t)
            if a is not None:
                order.append(a)
                if a.kind is ActionKind.BACKWARD_INPUT:
                    owed.append(W(a.microbatch, a.stage))
            elif owed:
                order.append(owed.popleft())
        order += owed
        acts.append(tuple(order))
    return Schedule(name, 2 * k, m, tuple(acts), v_shape(k))
