"""Building a pipeline: from layers, a balance and a schedule to a running engine.

:func:`build` does it once — in one process (every worker a device here) or as one rank of
torch.distributed (with data parallelism beside the pipeline on a 2-D DeviceMesh) — in this order:
how many workers; the balance (``'auto'``: timed on rank 0, shared); the schedule's placement
(:class:`~gpipe.runtime.placement.Placement`); the stages, each materialized only where it is placed; the tied
parameters and, under torch.distributed, their process groups; the transport; the executor; and the
step's collectives (:class:`~gpipe.distributed.Collectives`, nothing to do in one process).
``Pipeline`` and ``GPipe`` are front ends over the :class:`Engine` this returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from gpipe.distributed import (
    ChannelTransport,
    Collectives,
    RankCollectives,
    StageSharding,
    TpPlan,
    collective,
    comm_device,
    rank_device,
    start_heartbeat,
    tie_name,
)
from gpipe.distributed.experts import expert_group, split_experts
from gpipe.distributed.failure import name_coordinates
from gpipe.distributed.tensor_parallel import parallelize
from gpipe.runtime.context import LossFn
from gpipe.runtime.executor import Executor
from gpipe.runtime.partition import (
    Layers,
    auto_balance,
    check_balance,
    materialize_shards,
    partition,
    reads_shards,
    resolve_devices,
)
from gpipe.runtime.placement import Placement
from gpipe.runtime.planner import AutoPlanner, AutoSchedule, FixedPlanner, Planner
from gpipe.runtime.stage import Stage
from gpipe.schedule.generate import make_schedule
from gpipe.schedule.ir import round_robin, v_shape
from gpipe.tied import Tie, layer_at, local_ties, names, with_shared

__all__ = ["Engine", "build", "placement_of", "planner_of"]


@dataclass
class Engine:
    """A built pipeline as this process holds it."""

    placement: Placement
    executor: Executor
    partitions: dict[int, nn.Sequential]
    """This process's stages' layers, by stage index."""
    balance: list[int]
    devices: list[torch.device]
    """The devices of this process's workers."""
    ties: list[Tie]
    comm: Collectives
    planner: Planner
    sharding: StageSharding | None = None
    """This process's stages sharded over their data-parallel group (``fsdp=True``), else None."""

    @property
    def stages(self) -> list[Stage]:
        """This process's stages, in pipeline order."""
        return [self.executor.stages[s] for s in sorted(self.executor.stages)]


def placement_of(schedule: str | AutoSchedule, workers: int, chunks: int, virtual: int) -> tuple[int, ...]:
    """Which worker holds each stage under ``schedule`` (the generator's own placement; 'auto'
    plans over one stage per worker, two in a V (as ZB-V), or more round-robin)."""
    if isinstance(schedule, AutoSchedule) or schedule == "auto":
        return v_shape(workers) if virtual == 2 else round_robin(workers * virtual, workers)
    return make_schedule(schedule, workers, chunks, virtual).placement


def planner_of(
    schedule: str | AutoSchedule, placement: Placement, virtual: int, comm: Collectives, *, sharded: bool = False
) -> Planner:
    if isinstance(schedule, str) and schedule != "auto":
        return FixedPlanner(schedule, placement.num_workers, virtual, sharded=sharded)
    options = schedule if isinstance(schedule, AutoSchedule) else AutoSchedule()
    return AutoPlanner(placement.num_workers, placement.worker_of, options, comm.gather, comm.dp_rank, sharded=sharded)


