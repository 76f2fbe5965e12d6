"""Throughput, the paper's Tables 2 and 3: normalized training throughput for K partitions and M
micro-batches, measured where K fits the cores, projected by the simulator elsewhere.

Projection: every layer's forward and backward time is measured on one thread for the micro-batch
size of each M; the layers are split into K cells by the exact partitioner; the fill-drain schedule
is simulated with each cell's costs (backward includes the re-materialized forward, as in the paper)
and the throughput is N over the simulated makespan — K devices as fast as this core, no transfer
cost. Measurement: a real ``Pipeline`` step (checkpoint='always', one intra-op thread per stage) for
the K that fit the machine's cores, one process per stage. Both are normalized like the paper's Table 2, to K=2, M=1.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import torch

from gpipe.balance import solve
from gpipe.balance.profile import as_leaves, backward_through, each_layer
from gpipe.bench.common import Bench, Section, Workload, intra_op_threads, launch, spread, timed, workloads
from gpipe.microbatch import Batch, scatter
from gpipe.schedule import Action, ActionKind, make_schedule, simulate

__all__ = ["PAPER", "layer_costs", "project", "run"]

PARTITIONS = (1, 2, 4, 8)
MICROBATCHES = (1, 4, 32)

# The paper's Table 2 (TPUs, relative to K=2, M=1) and Table 3 (GPUs, M=32, relative to K=2).
PAPER = {
    "amoebanet": {(2, 1): 1.0, (4, 1): 1.13, (8, 1): 1.38, (2, 4): 1.07, (4, 4): 1.26, (8, 4): 1.72,
                  (2, 32): 1.21, (4, 32): 1.84, (8, 32): 3.48},
    "transformer": {(2, 1): 1.0, (4, 1): 1.07, (8, 1): 1.3, (2, 4): 1.7, (4, 4): 3.2, (8, 4): 4.8,
                    (2, 32): 1.8, (4, 32): 3.4, (8, 32): 6.3},
}  # fmt: skip
PAPER_GPU = {"amoebanet": {2: 1.0, 4: 1.7, 8: 2.7}, "transformer": {2: 1.0, 4: 1.8, 8: 3.3}}


def layer_costs(model: torch.nn.Sequential, sample: Any, repeats: int) -> tuple[list[float], list[float]]:
    """Each layer's forward and backward time (seconds, median of ``repeats``) on ``sample``,
    on the calling thread's intra-op threads."""
    forward, backward = [], []
    for layer, batch in each_layer(model, Batch.of(sample)):
        fs, bs = [], []
        for _ in range(repeats + 1):  # the first run warms up
            inputs = as_leaves(batch)
            holder: list[Batch] = []
            fs.append(timed(lambda: holder.append(Batch.of(layer(inputs.value)))))  # noqa: B023
            bs.append(timed(lambda: backward_through(holder[0])))  # noqa: B023
        forward.append(statistics.median(fs[1:]))
        backward.append(statistics.median(bs[1:]))
    return forward, backward


def project(forward: list[float], backward: list[float], balance: list[int], microbatches: int) -> float:
    """The simulated fill-drain makespan (seconds) of a step of ``microbatches`` micro-batches whose
    per-layer costs are given, over the cells of ``balance``."""
    cells_f, cells_b, start = [], [], 0
    for n in balance:
        f = sum(forward[start : start + n])
        cells_f.append(f)
        cells_b.append(f + sum(backward[start : start + n]))  # re-materialization redoes the forward
        start += n

    def cost(action: Action) -> float:
        return cells_f[action.stage] if action.kind is ActionKind.FORWARD else cells_b[action.stage]

    return simulate(make_schedule("gpipe", len(balance), microbatches), cost).makespan


def _measure(bench: Bench, work: Workload, costs: list[float], partitions: int) -> dict[int, list[float]]:
    """Step times for each M, K processes (one per stage, one thread each, gloo)."""
    spec = {"task": "throughput", "quick": bench.quick, "batch": work.batch, "workload": work.name,
            "costs": costs, "microbatches": list(MICROBATCHES), "repeats": bench.repeats,
            "devices": bench.devices}  # fmt: skip
    times = launch(partitions, spec)
    return {int(m): ts for m, ts in times.items()}


