"""Re-materialization (activation checkpointing) of a stage, per micro-batch.

In a re-materialized forward a stage keeps only its input; in backward it runs its forward again
(with the same random numbers, see :mod:`gpipe.rng`) and back-propagates through that. The mode picks
which micro-batches are re-materialized:

=============  =====================================================================
'always'       every micro-batch
'except_last'  all but the last one, whose backward comes right after its forward
'never'        none: every micro-batch keeps its activations until its backward
=============  =====================================================================

Nothing is re-materialized in eval mode or when autograd is off.

**Selective re-materialization.** ``checkpoint=`` also takes a :class:`Selective` policy, which
drops less than the whole stage — per layer, per operator, or both — on the micro-batches it names
(``microbatches='always'`` or ``'except_last'``)::

    Selective(layers={1, 2})                  # layers 1 and 2 recomputed whole, the others keep theirs
    Selective(layers=lambda i, layer: isinstance(layer, Block) and i % 2 == 0)
    Selective(save_ops="matmuls")             # every layer: keep matrix products and attention, recompute the rest
    Selective(save_ops={torch.ops.aten.mm.default, torch.ops.aten.addmm.default})
    Selective(save_ops=policy_fn)             # torch's policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy
    Selective(layers={3}, save_ops="matmuls", microbatches="except_last")

``layers`` picks the re-materialized layers (by global index — the position in the whole model —,
by type, or by a predicate on (index, layer); default: every layer); the others run with autograd as
under 'never'. ``save_ops`` is the per-operator policy inside a re-materialized layer: the outputs
of these ATen operators are kept from the forward, every other operator runs again in backward
(torch's selective activation checkpointing, ``torch.utils.checkpoint.create_selective_checkpoint_contexts``);
without it a re-materialized layer keeps nothing but its input. The preset ``'matmuls'`` keeps the
outputs of ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``addbmm``, ``_scaled_mm`` and ``_int_mm`` and
of every attention kernel (any ATen operator named ``*attention*``, e.g. what
``F.scaled_dot_product_attention`` dispatches to: ``_scaled_dot_product_flash_attention_for_cpu``,
``_scaled_dot_product_efficient_attention``, ...): the expensive products stay, the cheap elementwise
work, norms and dropout are recomputed. A loss function (the last stage of a :class:`gpipe.Pipeline`)
is never re-materialized. What a policy saves depends on the model: where the matrix products'
outputs are most of a layer's activations, keeping them saves little memory; and a language model's
output projection (logits, vocabulary-sized) is better left out (``layers=Block``), since the loss
keeps its own log-softmax beside them. A layer that changes a kept output in place (``ReLU(inplace=True)``
after a Linear) is refused at its recomputation: the kept value is no longer the one its backward needs.

How it runs: a selectively re-materialized micro-batch records the stage's *tape* (each layer's
input a fresh autograd leaf, as a split backward does); a re-materialized layer runs with what
autograd would save dropped (and, with ``save_ops``, the kept operators' outputs stored). Backward
walks the tape from the last layer: each re-materialized layer is recomputed (seeded alike,
``is_recomputing()`` true, running statistics restored) right before its own backward — B frees
its recomputation after that layer's backward; a split backward recomputes it in I and W uses the
same graph — so the forward is recomputed once, one layer at a time. Results equal 'never''s (the
same kernels run; dropout's random numbers are replayed). ``measure_memory=True`` counts what the
policy keeps: the kept layers' saved tensors, the re-materialized layers' inputs and kept outputs,
and each layer's recomputation while it lives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = [
    "CHECKPOINT_MODES",
    "MATMUL_OPS",
    "SAVE_OPS_PRESETS",
    "Selective",
    "checkpoint_stop",
    "is_checkpointing",
    "is_recomputing",
    "keep_matmuls",
]

CHECKPOINT_MODES = ("always", "except_last", "never")

# The ATen matrix products whose outputs the 'matmuls' preset keeps (attention kernels besides).
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "_int_mm"})

_local = threading.local()

LayerSelector = Callable[[int, nn.Module], bool] | Collection[int | type[nn.Module]]
PolicyFn = Callable[..., CheckpointPolicy | bool]


def _is_attention(name: str) -> bool:
    return "attention" in name and "backward" not in name


_KEEP: dict[Any, CheckpointPolicy] = {}


def keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``'matmuls'`` preset as a torch policy function: keep the outputs of ATen's matrix
    products (:data:`MATMUL_OPS`) and attention kernels, recompute the rest."""
    found = _KEEP.get(op)
    if found is None:
        name = op.name() if isinstance(op, torch._ops.OpOverload) else ""  # type: ignore[no-untyped-call]
        space, _, rest = name.partition("::")
        keep = space == "aten" and (rest.split(".")[0] in MATMUL_OPS or _is_attention(rest))
        found = _KEEP[op] = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return found


