"""gpipe against torch.distributed.pipelining, side by side: 2 CPU processes over gloo, 1 thread each.

The model of the engine benchmark (8 blocks of Linear(1024, 4096)-GELU-Linear(4096, 1024), each block
one layer, 4 blocks per stage), batch 256, M=8 micro-batches, MSE loss. Variants, all in the same two
processes, taking turns within every repetition (so that machine noise hits them alike):

- torch ScheduleGPipe and Schedule1F1B (PipelineStage per rank); they keep every activation;
- gpipe Pipeline with each schedule and checkpoint='never' (the same work as torch's), and with the
  default re-materialization ('except_last').

A step is timed between two barriers (forward + backward of the mini-batch + zero_grad). Reported:
the median step time per variant with its spread, and per repetition the ratio of gpipe's time to
torch's (same schedule, and best against best), as median [min-max].

Reproduce:  .venv/bin/python benchmarks/vs_torch_pipelining.py [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

WORLD = 2


def model(blocks: int, hidden: int, ffn: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden)) for _ in range(blocks)]
    )


def variants(
    args: argparse.Namespace, base: nn.Sequential, x: torch.Tensor, y: torch.Tensor
) -> dict[str, Callable[[], None]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from gpipe import Pipeline

    rank = dist.get_rank()
    half = len(base) // WORLD
    out: dict[str, Callable[[], None]] = {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        part = copy.deepcopy(base[rank * half : (rank + 1) * half])
        stage = PipelineStage(part, rank, WORLD, torch.device("cpu"))
        schedule = cls(stage, args.chunks, loss_fn=F.mse_loss)

        def step(schedule: object = schedule, part: nn.Module = part) -> None:
            if rank == 0:
                schedule.step(x)  # type: ignore[attr-defined]
            else:
                schedule.step(target=y, losses=[])  # type: ignore[attr-defined]
            part.zero_grad()

        out[f"torch {name}"] = step
    for name, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):
        for checkpoint in ("never", "except_last"):
            stages = WORLD * virtual
            pipe = Pipeline(
                copy.deepcopy(base),
                [len(base) // stages] * stages,
                chunks=args.chunks,
                schedule=name,
                loss_fn=F.mse_loss,
                checkpoint=checkpoint,
                virtual=virtual,
            )

            def gstep(pipe: Pipeline = pipe) -> None:
                pipe.step(x, y)
                pipe.zero_grad()

            out[f"gpipe {name} ({checkpoint})"] = gstep
    return out


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    base = model(args.blocks, args.hidden, args.ffn)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, args.hidden, generator=g), torch.randn(args.batch, args.hidden, generator=g)
    steps = variants(args, base, x, y)
    names = list(steps)
    for name in names:  # warm-up
        for _ in range(2):
            steps[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def report(times: dict[str, list[float]]) -> None:
    def ratio(a: str, b: str) -> str:
        rs = [x / y for x, y in zip(times[a], times[b])]
        return f"{statistics.median(rs):.2f} [{min(rs):.2f}-{max(rs):.2f}]"

    print("\n| variant | step (s) median [min-max] | vs torch, same schedule: median [min-max] |")
    print("|---|---|---|")
    for name, ts in times.items():
        same = ""
        for sched in ("gpipe", "1f1b"):
            if name.startswith(f"gpipe {sched} "):
                same = ratio(name, f"torch {sched}")
        print(f"| {name} | {statistics.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}] | {same} |")
    torch_best = min(("torch gpipe", "torch 1f1b"), key=lambda n: statistics.median(times[n]))
    equal_work = [n for n in times if n.startswith("gpipe") and n.endswith("(never)")]
    ours_best = min(equal_work, key=lambda n: statistics.median(times[n]))
    print(f"\nbest against best (equal work): {ours_best} / {torch_best} = {ratio(ours_best, torch_best)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--json", help="also write the step times here")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        procs = []
        for rank in range(WORLD):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--out", out], env=env))
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            print(f"a rank failed (exit codes {codes})", file=sys.stderr)
            return 1
        with open(out) as f:
            times = json.load(f)
    print(f"# torch {torch.__version__}; 2 processes x 1 thread (gloo); {' '.join(sys.argv)}")
    report(times)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(times, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
