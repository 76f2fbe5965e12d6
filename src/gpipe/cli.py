"""The ``gpipe`` command line.

``gpipe demo`` trains a small model with the pipeline on synthetic data, printing the schedule, its
bubble and the loss of every step.

``gpipe train`` trains the paper's Transformer or AmoebaNet-D, or a Hugging Face causal LM (see
:mod:`gpipe.train`).

``gpipe bench`` reproduces the paper's tables on this machine beside peers (see :mod:`gpipe.bench`).

``gpipe schedule --schedule 1f1b --stages 4 --chunks 8 [--virtual 2] [--out timeline.png]`` prints a
schedule's bubble and peak in-flight activations and draws its timeline.

``gpipe vocab --data DIR --size N`` trains one SentencePiece vocabulary for every language pair in DIR,
on text sampled with temperature T=5 (see :mod:`gpipe.data.vocab`).

``gpipe corpus --out DIR`` writes the built-in synthetic multilingual corpus as parallel text files
(the layout ``gpipe train --data DIR`` reads), to try the translation workflow without data.

``gpipe translate --checkpoint RUN`` translates sentences with a checkpoint of ``gpipe train --data
DIR`` (see :mod:`gpipe.translate`).

``gpipe schedule --auto --stages 4 --chunks 8 --costs F=1,I=1,W=2,transfer=0.1 [--memory-cap 4]`` prints
the schedule the cost-adaptive scheduler picks for those costs (see :mod:`gpipe.schedule.auto`), why
(every candidate's step time, peak memory and whether it fits the cap), and draws its timeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Sequence

import torch
from torch import nn

from gpipe.commands.args import ArgumentParser, UsageError
from gpipe.gpipe import GPipe
from gpipe.schedule import SCHEDULES, StageCosts, kind_cost, make_schedule, plan, render_timeline, simulate
from gpipe.schedule.render import check_timeline_path

__all__ = ["ArgumentParser", "UsageError", "main"]


def _demo_model(width: int, depth: int, classes: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(width, width * 2), nn.GELU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width * 2, width * 2), nn.GELU()]
    layers += [nn.Linear(width * 2, classes)]
    return nn.Sequential(*layers)


def _even_balance(layers: int, partitions: int) -> list[int]:
    base, extra = divmod(layers, partitions)
    return [base + (1 if k < extra else 0) for k in range(partitions)]


def demo(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    model = _demo_model(args.width, args.depth, args.classes)
    if args.partitions > len(model):
        print(f"error: --partitions {args.partitions} exceeds the model's {len(model)} layers", file=sys.stderr)
        return 2
    balance = _even_balance(len(model), args.partitions)
    pipe = GPipe(model, balance, devices=["cpu"] * args.partitions, chunks=args.chunks, checkpoint=args.checkpoint)

    # A synthetic task: classify points by a fixed random linear "teacher".
    teacher = torch.randn(args.width, args.classes)
    sim = simulate(make_schedule("gpipe", args.partitions, args.chunks))
    print(
        f"gpipe demo: {len(model)} layers, balance {balance} on {args.partitions} 'cpu' devices, "
        f"batch {args.batch} in {args.chunks} micro-batches, checkpoint={args.checkpoint!r}"
    )
    print(f"schedule 'gpipe' (fill-drain), unit costs — bubble {sim.bubble:.3f} = (K-1)/(M+K-1):")
    print(sim.text())
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.width)
        y = (x @ teacher).argmax(dim=1)
        optimizer.zero_grad()
        loss = criterion(pipe(x), y)
        loss.backward()
        optimizer.step()
        print(f"step {step:3d}/{args.steps}  loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - start
    print(f"{args.steps} steps in {elapsed:.1f} s ({args.steps * args.batch / elapsed:.0f} samples/s)")
    return 0


def _costs(text: str) -> dict[str, float]:
    costs = {}
    for item in filter(None, text.split(",")):
        kind, _, value = item.partition("=")
        if kind not in ("F", "B", "I", "W", "transfer", "jitter") or not value:
            raise argparse.ArgumentTypeError(
                f"expected KIND=COST with KIND one of F, B, I, W, or transfer=TIME, jitter=CV (got {item!r})"
            )
        try:
            costs[kind] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cost of {kind} is not a number (got {value!r})") from None
        if kind in ("transfer", "jitter"):
            if not costs[kind] >= 0 or not math.isfinite(costs[kind]):
                raise argparse.ArgumentTypeError(f"{kind} must be finite and >= 0 (got {value})")
        elif not costs[kind] > 0 or not math.isfinite(costs[kind]):
            raise argparse.ArgumentTypeError(f"cost of {kind} must be positive and finite (got {value})")
    return costs


def _memory_cap(text: str) -> tuple[float, ...]:
    caps = []
    for item in text.split(","):
        try:
            cap = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number, or one per worker separated by commas (got {item!r})"
            ) from None
        if not cap > 0 or not math.isfinite(cap):
            raise argparse.ArgumentTypeError(f"a memory cap must be positive and finite (got {item})")
        caps.append(cap)
    return tuple(caps)


def _printable(sim_makespan: float, values: Sequence[float]) -> bool:
    return sim_makespan <= 200 and all(float(c).is_integer() for c in values)


def schedule(args: argparse.Namespace) -> int:
    if args.auto:
        return auto(args)
    costs = dict(args.costs)
    transfer = costs.pop("transfer", 0.0)
    if costs.pop("jitter", 0.0):
        print("error: jitter=... is for --auto (it ranks candidates by their expected step time)", file=sys.stderr)
        return 2
    try:
        sched = make_schedule(args.schedule, args.stages, args.chunks, args.virtual)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sim = simulate(sched, kind_cost(**costs), transfer=transfer)
    shown = ", ".join(f"{k}={v:g}" for k, v in {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0, **costs}.items())
    if transfer:
        shown += f", transfer={transfer:g}"
    print(
        f"schedule {sched.name!r}: K={sched.num_workers} workers, M={sched.num_microbatches} micro-batches, "
        f"{sched.num_stages} stages; costs {shown}"
    )
    print(f"makespan {sim.makespan:g}, bubble {sim.bubble:.4f} ({sim.bubble:.1%})")
    print("idle per worker: " + ", ".join(f"{i:g}" for i in sim.idle))
    print("peak in-flight activations per worker: " + ", ".join(map(str, sim.peak_in_flight)))
    if _printable(sim.makespan, args.costs.values()):
        print(sim.text())
    if args.out:
        print(f"wrote {render_timeline(sim, args.out)}")
    return 0


def auto(args: argparse.Namespace) -> int:
    """``gpipe corpus --out DIR`` writes the built-in synthetic multilingual corpus as parallel text files
    (the layout ``gpipe train --data DIR`` reads), to try the translation workflow without data.

    ``gpipe translate --checkpoint RUN`` translates sentences with a checkpoint of ``gpipe train --data
    DIR`` (see :mod:`gpipe.translate`).

    ``gpipe schedule --auto``: what the cost-adaptive scheduler picks for uniform costs, and why."""
    given = args.costs
    split = {"I", "W"} & given.keys()
    # B alone: a fused backward was measured; split it half and half (StageCosts.from_trace's default).
    half = given["B"] / 2 if "B" in given and not split else 1.0
    stages = args.stages * args.virtual
    try:
        costs = StageCosts.uniform(
            stages,
            F=given.get("F", 1.0),
            I=given.get("I", half),
            W=given.get("W", half),
            B=given.get("B"),
            transfer=given.get("transfer", 0.0),
        )
        costs = dataclasses.replace(costs, jitter=given.get("jitter", 0.0))
        result = plan(args.stages, args.chunks, costs, memory_cap=args.memory_cap)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sim = result.simulation
    print(
        f"schedule 'auto': K={args.stages} workers, M={args.chunks} micro-batches, {stages} stages; "
        "the fastest candidate under these costs that fits the memory cap"
    )
    print(result.explain())
    print("idle per worker: " + ", ".join(f"{i:g}" for i in sim.idle))
    all_costs = (*costs.forward, *costs.input, *costs.weight, *costs.fused, costs.transfer)
    if _printable(sim.makespan, all_costs):
        print(sim.text())
    if args.out:
        title = (
            f"auto ({result.chosen}): K={args.stages}, M={args.chunks} — bubble {sim.bubble:.1%}, "
            f"peak memory {max(result.peak_memory):g}"
        )
        print(f"wrote {render_timeline(sim, args.out, title=title)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="gpipe", description="GPipe pipeline-parallel training on PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "train", help="train the paper's Transformer or AmoebaNet-D, or a Hugging Face causal LM, pipelined (see -h)"
    )
    sub.add_parser("bench", help="reproduce the paper's tables here, beside peers; a markdown report (see -h)")
    d = sub.add_parser("demo", help="train a small model with the pipeline on synthetic data")
    d.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
    d.add_argument("--partitions", type=int, default=2, help="K, the number of stages (default: 2)")
    d.add_argument("--chunks", type=int, default=8, help="M, micro-batches per mini-batch (default: 8)")
    d.add_argument("--batch", type=int, default=128, help="mini-batch size N (default: 128)")
    d.add_argument("--width", type=int, default=64, help="input width (default: 64)")
    d.add_argument("--depth", type=int, default=4, help="number of Linear layers (default: 4)")
    d.add_argument("--classes", type=int, default=10, help="number of classes (default: 10)")
    d.add_argument(
        "--checkpoint",
        default="except_last",
        choices=["always", "except_last", "never"],
        help="re-materialization (default: except_last)",
    )
    d.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default: 3e-3)")
    d.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    d.set_defaults(func=demo)

    s = sub.add_parser("schedule", help="generate, validate and simulate a schedule; draw its timeline")
    s.add_argument("--schedule", choices=list(SCHEDULES), help="the schedule (default: gpipe)")
    s.add_argument(
        "--auto",
        action="store_true",
        help="pick the fastest schedule for --costs within --memory-cap, and show the candidates (not with --schedule)",
    )
    s.add_argument("--stages", type=int, default=4, help="K, pipeline workers (devices) (default: 4)")
    s.add_argument("--chunks", type=int, default=8, help="M, micro-batches (default: 8)")
    s.add_argument("--virtual", type=int, default=1, help="v, stages per worker (interleaved) (default: 1)")
    s.add_argument(
        "--costs",
        type=_costs,
        default={},
        help="action costs and the time of a hand-over between workers, e.g. F=1,B=2,I=1,W=1,transfer=0.1 "
        "(default: all 1, transfer 0; with --auto, B defaults to I+W, and B alone is split into I=W=B/2)",
    )
    s.add_argument(
        "--memory-cap",
        type=_memory_cap,
        help="with --auto: activations a worker may hold, in micro-batches on a stage; "
        "one number, or one per worker separated by commas (default: no cap)",
    )
    s.add_argument("--out", help="write the timeline picture here (.png, .svg, .pdf, ...)")
    s.set_defaults(func=schedule)

    v = sub.add_parser("vocab", help="train one SentencePiece vocabulary for every language pair of a data directory")
    v.add_argument("--data", required=True, help="a directory of pair files: xx-yy.tsv, or xx-yy.xx + xx-yy.yy")
    v.add_argument("--size", type=int, default=32000, help="pieces in the vocabulary (default: 32000)")
    v.add_argument("--out", help="model prefix: writes PREFIX.model and PREFIX.vocab (default: DATA/vocab)")
    v.add_argument(
        "--temperature", type=float, default=5.0, help="sample pairs with p ∝ (D/ΣD)^(1/T) (default: 5, the paper's)"
    )
    v.add_argument("--sample", type=int, default=1_000_000, help="sentence pairs drawn to train on (default: 1e6)")
    v.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    v.set_defaults(func=vocab)
    c = sub.add_parser("corpus", help="write the built-in synthetic multilingual corpus as parallel text files")
    c.add_argument("--out", required=True, help="the folder to write (created if missing)")
    c.add_argument("--sizes", type=_sizes, default=(20000, 4000, 800, 150),
                   help="sentence pairs of each language pair (default: 20000,4000,800,150)")  # fmt: skip
    c.add_argument(
        "--held-out", type=int, default=64, help="held-out sentence pairs per pair, in OUT/eval (default: 64)"
    )
    c.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    c.set_defaults(func=corpus)
    sub.add_parser("translate", help="translate sentences with a checkpoint of gpipe train --data DIR (see -h)")
    return parser


def vocab(args: argparse.Namespace) -> int:
    """``gpipe vocab``: the shared vocabulary of a directory of language pairs, and the pairs' shares."""
    from pathlib import Path

    from gpipe.data import vocab as vocabulary

    try:
        pairs = vocabulary.read_pairs(args.data)
        shares = vocabulary.pair_probabilities(pairs, args.temperature)
        out = args.out or str(Path(args.data) / "vocab")
        model = vocabulary.train_vocab(
            pairs, out, size=args.size, temperature=args.temperature, sample=args.sample, seed=args.seed
        )
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total = sum(len(p) for p in pairs.values())
    print(f"{len(pairs)} language pairs, {total} sentence pairs; sampled with temperature {args.temperature:g}:")
    for name, p in pairs.items():
        print(f"  {name:<12} {len(p):>9} pairs  {len(p) / total:7.2%} of the data  {shares[name]:7.2%} of the sample")
    print(f"wrote {model} ({vocabulary.Vocab(model).size} pieces)")
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes such as 20000,4000,800 (got {text!r})") from None
    if not 1 <= len(sizes) <= 26 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"give 1 to 26 positive sizes (got {text!r})")
    return sizes


