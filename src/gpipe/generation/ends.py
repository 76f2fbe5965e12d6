"""The ends of the layers :func:`gpipe.generation.traced.cached_layers` makes: what turns a decoding
step's input into the traced input and hands the step's 2-D mask from layer to layer
(:class:`_StepIn`, :class:`_StepOut`), the head's view of the last position alone
(:class:`_KeepLast`), and the input outside decoding completed as the model's forward completes it
(:func:`_completed`), for the layers traced with a mask or for packed rows (:data:`PACKED_INPUTS`).
See :mod:`gpipe.generation.traced`'s docstring for the whole."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, fx, nn

from gpipe.cache import LayerCache, layer_cache

__all__ = ["INPUTS", "PACKED_INPUTS"]

INPUTS = ("input_ids", "attention_mask", "position_ids")
"""The first layer's inputs outside decoding (the traced ones), in their order."""

PACKED_INPUTS = ("input_ids", "position_ids")
"""The first layer's inputs outside decoding where the layers are traced for packed rows
(``cached_layers(model, packed=True)``): no mask; the positions restart at each example."""

_step = threading.local()
"""Per thread: ``mask``, the 2-D mask of the step the current layer runs (None outside a step);
``open``, per block in its call, the transformers cache layer it extends and its LayerCache."""


def _positions(mask: Tensor) -> Tensor:
    """The positions ``generate`` gives a prompt: counted over its tokens, padding at 0."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


# -- the layers' ends ---------------------------------------------------------------------------------
def _add_ends(layer: nn.Module, first: bool, last: bool, packed: bool = False) -> None:
    """Put a :class:`_StepIn` before the layer's code and a :class:`_StepOut` after it, as calls of
    modules in its graph (``_gpipe.step_in``, ``_gpipe.step_out``): copies of the layer
    (``copy.deepcopy``, pickling) keep them, where a GraphModule's copy would drop forward hooks."""
    assert isinstance(layer, fx.GraphModule)
    graph = layer.graph
    entry = next(n for n in graph.nodes if n.op == "placeholder")
    end = next(n for n in graph.nodes if n.op == "output")
    layer.add_submodule("_gpipe.step_in", _StepIn(first, packed))
    layer.add_submodule("_gpipe.step_out", _StepOut(last))
    with graph.inserting_after(entry):
        step_in = graph.call_module("_gpipe.step_in", (entry,))
    entry.replace_all_uses_with(step_in, delete_user_cb=lambda user: user is not step_in)
    with graph.inserting_before(end):
        step_out = graph.call_module("_gpipe.step_out", (end.args[0],))
    end.args = (step_out,)
    layer.recompile()


def _keep_last_before_head(model: nn.Module, layer: nn.Module) -> None:
    """In a step, let the output head see the last position only, as ``generate`` has it
    (``logits_to_keep=1``): a ``_gpipe.keep_last`` module before the head's ``linear`` in the last
    layer's graph. Where no such ``linear`` is found, a step's logits are every new position's."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    weight = getattr(output_embeddings() if callable(output_embeddings) else None, "weight", None)
    if not isinstance(layer, fx.GraphModule) or not isinstance(weight, Tensor):
        return
    graph = layer.graph
    fetched = [n for n in graph.nodes if n.op == "get_attr" and _attribute(layer, str(n.target)) is weight]
    uses = [u for n in fetched for u in n.users if u.target is torch.ops.aten.linear.default and u.args[1] is n]
    if len(uses) != 1:
        return
    (linear,) = uses
    layer.add_submodule("_gpipe.keep_last", _KeepLast())
    with graph.inserting_before(linear):
        kept = graph.call_module("_gpipe.keep_last", (linear.args[0],))
    linear.args = (kept, *linear.args[1:])
    layer.recompile()


def _attribute(layer: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    try:
        return getattr(layer.get_submodule(owner) if owner else layer, name)
    except AttributeError:
        return None


class _KeepLast(nn.Module):
    """The last position of the hidden states ``(rows, positions, hidden)`` in a step; all of them
    outside decoding."""

    def forward(self, x: Tensor) -> Tensor:
        return x[:, -1:] if getattr(_step, "mask", None) is not None else x


class _StepIn(nn.Module):
    """A layer's entry. Outside decoding: the first layer's input completed as the model's forward
    completes it. In a step: the first layer's step input turned into the traced input (this
    module's LayerCache keeps the 2-D mask so far and the last position, per row), or the 2-D mask
    taken off the values a later layer is handed, for its blocks. ``packed``: the layers were traced
    for packed rows (:data:`PACKED_INPUTS`)."""

    def __init__(self, first: bool, packed: bool = False) -> None:
        super().__init__()
        self.first, self.packed = first, packed

    def forward(self, x: Any) -> Any:
        kept = layer_cache(self)
        _step.mask = None
        if kept is None:
            return _completed(x, getattr(self, "packed", False)) if self.first else x
        if self.first:
            x, _step.mask = _step_input(kept, x)
            if getattr(self, "packed", False):  # (the blocks get the step's mask through their hooks)
                x = {k: v for k, v in x.items() if k != "attention_mask"}
        elif isinstance(x, tuple) and x and isinstance(x[-1], Tensor):
            x, _step.mask = x[:-1], x[-1]
        else:
            raise ValueError(
                f"a decoding step hands a layer {type(x).__name__}, where the layer before it hands on its values and "
                "the 2-D mask: run the layers of cached_layers in their order, each step from the first"
            )
        return x


class _StepOut(nn.Module):
    """A layer's exit in a step: the 2-D mask handed on after the layer's values; the last
    layer's logits."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.last = last

    def forward(self, output: Any) -> Any:
        mask = getattr(_step, "mask", None)
        if mask is None:
            return output
        _step.mask = None
        if self.last:
            return output["logits"] if isinstance(output, Mapping) else output[0]
        return (*output, mask)


