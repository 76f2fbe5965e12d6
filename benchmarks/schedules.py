"""Every schedule side by side on 2 'cpu' devices: step time, measured bubble, peak activation memory.

The model of the engine benchmark (8 blocks of Linear(1024, 4096)-GELU-Linear(4096, 1024), flattened to
24 layers), batch 256 in M=8 micro-batches, K=2 workers with one intra-op thread each, MSE loss. Every
schedule of ``gpipe.schedule.SCHEDULES`` runs — one stage per worker (balance [12, 12]), or two per
worker for 'interleaved-1f1b' (round robin), 'zb-v' and 'dualpipev' (V placement) with virtual=2
(balance [6, 6, 6, 6]) — and so does ``schedule='auto'`` (one stage per worker, and two in a V with
virtual=2), warmed up for 3 steps
so that the schedule it is timed with is planned from measured costs. Every variant runs with
re-materialization off ('never') and on ('always'); the variants take turns within each repetition
so that machine noise hits them alike. The default run (16 variants, 5 repetitions) takes about
4 minutes on a 2-core VM (sizes and repetitions unchanged).

Measured per variant:
- step time (median and spread over the repetitions);
- bubble: the idle fraction of the two workers over the step, from the step's own trace;
- idle: the idle time itself (the bubble's size);
- overhead: how much longer the step took than the simulator predicts from the step's measured
  action costs (the runtime's own cost: waiting, hand-over, Python);
- peak activation memory per worker (bytes autograd keeps for backward, measured in a separate step);
- the mean time of each kind of action, and the bubble the simulator predicts from those means
  (what the schedule would give if every action of a kind took the same time);
- for 'auto': the schedule its plan chose (``last_plan.chosen``) and the plan's simulated bubble
  (under the costs it measured).

The summary line gives, for 'never' and 'always', auto's measured bubble over fill-drain's (target
<= 1/3) and auto's step time over the best fixed schedule's (target <= 1.02x; per repetition, median
[min-max]).

Reproduce:  .venv/bin/python benchmarks/schedules.py [--repeats 5] [--json out.json] [--pictures DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from gpipe.runtime.planner import AutoPlanner
from gpipe.schedule import kind_cost, render_timeline, simulate
from gpipe.schedule.generate import SCHEDULES as GENERATORS

VIRTUAL = {"interleaved-1f1b": 2, "zb-v": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}  # two stages per worker
SCHEDULES = [(name, VIRTUAL.get(name, 1)) for name in GENERATORS] + [("auto", 1), ("auto", 2)]
CHECKPOINTS = ["never", "always"]
AUTO_WARMUP = 3  # steps before timing: the first two measure costs, the third runs the plan made from them


def model(blocks: int, hidden: int, ffn: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden)]
    return nn.Sequential(*layers)


def balance(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if k < extra else 0) for k in range(stages)]


@dataclass
class Result:
    schedule: str
    checkpoint: str
    times: list[float] = field(default_factory=list)
    bubbles: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    overheads: list[float] = field(default_factory=list)
    peak_mib: list[float] = field(default_factory=list)
    kind_ms: dict[str, list[float]] = field(default_factory=dict)
    mean_cost_bubbles: list[float] = field(default_factory=list)
    virtual: int = 1
    chosen: str | None = None  # 'auto': the candidate its plan chose
    plan_bubble: float | None = None  # 'auto': the plan's simulated bubble under its measured costs


def label(res: Result) -> str:
    return f"{res.schedule} (v={res.virtual})" if res.virtual > 1 else res.schedule


def ratio_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--pictures", help="write each variant's last measured timeline (PNG) and Chrome trace here")
    args = parser.parse_args(argv)

    base = model(args.blocks, args.hidden, args.ffn)
    x, y = torch.randn(args.batch, args.hidden), torch.randn(args.batch, args.hidden)
    pipes: dict[tuple[str, int, str], Pipeline] = {}
    results: dict[tuple[str, int, str], Result] = {}
    not_run: dict[str, str] = {}
    for name, virtual in SCHEDULES:
        for ck in CHECKPOINTS:
            try:
                pipes[(name, virtual, ck)] = Pipeline(
                    copy.deepcopy(base),
                    balance(len(base), 2 * virtual),
                    chunks=args.chunks,
                    schedule=name,
                    loss_fn=F.mse_loss,
                    checkpoint=ck,
                    virtual=virtual,
                    devices=["cpu", "cpu"],
                    cpu_threads=1,
                )
            except ValueError as exc:  # e.g. dualpipev with M < 2K
                not_run[name] = str(exc)
                continue
            results[(name, virtual, ck)] = Result(name, ck, virtual=virtual)

    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; 2 'cpu' workers x 1 thread")
    print(f"# {' '.join(sys.argv)}")
    for pipe in pipes.values():  # 'auto': plan from measured costs before the memory step and the timing
        if pipe.schedule == "auto":
            for _ in range(AUTO_WARMUP):
                pipe.step(x, y)
                pipe.zero_grad()
    for key, pipe in pipes.items():  # warm-up and peak memory, in a step of its own
        pipe.measure_memory = True
        pipe.step(x, y)
        pipe.measure_memory = False
        assert pipe.last_trace is not None and pipe.last_trace.peak_activation_bytes is not None
        results[key].peak_mib = [b / 2**20 for b in pipe.last_trace.peak_activation_bytes]
        pipe.zero_grad()
    keys = list(pipes)
    for r in range(args.repeats):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            pipe, res = pipes[key], results[key]
            start = time.perf_counter()
            pipe.step(x, y)
            res.times.append(time.perf_counter() - start)
            pipe.zero_grad()
            trace = pipe.last_trace
            assert trace is not None
            measured = trace.timeline()
            predicted = simulate(trace.schedule, trace.costs().__getitem__)
            res.bubbles.append(measured.bubble)
            res.idle.append(sum(measured.idle) / len(measured.idle))
            res.overheads.append(measured.makespan / predicted.makespan - 1)
            costs = trace.costs()
            means = {
                k: statistics.mean(v for a, v in costs.items() if a.kind.value == k)
                for k in "FBIW"
                if any(a.kind.value == k for a in costs)
            }
            for k, v in means.items():
                res.kind_ms.setdefault(k, []).append(v * 1e3)
            res.mean_cost_bubbles.append(simulate(trace.schedule, kind_cost(**means)).bubble)
    for key, pipe in pipes.items():
        planner = pipe.engine.planner
        if isinstance(planner, AutoPlanner) and planner.last_plan is not None:
            results[key].chosen = planner.last_plan.chosen
            results[key].plan_bubble = planner.last_plan.bubble

    if args.pictures:
        out = Path(args.pictures)
        out.mkdir(parents=True, exist_ok=True)
        for (name, virtual, ck), pipe in pipes.items():
            assert pipe.last_trace is not None
            stem = f"{name}-v{virtual}-{ck}" if name == "auto" and virtual > 1 else f"{name}-{ck}"
            render_timeline(pipe.last_trace.timeline(), out / f"{stem}.png", unit="seconds (measured)")
            pipe.last_trace.save_chrome(out / f"{stem}.trace.json")
    for name, why in not_run.items():
        print(f"# {name}: not run: {why}")
    fill = {ck: statistics.median(results[("gpipe", 1, ck)].bubbles) for ck in CHECKPOINTS}
    fill_idle = {ck: statistics.median(results[("gpipe", 1, ck)].idle) for ck in CHECKPOINTS}
    print(
        "\n| schedule | remat | step time (s) median [min-max] | bubble | bubble / fill-drain's "
        "| idle (ms) / fill-drain's | overhead vs simulator | peak activations per worker (MiB) "
        "| mean action (ms) | bubble simulated from mean costs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (_, _, ck), res in results.items():
        t, b, idle = statistics.median(res.times), statistics.median(res.bubbles), statistics.median(res.idle)
        print(
            f"| {label(res)} | {ck} | {t:.3f} [{min(res.times):.3f}-{max(res.times):.3f}] | {b:.3f} "
            f"| {b / fill[ck]:.2f} | {idle * 1e3:.0f} / {idle / fill_idle[ck]:.2f} "
            f"| {statistics.median(res.overheads):+.1%} | {', '.join(f'{p:.1f}' for p in res.peak_mib)} "
            f"| {' '.join(f'{k}={statistics.median(v):.0f}' for k, v in res.kind_ms.items())} "
            f"| {statistics.median(res.mean_cost_bubbles):.3f} |"
        )
    print()
    summary = []
    for virtual in (1, 2):
        for ck in CHECKPOINTS:
            auto = results.get(("auto", virtual, ck))
            if auto is None or not auto.times:
                continue
            print(
                f"- {label(auto)}, remat {ck}: chose {auto.chosen}; the plan's simulated bubble "
                f"{auto.plan_bubble:.3f} (measured {statistics.median(auto.bubbles):.3f})"
            )
            fixed = [r for (n, _, c), r in results.items() if c == ck and n != "auto"]
            best = min(fixed, key=lambda r: statistics.median(r.times))
            steps = [a / b for a, b in zip(auto.times, best.times)]
            summary.append(
                f"{label(auto)} {ck}: bubble / fill-drain's {statistics.median(auto.bubbles) / fill[ck]:.2f} "
                f"(target <= 0.33), step / best fixed ({label(best)}) {ratio_spread(steps)} (target <= 1.02)"
            )
    if summary:
        print(f"\nSummary — {'; '.join(summary)}.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results.values()], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