def run(bench: Bench, out: Path) -> Section:
    cores = os.cpu_count() or 1
    measured_k = [k for k in PARTITIONS if k <= cores]
    rows: dict[str, Any] = {}
    with intra_op_threads(1):
        for work in workloads(bench):
            model = work.build()
            costs = {m: layer_costs(model, scatter(work.inputs, m)[0].value, bench.repeats) for m in MICROBATCHES}
            whole = [f + b for f, b in zip(*costs[1])]  # cells are cut by the costs of the whole batch
            balances = {k: solve(whole, k) for k in PARTITIONS if k <= len(model)}
            projected = {
                (k, m): work.items / project(*costs[m], balances[k], m) for k in balances for m in MICROBATCHES
            }
            # the pipeline alone: every micro-batch costs 1/M of the whole batch (no kernel efficiency lost)
            ideal = {
                (k, m): work.items / project([c / m for c in costs[1][0]], [c / m for c in costs[1][1]], balances[k], m)
                for k in balances
                for m in MICROBATCHES
            }
            measured: dict[tuple[int, int], list[float]] = {}
            for k in measured_k:
                for m, times in _measure(bench, work, whole, k).items():
                    measured[(k, m)] = [work.items / t for t in times]
            rows[work.name] = {"work": work, "projected": projected, "ideal": ideal, "measured": measured,
                               "balances": balances}  # fmt: skip
    figure = _plot(rows, out / "throughput.png")
    return Section("Throughput (Tables 2 and 3)", _markdown(rows, measured_k, cores), [figure], _data(rows))


def _markdown(rows: dict[str, Any], measured_k: list[int], cores: int) -> str:
    lines = [
        "Normalized training throughput, relative to K=2, M=1 (the paper's Table 2). *Projected*: "
        "per-layer costs measured on one thread for each micro-batch size, cells split by the exact "
        "partitioner, the fill-drain step simulated (K devices as fast as one core, no transfer cost). "
        f"*Measured*: real `Pipeline` steps on this machine ({cores} cores: K ≤ {max(measured_k)}), one "
        "process per stage (gloo), one thread each, checkpoint='always', the same cells; median [min-max] "
        "over the repetitions. "
        "*Pipeline only*: projected with each micro-batch costing 1/M of the whole batch, i.e. without "
        "the kernels' loss of efficiency on small micro-batches — the schedule's own scaling. "
        "*Paper*: TPUv3 (Table 2).",
        "",
    ]
    for name, row in rows.items():
        work, projected, measured = row["work"], row["projected"], row["measured"]
        base_p = projected[(2, 1)]
        base_m = statistics.median(measured[(2, 1)]) if (2, 1) in measured else None
        cells = ", ".join(f"K={k}: {b}" for k, b in row["balances"].items() if k > 1)
        lines += [f"**{name}**: {work.describe}; mini-batch N={work.batch}; cells {cells}.", ""]
        lines += [
            f"| K | M | projected | pipeline only | measured | paper | measured {work.unit}/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for k in PARTITIONS:
            for m in MICROBATCHES:
                if (k, m) not in projected:
                    continue
                p = f"{projected[(k, m)] / base_p:.2f}"
                if (k, m) in measured and base_m:
                    meas = spread([v / base_m for v in measured[(k, m)]])
                    rate = spread(measured[(k, m)], ".0f")
                else:
                    meas = rate = "—"
                paper = PAPER[name].get((k, m))
                ideal = row["ideal"][(k, m)] / row["ideal"][(2, 1)]
                paper_text = paper if paper is not None else "—"
                lines.append(f"| {k} | {m} | {p} | {ideal:.2f} | {meas} | {paper_text} | {rate} |")
        m32 = {k: projected[(k, 32)] / projected[(2, 32)] for k in (2, 4, 8) if (k, 32) in projected}
        gpu = PAPER_GPU[name]
        lines += [
            "",
            "M=32 relative to K=2 (the paper's Table 3, P100 GPUs over PCI-E): projected "
            + ", ".join(f"K={k} {v:.2f}" for k, v in m32.items())
            + "; paper "
            + ", ".join(f"K={k} {v}" for k, v in gpu.items())
            + ".",
            "",
        ]
    return "\n".join(lines)


def _data(rows: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {
            "projected": {f"K={k},M={m}": v for (k, m), v in row["projected"].items()},
            "pipeline_only": {f"K={k},M={m}": v for (k, m), v in row["ideal"].items()},
            "measured": {f"K={k},M={m}": v for (k, m), v in row["measured"].items()},
        }
        for name, row in rows.items()
    }


def _plot(rows: dict[str, Any], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
    for ax, (name, row) in zip(axes[0], rows.items()):
        base = row["projected"][(2, 1)]
        for i, m in enumerate(MICROBATCHES):
            color = f"C{i}"
            ks = [k for k in PARTITIONS if (k, m) in row["projected"]]
            ax.plot(ks, [row["projected"][(k, m)] / base for k in ks], "o-", color=color, label=f"M={m} projected")
            paper = [(k, PAPER[name][(k, m)]) for k in ks if (k, m) in PAPER[name]]
            ax.plot(*zip(*paper), "x--", color=color, alpha=0.6, label=f"M={m} paper")
            if (2, 1) in row["measured"]:
                mbase = statistics.median(row["measured"][(2, 1)])
                meas = [
                    (k, statistics.median(row["measured"][(k, m)]) / mbase) for k in ks if (k, m) in row["measured"]
                ]
                ax.plot(*zip(*meas), "s", color=color, mfc="none", ms=9, label=f"M={m} measured")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(PARTITIONS), [str(k) for k in PARTITIONS])
        ax.set_xlabel("partitions K")
        ax.set_ylabel("throughput relative to K=2, M=1")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
