"""``gpipe schedule``: generate, validate and simulate a schedule and draw its timeline, without running it.

    gpipe schedule --schedule 1f1b --stages 4 --chunks 8 [--virtual 2] [--out timeline.png]

(the V schedules, zb-v, dualpipev, v-half and v-min, with ``--virtual 2``)

prints the schedule's bubble and peak in-flight activations and draws its timeline;

    gpipe schedule --auto --stages 4 --chunks 8 --costs F=1,I=1,W=2,transfer=0.1 [--memory-cap 4]

prints the schedule the cost-adaptive scheduler picks for those costs (see :mod:`gpipe.schedule.auto`),
why (every candidate's step time, peak memory and whether it fits the cap), and draws its timeline;

    gpipe schedule --decode --stages 4 --groups 4 [--steps 4] [--virtual 2] [--out timeline.png]

prints a decode's timeline (forwards only, ``--groups`` groups of sequences in flight, each step's
input chosen by the group's step before it; see :mod:`gpipe.schedule.decode`): its bubble over
``--steps`` steps and in steady state, and its throughput against one worker running every stage.

``--fsdp`` (with any of the three) shards the stages: the schedule gains each stage's all-gather of its
parameters (U), reduce-scatter of its gradients (G) and free (R), once per step
(:func:`gpipe.schedule.sharded`), which the timeline shows and ``--costs U=...,G=...,R=...`` times
(default 0); the collectives each worker runs per step are counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence

from gpipe.commands.args import ArgumentParser, UsageError, description, positive, refuse
from gpipe.schedule import (
    SCHEDULES,
    StageCosts,
    decode,
    decode_bubble,
    kind_cost,
    make_schedule,
    plan,
    render_timeline,
    sharded,
    simulate,
)
from gpipe.schedule.ir import STAGE_WIDE, Action, round_robin, v_shape
from gpipe.schedule.render import check_timeline_path
from gpipe.schedule.simulate import Simulation

__all__ = ["main"]

_SHARDED = ", sharded (FSDP)"


def _costs(text: str) -> dict[str, float]:
    costs = {}
    for item in filter(None, text.split(",")):
        kind, _, value = item.partition("=")
        if kind not in ("F", "B", "I", "W", "U", "G", "R", "transfer", "jitter") or not value:
            raise argparse.ArgumentTypeError(
                f"expected KIND=COST with KIND one of F, B, I, W, or transfer=TIME, jitter=CV, "
                f"or U, G, R with --fsdp (got {item!r})"
            )
        try:
            costs[kind] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cost of {kind} is not a number (got {value!r})") from None
        if kind in ("transfer", "jitter", "U", "G", "R"):
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
    s = ArgumentParser(prog="gpipe schedule", description=description(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    s.add_argument("--schedule", choices=list(SCHEDULES), help="the schedule (default: gpipe)")
    s.add_argument(
        "--auto",
        action="store_true",
        help="pick the fastest schedule for --costs within --memory-cap, and show the candidates (not with --schedule)",
    )
    s.add_argument("--stages", type=int, default=4, help="K, pipeline workers (devices) (default: 4)")
    s.add_argument("--chunks", type=int, help="M, micro-batches (default: 8; not with --decode)")
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
    s.add_argument(
        "--decode",
        action="store_true",
        help="a decode's schedule: forwards only, --groups groups of sequences in flight for --steps steps "
        "(not with --schedule, --auto, --chunks, --costs, --memory-cap)",
    )
    s.add_argument("--groups", type=int, help="with --decode: G, groups in flight (default: one per stage)")
    s.add_argument("--steps", type=int, help="with --decode: T, steps (tokens) of every group (default: 4)")
    s.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the stages (FSDP): each stage's all-gather (U), reduce-scatter (G) and free (R) once per "
        "step, shown in the timeline and counted per worker",
    )
    s.add_argument("--out", help="write the timeline picture here (.png, .svg, .pdf, ...)")
    return s


def _check(args: argparse.Namespace) -> None:
    """Refuse bad flags before any work starts."""
    wide = [k for k in ("U", "G", "R") if k in args.costs]
    if wide and not args.fsdp:
        raise UsageError(f"--costs {wide[0]}=... times a sharded stage's collectives: add --fsdp, or drop it")
    if args.decode:
        training = {
            "--schedule": args.schedule is not None,
            "--auto": args.auto,
            "--chunks": args.chunks is not None,
            "--costs": bool(args.costs),
            "--memory-cap": args.memory_cap is not None,
        }
        given = [flag for flag, on in training.items() if on]
        if given:
            raise UsageError(
                f"--decode makes its own schedule of --groups x --steps forwards, every one a unit long: "
                f"drop {', '.join(given)}"
            )
        args.groups = args.stages * args.virtual if args.groups is None else args.groups
        args.steps = 4 if args.steps is None else args.steps
        positive(args, "stages", "virtual", "groups", "steps")
    else:
        unused = [f for f, v in [("--groups", args.groups), ("--steps", args.steps)] if v is not None]
        if unused:
            need = "need" if len(unused) > 1 else "needs"
            raise UsageError(f"{' and '.join(unused)} {need} --decode (a training step has --chunks micro-batches)")
        args.chunks = 8 if args.chunks is None else args.chunks
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
    return _decode(args) if args.decode else _auto(args) if args.auto else _fixed(args)


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
    if args.fsdp:
        sched = sharded(sched)
    sim = simulate(sched, kind_cost(**costs), transfer=transfer)
    wide = {"U": 0.0, "G": 0.0, "R": 0.0} if args.fsdp else {}
    shown = ", ".join(f"{k}={v:g}" for k, v in {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0, **wide, **costs}.items())
    if transfer:
        shown += f", transfer={transfer:g}"
    print(
        f"schedule {sched.name!r}: K={sched.num_workers} workers, M={sched.num_microbatches} micro-batches, "
        f"{sched.num_stages} stages{_SHARDED if args.fsdp else ''}; costs {shown}"
    )
    print(f"makespan {sim.makespan:g}, bubble {sim.bubble:.4f} ({sim.bubble:.1%})")
    print("idle per worker: " + ", ".join(f"{i:g}" for i in sim.idle))
    print("peak in-flight activations per worker: " + ", ".join(map(str, sim.peak_in_flight)))
    if args.fsdp:
        print(_collectives(sim))
    if _printable(sim.makespan, args.costs.values()):
        print(sim.text())
    if args.out:
        print(f"wrote {render_timeline(sim, args.out)}")
    return 0


def _collectives(sim: Simulation) -> str:
    """The per-worker count of a sharded step's collectives, one line."""
    gathers, scatters = zip(*sim.collectives)
    return (
        f"collectives per step, per worker: all-gathers (U) {', '.join(map(str, gathers))}; "
        f"reduce-scatters (G) {', '.join(map(str, scatters))}"
    )


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
        # as Pipeline's 'auto': two stages per worker in a V (ZB-V, V-Half, V-Min among the candidates)
        placement = v_shape(args.stages) if args.virtual == 2 else None
        result = plan(args.stages, args.chunks, costs, memory_cap=args.memory_cap, placement=placement)
    except ValueError as exc:
        return refuse(exc)
    sim = result.simulation
    print(
        f"schedule 'auto': K={args.stages} workers, M={args.chunks} micro-batches, {stages} stages"
        f"{_SHARDED if args.fsdp else ''}; the fastest candidate under these costs that fits the memory cap"
    )
    print(result.explain())
    if args.fsdp:  # the plan is made unsharded; its schedule sharded, U, G and R timed as given (default 0)
        wide = {k: given.get(k, 0.0) for k in ("U", "G", "R")}

        def cost(a: Action) -> float:
            return wide[a.kind.value] if a.kind in STAGE_WIDE else costs.cost(a)

        sim = simulate(sharded(result.schedule), cost, transfer=costs.transfer)
        print(f"sharded: makespan {sim.makespan:g}, bubble {sim.bubble:.4f} ({sim.bubble:.1%})")
        print(_collectives(sim))
    print("idle per worker: " + ", ".join(f"{i:g}" for i in sim.idle))
    all_costs = (*costs.forward, *costs.input, *costs.weight, *costs.fused, costs.transfer)
    all_costs += tuple(given.get(k, 0.0) for k in ("U", "G", "R"))
    if _printable(sim.makespan, all_costs):
        print(sim.text())
    if args.out:
        title = (
            f"auto ({result.chosen}): K={args.stages}, M={args.chunks} — bubble {sim.bubble:.1%}, "
            f"peak memory {max(result.peak_memory):g}"
        )
        print(f"wrote {render_timeline(sim, args.out, title=title)}")
    return 0


