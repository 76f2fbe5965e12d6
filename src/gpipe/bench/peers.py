"""Peers side by side, in one run, on the same model: gpipe against torch.distributed.pipelining
(2 processes over gloo, one thread each; its ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV against gpipe's fixed
schedules and ``schedule='auto'``) and against torchgpipe (one process, 2 'cpu' devices; both
libraries with their defaults).

The model: blocks of Linear(hidden, ffn)-GELU-Linear(ffn, hidden), each block one layer, split in
two halves (four quarters for the schedules with two stages per worker); MSE loss. Variants take
turns within every repetition so that noise hits them alike; ratios are per repetition, reported as
median [min-max] (< 1: gpipe faster).
"""

from __future__ import annotations

import functools
import importlib
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from gpipe.bench.common import (
    AUTO_WARMUP,
    GPIPE_SCHEDULES,
    TORCH_SCHEDULES,
    Bench,
    Section,
    gpipe_key,
    launch,
    mlp,
    mlp_batch,
    mlp_sizes,
    spread,
    take_turns,
)

__all__ = ["render", "run"]

PAIRS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-v", "dualpipev")
"""gpipe's schedules with a torch.distributed.pipelining schedule of the same name (the same order)."""


def vs_torchgpipe(bench: Bench) -> dict[str, list[float]] | str:
    """Step times of torchgpipe's GPipe and gpipe's GPipe, or why torchgpipe could not run."""
    try:
        torch_gpipe: Any = importlib.import_module("torchgpipe").GPipe
    except ImportError:
        return "torchgpipe is not installed (`make bench` installs it, gpipe's bench extra: pip install -e '.[bench]')"
    from gpipe import GPipe

    s = mlp_sizes(bench)
    x, y = mlp_batch(s["batch"], s["hidden"])
    half = s["blocks"] // 2
    models = {
        "torchgpipe": torch_gpipe(mlp(s["blocks"], s["hidden"], s["ffn"]), balance=[half, half],
                                 devices=["cpu", "cpu"], chunks=s["chunks"]),
        "gpipe": GPipe(mlp(s["blocks"], s["hidden"], s["ffn"]), balance=[half, half], devices=["cpu", "cpu"],
                       chunks=s["chunks"]),
    }  # fmt: skip

    def step(model: Any) -> None:
        loss: torch.Tensor = F.mse_loss(model(x), y)
        torch.autograd.backward([loss])
        model.zero_grad()

    return take_turns({name: functools.partial(step, model) for name, model in models.items()}, bench.repeats * 2)


# the class behind each torch variant, and gpipe's variants' stages per worker, for the report
TORCH_CLASSES = {f"torch {name}": cls for name, cls, _, _ in TORCH_SCHEDULES}
VIRTUAL = {gpipe_key(name, v, ck): v for name, v, cks in GPIPE_SCHEDULES for ck in cks}


def run(bench: Bench, out: Path) -> Section:
    s = mlp_sizes(bench)
    # 16 variants: the full sizes take several minutes, well past launch's default bound on a slow machine
    found: dict[str, Any] = launch(2, {"task": "vs_torch", "repeats": bench.repeats * 2, **s}, timeout=2400.0)
    tg = vs_torchgpipe(bench)
    data = {"vs_torch": found["times"], "vs_torch_not_run": found["not_run"], "auto_plan": found["auto"],
            "vs_torchgpipe": tg}  # fmt: skip
    return Section("Peers", render(s, bench.repeats * 2, found, tg), [], data)


def render(s: dict[str, int], repeats: int, found: dict[str, Any], tg: dict[str, list[float]] | str) -> str:
    """The section's markdown: ``s`` the sizes, ``found`` what the ``vs_torch`` worker reported (times
    of every variant, why some did not run, the plan of 'auto'), ``tg`` the torchgpipe comparison."""
    torch_times: dict[str, list[float]] = found["times"]
    not_run: dict[str, str] = found["not_run"]
    auto_plans: dict[str, Any] = found["auto"] or {}

    def ratio(times: dict[str, list[float]], a: str, b: str) -> str:
        return spread([x / y for x, y in zip(times[a], times[b])])

    def label(name: str) -> str:
        if name in TORCH_CLASSES:
            return f"{name} ({TORCH_CLASSES[name]})"
        return f"{name}, v={VIRTUAL[name]}" if VIRTUAL.get(name, 1) > 1 else name  # unknown names as they are

    def median(name: str) -> float:
        return statistics.median(torch_times[name])

    lines = [
        f"Model: {s['blocks']} blocks of Linear({s['hidden']}, {s['ffn']})-GELU-Linear, batch {s['batch']}, "
        f"M={s['chunks']}, two workers (v=2: four stages of {s['blocks'] // 4} blocks, two per worker). Step "
        f"time median [min-max] over {repeats} repetitions; ratio = gpipe / peer per repetition "
        "(< 1: gpipe faster).",
        "",
        "**vs torch.distributed.pipelining** (2 processes, gloo, 1 thread each; torch keeps every "
        "activation, so gpipe's `checkpoint='never'` is the same work and `'except_last'` its default; "
        f"gpipe's `'auto'` is timed after {AUTO_WARMUP} steps, once planned from measured costs):",
        "",
        "| variant | step (s) | gpipe / torch, same schedule |",
        "|---|---|---|",
    ]
    for name, ts in torch_times.items():
        same = ""
        for sched in PAIRS:
            if name.startswith(f"gpipe {sched} (") and f"torch {sched}" in torch_times:
                same = ratio(torch_times, name, f"torch {sched}")
        lines.append(f"| {label(name)} | {spread(ts, '.3f')} | {same} |")
    for name, why in not_run.items():
        lines.append(f"| {label(name)} | not run: {why.replace('|', '/')} | |")
    for key, auto_plan in auto_plans.items():
        lines += ["", f"`{key}` chose {auto_plan['chosen']} (simulated bubble {auto_plan['bubble']:.3f} under "
                  "the costs it measured)."]  # fmt: skip
    torch_ran = [n for n in torch_times if n.startswith("torch ")]
    ours = [n for n in torch_times if n.startswith("gpipe") and n.endswith("(never)")]
    lines.append("")
    if torch_ran and ours:
        torch_best = min(torch_ran, key=median)
        ours_best = min(ours, key=median)
        lines.append(f"Best against best (equal work): {ours_best} / {torch_best} = "
                     f"{ratio(torch_times, ours_best, torch_best)}.")  # fmt: skip
        for key in (n for n in ours if n.startswith("gpipe auto")):
            lines.append(f"auto against torch's best: {key} / {torch_best} = "
                         f"{ratio(torch_times, key, torch_best)} (target ≤ 0.95).")  # fmt: skip
    else:
        lines.append("Best against best: not measured (no torch schedule or no gpipe schedule ran).")
    lines.append("")
    lines += ["**vs torchgpipe** (one process, devices ['cpu', 'cpu'], fill-drain, both with their "
              "default re-materialization 'except_last'):", ""]  # fmt: skip
    if isinstance(tg, str):
        lines.append(f"Not run: {tg}.")
    else:
        lines += [
            "| library | step (s) |",
            "|---|---|",
            *[f"| {n} | {spread(ts, '.3f')} |" for n, ts in tg.items()],
            "",
            f"gpipe / torchgpipe = {ratio(tg, 'gpipe', 'torchgpipe')}.",
        ]
    return "\n".join(lines)
