"""Experts spread over ranks (``--expert-parallel``, :mod:`gpipe.distributed.experts`) on this machine:
2 ranks under torchrun (gloo, one intra-op thread each), each a replica of a one-stage pipeline
(issue 49).

Reproduce (from the repository root; about 1 min here)::

    .venv/bin/python benchmarks/expert_parallel.py --out benchmarks/results/moe/expert_parallel
    .venv/bin/python benchmarks/expert_parallel.py --quick      # small sizes, under a minute

For each number of experts E (every feed-forward block a mixture, top-2, of size H), three layouts of
the same global batch train side by side, taking turns (``--repeats`` rounds of 5 timed steps after a
warm-up; the median step):

- ``dense``: the dense model of equal active parameters per token (feed-forward blocks 2H wide), two
  replicas;
- ``copied``: the MoE model, two replicas each holding every expert (``--data-parallel 2``);
- ``split``: the MoE model with its experts split over the two replicas (``--expert-parallel 2``).

Reported: tokens/s and the step over the dense one's; the all-to-all's share of a ``split`` step (the
time inside the exchanges and their waits, forward and backward, from torch's profiler over 3 steps);
each rank's expert parameters and Adam state (elements held, ``split`` over ``copied``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("dense", "copied", "split")


def _models(args: argparse.Namespace, experts: int) -> dict[str, Any]:
    from gpipe.models import transformer

    common = {"dim": args.dim, "vocab": 1000, "dropout": 0.0, "target_padding": "end"}
    return {
        "dense": lambda: transformer(args.layers, 2 * args.hidden, 4, **common),
        "copied": lambda: transformer(args.layers, args.hidden, 4, experts=experts, moe_every=1, **common),
        "split": lambda: transformer(args.layers, args.hidden, 4, experts=experts, moe_every=1, **common),
    }


def worker(args: argparse.Namespace) -> None:
    """One rank: every E's layouts, timed; its figures into ``--into``/rank<r>.json."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812
    from torch.distributed.tensor import DTensor

    from gpipe import Pipeline

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0)

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(1, 1000, (args.batch, args.length), generator=g)
    tgt = torch.randint(1, 1000, (args.batch, args.length + 1), generator=g)
    inputs, target = (src, tgt[:, :-1]), tgt[:, 1:]
    found: dict[str, Any] = {}
    for e in args.experts:
        pipes, optimizers = {}, {}
        for name, make in _models(args, e).items():
            torch.manual_seed(0)
            model = make()
            pipes[name] = Pipeline(model, [len(model)], chunks=args.chunks, loss_fn=loss_fn, data_parallel=2,
                                   expert_parallel=2 if name == "split" else 1)  # fmt: skip
            optimizers[name] = torch.optim.Adam(pipes[name].parameters(), lr=1e-4)
        times: dict[str, list[float]] = {name: [] for name in pipes}
        for name, pipe in pipes.items():  # warm-up, and the optimizer's state made
            pipe.step(inputs, target)
            optimizers[name].step()
        for _ in range(args.repeats):
            for name, pipe in pipes.items():
                for _ in range(5):
                    pipe.zero_grad()
                    dist.barrier()
                    began = time.perf_counter()
                    pipe.step(inputs, target)
                    times[name].append(time.perf_counter() - began)
        held = {}
        for name, pipe in pipes.items():
            experts = [p for n, p in pipe.named_parameters() if ".experts." in n]
            state = [t for p in experts for t in optimizers[name].state[p].values() if t.dim() > 0]
            local = [t.to_local() if isinstance(t, DTensor) else t for t in (*experts, *state)]
            held[name] = {"parameters": sum(p.numel() for p in local[: len(experts)]),
                          "adam_state": sum(t.numel() for t in local[len(experts) :])}  # fmt: skip
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                pipes["split"].zero_grad()
                pipes["split"].step(inputs, target)
        profiled = prof.key_averages()
        exchanged = sum(e.self_cpu_time_total for e in profiled if _exchange(e.key))
        total_us = sum(e.self_cpu_time_total for e in profiled)
        found[str(e)] = {
            "steps": times,
            "held": held,
            "exchange_s": exchanged / 1e6 / 3,
            "profiled_s": total_us / 1e6 / 3,
            "exchange_events": sorted({ev.key for ev in profiled if _exchange(ev.key)}),
        }
    Path(args.into, f"rank{dist.get_rank()}.json").write_text(json.dumps(found))


def _exchange(key: str) -> bool:
    """A profiler event of the experts' exchanges: the all-to-alls (forward and backward), their waits,
    and the capacities' all-gather."""
    return any(word in key for word in ("all_to_all", "alltoall", "wait_tensor", "all_gather"))


