"""Cutting the coarse graph into layers: each node's segment, the values crossing each boundary,
and one ``fx.GraphModule`` per segment holding the parameters and buffers it uses under their
qualified names (the original owners where it can) and the model's own initialization."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from gpipe.sequential.export import ToSequentialError, _has_tensor, pack
from gpipe.sequential.glue import _Coarse, _flat
from gpipe.sequential.layers import _Inputs, _Outputs, _shape_of, bring_init
from gpipe.sequential.taps import _call_tapping

__all__ = ["_cut"]


def _input_order(
    ep: ExportedProgram, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[int], dict[int, Any]]:
    """For each leaf of the packed input, its position among the traced user inputs; and the
    positions of the settings (keyword arguments without tensors) with their values."""
    in_spec = ep.call_spec.in_spec
    assert in_spec is not None
    pos_args, pos_kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    order = pytree.tree_leaves(pack(tuple(pos_args), {k: v for k, v in pos_kwargs.items() if _has_tensor(kwargs[k])}))
    example = pytree.tree_leaves((args, {k: kwargs[k] for k in pos_kwargs}))
    positions = pytree.tree_leaves((tuple(pos_args), pos_kwargs))
    settings = {p: v for p, v in zip(positions, example) if p not in set(order)}
    return order, settings


def _is_compute(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_module") and node.target is not getattr


def _segments(coarse: _Coarse, tail: bool) -> dict[fx.Node, int]:
    """Each node's layer: a layer starts at every block call; the code before the first block is
    a layer of its own, and with ``tail`` the code after the last block (its outputs unpacked) too
    — if they compute."""
    nodes = [n for n in coarse.graph.nodes if n.op not in ("placeholder", "output")]
    starts = [nodes.index(call) for call in coarse.block_calls]
    last = starts[-1] + 1
    unpacking = (_flat, operator.getitem, _call_tapping)  # (a tapped block's call after its first node)
    while last < len(nodes) and nodes[last].target in unpacking and nodes[last].op == "call_function":
        last += 1
    bounds = [0, *starts, last] if tail else [0, *starts]
    segment: dict[fx.Node, int] = {}
    for s in range(len(bounds)):
        end = bounds[s + 1] if s + 1 < len(bounds) else len(nodes)
        for node in nodes[bounds[s] : end]:
            segment[node] = s
    computing = sorted({s for n, s in segment.items() if _is_compute(n)})
    if not computing:
        raise ToSequentialError("the traced module computes nothing")
    # Fold a segment that computes nothing into its neighbour (the first into the next, the
    # others into the previous one), then number the segments 0, 1, ...
    relabel: dict[int, int] = {}
    for s in range(len(bounds)):
        if s in computing:
            relabel[s] = s
        else:
            later = [c for c in computing if c > s]
            relabel[s] = later[0] if s == 0 and later else max(c for c in computing if c < s) if s else computing[0]
    index = {s: i for i, s in enumerate(computing)}
    return {n: index[relabel[s]] for n, s in segment.items()}


def _cut(
    module: nn.Module,
    ep: ExportedProgram,
    coarse: _Coarse,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    packed: Any,
    tail: bool,
) -> nn.Sequential:
    graph = coarse.graph
    order, settings = _input_order(ep, args, kwargs)
    for pos, value in settings.items():  # settings are constants: no layer passes them on
        ph = coarse.inputs[pos]
        for user in list(ph.users):
            user.args = fx.node.map_arg(user.args, lambda n, ph=ph, value=value: value if n is ph else n)  # type: ignore[misc]
            user.kwargs = fx.node.map_arg(user.kwargs, lambda n, ph=ph, value=value: value if n is ph else n)  # type: ignore[misc]
    fx.GraphModule(coarse.attrs, graph).graph.eliminate_dead_code()  # (it needs an owning module)
    segment = _segments(coarse, tail)
    count = max(segment.values()) + 1
    output = next(n for n in graph.nodes if n.op == "output")
    for node in coarse.inputs:
        segment[node] = -1
    segment[output] = count - 1
    # The values crossing each boundary: defined at or before it, read after it.
    live: list[list[fx.Node]] = [[] for _ in range(count - 1)]
    for node in graph.nodes:
        if node.op in ("output", "get_attr") or node not in segment or not node.users:
            continue
        last_use = max(segment[u] for u in node.users)
        for b in range(max(segment[node], 0), last_use):
            live[b].append(node)
    leaf_spec = pytree.tree_structure(packed)
    tensor_leaves = [i for i, leaf in enumerate(pytree.tree_leaves(packed)) if isinstance(leaf, Tensor)]
    constants = {i: leaf for i, leaf in enumerate(pytree.tree_leaves(packed)) if not isinstance(leaf, Tensor)}
    shapes = {i: _shape_of(_placeholder_of(ep, coarse, order[i]), ep.range_constraints) for i in tensor_leaves}
    names = [f"input{pytree.keystr(path)}" for path, _ in pytree.tree_flatten_with_path(packed)[0]]
    carried = {k: v for k, v in kwargs.items() if not _has_tensor(v)} if isinstance(packed, dict) else {}
    checker = _Inputs(leaf_spec, constants, shapes, names, carried)  # (settings a dict input may carry)
    out_spec = ep.call_spec.out_spec
    assert out_spec is not None
    layers: list[nn.Module] = []
    for s in range(count):
        g = fx.Graph()
        env: dict[fx.Node, Any] = {}
        entry = g.placeholder("inputs")
        root: dict[str, Any] = {}
        if s == 0:
            root["_gpipe.inputs"] = checker
            flat = g.call_module("_gpipe.inputs", (entry,))
            for j, pos in enumerate(order):
                env[coarse.inputs[pos]] = g.call_function(operator.getitem, (flat, j))
        else:
            for j, node in enumerate(live[s - 1]):
                env[node] = g.call_function(operator.getitem, (entry, j))
        for node in graph.nodes:
            if segment.get(node) != s or node.op in ("placeholder", "output"):
                continue
            env[node] = g.node_copy(node, env.__getitem__)
            if node.op in ("get_attr", "call_module"):
                root[str(node.target)] = coarse.attrs[str(node.target)]
        if s == count - 1:
            root["_gpipe.outputs"] = _Outputs(out_spec)
            values = fx.node.map_arg(output.args[0], env.__getitem__)
            g.output(g.call_module("_gpipe.outputs", (list(values),)))
        else:
            g.output(tuple(env[n] for n in live[s]))
        layer = fx.GraphModule(root, g, class_name=f"Layer{s}")
        _fix_buffers(module, layer, root)
        _adopt_owners(module, layer, root)
        init = getattr(module, "_init_weights", None)  # a Hugging Face model's own initialization
        if callable(init):
            bring_init(layer, _ApplyInit(init))  # (see gpipe.runtime.partition.materialize)
        layers.append(layer)
    return nn.Sequential(*layers)


def _placeholder_of(ep: ExportedProgram, coarse: _Coarse, pos: int) -> fx.Node:
    """The traced graph's placeholder of user input ``pos`` (it carries the symbolic shape)."""
    name = coarse.inputs[pos].name
    found: fx.Node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name)
    return found


