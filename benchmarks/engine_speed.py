"""Engine speed: GPipe on two CPU workers against the plain sequential model, side by side.

Reproduce (from the repository root)::

    .venv/bin/python benchmarks/engine_speed.py

What it measures: the time of one training step (forward + backward + ``zero_grad``; no optimizer) of
four variants built from deep copies of the same initial model, on the same mini-batch:

1. ``sequential``: the plain ``nn.Sequential`` run on the M micro-batches (``torch.chunk``) one after
   the other, forward and backward each, accumulating the gradients; one intra-op thread, the same
   thread budget one pipeline worker gets.
2. ``gpipe-never``: ``GPipe`` on ``devices=['cpu', 'cpu']`` (K=2), ``chunks=M``, ``checkpoint='never'``,
   ``cpu_threads=1``.
3. ``gpipe-except_last``: the same with the default ``checkpoint='except_last'``.
4. ``ideal-2-threads`` (a reference, not a pipeline): the two halves of the model (the same split as
   the balance), each trained on all M micro-batches in its own one-thread worker, with no dependency
   between the two. Same work as ``sequential``, no bubble and no hand-over: its speed-up is what the
   two cores give at best on this machine, so the pipeline's speed-up can be read against it.

The model is ``--blocks`` blocks of ``Linear(hidden, ffn) - GELU - Linear(ffn, hidden)``; each block is
one layer (an ``nn.Sequential``) of the top-level ``nn.Sequential``, so 8 blocks are split with
balance ``[4, 4]``. The whole process runs with ``torch.set_num_threads(1)``, so the main thread (which
splits the batch, computes the loss and gathers the output) also uses one intra-op thread.

Each variant is warmed up (2 steps), then for ``--repeats`` repetitions one step of every variant is
timed with ``time.perf_counter`` in rotating order, so machine noise hits all variants alike. The
report gives per variant the median and min-max step time and the speed-up ``sequential / variant``
computed per repetition (median, min-max), next to the fill-drain bound ``K*M/(M+K-1)`` (1.78 for
K=2, M=8): the most a K-stage fill-drain pipeline can gain over one worker when the stages are
balanced and communication is free.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import gpipe

K = 2  # pipeline stages (two 'cpu' devices)
WARMUP_STEPS = 2
VARIANTS = ("sequential", "gpipe-never", "gpipe-except_last", "ideal-2-threads")


@dataclass(frozen=True)
class Config:
    batch: int
    chunks: int
    repeats: int
    hidden: int
    ffn: int
    blocks: int
    seed: int


def parse_args(argv: list[str] | None = None) -> tuple[Config, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch", type=int, default=256, help="mini-batch size (default: 256)")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches M (default: 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per variant (default: 5)")
    parser.add_argument("--hidden", type=int, default=1024, help="model width (default: 1024)")
    parser.add_argument("--ffn", type=int, default=4096, help="inner width of each block (default: 4096)")
    parser.add_argument("--blocks", type=int, default=8, help="number of blocks (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data (default: 0)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    for name in ("batch", "chunks", "repeats", "hidden", "ffn"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    if args.blocks < K:
        parser.error(f"--blocks must be at least {K} (one per stage)")
    if args.chunks > args.batch:
        parser.error("--chunks must not exceed --batch")
    config = Config(args.batch, args.chunks, args.repeats, args.hidden, args.ffn, args.blocks, args.seed)
    return config, args.json


def build_model(config: Config) -> nn.Sequential:
    """``blocks`` layers, each ``Linear(hidden, ffn) - GELU - Linear(ffn, hidden)``."""
    torch.manual_seed(config.seed)
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(config.hidden, config.ffn), nn.GELU(), nn.Linear(config.ffn, config.hidden))
            for _ in range(config.blocks)
        )
    )


def balance_of(blocks: int) -> list[int]:
    first = (blocks + 1) // 2
    return [first, blocks - first]


def loss_fn(output: Tensor, target: Tensor, batch: int) -> Tensor:
    """Squared error summed over the micro-batch and divided by the *mini*-batch size.

    Summing this over the micro-batches gives the mini-batch loss, so the sequential variant's
    accumulated gradients are those of one mini-batch step.
    """
    return (output - target).pow(2).sum() / batch


Step = Callable[[], None]


def sequential_step(model: nn.Sequential, x: Tensor, y: Tensor, chunks: int) -> Step:
    batch = x.size(0)

    def step() -> None:
        for xm, ym in zip(torch.chunk(x, chunks), torch.chunk(y, chunks)):
            loss_fn(model(xm), ym, batch).backward()
        model.zero_grad(set_to_none=True)

    return step


def gpipe_step(model: gpipe.GPipe, x: Tensor, y: Tensor) -> Step:
    batch = x.size(0)

    def step() -> None:
        loss_fn(model(x), y, batch).backward()
        model.zero_grad(set_to_none=True)

    return step


def ideal_step(halves: list[nn.Sequential], x: Tensor, y: Tensor, chunks: int) -> Step:
    """Each half of the model trained in its own thread on its own data, with no dependency between them.

    The same work as the sequential step, split over two one-thread workers that never wait for each
    other: no bubble, no hand-over of activations. Its speed-up is what two cores give at best here.
    """
    batch = x.size(0)

    def work(model: nn.Sequential) -> None:
        torch.set_num_threads(1)
        for xm, ym in zip(torch.chunk(x, chunks), torch.chunk(y, chunks)):
            loss_fn(model(xm), ym, batch).backward()
        model.zero_grad(set_to_none=True)

    def step() -> None:
        threads = [threading.Thread(target=work, args=(half,)) for half in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return step


def grad_check(models: dict[str, nn.Module], x: Tensor, y: Tensor, chunks: int) -> dict[str, float]:
    """One untimed step of each variant; the max |grad - sequential grad| of each GPipe variant."""
    batch = x.size(0)
    seq = models["sequential"]
    for xm, ym in zip(torch.chunk(x, chunks), torch.chunk(y, chunks)):
        loss_fn(seq(xm), ym, batch).backward()
    reference = [p.grad for p in seq.parameters()]
    diffs: dict[str, float] = {}
    for name, model in models.items():
        if name == "sequential":
            continue
        loss_fn(model(x), y, batch).backward()
        grads = [p.grad for p in model.parameters()]
        if len(grads) != len(reference) or any(g is None for g in grads):
            raise RuntimeError(f"{name}: missing gradients after backward")
        diffs[name] = max(float((g - r).abs().max()) for g, r in zip(grads, reference) if g is not None)
        model.zero_grad(set_to_none=True)
    seq.zero_grad(set_to_none=True)
    return diffs


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def git_revision() -> str:
    """The commit of the checkout, with ``+dirty`` when ``src/`` differs from it; ``unknown`` outside git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _load(load: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.2f}" for v in load)