def _decode(args: argparse.Namespace) -> int:
    """``gpipe schedule --decode``: the first ``--steps`` steps of ``--groups`` groups decoded on
    ``--stages`` workers (``--virtual`` stages each, round robin), every forward one unit long."""
    placement = round_robin(args.stages * args.virtual, args.stages)
    try:
        sched = decode(placement, args.groups, args.steps)
    except ValueError as exc:
        return refuse(exc)
    if args.fsdp:
        sched = sharded(sched)
    sim = simulate(sched)
    steady = decode_bubble(placement, args.groups)
    k = sched.num_workers
    print(
        f"schedule 'decode': K={k} workers, {sched.num_stages} stages{_SHARDED if args.fsdp else ''}, "
        f"G={args.groups} groups in flight, "
        f"T={args.steps} steps each ({sched.num_microbatches} micro-batches); every forward 1"
    )
    print(
        f"makespan {sim.makespan:g}, bubble {sim.bubble:.4f} ({sim.bubble:.1%}) over these steps; "
        f"throughput {sum(sim.busy) / sim.makespan:.2f}x one worker running every stage"
    )
    print(
        f"steady state: bubble {steady:.4f} ({steady:.1%}); throughput {k * (1 - steady):.2f}x one worker's "
        f"(tokens per unit of time, of {k} at most)"
    )
    print("key/value caches per worker (one per group and stage): " + ", ".join(map(str, sim.peak_in_flight)))
    if args.fsdp:
        print(_collectives(sim))
    if _printable(sim.makespan, ()):
        print(sim.text())
    if args.out:
        print(f"wrote {render_timeline(sim, args.out)}")
    return 0
