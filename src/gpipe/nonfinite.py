"""Non-finite values (NaN, Inf) in a training step of a :class:`gpipe.Pipeline`: the check after every
step (:func:`all_finite`: the loss and every gradient, agreed by the ranks), and, when it fails, the
step run again with every layer watched (:func:`locate`) to name where the first non-finite value
appeared: the layer (global index and class), its stage, rank and device, the micro-batch, forward or
backward.

The check reads each gradient once (``torch._foreach_norm``: a NaN or Inf anywhere makes its tensor's
norm non-finite, as does a norm beyond float32's range, over 1e19 an element), or none when the
caller has the gradients' norms already (to clip them), and, under torch.distributed, all-reduces one
flag; a step whose values are finite pays nothing else (benchmarks/faults.py: about 1% of a step).
:func:`locate` costs a second forward and backward of the step, with a check of every layer's output
and input gradient, and is only run after the check failed.

Since a step is a pure function of its seed, the weights and the batch, the step run again gives the
same values (the caller seeds it as it seeded the step); the pipeline's stages run their layers
through a watch that :func:`locate` sets (``Stage.watch``) and removes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_leaves

from gpipe.checkpoint import is_recomputing
from gpipe.distributed.devices import comm_device
from gpipe.distributed.failure import collective
from gpipe.shards import local

if TYPE_CHECKING:
    from gpipe.microbatch import Share
    from gpipe.pipeline import Pipeline
    from gpipe.runtime.stage import Stage

__all__ = ["NonFinite", "all_finite", "locate"]


@dataclass(frozen=True)
class NonFinite:
    """Where a non-finite value first appeared in a step. ``layer`` is the global index of the
    layer whose forward gave it (``direction`` "forward") or whose backward gave a gradient of its
    input or of one of its parameters ("backward"); the loss function counts as the layer after
    the last (``name`` "loss"). ``microbatch`` is None when only a parameter's gradient, summed over
    the micro-batches, showed it."""

    direction: str
    microbatch: int | None
    layer: int
    name: str
    stage: int
    rank: int
    device: str
    kind: str
    """``"NaN"`` or ``"Inf"``."""
    what: str = ""
    """In backward: ``"the gradient of its input"`` or of a named parameter."""

    def _order(self) -> tuple[int, int, int]:
        forward = self.direction == "forward"
        m = math.inf if self.microbatch is None else self.microbatch
        # forward first, in its order (micro-batch, then layer); backward runs from the last layer down
        return (0 if forward else 1, int(min(m, 2**31)), self.layer if forward else -self.layer)

    def __str__(self) -> str:
        where = f"rank {self.rank}, {self.device}" if dist.is_initialized() else self.device
        batch = "micro-batch unknown" if self.microbatch is None else f"micro-batch {self.microbatch}"
        what = f": {self.what}" if self.what else ""
        return (
            f"{self.kind} in the {self.direction} of layer {self.layer} ({self.name}) of stage {self.stage} "
            f"({where}), {batch}{what}"
        )


def _flag_device(pipe: Pipeline) -> torch.device:
    return comm_device(pipe.devices[0])


def all_finite(pipe: Pipeline, loss: float, *, norms: Sequence[float] | None = None) -> bool:
    """Whether ``loss`` and every gradient of ``pipe``'s parameters (of every rank) are finite.
    ``norms``: the gradients' norms, when the caller computed them anyway (for clipping): then no
    gradient is read again. Under torch.distributed every rank must call it after the step: one
    all-reduce of a flag."""
    bad = not math.isfinite(loss)
    if not bad and norms is not None:
        bad = not all(math.isfinite(n) for n in norms)
    elif not bad:
        by_device: dict[torch.device, list[Tensor]] = {}
        for p in pipe.parameters():
            if p.grad is not None:
                g = local(p.grad)
                by_device.setdefault(g.device, []).append(g)
        for grads in by_device.values():
            norms2 = torch._foreach_norm(grads, 2)  # (8x faster than ord=inf on CPU; NaN and Inf carry through)
            if not bool(torch.stack(norms2).isfinite().all()):
                bad = True
                break
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([int(bad)], device=_flag_device(pipe))
        with collective("all-reduce of the non-finite check"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag.item())
    return not bad


def _kind(value: Any) -> str | None:
    """``"NaN"``, ``"Inf"`` or None: the non-finite values among ``value``'s floating tensors."""
    found = None
    for t in _tensors(value):
        t = local(t.detach())
        if not bool(torch.isfinite(t).all()):
            if bool(torch.isnan(t).any()):
                return "NaN"
            found = "Inf"
    return found


