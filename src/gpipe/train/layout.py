"""The processes a run of ``gpipe train`` takes: ``--partitions`` K stages times ``--data-parallel`` D
replicas of the pipeline times ``--tensor-parallel`` T ranks splitting each layer, one process each
under torchrun (world = D x K x T), ``--fsdp`` sharding each stage over its D replicas.
:func:`layout_error` checks a layout against torchrun's world and the mini-batch and says what is
wrong and the fix (:class:`~gpipe.train.config.TrainConfig` raises it); :func:`launch_line` is the
torchrun line a layout needs."""

from __future__ import annotations

import math

__all__ = ["launch_line", "layout_error", "shares"]


def launch_line(partitions: int, data_parallel: int, fsdp: bool = False, tensor_parallel: int = 1) -> str:
    """The torchrun command that runs ``gpipe train`` with this layout on one node."""
    sharded = " --fsdp" if fsdp else ""
    split = f" --tensor-parallel {tensor_parallel}" if tensor_parallel > 1 else ""
    return (
        f"torchrun --nproc-per-node {partitions * data_parallel * tensor_parallel} -m gpipe train "
        f"--partitions {partitions} --data-parallel {data_parallel}{sharded}{split} ..."
    )


def shares(rows: int, replicas: int) -> int:
    """How many shares a mini-batch of ``rows`` makes over ``replicas`` (as ``torch.chunk`` splits it,
    which is how a pipeline's replicas take theirs: 5 rows over 4 replicas make 3 shares of 2, 2, 1)."""
    size = math.ceil(rows / replicas)
    return math.ceil(rows / size) if rows else 0


def layout_error(
    *, partitions: int, data_parallel: int, fsdp: bool, batch: int, world: int, tensor_parallel: int = 1
) -> str | None:
    """What is wrong with running ``partitions`` stages x ``data_parallel`` replicas (``fsdp``:
    sharded) x ``tensor_parallel`` on a mini-batch of ``batch`` in a world of ``world`` processes
    (1: no torchrun), or None."""
    k, d, t = partitions, data_parallel, tensor_parallel
    if t > 1 and world <= 1:
        return (
            f"--tensor-parallel {t} splits each layer over {t} processes: start it with "
            f"{launch_line(k, d, fsdp, t)} (or give --tensor-parallel 1 to train in one process)"
        )
    if t > 1 and world > 1 and world != d * k * t:
        return (
            f"--data-parallel {d} x --partitions {k} x --tensor-parallel {t} needs {d * k * t} processes, but "
            f"torchrun started {world}: start torchrun with {d * k * t} processes in all, or change the three"
        )
    if t > 1:  # the world is right; the rest is the layout of one tp rank's pipelines
        world //= t
    if fsdp and d < 2:
        return (
            f"--fsdp shards each stage over its --data-parallel replicas, but --data-parallel is {d}: give "
            f"--data-parallel 2 or more (under torchrun, D x --partitions processes), or leave --fsdp out"
        )
    if d > 1 and world <= 1:
        return (
            f"--data-parallel {d} runs {d} replicas of the pipeline, a process per stage and replica: start it "
            f"with {launch_line(k, d, fsdp)} (or give --data-parallel 1{', without --fsdp,' if fsdp else ''} to train "
            "in one process)"
        )
    if world > 1 and world != d * k:
        if d == 1:
            replicas = f", or --data-parallel {world // k} ({world // k} replicas)" if world % k == 0 else ""
            return (
                f"--partitions {k} differs from the {world} processes of torchrun: give --partitions {world}"
                f"{replicas}, or start torchrun with --nproc-per-node {k}"
            )
        fixes = [f"start torchrun with {d * k} processes in all (--nnodes x --nproc-per-node)"]
        if world % d == 0:
            fixes.append(f"give --partitions {world // d}")
        if world % k == 0:
            fixes.append(f"give --data-parallel {world // k}")
        return (
            f"--data-parallel {d} x --partitions {k} needs {d * k} processes, but torchrun started {world}: "
            + ", or ".join(fixes)
        )
    if d > 1 and shares(batch, d) < d:
        return (
            f"--batch {batch} does not split into {d} shares, one per --data-parallel replica (as torch.chunk "
            f"splits it: {shares(batch, d)} shares of up to {math.ceil(batch / d)} rows); give a --batch that is a "
            f"multiple of {d}"
        )
    return None
