"""``gpipe.GPipe``: the autograd-driven front end, a drop-in for torchgpipe's ``GPipe``.

``GPipe(module, balance, chunks=M)`` cuts an ``nn.Sequential`` into partitions, places them on their
devices and, on each call, runs the forward half of the fill-drain schedule over M micro-batches. The
gathered output carries an autograd node whose backward runs the backward half of the same schedule,
so ``loss.backward()`` trains the pipeline like a plain module. The engine — stages, schedule IR,
executor — does the work; this module only adapts it to ``nn.Module`` and autograd.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from gpipe.checkpoint import Checkpoint, Selective, check_mode, checkpoint_stop, selective
from gpipe.distributed import Collectives
from gpipe.engine import Engine, build
from gpipe.microbatch import Batch, batch_size, concat, flatten, gather, scatter
from gpipe.rng import step_seed
from gpipe.runtime.context import Grads, StepContext
from gpipe.runtime.executor import Executor, StepRun
from gpipe.runtime.partition import as_balance, check_chunks
from gpipe.runtime.placement import Placement
from gpipe.runtime.planner import FixedPlanner
from gpipe.schedule import Schedule, make_schedule
from gpipe.sequential import as_layers
from gpipe.tied import Tie

__all__ = ["GPipe", "MovingPartitionError"]


class MovingPartitionError(TypeError):
    """Raised when a GPipe module is asked to move to another device."""


@functools.lru_cache(maxsize=64)
def _fill_drain(num_stages: int, num_microbatches: int) -> Schedule:
    return make_schedule("gpipe", num_stages, num_microbatches)


class GPipe(nn.Module):
    """Wraps an ``nn.Sequential`` (or any module, traced into layers) to train it with GPipe's
    pipeline parallelism.

    Args:
        module: the layers, in order; or any other module, traced into layers on ``sample`` by
            :func:`gpipe.to_sequential` (not in torchgpipe). Parameters that layers of different
            partitions share are tied: a copy on each, their gradients summed after backward.
        balance: the number of layers in each partition, e.g. ``[3, 2]``; or ``'auto'``: time each
            layer on ``sample`` and split exactly over ``devices`` (see :mod:`gpipe.balance`).
        devices: one device per partition (default: the CUDA devices, or ``'cpu'`` for every
            partition); a device may repeat. Several ``'cpu'`` partitions run concurrently, each
            with its share of the intra-op threads.
        chunks: the number of micro-batches M a mini-batch is split into.
        checkpoint: which micro-batches are re-materialized: ``'always'``, ``'except_last'`` or
            ``'never'``; or a :class:`gpipe.Selective` policy (not in torchgpipe): which layers, and
            which operators' outputs they keep.
        deferred_batch_norm: normalize each micro-batch with its own statistics but update the
            running statistics once per mini-batch (see :class:`gpipe.DeferredBatchNorm`).
        cpu_threads: intra-op threads for each partition on a CPU device (not in torchgpipe).
            By default the caller's threads are shared out among the CPU partitions. CPU kernels
            may sum in another order with another thread count, so fix this (e.g. to 1) for
            gradients bitwise identical across partition counts on CPU.
        sample: a mini-batch to trace a module that is not an ``nn.Sequential`` (on its first
            micro-batch), and to time the layers on for ``balance='auto'`` (not in torchgpipe).

    Example::

        model = nn.Sequential(a, b, c, d)
        model = GPipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=8)
        loss = criterion(model(x), y)
        loss.backward()
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | str | None = None,
        *,
        devices: Sequence[torch.device | str | int] | None = None,
        chunks: int = 1,
        checkpoint: Checkpoint = "except_last",
        deferred_batch_norm: bool = False,
        cpu_threads: int | None = None,
        sample: Any = None,
    ) -> None:
        super().__init__()
        # As torchgpipe: chunks through int() (42.0, '8'), checkpoint through str(), then checked.
        self.checkpoint = check_mode(checkpoint if isinstance(checkpoint, Selective) else str(checkpoint))
        self.chunks = _as_chunks(chunks)
        module = as_layers(module, sample, self.chunks)
        balance = as_balance(balance)  # (a NumPy array of counts: a list)
        if balance is None:
            raise ValueError(
                "balance is required: the number of layers of each partition, e.g. [2, 2]; or let "
                "gpipe.balance find one: balance_by_time(partitions, module, sample), or balance='auto' "
                "with sample=..."
            )
        if len(module) == 0 and isinstance(balance, Sequence) and not isinstance(balance, str) and not balance:
            # An empty module, as torchgpipe allows: no partitions, no devices; forward is the identity.
            none = Placement((), ())
            self.engine = Engine(none, Executor([], none), {}, [], [], [], Collectives(), FixedPlanner("gpipe", 0, 1))
        else:
            self.engine = build(
                module, balance, schedule="gpipe", chunks=self.chunks, loss_fn=None, devices=devices,
                cpu_threads=cpu_threads, deferred_batch_norm=deferred_batch_norm, sample=sample,
            )  # fmt: skip
        self.balance: list[int] = self.engine.balance
        if isinstance(self.checkpoint, Selective):
            self.checkpoint.check_layers(sum(self.balance))
        self.devices: list[torch.device] = self.engine.devices
        self.partitions = nn.ModuleList(self.engine.partitions[s] for s in sorted(self.engine.partitions))

    def __len__(self) -> int:
        return sum(self.balance)

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"layer index {index} out of range for {len(layers)} layers")
        return layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        for part in self.partitions:
            yield from cast(nn.Sequential, part)

    def cuda(self, device: Any = None) -> GPipe:
        raise MovingPartitionError(_MOVE_HINT)

    def cpu(self) -> GPipe:
        raise MovingPartitionError(_MOVE_HINT)

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        # Only dtype casts pass. A device (an int or str too) or a tensor is refused before torch parses
        # it: on a machine without that device torch would fail first, with another error than torchgpipe's.
        first = args[0] if args else None
        moving = isinstance(first, (torch.device, str, int, Tensor)) and not isinstance(first, bool)
        if moving or kwargs.get("device") is not None or "tensor" in kwargs:
            raise MovingPartitionError(_MOVE_HINT)
        return super().to(*args, **kwargs)

    def forward(self, input: Any) -> Any:
        """Run the mini-batch ``input`` through the pipeline: a tensor or any pytree (a tuple, a
        dict, ...; see :mod:`gpipe.microbatch`), whose tensors are split along dim 0. Returns the
        gathered output, with the structure the last layer gives; gradients reach every tensor of
        ``input`` that requires grad."""
        if not self.partitions:  # an empty module
            if not any(isinstance(v, Tensor) for v in flatten(input)[0]):
                raise TypeError(f"expected a tensor or a pytree of tensors (got {type(input).__name__})")
            return input
        batches = scatter(input, self.chunks)
        sizes = [batch_size(b) for b in batches]
        schedule = _fill_drain(len(self.partitions), len(batches))
        inputs, _ = flatten(input)
        needs_grad = [isinstance(v, Tensor) and v.requires_grad for v in inputs]
        with torch.set_grad_enabled(
            torch.is_grad_enabled() and (any(needs_grad) or any(p.requires_grad for p in self.parameters()))
        ):
            ctx = StepContext.capture(
                num_microbatches=len(batches),
                checkpoint_stop=checkpoint_stop(self.checkpoint, len(batches)),
                selective=selective(self.checkpoint),
                training=self.training,
                seed=step_seed(),
                shares=[n / sum(sizes) for n in sizes],  # (an auxiliary loss: weighted by the micro-batch's rows)
            )
        run, outputs = self.engine.executor.forward(schedule, batches, ctx)
        if not ctx.grad_enabled:
            return gather(outputs)
        backprop = _Backprop(self.engine.executor, schedule, run, outputs, inputs, needs_grad, self.engine.ties)
        phony = torch.empty(0, requires_grad=True)  # makes autograd call the backward half
        tensors = _PipelineBackward.apply(backprop, phony, *backprop.grad_inputs)  # type: ignore[no-untyped-call]
        return backprop.assemble(tensors)