SAVE_OPS_PRESETS: dict[str, PolicyFn] = {"matmuls": keep_matmuls}


def _op_set_policy(ops: frozenset[Any]) -> PolicyFn:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _describe(value: object) -> str:
    return f"{value!r} of type {type(value).__name__}"


@dataclass(frozen=True, kw_only=True)
class Selective:
    """A selective re-materialization policy, for ``checkpoint=`` of :class:`gpipe.Pipeline` and
    :class:`gpipe.GPipe` (see the module's docstring).

    Args:
        layers: which layers are re-materialized: global layer indices and/or layer types (a set,
            a list, ...), or a predicate ``(index, layer) -> bool``; default (``None``): every layer.
        save_ops: inside a re-materialized layer, the ATen operators whose outputs are kept (a
            collection of ``OpOverload`` such as ``torch.ops.aten.mm.default``), the preset
            ``'matmuls'`` (matrix products and attention), or torch's ``policy_fn(ctx, op, *args,
            **kwargs)`` returning a ``CheckpointPolicy`` (or a bool, True to keep); default
            (``None``): nothing is kept, the layer is recomputed whole.
        microbatches: ``'always'`` (every micro-batch) or ``'except_last'`` (all but the last).
    """

    layers: LayerSelector | None = None
    save_ops: str | Collection[Any] | PolicyFn | None = None
    microbatches: str = "always"
    _policy: PolicyFn | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.microbatches not in ("always", "except_last"):
            hint = "; to keep every activation pass checkpoint='never'" if self.microbatches == "never" else ""
            raise ValueError(
                f"Selective(microbatches=...) is 'always' or 'except_last' (microbatches: {self.microbatches!r}){hint}"
            )
        if self.layers is None and self.save_ops is None:
            raise ValueError(
                "Selective() names neither layers= nor save_ops=, so it would re-materialize everything as "
                "checkpoint='always' does: give layers={...} (the layers to re-materialize) and/or "
                "save_ops='matmuls' (the operators whose outputs are kept)"
            )
        object.__setattr__(self, "layers", _check_layers(self.layers))
        save_ops, policy = _check_save_ops(self.save_ops)
        object.__setattr__(self, "save_ops", save_ops)
        object.__setattr__(self, "_policy", policy)

    def selects(self, index: int, layer: nn.Module) -> bool:
        """Whether layer ``index`` (its global index) is re-materialized."""
        chosen = self.layers
        if chosen is None:
            return True
        if callable(chosen):
            return bool(chosen(index, layer))
        return any(isinstance(layer, c) if isinstance(c, type) else c == index for c in chosen)

    def contexts(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any] | None]:
        """For one re-materialized layer call: the context of its forward and that of its
        recomputation (``None``: nothing was kept, recompute plainly)."""
        if self._policy is None:
            return nullcontext(), None
        forward, recompute = create_selective_checkpoint_contexts(self._policy)  # type: ignore[no-untyped-call]
        return forward, recompute

    def check_layers(self, count: int) -> None:
        """Refuse layer indices beyond a model of ``count`` layers."""
        if self.layers is None or callable(self.layers):
            return
        beyond = sorted(i for i in self.layers if isinstance(i, int) and i >= count)
        if beyond:
            raise ValueError(
                f"Selective(layers=...) names layers {beyond}, but the model has {count} layers (0..{count - 1})"
            )


