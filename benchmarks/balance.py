"""balance='auto' against a uniform balance on a model with very uneven layer costs, side by side.

The model: 10 Linear layers, each followed by GELU, whose widths make their costs differ by up to
64x: three 2048x2048 layers (and the two that widen to and narrow from them) come first, then five
256x256 ones, so that a uniform split puts nearly all the work on the first stage; batch 256, M=8,
2 'cpu' devices with one intra-op thread each, GPipe's fill-drain schedule with checkpoint='never'.
Variants, taking turns within each repetition:

- uniform: the same number of layers per stage;
- auto: ``balance='auto'`` (each layer timed on a micro-batch, split exactly);
- params: :func:`gpipe.balance.balance_by_params` (for comparison: parameters are not time).

Reported: each variant's balance, the largest stage's share of the measured layer times, and the step
time (median [min-max]) with its ratio to uniform's per repetition.

Reproduce:  .venv/bin/python benchmarks/balance.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from gpipe.balance import balance_by_params, layer_times

WIDTHS = [256, 2048, 2048, 2048, 2048, 256, 256, 256, 256, 256, 256]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    base = model()
    x, y = torch.randn(args.batch, WIDTHS[0]), torch.randn(args.batch, WIDTHS[-1])
    layers = len(base)
    pipes = {
        "uniform": Pipeline(copy.deepcopy(base), [layers // 2, layers - layers // 2], chunks=args.chunks,
                            loss_fn=F.mse_loss, checkpoint="never", devices=["cpu", "cpu"], cpu_threads=1),
        "auto": Pipeline(copy.deepcopy(base), "auto", chunks=args.chunks, loss_fn=F.mse_loss, checkpoint="never",
                         devices=["cpu", "cpu"], cpu_threads=1, sample=x),
        "params": Pipeline(copy.deepcopy(base), balance_by_params(2, base), chunks=args.chunks, loss_fn=F.mse_loss,
                           checkpoint="never", devices=["cpu", "cpu"], cpu_threads=1),
    }  # fmt: skip
    torch.set_num_threads(1)
    times = layer_times(base, x, chunks=args.chunks)
    torch.set_num_threads(2)
    results: dict[str, list[float]] = {name: [] for name in pipes}
    for pipe in pipes.values():
        pipe.step(x, y)
        pipe.zero_grad()
    names = list(pipes)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            pipes[name].step(x, y)
            results[name].append(time.perf_counter() - start)
            pipes[name].zero_grad()
    print(f"# torch {torch.__version__}; 2 'cpu' workers x 1 thread; {' '.join(sys.argv)}")
    print(f"# layer times (ms, one micro-batch, forward + backward): {', '.join(f'{t * 1e3:.1f}' for t in times)}")
    print(
        "\n| balance | layers per stage | largest stage's share of the time | step (s) median [min-max] | vs uniform |"
    )
    print("|---|---|---|---|---|")
    for name, pipe in pipes.items():
        shares, i = [], 0
        for b in pipe.balance:
            shares.append(sum(times[i : i + b]) / sum(times))
            i += b
        ratios = [a / u for a, u in zip(results[name], results["uniform"])]
        ts = results[name]
        print(
            f"| {name} | {pipe.balance} | {max(shares):.0%} | {statistics.median(ts):.3f} "
            f"[{min(ts):.3f}-{max(ts):.3f}] | {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
