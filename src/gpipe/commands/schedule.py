"""``gpipe schedule``: generate, validate and simulate a schedule and draw its timeline, without running it.

    gpipe schedule --schedule 1f1b --stages 4 --chunks 8 [--virtual 2] [--out timeline.png]

prints the schedule's bubble and peak in-flight activations and draws its timeline;

    gpipe schedule --auto --stages 4 --chunks 8 --costs F=1,I=1,W=2,transfer=0.1 [--memory-cap 4]

prints the schedule the cost-adaptive scheduler picks for those costs (see :mod:`gpipe.schedule.auto`),
why (every candidate's step time, peak memory and whether it fits the cap), and draws its timeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence

from gpipe.commands.args import ArgumentParser, UsageError, positive, refuse
from gpipe.schedule import SCHEDULES, StageCosts, kind_cost, make_schedule, plan, render_timeline, simulate
from gpipe.schedule.render import check_timeline_path

__all__ = ["main"]


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


def _parser() -> ArgumentParser:
    s = ArgumentParser(prog="gpipe schedule")
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
    return s


def _check(args: argparse.Namespace) -> None:
    """Refuse bad flags before any work starts."""
    positive(args, "stages", "chunks", "virtual")
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
    if args.out:
        try:
            check_timeline_path(args.out)
        except ValueError as exc:
            raise UsageError(f"--out: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe schedule``; a bad flag raises :class:`UsageError` (one line from :mod:`gpipe.cli`)."""
    args = _parser().parse_args(argv)
    _check(args)
    return _auto(args) if args.auto else _fixed(args)


def _printable(sim_makespan: float, values: Sequence[float]) -> bool:
    return sim_makespan <= 200 and all(float(c).is_integer() for c in values)


def _fixed(args: argparse.Namespace) -> int:
    """``gpipe schedule --schedule NAME``: a generator's schedule simulated under the given costs."""
    costs = dict(args.costs)
    transfer = costs.pop("transfer", 0.0)
    if costs.pop("jitter", 0.0):
        return refuse("jitter=... is for --auto (it ranks candidates by their expected step time)")
    try:
        sched = make_schedule(args.schedule, args.stages, args.chunks, args.virtual)
    except ValueError as exc:
        return refuse(exc)
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


def _auto(args: argparse.Namespace) -> int:
    """``gpipe schedule --auto``: what the cost-adaptive scheduler picks for uniform costs, and why."""
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
        return refuse(exc)
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
