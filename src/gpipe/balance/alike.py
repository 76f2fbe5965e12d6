"""Which layers cost the same: a key equal for layers whose forward and backward on the meta device
run the same operators on the same shapes, so that :func:`~gpipe.balance.profile.layer_costs`
counts one of them and answers the others (a language model's decoder blocks, traced or not).

Two layers get the same :func:`fingerprint` when:

- their modules, in order, are of the same classes (any ``torch.fx.GraphModule`` counts as one
  class, its graph compared instead), with parameters and buffers of the same names, shapes,
  strides, dtypes and devices, each requiring grad or not alike (a LoRA's frozen weights need no
  weight gradient);
- their other attributes are equal: numbers, strings, flags and tuples of them by value, anything
  else (a shared config, a function) by identity. Left out: the index a block keeps for its
  key/value cache (``layer_idx``, transformers' convention: the layers here run without a cache)
  and how gpipe materializes a layer (``gpipe_init``: its weights' source);
- a ``GraphModule``'s graph calls the same functions and methods, in the same order, on the same
  arguments, and its modules by their place in the layer (``model.layers.3`` in one is
  ``model.layers.4`` in the other).

A module with a hook gets no key (a hook may do anything), unless the hook was declared inert
outside a decoding step (:func:`inert`: the key/value cache's hooks of
:func:`gpipe.generation.traced.cached_layers`, which do nothing while a layer is profiled); nor does
a layer that is not wholly on the meta device: on a real device an operator's output may depend on
values. Keys are conservative: layers that differ in anything get different keys, and then each is
run.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

__all__ = ["fingerprint", "inert", "inputs_key"]

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks")  # fmt: skip
# (layer_idx: the block's place in a key/value cache; gpipe_init: how a layer of the meta device is
# materialized, its weights' source; neither changes a forward without a cache)
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"layer_idx", "gpipe_init"}
_FX_INTERNALS = frozenset({"_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls", "_tracer_extras",
                           "meta", "_replace_hooks", "_create_node_hooks", "_erase_node_hooks",
                           "_deepcopy_hooks", "shape_env"})  # fmt: skip
_SIMPLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


_INERT: set[Callable[..., Any]] = set()


def inert(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Declare ``hook`` (a function, or the function of the ``functools.partial`` registered) inert
    outside a decoding step: a module holding it still gets a :func:`fingerprint`. Returns it."""
    _INERT.add(hook)
    return hook


def _hooks(sub: nn.Module) -> Hashable | None:
    """The module's hooks: the inert ones by their function; None if it has any other."""
    found = []
    for name in _HOOKS:
        for hook in (getattr(sub, name, None) or {}).values():
            func = getattr(hook, "func", hook)
            if func not in _INERT:
                return None
            found.append((name, ("id", id(func))))
    return tuple(found)


def _value(x: Any) -> Hashable:
    """``x`` as a key: simple values and containers of them by value, anything else by identity."""
    if isinstance(x, _SIMPLE):
        return (type(x), x)
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_value(v) for v in x))
    if isinstance(x, dict):
        return (dict, tuple((_value(k), _value(v)) for k, v in x.items()))
    if isinstance(x, slice):
        return (slice, _value(x.start), _value(x.stop), _value(x.step))
    return ("id", id(x))


def _tensor(t: Tensor) -> Hashable:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _graph(gm: fx.GraphModule, prefix: str, place: dict[str, int]) -> Hashable:
    """The graph's operators and arguments; node names left out, modules named by their place in
    the layer (``gm`` at ``prefix``)."""

    def where(path: str) -> Hashable:
        full = f"{prefix}.{path}" if prefix and path else prefix or path
        return place.get(full, ("path", full))  # (not a module: a path, not alike across layers)

    index: dict[fx.Node, int] = {}
    nodes = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        target: Any = node.target
        if node.op == "call_module":
            target = where(str(target))
        elif node.op == "get_attr":
            owner, _, name = str(target).rpartition(".")
            target = (where(owner), name)
        refs = fx.node.map_aggregate(
            (node.args, node.kwargs), lambda a: ("node", index[a]) if isinstance(a, fx.Node) else a
        )
        nodes.append((node.op, _value(target), _value(refs)))
    return tuple(nodes)


def fingerprint(layer: nn.Module) -> Hashable | None:
    """A key equal for layers that run the same operators on the same shapes (see the module's
    docstring), or None: a layer with a hook, or not wholly on the meta device."""
    modules = list(layer.named_modules(remove_duplicate=False))
    place = {path: i for i, (path, _) in enumerate(modules)}
    parts: list[Hashable] = []
    for path, sub in modules:
        hooks = _hooks(sub)
        if hooks is None:
            return None
        tensors: list[Hashable] = []
        for kind, named in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            for name, t in named.items():
                if t is None:
                    tensors.append((kind, name, None))
                    continue
                if t.device.type != "meta":
                    return None
                tensors.append((kind, name, _tensor(t), name in sub._non_persistent_buffers_set))
        graph = isinstance(sub, fx.GraphModule)
        skip = _MODULE_INTERNALS | (_FX_INTERNALS if graph else frozenset())
        attributes = tuple((k, _value(v)) for k, v in vars(sub).items() if k not in skip)
        parts.append((fx.GraphModule if graph else type(sub), sub.training, hooks, tuple(tensors), attributes,
                      _graph(sub, path, place) if graph else None))  # fmt: skip
    return tuple(parts)


def inputs_key(value: Any) -> Hashable | None:
    """A key for a layer's inputs on the meta device: their structure, each tensor's metadata, the
    other values; None where a tensor is not on the meta device."""
    leaves, spec = pytree.tree_flatten(value)
    keys: list[Hashable] = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            if leaf.device.type != "meta":
                return None
            keys.append(_tensor(leaf))
        else:
            keys.append(_value(leaf))
    return (str(spec), tuple(keys))