def _completed(x: Any, packed: bool = False) -> Any:
    """The input outside decoding: ``input_ids`` alone, or a dict lacking the mask (ones) or the
    positions (0, 1, ... as the model's forward counts them without a cache), as the traced dict;
    for layers traced for packed rows, without the mask (one given is refused)."""
    if isinstance(x, Tensor):
        x = {"input_ids": x}
    if not isinstance(x, Mapping) or not isinstance(x.get("input_ids"), Tensor):
        return x  # the first layer's check names what does not fit
    ids = x["input_ids"]
    mask = x.get("attention_mask")
    positions = x.get("position_ids")
    if packed:
        if mask is not None:
            raise ValueError(
                "these layers are traced for packed rows (cached_layers(model, packed=True)): they take input_ids "
                "and position_ids that restart at each example, not an attention_mask; leave it out (padding "
                "after a row's last example is never attended to by it)"
            )
        if positions is None:
            positions = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
        rest = {k: v for k, v in x.items() if k not in INPUTS}
        return {"input_ids": ids, "position_ids": positions, **rest}
    if mask is None:
        mask = torch.ones_like(ids)
    if positions is None:
        positions = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
    rest = {k: v for k, v in x.items() if k not in INPUTS}
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **rest}


def _step_input(kept: LayerCache, x: Any) -> tuple[dict[str, Tensor], Tensor]:
    """The traced input for a step's new tokens, and the 2-D mask so far; the first layer keeps the
    mask and the last position per row."""
    if isinstance(x, Tensor):
        x = {"input_ids": x}
    if not isinstance(x, Mapping) or not isinstance(x.get("input_ids"), Tensor) or set(x) - {*INPUTS[:2]}:
        keys = list(x) if isinstance(x, Mapping) else type(x).__name__
        raise ValueError(
            f"a decoding step's input is the new tokens (rows, length), or a dict with 'input_ids' and optionally "
            f"'attention_mask' (got {keys}); positions are counted by the layers"
        )
    ids = x["input_ids"]
    new = x.get("attention_mask")
    if new is None:
        new = torch.ones_like(ids)
    if ids.dim() != 2 or new.shape != ids.shape:
        raise ValueError(
            f"a decoding step's input_ids are (rows, length) and its attention_mask alike (input_ids: "
            f"{tuple(ids.shape)}, attention_mask: {tuple(new.shape)})"
        )
    seen = kept.get("mask")
    if seen is None:  # the prefill: the prompts
        positions = _positions(new)
        whole = new.bool()
    else:
        if seen.shape[0] != ids.shape[0]:
            raise ValueError(
                f"a decoding step gives {ids.shape[0]} rows where the group's cache holds {seen.shape[0]}: keep the "
                "rows that go on with Cache.reorder(rows) before the step (beam search, finished sequences)"
            )
        last = kept.get("position")
        assert last is not None
        positions = last + 1 + torch.arange(ids.shape[1], device=last.device)
        whole = torch.cat([seen, new.to(seen.device, torch.bool)], dim=-1)
    kept.set("mask", whole)
    kept.set("position", positions[:, -1:])
    return {"input_ids": ids, "attention_mask": new, "position_ids": positions}, whole