def _fix_buffers(module: nn.Module, layer: nn.Module, root: Mapping[str, Any]) -> None:
    """Buffers a layer fetched by name are registered in it as persistent buffers; make those the
    model does not save (and the layer's own constants) non-persistent, as they were."""
    for target, value in root.items():
        if not isinstance(value, Tensor) or isinstance(value, nn.Parameter):
            continue
        owner_path, _, name = target.rpartition(".")
        owner = layer.get_submodule(owner_path) if owner_path else layer
        if target.startswith("_gpipe."):
            owner._non_persistent_buffers_set.add(name)
            continue
        try:
            original = module.get_submodule(owner_path) if owner_path else module
        except AttributeError:
            continue
        if name in original._non_persistent_buffers_set:
            owner._non_persistent_buffers_set.add(name)


def _adopt_owners(module: nn.Module, layer: nn.Module, root: Mapping[str, Any]) -> None:
    """A layer holds the parameters its operators fetch in stand-in modules along their qualified
    paths; where the original owner is a leaf module all of whose parameters the layer holds
    (GPT-2's ``transformer.wte``, an ``nn.Embedding``), hold the original instead: the same
    tensors and names, and the type its initialization looks at (``_init_weights``)."""
    held: dict[str, set[str]] = {}
    for target, value in root.items():
        if isinstance(value, Tensor) and not target.startswith("_gpipe."):
            owner, _, name = target.rpartition(".")
            held.setdefault(owner, set()).add(name)
    for path, names in held.items():
        if not path:
            continue
        try:
            original = module.get_submodule(path)
        except AttributeError:
            continue
        params = {n for n, _ in original.named_parameters(recurse=False)}
        buffers = {n for n, _ in original.named_buffers(recurse=False)}
        # (buffers the layer does not read may come along: a rotary embedding's original_inv_freq)
        if next(original.children(), None) is not None or not names <= params | buffers or not params <= names:
            continue
        parent_path, _, name = path.rpartition(".")
        parent = layer.get_submodule(parent_path) if parent_path else layer
        if type(parent.get_submodule(name)) is nn.Module:  # a stand-in (not a kept module)
            setattr(parent, name, original)


class _ApplyInit:
    """``layer.apply(init)``: a per-module initialization (Hugging Face's ``_init_weights``) run
    over one layer, for a layer materialized from the meta device."""

    def __init__(self, init: Callable[[nn.Module], None]) -> None:
        self.init = init

    def __call__(self, layer: nn.Module) -> None:
        with torch.no_grad():
            layer.apply(self.init)
