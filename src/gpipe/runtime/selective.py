"""Selective re-materialization of a stage (:class:`gpipe.Selective`): a forward that drops the
graph of some layers (or keeps only some operators' outputs in them), and their recomputation, one
layer at a time, in backward.

The forward records the stage's tape, as for a split backward (each layer's input a fresh autograd
leaf): a kept layer runs as under 'never'; a re-materialized one runs with autograd on (so that
its outputs know which need a gradient) under ``saved_tensors_hooks`` that drop what autograd would
save, and, with ``save_ops``, under torch's selective-checkpoint forward context, which stores the
kept operators' outputs. Before the backward of such a layer, :func:`recompute` runs it again on its
kept input leaf — seeded as the forward was, ``is_recomputing()`` true, its running statistics put
back — under the matching recomputation context (kept outputs handed back instead of recomputed),
and puts the new graph on the tape. B (:func:`backward`) then walks the tape back, freeing each
recomputation after its layer's backward; a split backward's I recomputes every such layer first,
and W reuses the graphs, so nothing is recomputed twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gpipe import memory, skip
from gpipe.checkpoint import Selective, checkpointing, recomputing
from gpipe.microbatch import Batch
from gpipe.runtime.context import Grads, Saved, StepContext, leaf, pairs, settled
from gpipe.runtime.hooks import _PartitionCall
from gpipe.runtime.inplace import _InPlace

__all__ = ["backward", "forward", "recompute_all", "selection"]


class Stage(Protocol):
    """What this module uses of a :class:`gpipe.runtime.stage.Stage`."""

    module: nn.Sequential
    first: int
    _in_place: _InPlace
    _selection: tuple[Selective, frozenset[int]] | None

    def _call(self, i: int, layer: Callable[[Any], Any], value: Any, m: int, ctx: StepContext) -> Any: ...
    def _where(self, i: int) -> str: ...
    def _layers(self, m: int, ctx: StepContext, call: _PartitionCall | None = None) -> list[Callable[[Any], Any]]: ...
    def _partition_call(self) -> _PartitionCall | None: ...
    def _stats_at(self, i: int) -> list[Tensor]: ...


def _drop(t: Tensor) -> None:
    return None


def _dropped(_: None) -> Tensor:
    raise RuntimeError("gpipe: the graph of a re-materialized layer was used before its recomputation")


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    else:
        found = getattr(value, "val", None)  # torch's wrapper of a kept output (its version checked)
        if isinstance(found, Tensor):
            yield found


def _kept_outputs(context: object) -> Iterator[Tensor]:
    """The operator outputs a selective-checkpoint forward context kept (in its ``storage``)."""
    yield from _tensors(getattr(context, "storage", {}))


def selection(stage: Stage, policy: Selective) -> frozenset[int]:
    """The positions of ``stage``'s layers that ``policy`` re-materializes (learned once per policy)."""
    known = stage._selection
    if known is not None and known[0] is policy:
        return known[1]
    chosen = frozenset(i for i, layer in enumerate(stage.module) if policy.selects(stage.first + i, layer))
    stage._selection = (policy, chosen)
    return chosen


def _step(
    stage: Stage, i: int, layer: Callable[[Any], Any], leaves: Batch, m: int, ctx: StepContext, around: Any
) -> Batch:
    """Call the ``i``-th function on the tape's ``leaves`` (inside ``around``), as a taped forward does."""
    fed, token = stage._in_place.feed(i, ctx.training, leaves)
    skips = fed.skip_items()
    before = skip.enter(skips)
    try:
        with around:
            value = stage._call(i, layer, fed.value, m, ctx)
    finally:
        skip.leave(before)
    stage._in_place.check(i, ctx.training, leaves, fed, token, functools.partial(stage._where, i))
    return settled(Batch.of(value).with_skips(skips) if skips or fed.skips else Batch.of(value))


class _Dropping:
    """Around a re-materialized layer's forward: the flag layers see, autograd's saving dropped,
    and the policy's forward context (which keeps the chosen operators' outputs)."""

    def __init__(self, keeping: AbstractContextManager[Any]) -> None:
        self._contexts = (checkpointing(), torch.autograd.graph.saved_tensors_hooks(_drop, _dropped), keeping)

    def __enter__(self) -> None:
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self._contexts):
            c.__exit__(*exc)


