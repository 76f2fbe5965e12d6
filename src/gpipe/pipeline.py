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
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.checkpoint import check_mode, checkpoint_stop
from gpipe.executor import LocalExecutor
from gpipe.microbatch import Batch, gather, scatter
from gpipe.partition import check_chunks, partition
from gpipe.rng import step_seed
from gpipe.schedule.generate import SCHEDULES, make_schedule
from gpipe.schedule.ir import ActionKind, Schedule
from gpipe.stage import LossFn, StepContext, stages_of
from gpipe.trace import StepTrace

__all__ = ["Pipeline"]


class Pipeline(nn.Module):
    """A model cut into stages that trains one mini-batch per :meth:`step` under a schedule.

    Args:
        module: the layers, in order.
        balance: the number of layers of each stage; with ``virtual`` stages per device, stage ``s``
            runs on device ``s mod K`` where K = len(balance) / virtual.
        chunks: M, the number of micro-batches of a mini-batch.
        schedule: one of ``gpipe.schedule.SCHEDULES``: 'gpipe' (fill-drain), '1f1b',
            'interleaved-1f1b', 'zb-h1'.
        loss_fn: ``loss_fn(output, target) -> scalar`` with a mean reduction, applied per
            micro-batch; the step's gradients are those of the mean loss over the mini-batch.
        checkpoint: which micro-batches are re-materialized ('always', 'except_last', 'never').
        devices: one device per worker (default: the GPUs, or 'cpu' for each).
        virtual: stages per device (for 'interleaved-1f1b').
        cpu_threads: intra-op threads per CPU worker (default: shared out); fix it for bitwise
            reproducibility across partition counts on CPU.
        deferred_batch_norm: per-micro-batch batch-norm statistics, running averages per mini-batch.
        measure_memory: record every worker's peak activation memory in each step's trace
            (``last_trace.peak_activation_bytes``); costs a hook call per saved tensor.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int],
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
    ) -> None:
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target) (loss_fn: {loss_fn!r})")
        self.schedule = schedule
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_mode(checkpoint)
        self.virtual = virtual
        self.balance, self.devices, partitions = partition(
            module, balance, devices, virtual=virtual, deferred_batch_norm=deferred_batch_norm
        )
        self.partitions = nn.ModuleList(partitions)
        stage_devices = [self.devices[s % len(self.devices)] for s in range(len(partitions))]
        self._executor = LocalExecutor(stages_of(partitions, stage_devices, loss_fn), cpu_threads=cpu_threads)
        self.schedule_for(self.chunks)  # fail now, not at the first step, if the schedule can't be made
        self.measure_memory = measure_memory
        self.last_trace: StepTrace | None = None

    @functools.lru_cache(maxsize=16)  # noqa: B019 - a few (K, M) per pipeline
    def schedule_for(self, microbatches: int) -> Schedule:
        """The validated schedule for a mini-batch of ``microbatches`` micro-batches."""
        return make_schedule(self.schedule, len(self.devices), microbatches, self.virtual)

    def step(self, inputs: Any, target: Any) -> Tensor:
        """Forward and backward of one mini-batch; returns its mean loss (detached). Gradients are
        accumulated into the parameters' ``.grad``."""
        batches = scatter(inputs, self.chunks)
        targets = scatter(target, self.chunks)
        sizes = [_size(b) for b in batches]
        if [_size(t) for t in targets] != sizes:
            raise ValueError(
                f"inputs and target split into different micro-batches (inputs: {sizes}, "
                f"target: {[_size(t) for t in targets]}); give them the same size in dim 0"
            )
        last = self._executor.stages[self._executor.num_stages - 1]
        total = sum(sizes)
        with torch.enable_grad():
            ctx = StepContext.capture(
                num_microbatches=len(batches),
                checkpoint_stop=checkpoint_stop(self.checkpoint, len(batches)),
                training=self.training,
                seed=step_seed(),
                targets=[last.receive(t).value for t in targets],
                loss_scale=[n / total for n in sizes],
            )
            schedule = self.schedule_for(len(batches))
            run, losses = self._executor.step(schedule, batches, ctx, measure_memory=self.measure_memory)
        peak = tuple(run.meter.peak) if run.meter is not None else None
        self.last_trace = StepTrace(schedule, run.trace, peak)
        return torch.stack([b.value for b in losses]).sum()

    def forward(self, inputs: Any) -> Any:
        """The forwards only, without autograd, for evaluation; returns the gathered output."""
        batches = scatter(inputs, self.chunks)
        schedule = self.schedule_for(len(batches)).only(ActionKind.FORWARD)
        with torch.no_grad():
            ctx = StepContext.capture(
                num_microbatches=len(batches), checkpoint_stop=0, training=self.training, seed=step_seed()
            )
            _, outputs = self._executor.forward(schedule, batches, ctx)
        return gather(outputs)


def _size(batch: Batch) -> int:
    return next(batch.tensors()).size(0)
