"""V-Half and V-Min against 1F1B: peak activation memory per worker and step time, in one process.

The model: 16 layers (2K from K=16 on), each a block Linear(H, 4H)-GELU-Linear(4H, H) (H=256; --quick:
H=128), MSE loss, batch 256 in M micro-batches, on K=2, 4, 8, 16 and 24 'cpu' devices (one intra-op
thread each; --quick: K=2, 4). The peaks approach the paper's 1/2 and 1/3 only as K grows: V-Half holds
(K+2)//2 and V-Min (K+4)//3 of 1F1B's K micro-batches (schedule/controllable.py). From K=16 on, K
threads share this machine's 2 cores: those step times say little. 1F1B cuts
the layers into K equal stages, one per worker; 'v-half' and 'v-min' into 2K, two per worker in a
V (virtual=2, stages w and 2K-1-w on worker w). Re-materialization off (checkpoint='never'), so a
forward keeps every activation its backward needs.

Measured:
- peak activation memory per worker: the bytes autograd keeps for backward
  (``Pipeline(measure_memory=True)``, ``last_trace.peak_activation_bytes``), in a step of its own;
  the table gives the largest worker's and its ratio to 1F1B's largest (targets: v-half <= 0.55x,
  v-min <= 0.40x), next to the simulator's prediction from the schedules alone (peak
  (stage, micro-batch) pairs, half a 1F1B micro-batch each);
- step time: the schedules take turns within each repetition (the order rotated), so that machine
  noise hits them alike; median over repetitions, and the per-repetition ratio to 1F1B's step,
  median [min-max].

Reproduce:  .venv/bin/python benchmarks/memory_schedules.py [--quick] [--repeats 7]
            [--out benchmarks/results/memory_schedules]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from gpipe.schedule import make_schedule, simulate

SCHEDULES = [("1f1b", 1), ("v-half", 2), ("v-min", 2)]
TARGETS = {"v-half": 0.55, "v-min": 0.40}
BATCH = 256


def model(hidden: int, blocks: int = 16) -> nn.Sequential:
    """``blocks`` layers, each a block Linear-GELU-Linear: every stage of every K here gets as many."""
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)) for _ in range(blocks))
    )


def even(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def pipeline(net: nn.Sequential, name: str, virtual: int, k: int, m: int, measure: bool) -> Pipeline:
    return Pipeline(
        copy.deepcopy(net),
        even(len(net), k * virtual),
        chunks=m,
        schedule=name,
        loss_fn=F.mse_loss,
        virtual=virtual,
        devices=["cpu"] * k,
        cpu_threads=1,
        checkpoint="never",
        measure_memory=measure,
    )


def predicted(name: str, virtual: int, k: int, m: int) -> float:
    """The simulator's peak per worker in 1F1B micro-batches of a worker's layers."""
    peak = max(simulate(make_schedule(name, k, m, virtual)).peak_in_flight)
    return peak / virtual


def run(k: int, m: int, hidden: int, repeats: int) -> dict[str, Any]:
    net = model(hidden, max(16, 2 * k))  # (at least one layer per V stage)
    x = torch.randn(BATCH, hidden, generator=torch.Generator().manual_seed(1))
    y = torch.randn(BATCH, hidden, generator=torch.Generator().manual_seed(2))
    out: dict[str, Any] = {"K": k, "M": m, "hidden": hidden, "schedules": {}}
    pipes = {}
    for name, virtual in SCHEDULES:
        measured = pipeline(net, name, virtual, k, m, measure=True)
        measured.step(x, y)
        assert measured.last_trace is not None and measured.last_trace.peak_activation_bytes is not None
        peaks = [int(b) for b in measured.last_trace.peak_activation_bytes]
        out["schedules"][name] = {"peak_bytes": peaks, "predicted": predicted(name, virtual, k, m), "times": []}
        pipes[name] = pipeline(net, name, virtual, k, m, measure=False)
        pipes[name].step(x, y)  # warm-up
    names = [n for n, _ in SCHEDULES]
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            pipes[name].step(x, y)
            out["schedules"][name]["times"].append(time.perf_counter() - start)
    return out


def summary(results: list[dict[str, Any]]) -> str:
    lines = [
        "| K | M | schedule | peak activations per worker (MiB) | x 1F1B (measured) | x 1F1B (simulated) "
        "| target | step time (s) | step x 1F1B, median [min-max] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        base = res["schedules"]["1f1b"]
        base_peak, base_pred = max(base["peak_bytes"]), base["predicted"]
        for name, _ in SCHEDULES:
            got = res["schedules"][name]
            ratios = [t / b for t, b in zip(got["times"], base["times"])]
            peak = max(got["peak_bytes"])
            target = f"≤ {TARGETS[name]:.2f}" if name in TARGETS else ""
            lines.append(
                f"| {res['K']} | {res['M']} | {name} | "
                + ", ".join(f"{b / 2**20:.1f}" for b in got["peak_bytes"])
                + f" | {peak / base_peak:.3f} | {got['predicted'] / base_pred:.3f} | {target} | "
                f"{statistics.median(got['times']):.3f} | {statistics.median(ratios):.3f} "
                f"[{min(ratios):.3f}-{max(ratios):.3f}] |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="H=128, M=8 only, 5 repetitions (about a minute)")
    parser.add_argument("--repeats", type=int, help="repetitions of the timed steps (default 7; --quick 5)")
    parser.add_argument("--out", type=Path, help="write results.json and report.md into this folder")
    args = parser.parse_args()
    hidden = 128 if args.quick else 256
    repeats = args.repeats or (5 if args.quick else 7)
    sizes = [(2, 8), (4, 8)] if args.quick else [(2, 8), (4, 8), (4, 16), (8, 16), (16, 32), (24, 32)]
    torch.set_num_threads(1)
    results = [run(k, m, hidden, repeats) for k, m in sizes]
    table = summary(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(), "quick": args.quick}
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        head = (
            f"# V-Half and V-Min against 1F1B\n\n`.venv/bin/python benchmarks/memory_schedules.py"
            f"{' --quick' if args.quick else ''} --repeats {repeats} --out {args.out}` "
            f"(torch {torch.__version__}, {repeats} repetitions, H={hidden}, batch {BATCH}).\n\n"
        )
        (args.out / "report.md").write_text(head + table + "\n")


if __name__ == "__main__":
    main()
