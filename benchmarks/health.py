"""Training health (issue: training health): what ``gpipe train --health-every N`` costs a step.

    .venv/bin/python benchmarks/health.py --out benchmarks/results/health      # ≈ 5 min here

``gpipe train``'s step as its loop runs it (the pipeline built with the loop's arguments, in one
process; the step, the per-parameter norms, the non-finite check on them, the clipping, Adam's
update, the metrics row as JSON), measured side by side in one process:

- **off** (``--health-every 0``) against **every step** (``--health-every 1``: each step recorded, a
  hooked view of every layer's input per micro-batch, a squared norm per output gradient, the
  global norm from the clipping's norms, the result and its keys in the row): pairs of steps on the
  same batch;
- **off** against **the default** (``--health-every N``, N the default): pairs of blocks of N steps,
  the last of each recorded.

Which of a pair runs first alternates; medians of the ratios over the pairs, wall and CPU time, on
``gpipe train``'s default model (the Transformer T(2, 256, 4), dim 64, batch 64, 4 micro-batches, 2
stages, 1F1B, re-materialization but for the last micro-batch) and a deeper one (T(12, 256, 4): 27
layers). TensorBoard's writes are left out (one ``add_scalar`` per key).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)  # (the main thread's intra-op threads, as the stages' --threads 1: no spinning on busy cores)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpipe import Pipeline, Selective  # noqa: E402
from gpipe.balance import balance_by_flops  # noqa: E402
from gpipe.data import PAD  # noqa: E402
from gpipe.health import Recorder  # noqa: E402
from gpipe.nonfinite import all_finite  # noqa: E402
from gpipe.recipe import clip_grad_norm_per_parameter, count_tokens, grad_norms, label_smoothing_loss  # noqa: E402
from gpipe.train import TrainConfig  # noqa: E402
from gpipe.train.data import train_batch  # noqa: E402
from gpipe.train.setup import make_data, make_model, make_optimizer  # noqa: E402

DEFAULT = TrainConfig().health_every


def build(cfg: TrainConfig) -> tuple[Pipeline, torch.optim.Optimizer, list[Any]]:
    """``gpipe train``'s pipeline for ``cfg`` (the loop's arguments, in one process), its optimizer,
    and the batches of its first steps."""
    data = make_data(cfg)
    model = make_model(cfg, data)
    sample = data.batch(cfg.batch, 0, split="eval").inputs
    loss_fn = functools.partial(label_smoothing_loss, smoothing=cfg.label_smoothing, ignore_index=PAD, reduction="sum")
    pipe = Pipeline(
        model, balance_by_flops(cfg.partitions, model, sample, chunks=cfg.chunks), chunks=cfg.chunks,
        schedule=cfg.schedule, loss_fn=loss_fn, loss_count=count_tokens(PAD),
        checkpoint=Selective(save_ops="matmuls", microbatches="except_last") if cfg.checkpoint == "matmuls"
        else cfg.checkpoint,
        devices=["cpu"] * cfg.partitions, init_seed=cfg.seed, cpu_threads=cfg.threads,
    )  # fmt: skip
    optimizer = make_optimizer(cfg, pipe.parameters())
    for group in optimizer.param_groups:
        group["lr"] = 1e-3
    return pipe, optimizer, [train_batch(data, cfg, 0, step) for step in range(1, DEFAULT + 1)]


def step(cfg: TrainConfig, pipe: Pipeline, optimizer: torch.optim.Optimizer, batch: Any, health: bool) -> str:
    """One step as ``gpipe train``'s loop runs it; returns its metrics row."""
    optimizer.zero_grad()
    recorder = Recorder(pipe) if health else None
    with recorder or contextlib.nullcontext():
        loss = float(pipe.step(batch.inputs, batch.target))
    norms = grad_norms(pipe.parameters())
    report = recorder.result(norms) if recorder is not None else None
    assert all_finite(pipe, loss, norms=[n for _, n in norms])
    clip_grad_norm_per_parameter(pipe.parameters(), cfg.clip_norm, norms=norms)
    optimizer.step()
    row: dict[str, Any] = {"loss": loss}
    if report is not None:
        row.update(report.metrics())
    return json.dumps(row)