def _as_chunks(chunks: Any) -> int:
    """``int(chunks)`` as torchgpipe takes it (42.0 and '8' are fine), then checked positive; a number
    with a fraction (2.5) is refused, where torchgpipe would quietly cut it to 2."""
    if isinstance(chunks, bool):
        return check_chunks(chunks)  # (refused: True is no number of micro-batches)
    try:
        number = int(chunks)
    except TypeError:
        raise TypeError(f"number of chunks must be a positive integer (chunks: {chunks!r})") from None
    except ValueError:
        raise ValueError(f"number of chunks must be a positive integer (chunks: {chunks!r})") from None
    if isinstance(chunks, float) and chunks != number:
        raise ValueError(f"number of chunks must be a whole number of micro-batches (chunks: {chunks!r})")
    return check_chunks(number)


_MOVE_HINT = (
    "GPipe places its partitions on their devices when it is built and does not move them; "
    "pass devices=[...] to GPipe instead"
)


class _Backprop:
    """The bridge between autograd and the backward half of a step."""

    def __init__(
        self,
        executor: Executor,
        schedule: Schedule,
        run: StepRun,
        outputs: list[Batch],
        inputs: tuple[Any, ...],
        needs_grad: list[bool],
        ties: Sequence[Tie],
    ) -> None:
        self.executor, self.schedule, self.run, self.outputs = executor, schedule, run, outputs
        self.ties = ties
        self.inputs = inputs
        self.grad_positions = [i for i, n in enumerate(needs_grad) if n]
        self.grad_inputs = [inputs[i] for i in self.grad_positions]
        self.tensor_positions = [i for i, v in enumerate(outputs[0].values) if isinstance(v, Tensor)]
        self.whole: Batch | None = None  # the gathered output, flat (by the autograd node's forward)

    def gathered(self) -> tuple[Tensor, ...]:
        self.whole = concat(self.outputs)
        return tuple(self.whole.values[i] for i in self.tensor_positions)

    def assemble(self, tensors: tuple[Tensor, ...]) -> Any:
        """The output's structure, with the tensors autograd's node returned in place of its leaves."""
        assert self.whole is not None, "assemble before gathered"
        values = list(self.whole.values)
        for i, t in zip(self.tensor_positions, tensors):
            values[i] = t
        return Batch(tuple(values), self.whole.spec).value

    def backward(self, grads: tuple[Tensor, ...]) -> list[Tensor | None]:
        per_mb: list[list[Tensor | None]] = [[None] * len(b) for b in self.outputs]
        for i, g in zip(self.tensor_positions, grads):
            sizes = [b.values[i].size(0) if b.values[i].dim() else 1 for b in self.outputs]
            parts = torch.split(g, sizes) if self.outputs[0].values[i].dim() else g.unbind(0)
            for m, part in enumerate(parts):
                per_mb[m][i] = part
        mb_grads: list[Grads] = [tuple(g) for g in per_mb]
        inline = any(s.device.type == "cuda" for s in self.executor.stages.values())
        input_grads = self.executor.backward(self.schedule, self.run, mb_grads, inline=inline)
        for tie in self.ties:  # (every stage's backward is done)
            tie.sync_grads()
        result: list[Tensor | None] = []
        for i in self.grad_positions:
            grads_i = [g[i] for g in input_grads]
            if all(p is None for p in grads_i):
                result.append(None)
                continue
            whole = self.inputs[i]
            if whole.dim() == 0:  # handed whole to every micro-batch: its gradient is their sum
                result.append(sum((p.to(whole.device) for p in grads_i if p is not None), torch.zeros_like(whole)))
                continue
            filled = [torch.zeros_like(c) if p is None else p for p, c in zip(grads_i, whole.chunk(len(grads_i)))]
            result.append(torch.cat(filled).to(whole.device))
        return result


class _PipelineBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, backprop: _Backprop, phony: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.backprop = backprop
        outputs = backprop.gathered()
        flags = backprop.outputs[0].grad_flags()
        needs = [flags[i] for i in backprop.tensor_positions]
        ctx.mark_non_differentiable(*(t for t, n in zip(outputs, needs) if not n))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        backprop: _Backprop | None = getattr(ctx, "backprop", None)
        if backprop is None:
            raise RuntimeError(
                "trying to backward through a GPipe output a second time: the pipeline's saved "
                "activations were freed by the first backward; run the forward again"
            )
        del ctx.backprop
        return (None, None, *backprop.backward(grads))