def _tensors(value: Any) -> Iterator[Tensor]:
    try:
        leaves = tree_leaves(value)
    except Exception:  # (a structure pytree does not know: looked at as it is)
        leaves = [value]
    return (t for t in leaves if isinstance(t, Tensor) and t.is_floating_point())


class _Watch:
    """What :func:`locate` sets as every local stage's ``watch``: the first non-finite values seen."""

    def __init__(self) -> None:
        self.found: set[NonFinite] = set()
        self._lock = threading.Lock()
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def _record(self, stage: Stage, m: int | None, i: int, direction: str, kind: str, what: str = "") -> None:
        layers = len(stage.module)
        name = type(stage.module[i]).__name__ if i < layers else "loss"
        found = NonFinite(direction, m, stage.first + i, name, stage.index, self.rank, str(stage.device), kind, what)
        with self._lock:
            self.found.add(found)

    def __call__(self, stage: Stage, m: int, i: int, f: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def watched(value: Any) -> Any:
            for t in _tensors(value):
                if t.requires_grad:  # its gradient comes from this function's backward
                    t.register_hook(lambda g: self._backward(stage, m, i, g))  # type: ignore[no-untyped-call]
            out = f(value)
            if not is_recomputing() and (kind := _kind(out)) is not None:
                self._record(stage, m, i, "forward", kind)
            return out

        return watched

    def _backward(self, stage: Stage, m: int, i: int, grad: Tensor) -> None:
        if (kind := _kind(grad)) is not None:
            self._record(stage, m, i, "backward", kind, "the gradient of its input")

    def parameters(self, pipe: Pipeline) -> None:
        """Parameters whose summed gradient is not finite (when no activation's gradient showed it)."""
        for stage in pipe.engine.stages:
            for i, layer in enumerate(stage.module):
                for name, p in layer.named_parameters():
                    if p.grad is not None and (kind := _kind(p.grad)) is not None:
                        self._record(stage, None, i, "backward", kind, f"the gradient of its parameter {name!r}")


def locate(pipe: Pipeline, inputs: Any, target: Any, *, share: Share | None = None) -> NonFinite | None:
    """Run the step ``pipe.step(inputs, target, share=share)`` again with every layer watched, and
    return where its first non-finite value appeared (None: none did, so the first run's was not
    reproduced). The caller seeds the step as it seeded the first run, and restores what the first
    run changed besides the gradients (running statistics); the gradients of this run are left in
    ``.grad``. Under torch.distributed a collective: every rank calls it, and every rank gets the
    same answer."""
    watch = _Watch()
    stages = pipe.engine.stages
    for p in pipe.parameters():
        p.grad = None
    for stage in stages:
        stage.watch = watch
    try:
        pipe.step(inputs, target, share=share)
    finally:
        for stage in stages:
            stage.watch = None
    if not any(f.direction == "forward" or f.microbatch is not None for f in watch.found):
        watch.parameters(pipe)
    first = min(watch.found, key=NonFinite._order, default=None)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[NonFinite | None] = [None] * dist.get_world_size()
        with collective("gathering of where a non-finite value appeared"):
            dist.all_gather_object(everyone, first)
        first = min((f for f in everyone if f is not None), key=NonFinite._order, default=None)
    return first