def build(
    module: Layers,
    balance: Sequence[int] | str,
    *,
    schedule: str | AutoSchedule,
    chunks: int,
    loss_fn: LossFn | None,
    devices: Sequence[torch.device | str | int] | None = None,
    virtual: int = 1,
    cpu_threads: int | None = None,
    deferred_batch_norm: bool = False,
    timeout: float = 60.0,
    data_parallel: int = 1,
    fsdp: bool = False,
    expert_parallel: int = 1,
    tensor_parallel: int = 1,
    tp_plan: TpPlan = "auto",
    init_seed: int = 0,
    sample: Any = None,
    tied: Sequence[Sequence[str]] = (),
    init_fn: Callable[[nn.Module], None] | None = None,
    distributed: bool = False,
) -> Engine:
    """Build the engine of a pipeline (see :class:`gpipe.Pipeline` for the arguments)."""
    if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual <= 0:
        raise ValueError(f"virtual stages per worker must be a positive integer (virtual: {virtual!r})")
    if distributed:
        return _build_ranks(
            module, balance, schedule=schedule, chunks=chunks, loss_fn=loss_fn, devices=devices, virtual=virtual,
            deferred_batch_norm=deferred_batch_norm, timeout=timeout, data_parallel=data_parallel, fsdp=fsdp,
            expert_parallel=expert_parallel, tensor_parallel=tensor_parallel, tp_plan=tp_plan,
            init_seed=init_seed, sample=sample, tied=tied, init_fn=init_fn,
        )  # fmt: skip
    if balance == "auto":
        if devices is None:
            raise ValueError("balance='auto' needs devices=[...]: one device per worker to balance over")
        balance = auto_balance(module, len(devices) * virtual, sample, chunks)
    balance = check_balance(module, balance)
    if len(balance) % virtual:
        raise ValueError(
            f"the number of stages must be a multiple of the virtual stages per worker "
            f"(stages: {len(balance)}, virtual: {virtual}); give one balance entry per stage"
        )
    workers = len(balance) // virtual
    placement = Placement(placement_of(schedule, workers, chunks, virtual), tuple(resolve_devices(devices, workers)))
    tied = with_shared(module, balance, tied)
    partitions, stages = _placed_stages(
        module, balance, placement, loss_fn, deferred_batch_norm=deferred_batch_norm, init_seed=init_seed,
        tied=tied, init_fn=init_fn,
    )  # fmt: skip
    comm = Collectives()
    return Engine(
        placement,
        Executor(stages, placement, cpu_threads=cpu_threads),
        dict(enumerate(partitions)),
        balance,
        list(placement.devices),
        local_ties(partitions, balance, tied),
        comm,
        planner_of(schedule, placement, virtual, comm),
    )


def _placed_stages(
    module: Layers,
    balance: Sequence[int],
    placement: Placement,
    loss_fn: LossFn | None,
    *,
    deferred_batch_norm: bool,
    init_seed: int,
    tied: Sequence[Sequence[str]],
    init_fn: Callable[[nn.Module], None] | None,
    defer: bool = False,
) -> tuple[list[nn.Sequential], list[Stage]]:
    """Every stage's layers, each materialized where ``placement`` puts it ('meta' elsewhere, and
    with ``defer`` here too, to be split, sharded and then materialized), and the stages this process
    runs (the last one computing the loss)."""
    devices = [torch.device("meta")] * len(balance) if defer else placement.stage_devices
    partitions = partition(
        module, balance, devices, deferred_batch_norm=deferred_batch_norm, init_seed=init_seed, tied=tied,
        init_fn=init_fn,
    )  # fmt: skip
    firsts = [sum(balance[:s]) for s in range(len(balance))]
    last = len(balance) - 1
    stages = [
        Stage(s, partitions[s], firsts[s], placement.device_of(s), loss_fn if s == last else None)
        for s in placement.local_stages
    ]
    return partitions, stages