def corpus(args: argparse.Namespace) -> int:
    """``gpipe corpus``: the built-in synthetic language pairs as text files."""
    from pathlib import Path

    from gpipe.data import SyntheticTranslation

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out {args.out!r} is a file; name a folder", file=sys.stderr)
        return 2
    data = SyntheticTranslation(sizes=args.sizes, held_out=args.held_out, seed=args.seed)
    files = data.write(out)
    for name, size in data.pair_sizes.items():
        print(f"  {name}: {size} sentence pairs, {args.held_out} held out")
    print(f"wrote {len(files)} files to {out}; next: gpipe train --data {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from gpipe.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["translate"]:
        from gpipe.translate import main as translate_main

        return translate_main(argv[1:])
    if argv[:1] == ["bench"]:
        from gpipe.bench import main as bench_main

        return bench_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        _check(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return int(args.func(args))


def _check(args: argparse.Namespace) -> None:
    """Refuse bad flags of ``gpipe demo``, ``gpipe schedule`` and ``gpipe vocab`` before any work starts."""
    for name in ("steps", "partitions", "chunks", "batch", "width", "depth", "classes", "stages", "virtual", "size",
                 "sample", "temperature", "held_out"):  # fmt: skip
        if getattr(args, name, 1) <= 0:
            raise UsageError(f"--{name} must be positive (got {getattr(args, name)})")
    if args.command == "demo":
        if args.depth < 2:
            raise UsageError(f"--depth must be at least 2: the first and the last Linear layer (got {args.depth})")
        if args.classes < 2:
            raise UsageError(f"--classes must be at least 2 (got {args.classes})")
        if not args.lr > 0 or not math.isfinite(args.lr):
            raise UsageError(f"--lr must be a positive finite number (got {args.lr})")
    if args.command == "schedule":
        if args.auto and args.schedule is not None:
            raise UsageError("--auto picks the schedule: drop --schedule, or drop --auto")
        if not args.auto:
            if args.memory_cap is not None:
                raise UsageError("--memory-cap needs --auto (the fixed schedules' memory is shown, not capped)")
            args.schedule = args.schedule or "gpipe"
        if args.memory_cap is not None and len(args.memory_cap) not in (1, args.stages):
            raise UsageError(
                f"--memory-cap: give one number, or one per worker ({args.stages}); got {len(args.memory_cap)}"
            )
        if args.memory_cap is not None and len(args.memory_cap) == 1:
            args.memory_cap = args.memory_cap[0]
    if args.command == "schedule" and args.out:
        try:
            check_timeline_path(args.out)
        except ValueError as exc:
            raise UsageError(f"--out: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
