"""``gpipe demo``: a small model trained with :class:`gpipe.GPipe` on synthetic data, printing the
schedule, its bubble and the loss of every step."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence

import torch
from torch import nn

from gpipe.commands.args import ArgumentParser, UsageError, positive, refuse
from gpipe.gpipe import GPipe
from gpipe.schedule import make_schedule, simulate

__all__ = ["main"]


def _parser() -> ArgumentParser:
    d = ArgumentParser(prog="gpipe demo")
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
    return d


def _check(args: argparse.Namespace) -> None:
    """Refuse bad flags before any work starts."""
    positive(args, "steps", "partitions", "chunks", "batch", "width", "depth", "classes")
    if args.depth < 2:
        raise UsageError(f"--depth must be at least 2: the first and the last Linear layer (got {args.depth})")
    if args.classes < 2:
        raise UsageError(f"--classes must be at least 2 (got {args.classes})")
    if not args.lr > 0 or not math.isfinite(args.lr):
        raise UsageError(f"--lr must be a positive finite number (got {args.lr})")


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe demo``; a bad flag raises :class:`UsageError` (one line from :mod:`gpipe.cli`)."""
    args = _parser().parse_args(argv)
    _check(args)
    return demo(args)


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
    """Train the demo's model as ``args`` (checked) say; print every step's loss."""
    torch.manual_seed(args.seed)
    model = _demo_model(args.width, args.depth, args.classes)
    if args.partitions > len(model):
        return refuse(f"--partitions {args.partitions} exceeds the model's {len(model)} layers")
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
