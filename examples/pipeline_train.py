"""Train a small model with gpipe.Pipeline; the same script runs in one process or under torchrun.

    python examples/pipeline_train.py                          # 2 stages on 2 'cpu' devices, one process
    torchrun --nproc-per-node 2 examples/pipeline_train.py     # one process per stage (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 4 examples/pipeline_train.py --data-parallel 2   # 2 replicas x 2 stages
    torchrun --nproc-per-node 4 examples/pipeline_train.py --data-parallel 2 --fsdp   # ... each stage sharded over 2
    torchrun --nproc-per-node 2 examples/pipeline_train.py --tensor-parallel 2   # 1 stage, each block split over 2
    torchrun --nproc-per-node 8 examples/pipeline_train.py --data-parallel 2 --fsdp --tensor-parallel 2

Every process runs the same code: it builds the model on the meta device (each process materializes
only its own stages), calls ``pipe.step(x, y)`` with the same global mini-batch, and gets the
mini-batch loss back.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from gpipe import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true", help="shard each stage over its data-parallel replicas")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="split each block over this many ranks")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # One process: 2 stages on 2 'cpu' devices. Under torchrun: the ranks left once each stage has its
    # replicas and tensor-parallel ranks (gpipe refuses a world size that is not a multiple of them).
    stages = 2 if world == 1 else max(world // (args.data_parallel * args.tensor_parallel), 1)
    with torch.device("meta"):  # nothing is allocated until each process materializes its stages
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4)])
    pipe = Pipeline(
        model,
        [len(model) // stages + (s < len(model) % stages) for s in range(stages)],  # 4 blocks, as even as can be
        chunks=args.chunks,
        schedule=args.schedule,
        loss_fn=F.mse_loss,
        data_parallel=args.data_parallel,
        fsdp=args.fsdp,
        tensor_parallel=args.tensor_parallel,
        # Megatron's split of each block: the first projection by output features, the second by input.
        tp_plan={"0": ColwiseParallel(), "2": RowwiseParallel()},
    )
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    torch.manual_seed(0)
    teacher = torch.randn(32, 32)
    for step in range(args.steps):
        x = torch.randn(64, 32)
        loss = pipe.step(x, torch.tanh(x @ teacher))
        optimizer.step()
        optimizer.zero_grad()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