def _build_ranks(
    module: Layers,
    balance: Sequence[int] | str,
    *,
    schedule: str | AutoSchedule,
    chunks: int,
    loss_fn: LossFn | None,
    devices: Sequence[torch.device | str | int] | None,
    virtual: int,
    deferred_batch_norm: bool,
    timeout: float,
    data_parallel: int,
    fsdp: bool,
    expert_parallel: int,
    tensor_parallel: int,
    tp_plan: TpPlan,
    init_seed: int,
    sample: Any,
    tied: Sequence[Sequence[str]],
    init_fn: Callable[[nn.Module], None] | None,
) -> Engine:
    """One rank of K (x data_parallel x tensor_parallel): this rank's stages on its device, the
    others on 'meta' (``fsdp``: sharded over the data-parallel group; ``tensor_parallel``: each
    layer with a plan split over the tp group)."""
    world, me, dp, tp = dist.get_world_size(), dist.get_rank(), data_parallel, tensor_parallel
    if world % (dp * tp):
        raise ValueError(
            f"the world size is not a multiple of data_parallel x tensor_parallel (world: {world}, "
            f"data_parallel: {dp}, tensor_parallel: {tp}): start data_parallel x stages x tensor_parallel processes"
        )
    if devices is not None and len(devices) != world:
        raise ValueError(
            f"under torch.distributed, devices lists one device per rank (devices: {len(devices)}, ranks: {world})"
        )
    start_heartbeat(timeout)
    k = world // (dp * tp)
    if balance == "auto":  # rank 0 times the layers (timings differ between processes; the balance must not)
        found: list[Any] = [auto_balance(module, k * virtual, sample, chunks) if me == 0 else None]
        with collective("broadcast of the automatic balance from rank 0"):
            dist.broadcast_object_list(found, src=0)
        balance = list(found[0])
    balance = check_balance(module, balance)
    if len(balance) != k * virtual:
        raise ValueError(
            f"balance has {len(balance)} stages but {k} pipeline ranks x {virtual} virtual stages "
            "run here; give one balance entry per stage"
        )
    device = torch.device(devices[me]) if devices is not None else rank_device()
    shape, dims = ((dp, k, tp), ("dp", "pp", "tp")) if tp > 1 else ((dp, k), ("dp", "pp"))
    with collective("creation of the device mesh"):
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=dims)
    dp_group = mesh["dp"].get_group() if dp > 1 else None
    pp_group = mesh["pp"].get_group()
    tp_group = mesh["tp"].get_group() if tp > 1 else None
    for group in (dp_group, pp_group, tp_group):  # the mesh's groups wait 30 min by default
        if group is not None:
            _set_pg_timeout(timedelta(seconds=timeout), group)
    name_coordinates(mesh.mesh.tolist(), dims)
    # One pipeline per (dp, tp) coordinate: its ranks of the K workers (tp innermost, in rank order).
    ranks = mesh.mesh.reshape(dp, k, tp)
    pipelines = [ranks[d, :, t].tolist() for d in range(dp) for t in range(tp)]
    placement = Placement.distributed(placement_of(schedule, k, chunks, virtual), device, pipelines, me)
    tied = with_shared(module, balance, tied)
    # Layers whose initialization fills its shards alone (pretrained weights read per slice) are split and
    # sharded on the meta device, then materialized: a rank never holds more than its shards of them.
    defer = (tp > 1 or fsdp) and init_fn is None and isinstance(module, nn.Sequential)
    defer = defer and all(reads_shards(layer, None) for layer in module)  # type: ignore[arg-type]
    partitions, stages = _placed_stages(
        module, balance, placement, loss_fn, deferred_batch_norm=deferred_batch_norm, init_seed=init_seed,
        tied=tied, init_fn=init_fn, defer=defer,
    )  # fmt: skip
    with collective("creation of the pipeline's process groups"):
        transport = ChannelTransport(placement, device, timeout=timeout)
    ties = _rank_ties(partitions, balance, tied, placement, timeout, sync=not defer)  # (deferred: see below)
    local = {s: partitions[s] for s in placement.local_stages}
    if tp > 1:  # after the ties' values agree; before FSDP shards what it split
        _split_layers(local, mesh["tp"], tp_plan, device)
    edp_group = _spread_experts(local, device, (dp, expert_parallel, k, tp), timeout) if expert_parallel > 1 else None
    comm = RankCollectives(
        placement, device, dp_group=dp_group, pp_group=pp_group, data_parallel=dp, dp_rank=placement.replica // tp,
        expert_parallel=expert_parallel, expert_dp_group=edp_group,
    )  # fmt: skip
    materialize = (lambda: _materialize_shards(local, device, init_seed)) if defer else None
    sharding = StageSharding(local, mesh["dp"], materialize=materialize) if fsdp else None
    if materialize is not None and not fsdp:
        materialize()
    if tp > 1 or fsdp:
        for tie in ties:
            _find_copies(tie, partitions, balance, placement)
    # (deferred copies of a tie are not synced: an init that reads shards gives each copy its slice of the
    # one tensor they share, as a loader of pretrained weights reads both from the same file tensor)
    return Engine(
        placement,
        Executor(stages, placement, transport=transport, stage_wide=sharding.run if sharding else None),
        local,
        balance,
        [device],
        ties,
        comm,
        planner_of(schedule, placement, virtual, comm, sharded=fsdp),
        sharding,
    )