def launch(args: argparse.Namespace, into: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    flags = ["--layers", str(args.layers), "--dim", str(args.dim), "--hidden", str(args.hidden), "--batch",
             str(args.batch), "--length", str(args.length), "--chunks", str(args.chunks), "--repeats",
             str(args.repeats), "--experts", *map(str, args.experts)]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(args.port),
           __file__, "--worker", "--into", str(into), *flags]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, timeout=1800)
    return [json.loads((into / f"rank{r}.json").read_text()) for r in range(2)]


def summarize(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = args.batch * args.length * 2  # the global batch's source and target positions
    out: dict[str, Any] = {}
    for e in map(str, args.experts):
        # a step lasts as long as its slowest rank's
        steps = {name: [max(a, b) for a, b in zip(ranks[0][e]["steps"][name], ranks[1][e]["steps"][name])]
                 for name in LAYOUTS}  # fmt: skip
        median = {name: statistics.median(t) for name, t in steps.items()}
        held = ranks[0][e]["held"]
        out[e] = {
            "step_s": median,
            "tokens_per_s": {name: tokens / t for name, t in median.items()},
            "over_dense": {name: t / median["dense"] for name, t in median.items()},
            "split_over_copied": median["split"] / median["copied"],
            "exchange_share": statistics.mean(r[e]["exchange_s"] / r[e]["profiled_s"] for r in ranks),
            "exchange_s": statistics.mean(r[e]["exchange_s"] for r in ranks),
            "exchange_events": ranks[0][e]["exchange_events"],
            "held": held,
            "held_split_over_copied": {k: held["split"][k] / held["copied"][k] for k in ("parameters", "adam_state")},
        }
    return out


def report(args: argparse.Namespace, found: dict[str, Any], seconds: float) -> str:
    lines = [
        "# Experts spread over ranks (`--expert-parallel 2`)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} ({os.cpu_count()} cores), torch "
        f"{__import__('torch').__version__}, 2 ranks under torchrun (gloo, 1 thread each), in {seconds:.0f} s.",
        "",
        f"Command: `.venv/bin/python benchmarks/expert_parallel.py{' --quick' if args.quick else ''} --out {args.out}`",
        "",
        f"T({args.layers}, H={args.hidden}, 4) at dimension {args.dim}, every feed-forward block a mixture of E "
        f"experts (top-2) of size H; the dense model's blocks are 2H wide (equal active parameters). Two replicas "
        f"of a one-stage pipeline, a global batch of {args.batch} x {args.length} token pairs, {args.chunks} "
        f"micro-batches per replica, Adam; the median of {args.repeats} rounds of 5 steps (each step as long as "
        "its slower rank).",
        "",
        "| E | layout | step (s) | tokens/s | over dense | expert parameters per rank | Adam state per rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for e, r in found.items():
        for name in LAYOUTS:
            h = r["held"][name]
            lines.append(f"| {e} | {name} | {r['step_s'][name]:.3f} | {r['tokens_per_s'][name]:,.0f} | "
                         f"{r['over_dense'][name]:.2f}x | {h['parameters']:,} | {h['adam_state']:,} |")  # fmt: skip
    lines += ["", "| E | split step over copied | all-to-all share of a split step | its seconds per step | "
              "split's experts per rank over copied (parameters, Adam state) |", "|---|---|---|---|---|"]  # fmt: skip
    for e, r in found.items():
        ratio = r["held_split_over_copied"]
        lines.append(f"| {e} | {r['split_over_copied']:.2f}x | {100 * r['exchange_share']:.1f}% | "
                     f"{r['exchange_s']:.3f} | {ratio['parameters']:.2f}, {ratio['adam_state']:.2f} |")  # fmt: skip
    first = next(iter(found.values()))
    lines += ["", f"The all-to-all share counts the profiler's events {', '.join(first['exchange_events'])} (their "
              "own time: transfers and waits for the peer), over all the step's events."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/expert_parallel")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--into", help=argparse.SUPPRESS)
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--port", type=int, default=29731)
    for name in ("layers", "dim", "hidden", "batch", "length", "chunks", "repeats"):
        parser.add_argument(f"--{name}", type=int)
    args = parser.parse_args()
    sizes = (2, 64, 128, 8, 16, 2, 1) if args.quick else (2, 256, 512, 32, 64, 4, 3)
    for name, value in zip(("layers", "dim", "hidden", "batch", "length", "chunks", "repeats"), sizes):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.worker:
        worker(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpipe-ep-") as into:
        found = summarize(args, launch(args, Path(into)))
    (out / "results.json").write_text(json.dumps(found, indent=1) + "\n")
    text = report(args, found, time.perf_counter() - began)
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
