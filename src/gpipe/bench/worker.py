"""One process of a multi-process benchmark (started by :func:`gpipe.bench.common.launch`)."""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe.balance import solve
from gpipe.bench.common import (
    AUTO_WARMUP,
    GPIPE_SCHEDULES,
    TORCH_SCHEDULES,
    Bench,
    gpipe_key,
    mlp,
    mlp_batch,
    take_turns,
    workloads,
)
from gpipe.distributed import init_from_env
from gpipe.pipeline import Pipeline
from gpipe.runtime.planner import AutoPlanner


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def throughput(spec: dict[str, Any]) -> dict[str, list[float]]:
    """Step times of the pipelined workload for each M, on this world's K stages."""
    work = next(w for w in workloads(Bench.of(spec["quick"]), spec["batch"]) if w.name == spec["workload"])
    model = work.build()
    world = dist.get_world_size() if dist.is_initialized() else 1
    balance = solve(spec["costs"], world)
    local: dict[str, Any] = {"devices": Bench.of(True, spec.get("devices", "cpu")).place(1), "cpu_threads": 1}
    local = local if world == 1 else {}
    pipe = Pipeline(model, balance, chunks=1, loss_fn=work.loss_fn, checkpoint="always", **local)

    def step(m: int) -> Callable[[], None]:
        def run() -> None:
            pipe.chunks = m
            pipe.step(work.inputs, work.target)
            pipe.zero_grad()

        return run

    return take_turns({str(m): step(m) for m in spec["microbatches"]}, spec["repeats"], _barrier)


def torch_stage_indices(rank: int, world: int, virtual: int, style: str) -> list[int]:
    """The stages rank ``rank`` holds, in torch.distributed.pipelining's placement ``style``."""
    if style == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + i * world for i in range(virtual)]


def _agree(reason: str | None) -> str | None:
    """Every rank's reason for a failure, joined (None when every rank succeeded)."""
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    found = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None]
    return "; ".join(found) if found else None


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


def vs_torch(spec: dict[str, Any]) -> dict[str, Any]:
    """gpipe's Pipeline and torch.distributed.pipelining's schedules on the same model, 2 ranks:
    ``{"times": {variant: step times}, "not_run": {variant: why}, "auto": {variant: its plan}}`` (the
    'auto' variants: one stage per worker, and two in a V).

    Every torch schedule gets its own copy of the model (split into as many stages as it places), the
    same micro-batches, the same loss and zeroed gradients after every step; it runs in a process group
    of its own with a short timeout, so that one failing on gloo/CPU (on one rank, with the other
    waiting for it) is reported, not fatal."""
    from torch.distributed import pipelining

    world, rank = dist.get_world_size(), dist.get_rank()
    base = mlp(spec["blocks"], spec["hidden"], spec["ffn"])
    x, y = mlp_batch(spec["batch"], spec["hidden"])
    timeout = timedelta(seconds=float(spec.get("torch_timeout", 60.0)))
    steps: dict[str, Callable[[], object]] = {}
    not_run: dict[str, str] = {}
    for name, cls_name, virtual, style in TORCH_SCHEDULES:
        key = f"torch {name}"
        group = dist.new_group(backend="gloo", timeout=timeout)
        reason: str | None = None
        try:
            per = len(base) // (world * virtual)
            indices = torch_stage_indices(rank, world, virtual, style)
            parts = [copy.deepcopy(base[i * per : (i + 1) * per]) for i in indices]
            stages = [
                pipelining.PipelineStage(part, i, world * virtual, torch.device("cpu"), group=group)
                for part, i in zip(parts, indices)
            ]
            cls = getattr(pipelining, cls_name)
            schedule = cls(stages[0] if virtual == 1 else stages, spec["chunks"], loss_fn=F.mse_loss)
            first, last = 0 in indices, world * virtual - 1 in indices

            def torch_step(schedule: Any = schedule, parts: list[nn.Module] = parts, first: bool = first,
                           last: bool = last) -> None:  # fmt: skip
                schedule.step(*((x,) if first else ()), **({"target": y, "losses": []} if last else {}))
                for part in parts:
                    part.zero_grad()

            torch_step()  # a failure shows here (take_turns warms up again)
        except Exception as exc:  # any failure of a peer's schedule is reported, not fatal
            reason = _reason(exc)
        reason = _agree(reason)
        if reason is None:
            steps[key] = torch_step
        else:
            not_run[key] = reason
    autos: dict[str, Pipeline] = {}
    for name, virtual, checkpoints in GPIPE_SCHEDULES:
        for checkpoint in checkpoints:
            key = gpipe_key(name, virtual, checkpoint)
            try:
                pipe = Pipeline(copy.deepcopy(base), [len(base) // (world * virtual)] * (world * virtual),
                                chunks=spec["chunks"], schedule=name, loss_fn=F.mse_loss, checkpoint=checkpoint,
                                virtual=virtual)  # fmt: skip
            except ValueError as exc:  # a schedule that cannot be made for these sizes, on every rank alike
                not_run[key] = _reason(exc)
                continue

            def gpipe_step(pipe: Pipeline = pipe) -> None:
                pipe.step(x, y)
                pipe.zero_grad()

            if name == "auto":
                autos[key] = pipe
                for _ in range(AUTO_WARMUP - 1):  # take_turns warms up once more
                    gpipe_step()
            steps[key] = gpipe_step
    times = take_turns(steps, spec["repeats"], _barrier)
    plans = {}
    for key, auto in autos.items():
        made = auto.engine.planner.last_plan if isinstance(auto.engine.planner, AutoPlanner) else None
        if made is not None:
            plans[key] = {"chosen": made.chosen, "bubble": made.bubble, "explain": made.explain()}
    return {"times": times, "not_run": not_run, "auto": plans}


TASKS: dict[str, Callable[[dict[str, Any]], Any]] = {"throughput": throughput, "vs_torch": vs_torch}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:  # (each rank on its own device for spec["devices"]: auto, cuda, cpu)
        init_from_env(devices=spec.get("devices", "cpu"))
    result = TASKS[spec["task"]](spec)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(spec["result"], "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