def main(argv: list[str] | None = None) -> None:
    config, json_path = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv])
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per worker: the sequential baseline and the main thread
    m = config.chunks
    balance = balance_of(config.blocks)
    schedule = gpipe.make_schedule("gpipe", K, m)
    bubble = gpipe.simulate(schedule).bubble
    bound = K * m / (m + K - 1)

    print(f"command:  {command}")
    revision = git_revision()
    print(f"gpipe {gpipe.__version__} at git {revision} (src/), gpipe from {os.path.dirname(gpipe.__file__)}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.platform()}")
    print(
        f"threads:  torch default {default_threads} intra-op, set to {torch.get_num_threads()} for the "
        f"process (sequential + main thread); GPipe cpu_threads=1 per worker, {K} workers; "
        f"interop {torch.get_num_interop_threads()}; os.cpu_count()={os.cpu_count()}"
    )
    print(
        f"model:    {config.blocks} x [Linear({config.hidden}, {config.ffn}) - GELU - "
        f"Linear({config.ffn}, {config.hidden})], one block per layer, balance {balance}"
    )
    print(f"step:     batch {config.batch}, M={m} micro-batches, K={K}, forward + backward + zero_grad")
    load_before = os.getloadavg()
    print(f"load:     1/5/15-min load average {_load(load_before)} (other work on the cores skews the timings)")
    print(f"schedule: fill-drain bubble (K-1)/(M+K-1) = {bubble:.3f}; bound K*M/(M+K-1) = {bound:.2f}x")

    base = build_model(config)
    torch.manual_seed(config.seed + 1)
    x = torch.randn(config.batch, config.hidden)
    y = torch.randn(config.batch, config.hidden)
    seq_model = copy.deepcopy(base)
    never = gpipe.GPipe(
        copy.deepcopy(base), balance, devices=["cpu", "cpu"], chunks=m, checkpoint="never", cpu_threads=1
    )
    except_last = gpipe.GPipe(copy.deepcopy(base), balance, devices=["cpu", "cpu"], chunks=m, cpu_threads=1)
    models: dict[str, nn.Module] = {"sequential": seq_model, "gpipe-never": never, "gpipe-except_last": except_last}
    steps: dict[str, Step] = {
        "sequential": sequential_step(seq_model, x, y, m),
        "gpipe-never": gpipe_step(never, x, y),
        "gpipe-except_last": gpipe_step(except_last, x, y),
        "ideal-2-threads": ideal_step([copy.deepcopy(base[: balance[0]]), copy.deepcopy(base[balance[0] :])], x, y, m),
    }

    diffs = grad_check(models, x, y, m)
    print("grads:    max |grad - sequential grad| " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))

    start = time.perf_counter()
    for name in VARIANTS:
        for _ in range(WARMUP_STEPS):
            steps[name]()
    print(f"warm-up:  {WARMUP_STEPS} steps per variant, {time.perf_counter() - start:.1f} s")

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(config.repeats):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for name in order:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
        row = ", ".join(f"{name} {times[name][-1]:.3f}" for name in VARIANTS)
        print(f"repeat {r + 1}/{config.repeats} (order {' > '.join(order)}): {row} s")

    ratios = {
        name: [s / v for s, v in zip(times["sequential"], times[name])] for name in VARIANTS if name != "sequential"
    }
    stats = {name: summary(values) for name, values in times.items()}
    ratio_stats = {name: summary(values) for name, values in ratios.items()}

    print()
    print(f"{'variant':<20} {'median s':>9} {'min s':>8} {'max s':>8} {'speed-up (median, min-max)':>28}")
    for name in VARIANTS:
        s = stats[name]
        if name == "sequential":
            speed = "1.00x (reference)"
        else:
            q = ratio_stats[name]
            speed = f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f})"
        print(f"{name:<20} {s['median']:>9.3f} {s['min']:>8.3f} {s['max']:>8.3f} {speed:>28}")
    print(f"{'bound K*M/(M+K-1)':<20} {'':>9} {'':>8} {'':>8} {f'{bound:.2f}x':>28}")
    load_after = os.getloadavg()
    print(f"total time: {time.perf_counter() - start:.1f} s after the gradient check; load average {_load(load_after)}")

    if json_path is not None:
        result = {
            "command": command,
            "git": revision,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "threads": {
                "torch_default": default_threads,
                "process": torch.get_num_threads(),
                "gpipe_cpu_threads": 1,
                "interop": torch.get_num_interop_threads(),
            },
            "config": {**config.__dict__, "stages": K, "balance": balance, "warmup_steps": WARMUP_STEPS},
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "bubble": bubble,
            "bound": bound,
            "grad_max_abs_diff": diffs,
            "times_s": times,
            "time_stats_s": stats,
            "speedup_per_repeat": ratios,
            "speedup_stats": ratio_stats,
        }
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