def _check_layers(layers: object) -> Any:
    if isinstance(layers, type) and issubclass(layers, nn.Module):  # one type: its layers
        return frozenset({layers})
    if layers is None or (callable(layers) and not isinstance(layers, type)):
        return layers
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Collection):
        raise TypeError(
            f"Selective(layers=...) takes layer indices, layer types or a predicate (index, layer) -> bool "
            f"(layers: {_describe(layers)})"
        )
    for c in layers:
        if isinstance(c, bool) or not (
            (isinstance(c, int) and c >= 0) or (isinstance(c, type) and issubclass(c, nn.Module))
        ):
            raise TypeError(
                f"Selective(layers=...) takes global layer indices >= 0 and nn.Module types (got {_describe(c)}); "
                "for another choice pass a predicate (index, layer) -> bool"
            )
    if not layers:
        raise ValueError(
            "Selective(layers=set()) re-materializes no layer; to keep every activation pass checkpoint='never'"
        )
    return frozenset(layers)


def _check_save_ops(save_ops: object) -> tuple[Any, PolicyFn | None]:
    if save_ops is None:
        return None, None
    if isinstance(save_ops, str):
        if save_ops not in SAVE_OPS_PRESETS:
            raise ValueError(
                f"unknown Selective(save_ops=...) preset {save_ops!r}; choose "
                f"{' or '.join(map(repr, SAVE_OPS_PRESETS))}, or give ATen operators (torch.ops.aten.mm.default, "
                "...) or a policy_fn"
            )
        return save_ops, SAVE_OPS_PRESETS[save_ops]
    if isinstance(save_ops, Collection):
        for op in save_ops:
            if not isinstance(op, torch._ops.OpOverload):
                hint = (
                    f"; pick an overload, e.g. {op}.default"
                    if isinstance(op, torch._ops.OpOverloadPacket)
                    else " such as torch.ops.aten.mm.default"
                )
                raise TypeError(f"Selective(save_ops=...) takes ATen OpOverloads (got {_describe(op)}){hint}")
        ops = frozenset(save_ops)
        return ops, _op_set_policy(ops)
    if callable(save_ops):
        return save_ops, save_ops
    raise TypeError(
        f"Selective(save_ops=...) takes 'matmuls', a collection of OpOverloads or a policy_fn(ctx, op, *args, "
        f"**kwargs) (save_ops: {_describe(save_ops)})"
    )


Checkpoint = str | Selective


def check_mode(mode: object) -> Checkpoint:
    if isinstance(mode, Selective):
        return mode
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint is not one of 'always', 'except_last', or 'never' (checkpoint: {mode!r}); "
            "for selective re-materialization pass gpipe.Selective(layers=..., save_ops=...)"
        )
    return str(mode)


def checkpoint_stop(mode: Checkpoint, chunks: int) -> int:
    """Micro-batches ``0 .. stop-1`` are re-materialized."""
    if isinstance(mode, Selective):
        mode = mode.microbatches
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[str(check_mode(mode))]


def selective(mode: Checkpoint) -> Selective | None:
    """The policy of a selective mode, ``None`` for the plain ones."""
    return mode if isinstance(mode, Selective) else None


def is_checkpointing() -> bool:
    """True inside a forward whose activations are dropped, to be recomputed in backward."""
    return bool(getattr(_local, "checkpointing", False))


def is_recomputing() -> bool:
    """True inside the recomputation of a forward during backward.

    A layer with side effects in forward (a running-statistics update, say) skips them here, so
    that they happen once per micro-batch::

        if not gpipe.is_recomputing():
            self.counter += 1
    """
    return bool(getattr(_local, "recomputing", False))


@contextmanager
def _flag(name: str) -> Iterator[None]:
    before = getattr(_local, name, False)
    setattr(_local, name, True)
    try:
        yield
    finally:
        setattr(_local, name, before)


def checkpointing() -> AbstractContextManager[None]:
    return _flag("checkpointing")


def recomputing() -> AbstractContextManager[None]:
    return _flag("recomputing")
