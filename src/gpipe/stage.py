"""A stage (the paper's *cell*): consecutive layers on one device, run one micro-batch at a time.

A stage's forward of micro-batch ``m`` either keeps its activations for backward, or — when the
micro-batch is re-materialized — keeps only its input and runs the forward again in backward. Either
way the layers draw their random numbers from generators seeded by (step, global layer index,
micro-batch), so the forward and its recomputation see the same numbers whatever the partitioning.

Stages hold no per-step state: what a forward keeps for its backward is returned to the caller
(an executor), which hands it back to :meth:`Stage.backward`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.batchnorm import DeferredBatchNorm
from gpipe.checkpoint import checkpointing, recomputing
from gpipe.microbatch import Batch
from gpipe.rng import derive_seed, layer_randomness

__all__: list[str] = []

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class StepContext:
    """What every stage of one step needs to know, captured from the caller's thread."""

    seed: int
    num_microbatches: int
    checkpoint_stop: int
    grad_enabled: bool
    training: bool
    autocast: tuple[tuple[str, torch.dtype, bool], ...]

    @staticmethod
    def capture(*, num_microbatches: int, checkpoint_stop: int, training: bool, seed: int) -> StepContext:
        grad = torch.is_grad_enabled()
        autocast = tuple(
            (dt, torch.get_autocast_dtype(dt), torch.is_autocast_enabled(dt)) for dt in AUTOCAST_DEVICE_TYPES
        )
        stop = checkpoint_stop if grad and training else 0
        return StepContext(seed, num_microbatches, stop, grad, training, autocast)

    @contextmanager
    def applied(self, device: torch.device) -> Iterator[None]:
        """Enter the caller's autocast state (and the stage's CUDA device) on a worker thread."""
        with ExitStack() as stack:
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
            for device_type, dtype, enabled in self.autocast:
                if enabled or torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield


@dataclass
class Saved:
    """What a forward keeps for its backward: the input leaves, and the outputs unless the
    micro-batch is re-materialized."""

    inputs: Batch
    outputs: Batch | None


Grads = tuple[Tensor | None, ...]


class Stage:
    """Layers ``first .. first+len(module)-1`` of the model, placed on ``device``."""

    def __init__(self, index: int, module: nn.Sequential, first: int, device: torch.device) -> None:
        self.index = index
        self.module = module
        self.first = first
        self.device = device
        self._deferred_bn = [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]

    def __repr__(self) -> str:
        return f"Stage({self.index}, layers {self.first}..{self.first + len(self.module) - 1}, {self.device})"

    def receive(self, values: Any) -> Any:
        """Move a batch or a tuple of gradients onto this stage's device."""
        if isinstance(values, Batch):
            return values.map(self._to_device)
        return tuple(None if g is None else self._to_device(g) for g in values)

    def _to_device(self, t: Tensor) -> Tensor:
        # Asynchronous only towards a GPU: a copy to the CPU must be complete before it is read.
        return t.to(self.device, non_blocking=self.device.type == "cuda")

    def _run(self, m: int, batch: Batch, ctx: StepContext) -> Batch:
        value = batch.value
        for i, layer in enumerate(self.module):
            with layer_randomness(derive_seed(ctx.seed, self.first + i, m)):
                value = layer(value)
        return Batch.of(value)

    def _leaf(self, t: Tensor) -> Tensor:
        differentiable = t.is_floating_point() or t.is_complex()
        requires = t.requires_grad if self.index == 0 else differentiable
        return t.detach().requires_grad_(requires and differentiable)

    def forward(self, m: int, batch: Batch, ctx: StepContext) -> tuple[Batch, Saved | None]:
        """Forward of micro-batch ``m``. Returns the (detached) output and what backward needs."""
        if not ctx.grad_enabled:
            with torch.no_grad():
                return self._run(m, batch, ctx), None
        inputs = batch.map(self._leaf)
        if m < ctx.checkpoint_stop:
            with torch.no_grad(), checkpointing():
                return self._run(m, inputs, ctx), Saved(inputs, None)
        with torch.enable_grad():
            outputs = self._run(m, inputs, ctx)
        return outputs.map(Tensor.detach), Saved(inputs, outputs)

    def backward(self, m: int, saved: Saved, grads: Grads, ctx: StepContext) -> Grads:
        """Backward of micro-batch ``m`` given the gradients of its outputs; accumulates parameter
        gradients and returns the gradients of its inputs."""
        outputs = saved.outputs
        if outputs is None:
            with torch.enable_grad(), recomputing():
                outputs = self._run(m, saved.inputs, ctx)
        if len(grads) != len(outputs):
            raise RuntimeError(
                f"stage {self.index} got {len(grads)} gradients for {len(outputs)} outputs of micro-batch {m}"
            )
        pairs = [
            (o, g) for o, g in zip(outputs.values, grads) if isinstance(o, Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return tuple(v.grad if isinstance(v, Tensor) else None for v in saved.inputs.values)

    def finish_forwards(self) -> None:
        """All forwards of the step are done: fold the micro-batches' batch-norm statistics."""
        for bn in self._deferred_bn:
            bn.commit()


def stages_of(partitions: Sequence[nn.Sequential], devices: Sequence[torch.device]) -> list[Stage]:
    stages, first = [], 0
    for k, (part, device) in enumerate(zip(partitions, devices)):
        stages.append(Stage(k, part, first, device))
        first += len(part)
    return stages