def forward(
    stage: Stage, m: int, inputs: Batch, ctx: StepContext, policy: Selective, selected: frozenset[int]
) -> tuple[Batch, Saved]:
    """The forward of micro-batch ``m`` re-materializing the layers at ``selected``; returns the
    output (with its graph) and what backward needs."""
    call = stage._partition_call()
    layers = stage._layers(m, ctx, call)
    tape: list[tuple[Batch, Batch]] = []
    saved = Saved(inputs, None, tape, layers=layers)
    state = inputs
    try:
        for i, layer in enumerate(layers):
            leaves = state.map(leaf) if i else state
            if i in selected:
                keeping, again = policy.contexts()
                state = _step(stage, i, layer, leaves, m, ctx, _Dropping(keeping))
                if any(t.requires_grad for t in state.tensors()):
                    saved.recompute[i] = again
                    memory.keep(leaves.tensors())
                    memory.keep(_kept_outputs(keeping))
            else:
                state = _step(stage, i, layer, leaves, m, ctx, nullcontext())
            tape.append((leaves, state))
    except Exception:
        if call is not None:
            call.failed()
        raise
    saved.outputs = state
    return state, saved


def _recompute(stage: Stage, j: int, m: int, saved: Saved, ctx: StepContext) -> None:
    """Run the re-materialized layer ``j`` again, putting its graph on the tape."""
    assert saved.tape is not None and saved.layers is not None
    again = saved.recompute.pop(j)
    leaves, _ = saved.tape[j]
    # The forward already updated the layer's running statistics; the recomputation must not again.
    stats = [(t, t.clone()) for t in stage._stats_at(j)] if ctx.training else []
    try:
        with torch.enable_grad(), recomputing():
            state = _step(stage, j, saved.layers[j], leaves, m, ctx, again or nullcontext())
    except RuntimeError as exc:
        if "selective activation checkpoint has been mutated" not in str(exc):
            raise
        raise RuntimeError(
            f"{stage._where(j)} changes in place the output of an operator that Selective(save_ops=...) keeps, "
            "so the kept value is not the one its backward needs: leave that operator out of save_ops, or make "
            "the change out of place (e.g. inplace=False)"
        ) from exc
    finally:
        for t, before in stats:  # (through .data: see Stage._recompute)
            t.data.copy_(before)
    saved.tape[j] = (leaves, state)


def _handed_back(saved: Saved, j: int) -> None:
    """The recomputation of layer ``j`` takes back the outputs its forward kept: they stop being
    counted as kept (those its graph saves are counted again, the others are freed)."""
    memory.forget(_kept_outputs(saved.recompute[j]))


def recompute_all(stage: Stage, m: int, saved: Saved, ctx: StepContext) -> None:
    """Before a split backward's I: recompute every re-materialized layer (W reuses the graphs)."""
    for j in sorted(saved.recompute, reverse=True):
        _handed_back(saved, j)
        _recompute(stage, j, m, saved, ctx)


def _grads_of(leaves: Batch) -> Grads:
    return tuple(v.grad if isinstance(v, Tensor) and v.requires_grad else None for v in leaves.values)


def backward(stage: Stage, m: int, saved: Saved, grads: Grads, ctx: StepContext) -> Grads:
    """Full backward (B) along the tape: each layer's backward, a re-materialized one's right after
    its recomputation (which is freed then)."""
    tape = saved.tape
    assert tape is not None
    while tape:
        j = len(tape) - 1
        recomputed = j in saved.recompute
        if recomputed:
            _handed_back(saved, j)
        with memory.transient() if recomputed else nullcontext():
            if recomputed:
                _recompute(stage, j, m, saved, ctx)
            leaves, outputs = tape.pop()
            outs, gs = pairs(outputs, grads)
            if outs:
                torch.autograd.backward(outs, gs)
            del outs, outputs
        grads = _grads_of(leaves)
    saved.tape = None
    return grads
