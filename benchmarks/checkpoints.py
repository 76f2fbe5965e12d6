"""Checkpoint saves side by side: synchronous against asynchronous (torch.distributed.checkpoint).

The state: a pipeline of 8 Linear(1792, 1792) layers on 2 'cpu' stages (98 MiB of weights), after one
Adam step; saved without and with the optimizer's state (3x the bytes). Within each repetition the
variants take turns, each into a fresh folder on the same disk:

- sync: ``save(pipe, dir, step)``, the time until it returns (the checkpoint is complete);
- async, blocks: ``save(..., asynchronous=True)``, the time until it returns (the state is copied to
  CPU memory; training may go on);
- async, complete: until ``.wait()`` returns (written and committed to ``latest``).

Then the cost of a background write to training: step times of a small training loop with no save
under way, and while an asynchronous save of the same state runs beside it (medians of the steps
that overlap a write).

Reported: medians [min-max] in ms, and the ratio of each median to the first variant's.

Reproduce:  .venv/bin/python benchmarks/checkpoints.py [--repeats 7] [--dir /tmp/ckpt-bench]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from gpipe.saving import save

WIDTH, LAYERS = 1792, 8


def pipeline() -> tuple[Pipeline, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]), [4, 4], chunks=2,
                    loss_fn=F.mse_loss, devices=["cpu", "cpu"], cpu_threads=1)  # fmt: skip
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-4)
    batch = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    step(pipe, optimizer, batch)
    return pipe, optimizer, batch


def step(pipe: Pipeline, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    optimizer.zero_grad()
    pipe.step(*batch)
    optimizer.step()


def summary(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} [{min(values) * 1000:.0f}-{max(values) * 1000:.0f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the raw numbers to this file")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="gpipe-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    pipe, optimizer, batch = pipeline()
    mib = sum(p.numel() * p.element_size() for p in pipe.parameters()) / 2**20
    print(f"{LAYERS} x Linear({WIDTH}) on 2 stages: {mib:.0f} MiB of weights; torch {torch.__version__}; "
          f"{args.repeats} repetitions after 2 warm-ups")  # fmt: skip
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for label, kwargs in (("model", {}), ("model + Adam", {"optimizer": optimizer})):
            times = results.setdefault(label, {"sync": [], "async, blocks": [], "async, complete": []})
            for rep in range(args.repeats + 2):
                folder = root / f"{label.replace(' ', '')}-{rep}"
                began = time.perf_counter()
                save(pipe, folder / "sync", 1, **kwargs)
                sync = time.perf_counter() - began
                began = time.perf_counter()
                handle = save(pipe, folder / "async", 1, asynchronous=True, **kwargs)
                blocks = time.perf_counter() - began
                handle.wait()
                complete = time.perf_counter() - began
                shutil.rmtree(folder)
                if rep >= 2:
                    times["sync"].append(sync)
                    times["async, blocks"].append(blocks)
                    times["async, complete"].append(complete)
        # training beside a background write
        quiet, beside = [], []
        for rep in range(args.repeats):
            for _ in range(3):
                began = time.perf_counter()
                step(pipe, optimizer, batch)
                quiet.append(time.perf_counter() - began)
            handle = save(pipe, root / f"overlap-{rep}", 1, optimizer=optimizer, asynchronous=True)
            while not handle.done():
                began = time.perf_counter()
                step(pipe, optimizer, batch)
                if not handle.done():
                    beside.append(time.perf_counter() - began)
            handle.wait()
            shutil.rmtree(root / f"overlap-{rep}")
        results["training step"] = {"no save under way": quiet, "beside a background write": beside}
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    for label, times in results.items():
        print(f"\n{label}: ms, median [min-max]")
        base = times.get("sync") or times["no save under way"]
        for name, values in times.items():
            ratio = statistics.median(values) / statistics.median(base)
            print(f"  {name:<28} {summary(values):>16}   {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
