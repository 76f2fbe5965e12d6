"""A stage (the paper's *cell*): consecutive layers on one device, run one micro-batch at a time.

A stage's forward of micro-batch ``m`` either keeps its activations for backward, or — when the
micro-batch is re-materialized — keeps only its input and runs the forward again in backward. Either
way the layers draw their random numbers from generators seeded by (step, global layer index,
micro-batch), so the forward and its recomputation see the same numbers whatever the partitioning.

Backward comes whole (B: input and weight gradients in one pass) or split (I, then W). For a split
backward the forward records a *tape*: every layer's input is a fresh autograd leaf, so I can walk
the layers back computing input gradients only, keeping each layer's output gradient, and W later
computes each layer's weight gradients from them. The split is exact at layer boundaries (W does not
redo I's work); a re-materialized micro-batch is recomputed once, by I.

The last stage may compute the loss: ``loss_fn(output, target)`` per micro-batch, scaled by the
micro-batch's share of the mini-batch, so that the gradients are those of the mini-batch's mean loss.

Stages hold no per-step state: what a forward keeps for its backward is returned to the caller
(an executor), which hands it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gpipe import skip
from gpipe.batchnorm import DeferredBatchNorm
from gpipe.checkpoint import checkpointing, recomputing
from gpipe.microbatch import Batch
from gpipe.rng import derive_seed, layer_randomness

__all__: list[str] = []

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")

LossFn = Callable[[Any, Any], Tensor]


@dataclass(frozen=True)
class StepContext:
    """What every stage of one step needs to know, captured from the caller's thread."""

    seed: int
    num_microbatches: int
    checkpoint_stop: int
    grad_enabled: bool
    training: bool
    autocast: tuple[tuple[str, torch.dtype, bool], ...]
    targets: Sequence[Any] | None = None
    loss_scale: Sequence[float] | None = None

    @staticmethod
    def capture(
        *,
        num_microbatches: int,
        checkpoint_stop: int,
        training: bool,
        seed: int,
        targets: Sequence[Any] | None = None,
        loss_scale: Sequence[float] | None = None,
    ) -> StepContext:
        grad = torch.is_grad_enabled()
        autocast = tuple(
            (dt, torch.get_autocast_dtype(dt), torch.is_autocast_enabled(dt)) for dt in AUTOCAST_DEVICE_TYPES
        )
        stop = checkpoint_stop if grad and training else 0
        return StepContext(seed, num_microbatches, stop, grad, training, autocast, targets, loss_scale)

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


Grads = tuple[Tensor | None, ...]


@dataclass
class Saved:
    """What a forward keeps for its backward.

    ``inputs``: the stage's input leaves. ``outputs``: the outputs with their autograd graph, unless
    re-materialized. ``tape``: for a split backward, each layer's (input leaves, outputs).
    ``output_grads``: after I, each taped layer's output gradients, for W.
    """

    inputs: Batch
    outputs: Batch | None
    tape: list[tuple[Batch, Batch]] | None = None
    output_grads: list[Grads] = field(default_factory=list)


def _leaf(t: Tensor) -> Tensor:
    differentiable = t.is_floating_point() or t.is_complex()
    return t.detach().requires_grad_(differentiable)


def _pairs(outputs: Batch, grads: Grads) -> tuple[list[Tensor], list[Tensor]]:
    outs, gs = [], []
    for o, g in zip(outputs.values, grads):
        if isinstance(o, Tensor) and o.requires_grad and g is not None:
            outs.append(o)
            gs.append(g)
    return outs, gs