def _spread_experts(
    local: dict[int, nn.Sequential], device: torch.device, sizes: tuple[int, int, int, int], timeout: float
) -> Any:
    """Split this rank's experts over its expert-parallel group (:mod:`gpipe.distributed.experts`);
    the process group of the ranks holding the same experts (None: no other replica does). Refuses a
    model with no experts anywhere (the count all-reduced)."""
    dp, ep, k, tp = sizes
    shape = (dp // ep, ep, k, tp) if tp > 1 else (dp // ep, ep, k)
    with collective("creation of the expert-parallel mesh"):
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("edp", "ep", "pp", "tp")[: len(shape)])
        experts = expert_group(mesh, timeout)
    edp = mesh["edp"].get_group() if dp // ep > 1 else None
    for group in (experts.group, edp):
        if group is not None:
            _set_pg_timeout(timedelta(seconds=timeout), group)
    if not _anywhere(split_experts(local, experts), device, "count of the layers whose experts were split"):
        raise ValueError(
            f"expert_parallel={ep}, but no layer of the model has experts to split (a module with "
            "gpipe_split_experts, as gpipe.models.moe.MoEFeedForward): build the model with experts, or drop "
            "expert_parallel"
        )
    return edp


def _materialize_shards(local: dict[int, nn.Sequential], device: torch.device, init_seed: int) -> None:
    """Storage and values for this rank's shards of its layers, split and sharded on the meta device."""
    for layers in local.values():
        for index, layer in layers.named_children():
            materialize_shards(layer, int(index), device, init_seed)


def _split_layers(local: dict[int, nn.Sequential], mesh: Any, plan: TpPlan, device: torch.device) -> None:
    """Split this rank's layers over the tp group; refuse a plan that splits no layer anywhere (the count
    all-reduced on the default group's device for this rank: CUDA under an NCCL-only group)."""
    if not _anywhere(parallelize(local, mesh, plan), device, "count of the layers tensor parallelism split"):
        raise ValueError(
            f"tensor_parallel={mesh.size()}, but no layer of the model has a tensor-parallel plan (tp_plan='auto' "
            "knows gpipe's Transformer layers and Hugging Face models with a base_model_tp_plan): give tp_plan="
        )


def _anywhere(count: int, device: torch.device, what: str) -> bool:
    """Whether ``count`` summed over every rank (all-reduced on the default group's device for this
    rank: CUDA under an NCCL-only group) is above 0."""
    total = torch.tensor([count], dtype=torch.int64, device=comm_device(device))
    with collective(what):
        dist.all_reduce(total)
    return int(total.item()) > 0


def _find_copies(tie: Tie, partitions: Sequence[nn.Sequential], balance: Sequence[int], placement: Placement) -> None:
    """The tie's copies this rank holds, as its layers hold them now (splitting and sharding a layer
    put new parameters in place of its own)."""
    tie.local = [
        layer_at(partitions, balance, i)[1].get_parameter(path)
        for i, path in tie.members
        if placement.holds(layer_at(partitions, balance, i)[0])
    ]


def _rank_ties(
    partitions: Sequence[nn.Sequential],
    balance: Sequence[int],
    tied: Sequence[Sequence[str]],
    placement: Placement,
    timeout: float,
    *,
    sync: bool = True,
) -> list[Tie]:
    """Per tie, this rank's copies and a process group of the ranks holding copies (created by
    every rank for every replica, in the same order: new_group is collective); with ``sync`` the
    first copy's value given to the others (else later: the copies are on the meta device)."""
    ties = []
    me = dist.get_rank()
    for members in names(tied):
        stages = [layer_at(partitions, balance, i)[0] for i, _ in members]
        tie = Tie(members)
        for ranks in placement.replicas:
            holders = sorted({placement.rank_of(s, ranks) for s in stages})
            with collective(f"creation of the process group of tied parameter {tie_name(tie)}"):
                group = dist.new_group(holders, timeout=timedelta(seconds=timeout)) if len(holders) > 1 else None
            if me in ranks:
                tie.group, tie.owner = group, placement.rank_of(stages[0], ranks)
        _find_copies(tie, partitions, balance, placement)
        if sync:
            with collective(f"broadcast of tied parameter {tie_name(tie)}", tie.group):
                tie.sync_values()
        ties.append(tie)
    return ties
