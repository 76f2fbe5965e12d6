"""The exact partitioner: split L layer costs into K contiguous cells minimizing the largest cell.

The largest cell is the pipeline's bottleneck: every stage waits for the slowest. Two dynamic
programs over prefixes, O(K·L²):

1. ``best[k][i]``: the smallest possible largest cell when layers ``0..i-1`` form ``k`` cells (each
   cell within the optional memory cap). ``best[K][L]`` is the optimum B*.
2. Among the partitions whose cells all cost at most B*, the one whose smallest cell is largest, i.e.
   (B* being the largest cell of all of them) the one with the smallest spread, max - min.

Exact, not a heuristic: ``tests/test_balance.py`` checks it against brute force.

:func:`lightest` adds memory as a second goal: among the splits whose largest cell costs at most
``1 + slack`` times B*, the smallest largest memory M* (a third program, over the same prefixes); then
:func:`solve` under the cap M*: the fastest of the lightest. An embedding that costs no time but holds
a third of a language model's parameters no longer lands beside as many layers as the others get.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["lightest", "solve"]


def _check(costs: Sequence[float], partitions: int) -> None:
    if partitions <= 0:
        raise ValueError(f"partitions must be positive (partitions: {partitions})")
    if len(costs) < partitions:
        raise ValueError(
            f"more partitions than layers (layers: {len(costs)}, partitions: {partitions}); "
            "every partition needs at least one layer"
        )
    bad = [i for i, c in enumerate(costs) if not (c >= 0 and math.isfinite(c))]
    if bad:
        raise ValueError(f"layer costs must be finite and non-negative (layer {bad[0]}: {costs[bad[0]]})")


def solve(
    costs: Sequence[float],
    partitions: int,
    *,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
) -> list[int]:
    """The balance (layers per cell) of the optimal split of ``costs`` into ``partitions`` cells;
    with ``memory`` and ``memory_cap``, no cell's summed memory exceeds the cap."""
    _check(costs, partitions)
    n, k_max = len(costs), partitions
    if (memory is None) != (memory_cap is None):
        raise ValueError("give both memory (per layer) and memory_cap, or neither")
    if memory is not None and len(memory) != n:
        raise ValueError(f"memory lists {len(memory)} layers, costs {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    mem_prefix = [0.0]
    for m in memory or [0.0] * n:
        mem_prefix.append(mem_prefix[-1] + m)

    def cost(j: int, i: int) -> float:
        return prefix[i] - prefix[j]

    def fits(j: int, i: int) -> bool:
        return memory_cap is None or mem_prefix[i] - mem_prefix[j] <= memory_cap

    inf = math.inf
    # best[k][i]: smallest largest cell for layers 0..i-1 in k cells.
    best = [[inf] * (n + 1) for _ in range(k_max + 1)]
    best[0][0] = 0.0
    for k in range(1, k_max + 1):
        for i in range(k, n - (k_max - k) + 1):
            best[k][i] = min(
                (max(best[k - 1][j], cost(j, i)) for j in range(k - 1, i) if best[k - 1][j] < inf and fits(j, i)),
                default=inf,
            )
    bottleneck = best[k_max][n]
    if bottleneck == inf:
        raise ValueError(
            f"no split into {partitions} cells keeps every cell within the memory cap {memory_cap:g}; "
            "raise the cap or use more partitions"
        )
    # widest[k][i]: the largest smallest cell over splits of 0..i-1 into k cells of cost <= bottleneck.
    widest = [[-inf] * (n + 1) for _ in range(k_max + 1)]
    cut = [[-1] * (n + 1) for _ in range(k_max + 1)]
    widest[0][0] = inf
    for k in range(1, k_max + 1):
        for i in range(k, n - (k_max - k) + 1):
            for j in range(k - 1, i):
                if widest[k - 1][j] == -inf or cost(j, i) > bottleneck or not fits(j, i):
                    continue
                value = min(widest[k - 1][j], cost(j, i))
                if value > widest[k][i]:
                    widest[k][i], cut[k][i] = value, j
    balance, i = [], n
    for k in range(k_max, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return balance[::-1]


def lightest(
    costs: Sequence[float],
    partitions: int,
    memory: Sequence[float],
    *,
    slack: float = 0.05,
    memory_cap: float | None = None,
) -> list[int]:
    """The balance of the split of ``costs`` into ``partitions`` cells whose largest summed ``memory``
    is smallest among those whose largest cell costs at most ``1 + slack`` times the fastest split's
    (within ``memory_cap``, if given); the fastest of them, the most even (see the module's docstring)."""
    if not (slack >= 0 and math.isfinite(slack)):
        raise ValueError(f"slack must be a finite number >= 0 (slack: {slack})")
    _check(memory, partitions)
    fastest = solve(costs, partitions, memory=memory if memory_cap is not None else None, memory_cap=memory_cap)
    prefix, mem_prefix = [0.0], [0.0]
    for c, m in zip(costs, memory, strict=True):
        prefix.append(prefix[-1] + c)
        mem_prefix.append(mem_prefix[-1] + m)
    n, bound, edges = len(costs), 0.0, [0]
    for size in fastest:
        edges.append(edges[-1] + size)
        bound = max(bound, prefix[edges[-1]] - prefix[edges[-2]])
    bound *= 1 + slack
    inf = math.inf
    # heaviest[k][i]: the smallest largest memory of layers 0..i-1 in k cells, each costing at most bound.
    heaviest = [[inf] * (n + 1) for _ in range(partitions + 1)]
    heaviest[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, n - (partitions - k) + 1):
            heaviest[k][i] = min(
                (
                    max(heaviest[k - 1][j], mem_prefix[i] - mem_prefix[j])
                    for j in range(k - 1, i)
                    if heaviest[k - 1][j] < inf and prefix[i] - prefix[j] <= bound
                ),
                default=inf,
            )
    cap = heaviest[partitions][n]  # (finite: the fastest split is among them)
    return solve(costs, partitions, memory=memory, memory_cap=cap)