def _timed(run: Any) -> tuple[float, float]:
    """Wall and CPU seconds (this process's, every thread's) of ``run()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def _summary(pairs: list[tuple[tuple[float, float], tuple[float, float]]]) -> dict[str, Any]:
    """Medians of (without, with) timings, and of their ratios (with the range), wall and CPU."""
    found: dict[str, Any] = {}
    for k, clock in enumerate(("wall", "cpu")):
        ratios = [b[k] / a[k] for a, b in pairs]
        found |= {
            f"{clock}_off_s": statistics.median(a[k] for a, _ in pairs),
            f"{clock}_on_s": statistics.median(b[k] for _, b in pairs),
            f"{clock}_ratio": statistics.median(ratios),
            f"{clock}_ratio_range": [min(ratios), max(ratios)],
        }
    return found


def measure(cfg: TrainConfig, repeats: int) -> dict[str, Any]:
    """Steps off and every step recorded, in pairs on the same batch (which of the two runs first
    alternates); then blocks of N steps off and at the default (one step of the N recorded), in pairs
    alike. ``repeats`` times, after a warm-up of each."""
    pipe, optimizer, batches = build(cfg)

    def block(healthy: bool) -> None:
        for i, batch in enumerate(batches):
            step(cfg, pipe, optimizer, batch, healthy and i == len(batches) - 1)

    steps: list[tuple[tuple[float, float], tuple[float, float]]] = []
    blocks: list[tuple[tuple[float, float], tuple[float, float]]] = []
    for i in range(repeats + 1):
        for batch in batches:
            off, on = (functools.partial(step, cfg, pipe, optimizer, batch, h) for h in (False, True))
            timed = [_timed(off), _timed(on)] if i % 2 else [_timed(on), _timed(off)][::-1]
            if i:  # (the first round: a warm-up)
                steps.append((timed[0], timed[1]))
        if i % 2:
            timed = [_timed(lambda: block(False)), _timed(lambda: block(True))]
        else:
            timed = [_timed(lambda: block(True)), _timed(lambda: block(False))][::-1]
        if i:
            blocks.append((timed[0], timed[1]))
    every, default = _summary(steps), _summary(blocks)
    return {
        "model": f"Transformer T({cfg.depth}, {cfg.hidden}, {cfg.heads}), dim {cfg.dim}, {sum(pipe.balance)} layers",
        "run": f"batch {cfg.batch}, {cfg.chunks} micro-batches, {cfg.partitions} stages, {cfg.schedule}, "
        f"checkpoint {cfg.checkpoint}",
        "every_step": every,
        "default": {**default, **{f"{c}_off_s": default[f"{c}_off_s"] / DEFAULT for c in ("wall", "cpu")}},
        # what one recorded step adds, spread over the N steps of the default's interval
        "default_derived": {f"{c}_ratio": 1 + (every[f"{c}_ratio"] - 1) / DEFAULT for c in ("wall", "cpu")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/health")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    runs = [measure(TrainConfig(), args.repeats), measure(TrainConfig(layers=12), args.repeats)]
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "load_average": [load, os.getloadavg()[0]],  # (1 minute, at the start and the end: other work)
        "default_health_every": DEFAULT,
        "repeats": args.repeats,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "# Training health: the cost of `--health-every`",
        "",
        f"{results['machine']}. Command: `.venv/bin/python benchmarks/health.py --out {out}`. `gpipe train`'s "
        f"step in one process, side by side: {args.repeats} rounds of pairs of steps on the same batch (off, "
        f"every step recorded) and of pairs of blocks of {DEFAULT} steps (off, the default: one of the "
        f"{DEFAULT} recorded), which of a pair runs first alternating. Ratios to *off*: medians of the pairs, "
        "their range in brackets; CPU: the process's CPU time (every thread's), less disturbed by other work "
        f"on the machine than the wall clock (load average {results['load_average'][0]:.1f} at the start, "
        f"{results['load_average'][1]:.1f} at the end, on {os.cpu_count()} cores).",
        "",
        f"| model | step, off | every step (`--health-every 1`) | the default (`--health-every {DEFAULT}`) | "
        "the default, derived |",
        "|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        for clock in ("wall", "cpu"):
            every, default = r["every_step"], r["default"]
            lines.append(
                f"| {r['model']} ({clock}) | {every[f'{clock}_off_s'] * 1e3:.1f} ms | {_ratio(every, clock)} | "
                f"{_ratio(default, clock)} | x{r['default_derived'][f'{clock}_ratio']:.4f} |"
            )
    lines += [
        "",
        f"Each run: {results['runs'][0]['run']}. *The default, derived*: what the every-step pairs measure one "
        f"recorded step to add, spread over the {DEFAULT} steps of the default's interval: the figure the "
        "default's blocks estimate, whose ratio carries the noise of whole blocks.",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _ratio(found: dict[str, Any], clock: str) -> str:
    low, high = found[f"{clock}_ratio_range"]
    return f"x{found[f'{clock}_ratio']:.3f} [{low:.3f}, {high:.3f}]"


if __name__ == "__main__":
    main()