class Stage:
    """Layers ``first .. first+len(module)-1`` of the model, placed on ``device``."""

    def __init__(
        self, index: int, module: nn.Sequential, first: int, device: torch.device, loss_fn: LossFn | None = None
    ) -> None:
        self.index = index
        self.module = module
        self.first = first
        self.device = device
        self.loss_fn = loss_fn
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

    def _layers(self, m: int, ctx: StepContext) -> list[Callable[[Any], Any]]:
        """The stage's functions for micro-batch ``m``: its layers, then the loss if it has one."""
        layers: list[Callable[[Any], Any]] = list(self.module)
        if self.loss_fn is not None and ctx.targets is not None:
            loss_fn, target = self.loss_fn, ctx.targets[m]
            scale = ctx.loss_scale[m] if ctx.loss_scale is not None else 1.0

            def loss(value: Any) -> Tensor:
                out = loss_fn(value, target)
                if not isinstance(out, Tensor) or out.dim() != 0:
                    shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                    raise TypeError(f"loss_fn must return a scalar tensor (got {shape}); reduce it with a mean")
                return out * scale

            layers.append(loss)
        return layers

    def _run(self, m: int, batch: Batch, ctx: StepContext, tape: list[tuple[Batch, Batch]] | None = None) -> Batch:
        """Run the layers on ``batch``; the skip connections it carries are stashed and popped on
        the way, and those still open leave with the output."""
        state = batch
        for i, layer in enumerate(self._layers(m, ctx)):
            if tape is not None and i:
                state = state.map(_leaf)
            leaves = state
            with layer_randomness(derive_seed(ctx.seed, self.first + i, m)), skip.scope(state.skip_items()) as skips:
                value = layer(state.value)
            state = Batch.of(value).with_skips(skips) if skips or state.skips else Batch.of(value)
            if tape is not None:
                tape.append((leaves, state))
        return state

    def _input_leaf(self, t: Tensor) -> Tensor:
        differentiable = t.is_floating_point() or t.is_complex()
        requires = t.requires_grad if self.index == 0 else differentiable
        return t.detach().requires_grad_(requires and differentiable)

    def forward(self, m: int, batch: Batch, ctx: StepContext, *, split: bool = False) -> tuple[Batch, Saved | None]:
        """Forward of micro-batch ``m``. Returns the (detached) output and what backward needs;
        ``split`` records the tape a split backward (I, W) needs."""
        if not ctx.grad_enabled:
            with torch.no_grad():
                return self._run(m, batch, ctx), None
        inputs = batch.map(self._input_leaf)
        if m < ctx.checkpoint_stop:
            with torch.no_grad(), checkpointing():
                return self._run(m, inputs, ctx), Saved(inputs, None)
        tape: list[tuple[Batch, Batch]] | None = [] if split else None
        with torch.enable_grad():
            outputs = self._run(m, inputs, ctx, tape)
        return outputs.map(Tensor.detach), Saved(inputs, outputs, tape)

    def _recompute(self, m: int, saved: Saved, ctx: StepContext, *, split: bool) -> Batch:
        tape: list[tuple[Batch, Batch]] | None = [] if split else None
        with torch.enable_grad(), recomputing():
            outputs = self._run(m, saved.inputs, ctx, tape)
        saved.outputs, saved.tape = outputs, tape
        return outputs

    def _check_grads(self, m: int, grads: Grads, outputs: Batch) -> None:
        if len(grads) != len(outputs):
            raise RuntimeError(
                f"stage {self.index} got {len(grads)} gradients for {len(outputs)} outputs of micro-batch {m}"
            )

    def backward(self, m: int, saved: Saved, grads: Grads, ctx: StepContext) -> Grads:
        """Full backward (B) of micro-batch ``m`` given the gradients of its outputs: accumulates
        parameter gradients and returns the gradients of its inputs."""
        outputs = saved.outputs if saved.outputs is not None else self._recompute(m, saved, ctx, split=False)
        self._check_grads(m, grads, outputs)
        outs, gs = _pairs(outputs, grads)
        if outs:
            torch.autograd.backward(outs, gs)
        return tuple(v.grad if isinstance(v, Tensor) else None for v in saved.inputs.values)

    def backward_input(self, m: int, saved: Saved, grads: Grads, ctx: StepContext) -> Grads:
        """Input-gradient backward (I): walks the tape back computing only input gradients, and keeps
        each layer's output gradients for :meth:`backward_weight`."""
        if saved.tape is None:
            self._recompute(m, saved, ctx, split=True)
        assert saved.tape is not None and saved.outputs is not None
        self._check_grads(m, grads, saved.outputs)
        per_layer: list[Grads] = []
        for leaves, outputs in reversed(saved.tape):
            per_layer.append(grads)
            outs, gs = _pairs(outputs, grads)
            wanted = [v for v in leaves.values if isinstance(v, Tensor) and v.requires_grad]
            found = iter(
                torch.autograd.grad(outs, wanted, gs, retain_graph=True, allow_unused=True) if outs and wanted else ()
            )
            grads = tuple(
                next(found, None) if isinstance(v, Tensor) and v.requires_grad else None for v in leaves.values
            )
        saved.output_grads = per_layer[::-1]
        return grads

    def backward_weight(self, m: int, saved: Saved) -> None:
        """Weight-gradient backward (W), after :meth:`backward_input` of the same micro-batch."""
        assert saved.tape is not None, "W before I"
        layers = list(self.module)
        for j, ((_, outputs), grads) in enumerate(zip(saved.tape, saved.output_grads)):
            params = [p for p in layers[j].parameters() if p.requires_grad] if j < len(layers) else []
            outs, gs = _pairs(outputs, grads)
            if params and outs:
                torch.autograd.backward(outs, gs, inputs=params)
        saved.tape = None
        saved.output_grads = []

    def finish_forwards(self) -> None:
        """All forwards of the step are done: fold the micro-batches' batch-norm statistics."""
        for bn in self._deferred_bn:
            bn.commit()


def stages_of(
    partitions: Sequence[nn.Sequential], devices: Sequence[torch.device], loss_fn: LossFn | None = None
) -> list[Stage]:
    stages, first = [], 0
    for k, (part, device) in enumerate(zip(partitions, devices)):
        stages.append(Stage(k, part, first, device, loss_fn if k == len(partitions) - 1 else None))
        first += len(part)
    return stages
