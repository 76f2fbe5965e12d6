"""``gpipe.Pipeline``: the step API, for every schedule.

``loss = pipe.step(inputs, target)`` runs one training step — the forward and backward of every
micro-batch in the order the schedule says — with the loss computed per micro-batch on the last
stage, and leaves the gradients of the mini-batch's mean loss in the parameters for the optimizer::

    pipe = gpipe.Pipeline(model, balance=[4, 4], chunks=8, schedule="1f1b", loss_fn=F.cross_entropy)
    for x, y in data:
        optimizer.zero_grad()
        loss = pipe.step(x, y)
        optimizer.step()

``pipe(inputs)`` (``forward``) runs the forwards only, without autograd, for evaluation.

Inputs, targets and what layers hand on may be any pytree — a tensor, a tuple, a dict such as a
tokenizer's output, a dataclass, a ``ModelOutput`` (see :mod:`gpipe.microbatch`): their tensors are
split along dim 0 into micro-batches, and every layer and ``loss_fn(output, target)`` receives the
micro-batch in the same structure.

The same script runs in one process (stages on the local devices, one worker thread each) or under
``torchrun --nproc-per-node K`` (one process per pipeline worker, over torch.distributed: gloo on CPU,
NCCL on GPUs; see :mod:`gpipe.distributed`). Under torchrun each rank holds only its own stages (the
others are dropped to the meta device), every rank calls ``step(x, y)`` alike, only the last stage
computes the loss, and ``step`` returns the mini-batch loss on every rank.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from gpipe.checkpoint import check_mode, checkpoint_stop
from gpipe.distributed import DistributedExecutor, collective, init_from_env, start_heartbeat
from gpipe.executor import LocalExecutor
from gpipe.microbatch import Batch, gather, scatter
from gpipe.partition import Layers, as_balance, auto_balance, check_balance, check_chunks, partition
from gpipe.rng import step_seed
from gpipe.schedule.generate import SCHEDULES, make_schedule
from gpipe.schedule.ir import ActionKind, Schedule
from gpipe.sequential import as_layers
from gpipe.stage import LossFn, Stage, StepContext, stages_of
from gpipe.tied import Tie, layer_at, local_ties, with_shared
from gpipe.tied import names as untie_names
from gpipe.trace import StepTrace

__all__ = ["Pipeline"]


class Pipeline(nn.Module):
    """A model cut into stages that trains one mini-batch per :meth:`step` under a schedule.

    Args:
        module: the layers, in order: an ``nn.Sequential`` (it may be built on the meta device:
            each process then materializes only its own stages' layers), or a list of layer
            factories (each process builds only its own layers). Either way those layers are
            initialized seeded by their global index, so the initial weights do not depend on K.
            Any other module is traced into layers on ``sample`` (:func:`gpipe.to_sequential`:
            one per repeated block, plus the code before and after).
        balance: the number of layers of each stage; with ``virtual`` stages per device, stage ``s``
            runs on device ``s mod K`` where K = len(balance) / virtual. Or ``'auto'``: time each
            layer on ``sample`` and split exactly into K x virtual stages (K: the devices, or the
            pipeline ranks under torch.distributed).
        chunks: M, the number of micro-batches of a mini-batch.
        schedule: one of ``gpipe.schedule.SCHEDULES``: 'gpipe' (fill-drain), '1f1b',
            'interleaved-1f1b', 'zb-h1'.
        loss_fn: ``loss_fn(output, target) -> scalar``, applied per micro-batch: by default a mean
            over the micro-batch's samples, weighted by its share of the mini-batch's samples, so
            that the step's gradients are those of the mean loss over the mini-batch.
        loss_count: for losses averaged over *items* that micro-batches hold different numbers of
            (tokens that are not padding, targets that are not ``ignore_index``):
            ``loss_count(target)`` counts the items of a target, ``loss_fn`` then returns the
            micro-batch's *sum* over its items, and the step's loss and gradients are those of the
            mini-batch's item mean: sum over micro-batches / count over the mini-batch (0 when
            it counts none). E.g. ``gpipe.recipe.count_tokens(pad)`` with a summed token loss.
        checkpoint: which micro-batches are re-materialized ('always', 'except_last', 'never').
        devices: one device per worker (default: the GPUs, or 'cpu' for each).
        virtual: stages per device (for 'interleaved-1f1b').
        cpu_threads: intra-op threads per CPU worker (default: shared out); fix it for bitwise
            reproducibility across partition counts on CPU.
        deferred_batch_norm: per-micro-batch batch-norm statistics, running averages per mini-batch.
        measure_memory: record every worker's peak activation memory in each step's trace
            (``last_trace.peak_activation_bytes``); costs a hook call per saved tensor.
        timeout: under torch.distributed, seconds a transfer or a collective between ranks may take
            before the step fails, naming the rank that does not answer (a rank that dies or raises
            is named at once).
        data_parallel: under torch.distributed, the number of data-parallel replicas of the
            pipeline (world = data_parallel x K, on a 2-D DeviceMesh ("dp", "pp")). Every rank
            passes the global mini-batch to ``step``; each replica trains on its share, and each
            stage's gradients are all-reduced over its replicas once per step.
        init_seed: the seed layers built here (factories, the meta device) are initialized from.
        sample: a mini-batch of inputs: to trace a module that is not an ``nn.Sequential``, and
            to time the layers for ``balance='auto'``.
        tied: parameters that are one in the model but held by layers on different stages, as
            groups of '<layer index>.<parameter name>'; each stage keeps a copy and the copies'
            gradients are summed. Parameters that several layers hold as one object (a traced
            GPT-2's token embedding and LM head) are tied without being named.
        init_fn: ``init_fn(layer)`` initializes a layer materialized from the meta device in
            place (default: the layer's own, e.g. a traced Hugging Face model's ``_init_weights``,
            else each module's ``reset_parameters``).
    """

    def __init__(
        self,
        module: Layers,
        balance: Sequence[int] | str,
        *,
        chunks: int,
        loss_fn: LossFn,
        schedule: str = "gpipe",
        checkpoint: str = "except_last",
        devices: Sequence[torch.device | str | int] | None = None,
        virtual: int = 1,
        cpu_threads: int | None = None,
        deferred_batch_norm: bool = False,
        measure_memory: bool = False,
        timeout: float = 60.0,
        data_parallel: int = 1,
        init_seed: int = 0,
        sample: Any = None,
        tied: Sequence[Sequence[str]] = (),
        loss_count: Callable[[Any], int | Tensor] | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        super().__init__()
        module = as_layers(module, sample)
        balance = as_balance(balance)  # (a NumPy array of counts: a list)
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target) (loss_fn: {loss_fn!r})")
        if loss_count is not None and not callable(loss_count):
            raise TypeError(
                f"loss_count must be callable as loss_count(target) -> number of items (loss_count: {loss_count!r})"
            )
        self.loss_count = loss_count
        self._init_fn = init_fn
        self.schedule = schedule
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_mode(checkpoint)
        self.virtual = virtual
        self.distributed = init_from_env(timeout) and dist.get_world_size() > 1
        self.data_parallel = data_parallel
        self.dp_rank = 0
        self._dp_group: Any = None
        self._pp_group: Any = None
        self._ties: list[Tie] = []
        if not isinstance(data_parallel, int) or data_parallel <= 0:
            raise ValueError(f"data_parallel must be a positive integer (data_parallel: {data_parallel!r})")
        if data_parallel > 1 and not self.distributed:
            raise ValueError(
                f"data_parallel={data_parallel} needs torch.distributed (run under torchrun with "
                f"data_parallel x stages processes)"
            )
        if self.distributed:
            start_heartbeat(timeout)
            if balance == "auto":
                balance = self._auto_balance_everywhere(module, sample)
            self._build_distributed(module, balance, devices, loss_fn, deferred_batch_norm, timeout, init_seed, tied)
        else:
            if balance == "auto":
                if devices is None:
                    raise ValueError("balance='auto' needs devices=[...]: one device per worker to balance over")
                balance = auto_balance(module, len(devices) * virtual, sample, self.chunks)
            tied = with_shared(module, check_balance(module, balance), tied)
            self.balance, self.devices, partitions = partition(
                module,
                balance,
                devices,
                virtual=virtual,
                deferred_batch_norm=deferred_batch_norm,
                init_seed=init_seed,
                tied=tied,
                init_fn=init_fn,
            )
            self._ties = local_ties(partitions, self.balance, tied)
            self.partitions = nn.ModuleDict({str(s): p for s, p in enumerate(partitions)})
            stage_devices = [self.devices[s % len(self.devices)] for s in range(len(partitions))]
            stages = stages_of(partitions, stage_devices, loss_fn)
            self._executor = LocalExecutor(stages, cpu_threads=cpu_threads)
        self.schedule_for(self.chunks)  # fail now, not at the first step, if the schedule can't be made
        self.measure_memory = measure_memory
        self.last_trace: StepTrace | None = None

    def _auto_balance_everywhere(self, module: Layers, sample: Any) -> list[int]:
        """``balance='auto'`` under torch.distributed: rank 0 times the layers, every rank uses its
        balance (timings differ from process to process; the balance must not)."""
        stages = dist.get_world_size() // self.data_parallel * self.virtual
        found: list[Any] = [auto_balance(module, stages, sample, self.chunks) if dist.get_rank() == 0 else None]
        with collective("broadcast of the automatic balance from rank 0"):
            dist.broadcast_object_list(found, src=0)
        return list(found[0])

    def _build_distributed(
        self,
        module: Layers,
        balance: Sequence[int] | str,
        devices: Sequence[torch.device | str | int] | None,
        loss_fn: LossFn,
        deferred_batch_norm: bool,
        timeout: float,
        init_seed: int,
        tied: Sequence[Sequence[str]],
    ) -> None:
        """One rank of K: keep this rank's stages on its device, drop the others to 'meta'."""
        world, me = dist.get_world_size(), dist.get_rank()
        dp = self.data_parallel
        if world % dp:
            raise ValueError(f"the world size is not a multiple of data_parallel (world: {world}, data_parallel: {dp})")
        if devices is not None and len(devices) != world:
            raise ValueError(
                f"under torch.distributed, devices lists one device per rank (devices: {len(devices)}, ranks: {world})"
            )
        device = torch.device(devices[me]) if devices is not None else _default_device()
        with collective("creation of the device mesh"):
            mesh = init_device_mesh(device.type, (dp, world // dp), mesh_dim_names=("dp", "pp"))
        self.dp_rank, rank = mesh.get_coordinate() or (0, 0)
        self._dp_group = mesh["dp"].get_group() if dp > 1 else None
        self._pp_group = mesh["pp"].get_group()
        for group in (self._dp_group, self._pp_group):  # the mesh's groups wait 30 min by default
            if group is not None:
                _set_pg_timeout(timedelta(seconds=timeout), group)
        replicas = mesh.mesh.tolist()
        k = len(replicas[0])
        workers = [device if w == rank else torch.device("meta") for w in range(k)]
        tied = with_shared(module, check_balance(module, balance), tied)
        self.balance, _, partitions = partition(
            module,
            balance,
            workers,
            virtual=self.virtual,
            deferred_batch_norm=deferred_batch_norm,
            init_seed=init_seed,
            tied=tied,
            init_fn=self._init_fn,
        )
        if len(partitions) != k * self.virtual:
            raise ValueError(
                f"balance has {len(partitions)} stages but {k} pipeline ranks x {self.virtual} virtual stages "
                "run here; give one balance entry per stage"
            )
        self.devices = [device]
        self._num_workers = k
        firsts = [sum(self.balance[:s]) for s in range(len(partitions))]
        mine = [s for s in range(len(partitions)) if s % k == rank]
        self.partitions = nn.ModuleDict({str(s): partitions[s] for s in mine})
        stages = [
            Stage(s, partitions[s], firsts[s], device, loss_fn if s == len(partitions) - 1 else None) for s in mine
        ]
        with collective("creation of the pipeline's process groups"):
            self._executor = DistributedExecutor(
                stages, len(partitions), replicas=replicas, device=device, timeout=timeout
            )
        self._ties = self._distributed_ties(partitions, tied, replicas, mine)

    def _distributed_ties(
        self,
        partitions: Sequence[nn.Sequential],
        tied: Sequence[Sequence[str]],
        replicas: Sequence[Sequence[int]],
        mine: Sequence[int],
    ) -> list[Tie]:
        """Per tie, this rank's copies and a process group of the ranks holding copies (created by
        every rank for every replica, in the same order: new_group is collective)."""
        ties = []
        me, k = dist.get_rank(), len(replicas[0])
        assert isinstance(self._executor, DistributedExecutor)
        timeout = timedelta(seconds=self._executor.timeout)
        for members in untie_names(tied):
            stages = [layer_at(partitions, self.balance, i)[0] for i, _ in members]
            tie = Tie(members)
            for ranks in replicas:
                holders = sorted({ranks[s % k] for s in stages})
                with collective(f"creation of the process group of tied parameter {_tie_name(tie)}"):
                    group = dist.new_group(holders, timeout=timeout) if len(holders) > 1 else None
                if me in ranks:
                    tie.group, tie.owner = group, ranks[stages[0] % k]
            tie.local = [
                layer_at(partitions, self.balance, i)[1].get_parameter(path)
                for (i, path), s in zip(members, stages)
                if s in mine
            ]
            with collective(f"broadcast of tied parameter {_tie_name(tie)}", tie.group):
                tie.sync_values()
            ties.append(tie)
        return ties

    @property
    def num_workers(self) -> int:
        """K: devices in one process, or ranks under torch.distributed."""
        return self._num_workers if self.distributed else len(self.devices)

    @functools.lru_cache(maxsize=16)  # noqa: B019 - a few (K, M) per pipeline
    def schedule_for(self, microbatches: int) -> Schedule:
        """The validated schedule for a mini-batch of ``microbatches`` micro-batches."""
        return make_schedule(self.schedule, self.num_workers, microbatches, self.virtual)

    def _seed(self) -> int:
        """The step's seed, drawn on the first rank and shared, so all ranks draw alike."""
        seed = step_seed()
        if not self.distributed:
            return seed
        t = torch.tensor([seed], dtype=torch.int64, device=self._comm_device())
        with collective("broadcast of the step's seed from rank 0"):
            dist.broadcast(t, src=0)
            return int(t.item())

    def _comm_device(self) -> torch.device:
        return self.devices[0] if dist.get_backend() == "nccl" else torch.device("cpu")

    def _share_loss(self, loss: Tensor | None) -> Tensor:
        """The mini-batch loss, from the last stage's rank (summed over the replicas) to every rank."""
        if loss is not None and self._dp_group is not None:
            loss = loss.detach().reshape(1).to(self._comm_device())
            with collective("all-reduce of the loss over the data-parallel replicas", self._dp_group):
                dist.all_reduce(loss, group=self._dp_group)
            loss = loss[0]
        return self.from_last_stage(loss)

    def from_last_stage(self, value: Tensor | None) -> Tensor:
        """A scalar known on the rank of the last stage (``None`` elsewhere), on every rank of the
        pipeline; in one process, the value itself."""
        if not self.distributed:
            assert value is not None
            return value
        executor = self._executor
        assert isinstance(executor, DistributedExecutor)
        buf = torch.zeros(1, device=self._comm_device())
        if value is not None:
            buf.copy_(value.detach().reshape(1))
        last = executor.pipeline_ranks[(executor.num_stages - 1) % len(executor.pipeline_ranks)]
        with collective(f"broadcast from the last stage's rank {last}", self._pp_group):
            dist.broadcast(buf, src=last, group=self._pp_group)
            return buf[0].to(self.devices[0])

    def _all_reduce_gradients(self) -> None:
        """Sum each stage's gradients over its data-parallel replicas (each replica's loss is already
        scaled by its share of the global mini-batch)."""
        if self._dp_group is None:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for the whole stage
        with collective("all-reduce of the gradients over the data-parallel replicas", self._dp_group):
            dist.all_reduce(flat, group=self._dp_group)
        for g, reduced in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))

    def _share(self, value: Any) -> Any:
        """This replica's share of a global mini-batch (all of it without data parallelism)."""
        if self.data_parallel == 1:
            return value
        shares = scatter(value, self.data_parallel)
        if len(shares) < self.data_parallel:
            raise ValueError(
                f"a mini-batch of {_size(shares[0]) * len(shares)} cannot be shared by "
                f"{self.data_parallel} data-parallel replicas"
            )
        return shares[self.dp_rank].value

    def step(self, inputs: Any, target: Any) -> Tensor:
        """Forward and backward of one mini-batch; returns its mean loss (detached). Gradients are
        accumulated into the parameters' ``.grad``. ``inputs`` and ``target`` are pytrees (a tensor,
        a tuple, a dict, ...) whose tensors have the same size in dim 0."""
        if target is None:
            raise TypeError(
                "Pipeline.step(inputs, target) needs the target that loss_fn compares the output with "
                "(target: None); to run the forward pass alone, call pipe(inputs)"
            )
        total = _size(scatter(inputs, 1)[0])
        batches = scatter(self._share(inputs), self.chunks)
        targets = scatter(self._share(target), self.chunks)
        sizes = [_size(b) for b in batches]
        if [_size(t) for t in targets] != sizes:
            raise ValueError(
                f"inputs and target split into different micro-batches (inputs: {sizes}, "
                f"target: {[_size(t) for t in targets]}); give them the same size in dim 0"
            )
        last = self._executor.stages.get(self._executor.num_stages - 1)
        seed = self._seed()
        with torch.enable_grad():
            ctx = StepContext.capture(
                num_microbatches=len(batches),
                checkpoint_stop=checkpoint_stop(self.checkpoint, len(batches)),
                training=self.training,
                seed=seed,
                targets=[last.receive(t).value for t in targets] if last is not None else None,
                loss_scale=self._loss_scale(target, sizes, total),
            )
            schedule = self.schedule_for(len(batches))
            run, losses = self._executor.step(schedule, batches, ctx, measure_memory=self.measure_memory)
        for tie in self._ties:
            with collective(f"all-reduce of tied parameter {_tie_name(tie)}'s gradients", tie.group):
                tie.sync_grads()
        self._all_reduce_gradients()
        peak = tuple(run.meter.peak) if run.meter is not None else None
        self.last_trace = StepTrace(schedule, run.trace, peak)
        return self._share_loss(torch.stack([b.value for b in losses]).sum() if losses else None)

    def _loss_scale(self, target: Any, sizes: Sequence[int], total: int) -> list[float]:
        """What each micro-batch's loss is multiplied by: its share of the mini-batch's samples, or
        with ``loss_count`` one over the items the whole mini-batch counts (every replica's)."""
        if self.loss_count is None:
            return [n / total for n in sizes]
        found = self.loss_count(target)
        if isinstance(found, Tensor) and found.numel() != 1:
            raise ValueError(f"loss_count must return a number, got a tensor of shape {tuple(found.shape)}")
        count = found.item() if isinstance(found, Tensor) else found
        if not isinstance(count, (int, float)) or count < 0:
            raise ValueError(f"loss_count must return a number >= 0 (loss_count(target): {count!r})")
        return [1.0 / count if count else 0.0] * len(sizes)

    def forward(self, inputs: Any) -> Any:
        """The forwards only, without autograd, for evaluation; returns the gathered output (under
        torch.distributed: on the last stage's rank, ``None`` on the others; with data parallelism,
        each replica evaluates and returns its share)."""
        batches = scatter(self._share(inputs), self.chunks)
        schedule = self.schedule_for(len(batches)).only(ActionKind.FORWARD)
        seed = self._seed()
        with torch.no_grad():
            ctx = StepContext.capture(
                num_microbatches=len(batches), checkpoint_stop=0, training=self.training, seed=seed
            )
            _, outputs = self._executor.forward(schedule, batches, ctx)
        return gather(outputs) if outputs else None


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _tie_name(tie: Tie) -> str:
    return "/".join(f"{i}.{path}" for i, path in tie.members)


def _size(batch: Batch) -> int:
    """A micro-batch's number of samples: the batch dimension of its tensors (scatter checked they
    agree; 0-dimensional ones have none)."""
    return next(t.size(0) for t in batch.tensors() if t.dim())
