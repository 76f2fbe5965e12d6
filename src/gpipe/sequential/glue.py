"""The coarse graph: the exported graph with every kept module's operators replaced by a call of
the module (which also returns the values the code after it reads from inside it, see
:mod:`~gpipe.sequential.taps`), and the glue code between them adjusted (dropout following the
layer's mode, tensors created on the layer's device, device assertions dropped)."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    InputKind,
    OutputKind,
    SymBoolArgument,
    SymFloatArgument,
    SymIntArgument,
    TensorArgument,
)
from torch.nn.modules.dropout import _DropoutNd
from torch.utils import _pytree as pytree

from gpipe.sequential.export import _WAYS_OUT, ToSequentialError, _call_key, _innermost
from gpipe.sequential.taps import Tap, _call_tapping, _find_tap, _Recorder

__all__ = ["_Coarse", "_flat"]


class _Dropout(_DropoutNd):
    """A dropout written as a function in the glue (``F.dropout(x, p, self.training)``), following
    the layer's training mode as the function followed the module's."""

    def __init__(self, op: Any, p: float) -> None:
        super().__init__(p)
        self.op = op

    def forward(self, x: Tensor) -> Tensor:
        return self.op(x, self.p, self.training)  # type: ignore[no-any-return]


def _flat(value: Any) -> tuple[Any, ...]:
    return tuple(pytree.tree_leaves(value))


_DROPOUTS = {
    torch.ops.aten.dropout.default,
    torch.ops.aten.feature_dropout.default,
    torch.ops.aten.alpha_dropout.default,
    torch.ops.aten.feature_alpha_dropout.default,
    torch.ops.aten.dropout_.default,  # nn.Dropout(inplace=True)
    torch.ops.aten.feature_dropout_.default,
    torch.ops.aten.alpha_dropout_.default,
    torch.ops.aten.feature_alpha_dropout_.default,
}
_DROPPED = {torch.ops.aten._assert_tensor_metadata.default}


def _replace_device(value: Any, device: torch.device, make: Callable[[], Any]) -> Any:
    """``value`` (a node's args or kwargs) with every ``device`` in it replaced by ``make()``."""
    if isinstance(value, torch.device):
        return make() if value == device else value
    if isinstance(value, (list, tuple)):
        return type(value)(_replace_device(v, device, make) for v in value)
    if isinstance(value, dict):
        return {k: _replace_device(v, device, make) for k, v in value.items()}
    return value


def _placed_graph(graph_module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A copy of a higher-order operator's graph (a ``no_grad`` region, say) whose tensors go to
    the device of its first tensor argument rather than the trace's, without the traced device
    assertions."""
    gm = copy.deepcopy(graph_module)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tensors = [n for n in placeholders if isinstance(n.meta.get("val"), Tensor)] or placeholders
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED and not node.users:
            graph.erase_node(node)
        elif node.op == "get_attr" and isinstance(getattr(gm, str(node.target), None), fx.GraphModule):
            setattr(gm, str(node.target), _placed_graph(getattr(gm, str(node.target)), device))

    def device_of_input() -> fx.Node:
        if not tensors:
            raise ToSequentialError("a traced region creates tensors on the trace's device but takes no tensor")
        with graph.inserting_after(placeholders[-1]):
            return graph.call_function(getattr, (tensors[0], "device"))

    for node in list(graph.nodes):
        if node.op == "call_function":
            node.args = _replace_device(node.args, device, device_of_input)
            node.kwargs = _replace_device(node.kwargs, device, device_of_input)
    gm.recompile()
    return gm


def _same_geometry(a: Any, b: Any) -> bool:
    return (
        isinstance(a, Tensor)
        and isinstance(b, Tensor)
        and (a.dtype, a.device, a.shape, a.stride()) == (b.dtype, b.device, b.shape, b.stride())
    )


class _Coarse:
    """The exported graph with every kept module's traced operators replaced by a call of the
    module, every parameter, buffer and constant fetched where it is used, and the glue adjusted."""

    def __init__(
        self,
        module: nn.Module,
        ep: ExportedProgram,
        blocks: Sequence[str],
        norms: Sequence[str],
        device: torch.device,
        recorder: _Recorder,
    ) -> None:
        self.module, self.ep, self.device, self.recorder = module, ep, device, recorder
        self.kept_blocks = set(blocks)
        self.graph = fx.Graph()
        self.attrs: dict[str, Any] = {}
        self.kept = set(blocks) | set(norms)
        self.calls: dict[str, Any] = {e.fqn: e.signature for e in ep.module_call_graph if e.signature is not None}
        self.env: dict[str, Any] = {}
        self.inputs: list[fx.Node] = []  # the user-input placeholders, in the traced order
        self.input_sources: dict[str, tuple[str, str]] = {}
        self.block_calls: list[fx.Node] = []  # each block call's first node
        self.taps: dict[str, list[tuple[str, Tap]]] = {}  # per call: the values read after it, and where
        self._dropouts = 0
        self._user: fx.Node | None = None  # the traced node being copied (whose parameters are named after it)
        self._nodes: dict[str, fx.Node] = {n.name: n for n in ep.graph.nodes}
        self._members: dict[str, tuple[str, str]] = {}  # node -> (kept module, call) that computed it
        self._build()

    # -- what a node's argument becomes ---------------------------------------------------------
    def _fetch(self, name: str) -> Any:
        source = self.input_sources.get(name)
        if source is None:
            found = self.env.get(name)
            if found is not None or name in self.env:
                return found
            alias = self._alias_outside(self._nodes[name]) if name in self._nodes else None
            return self._fetch(alias.name) if alias is not None else self._size_from_inside(name)
        kind, target = source
        if kind in ("param", "buffer") and self._user is not None:
            target = self._own_name(target, self._user)
            self.attrs.setdefault(target, self.attrs[source[1]])
        return self.graph.get_attr(target)  # parameters, buffers, constants: fetched where they are used

    def _size_from_inside(self, name: str) -> Any:
        """A value the glue reads that the trace computed inside a kept module's call (export shares
        a size expression, such as a window count from ``x.shape``, between the call and the code
        after it): computed again here, from what it depends on. Only sizes: a tensor computed
        inside a call is not the glue's to recompute."""
        node = self._nodes.get(name)
        value = node.meta.get("val") if node is not None else None
        if node is None or node.op != "call_function" or isinstance(value, Tensor):
            raise ToSequentialError(
                f"the code between blocks reads {name}, a value computed inside a block's call that the block does "
                f"not return; {_WAYS_OUT}"
            )
        new = self.graph.call_function(node.target, self._arg(node.args), self._arg(node.kwargs))  # type: ignore[arg-type]
        new.meta = dict(node.meta)
        self.env[name] = new
        return new

    def _alias_outside(self, node: fx.Node) -> fx.Node | None:
        """The value outside a kept module's call that ``node``, computed inside it, is: a
        conversion to the dtype and device the tensor has (an RMS norm's ``x.to(torch.float32)``)
        returns the tensor itself, and export names the block's input after it (Hugging Face's
        ``output_hidden_states`` records it so). None where ``node`` is no such conversion."""
        key = self._members.get(node.name)
        while key is not None and self._members.get(node.name) == key:
            source = node.args[0] if node.op == "call_function" and node.args else None
            if not (
                getattr(node.target, "overloadpacket", None) is torch.ops.aten.to
                and isinstance(source, fx.Node)
                and _same_geometry(node.meta.get("val"), source.meta.get("val"))
            ):
                return None
            node = source
        return node if key is not None else None

    def _own_name(self, target: str, user: fx.Node) -> str:
        """The name a shared parameter has in the module that uses it (export names every shared
        parameter once: GPT-2's token embedding would be called ``lm_head.weight``)."""
        value = self.attrs[target]
        for path, _ in reversed(list((user.meta.get("nn_module_stack") or {}).values())):
            owner = self.module.get_submodule(path)
            for name, t in (*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)):
                if t is value:
                    return f"{path}.{name}" if path else name
        return target

    def _arg(self, a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: self._fetch(n.name))

    def _device(self) -> fx.Node:
        if "_gpipe.device" not in self.attrs:
            self.attrs["_gpipe.device"] = torch.empty(0, device=self.device)
        return self.graph.call_function(getattr, (self.graph.get_attr("_gpipe.device"), "device"))

    def _placed(self, value: Any) -> Any:
        """``value`` (args or kwargs) with the trace's device replaced by the layer's."""
        return _replace_device(value, self.device, self._device)

    # -- building ---------------------------------------------------------------------------------
    def _build(self) -> None:
        sig = self.ep.graph_signature
        for spec in sig.input_specs:
            if not isinstance(spec.arg, TensorArgument) and spec.kind != InputKind.USER_INPUT:
                raise ToSequentialError(f"the traced module takes an input of kind {spec.kind.name}, not supported")
            name = spec.arg.name if hasattr(spec.arg, "name") else ""
            if spec.kind == InputKind.PARAMETER:
                assert spec.target is not None
                self.attrs[spec.target] = self.module.get_parameter(spec.target)
                self.input_sources[name] = ("param", spec.target)
            elif spec.kind == InputKind.BUFFER:
                assert spec.target is not None
                self.attrs[spec.target] = self.module.get_buffer(spec.target)
                self.input_sources[name] = ("buffer", spec.target)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                assert spec.target is not None
                target = f"_gpipe.constant_{len(self.attrs)}"
                self.attrs[target] = self.ep.constants[spec.target]
                self.input_sources[name] = ("constant", target)
            elif spec.kind != InputKind.USER_INPUT:
                raise ToSequentialError(f"the traced module takes an input of kind {spec.kind.name}, not supported")
        user_inputs = {s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT}
        members = self._members
        for node in self.ep.graph.nodes:
            if node.op == "call_function":
                key = _call_key(node, self.kept)
                if key is not None:
                    members[node.name] = key
        self._find_taps()
        emitted: set[str] = set()
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                if node.name in user_inputs:
                    self.env[node.name] = ph = self.graph.placeholder(node.name)
                    ph.meta = dict(node.meta)
                    self.inputs.append(ph)
            elif node.name in members:
                path, call = members[node.name]
                if call not in emitted:
                    emitted.add(call)
                    self._emit_call(path, call, members)
            elif node.op == "call_function":
                self._emit_glue(node)
            elif node.op == "get_attr":  # the graphs of higher-order operators (no_grad regions, autocast)
                target = f"_gpipe.{node.target}"
                self.attrs[target] = _placed_graph(getattr(self.ep.graph_module, str(node.target)), self.device)
                self.input_sources[node.name] = ("graph", target)
            elif node.op == "output":
                self._emit_output(node)
            else:
                raise ToSequentialError(f"unexpected {node.op} node {node.name} in the traced graph")
        missing = sorted(self.kept_blocks - {path for path, _ in members.values()})
        if missing:
            raise ToSequentialError(f"the split points {missing} are never called by the module's forward")

    def read_inside(self, path: str) -> bool:
        """Whether the code after a call of kept module ``path`` reads a value computed inside it
        that the call does not return (:meth:`_find_taps`)."""
        return any(taps and call.partition("@")[0] == path for call, taps in self.taps.items())

    def _find_taps(self) -> None:
        """The tensors computed inside a kept module's call that code outside it reads (the glue, the
        output, another call's arguments) although the call does not return them: the router logits
        a mixture-of-experts model's hooks collect for its load-balancing loss. Each becomes an
        extra output of the call, caught where a module inside it returns it."""
        returns = {
            e.fqn: {a.name for a in e.signature.outputs if not isinstance(a, ConstantArgument)}
            for e in self.ep.module_call_graph
            if e.signature is not None
        }
        read: dict[str, fx.Node] = {}
        for node in self.ep.graph.nodes:
            if node.name not in self._members:
                read.update((a.name, a) for a in node.all_input_nodes)
        for call, signature in self.calls.items():
            for arg in signature.inputs:
                name = getattr(arg, "name", "")
                if name in self._members and self._members[name][1] != call:
                    read[name] = self._nodes[name]
        for node in read.values():
            while (alias := self._alias_outside(node)) is not None:  # (the value itself, where it is made)
                node = alias
            key = self._members.get(node.name)
            value = node.meta.get("val")
            if key is None or node.name in returns.get(key[1], ()) or not isinstance(value, Tensor):
                continue  # computed outside, returned by the call, or a size (computed again)
            path, call = key
            taps = self.taps.setdefault(call, [])
            if any(name == node.name for name, _ in taps):
                continue
            tap = _find_tap(self.recorder, path, int(call.rpartition("@")[2]) if "@" in call else 0, value)
            if tap is None:
                raise ToSequentialError(
                    f"the code after {path} reads {node.name} (a tensor of shape {tuple(value.shape)}), computed "
                    f"inside its call, which neither {path} nor any module inside it returns; return it from the "
                    f"block's forward or from a module inside it. {_WAYS_OUT}"
                )
            taps.append((node.name, tap))

    def _emit_call(self, path: str, call: str, members: dict[str, tuple[str, str]]) -> None:
        signature = self.calls.get(call)
        if signature is None:
            raise ToSequentialError(f"the trace recorded no call signature for {call}")
        leaves: list[Any] = []
        for arg in signature.inputs:
            if isinstance(arg, ConstantArgument):
                leaves.append(arg.value)
            elif isinstance(arg, (TensorArgument, SymIntArgument, SymFloatArgument, SymBoolArgument)):
                leaves.append(self._fetch(arg.name))
            else:
                raise ToSequentialError(f"{path} is called with an argument of kind {type(arg).__name__}")
        args, kwargs = pytree.tree_unflatten(leaves, signature.in_spec)
        module = self.module.get_submodule(path)
        self.attrs[path] = module
        taps = self.taps.get(call)
        if taps:  # the block's own call, and the values read after it, caught inside it
            first = self.graph.get_attr(path)
            both = self.graph.call_function(
                _call_tapping, (first, tuple(tap for _, tap in taps), tuple(args), dict(kwargs))
            )
            out = self.graph.call_function(operator.getitem, (both, 0))
            extras = self.graph.call_function(operator.getitem, (both, 1))
            for k, (name, _) in enumerate(taps):
                self.env[name] = self.graph.call_function(operator.getitem, (extras, k))
        else:
            out = first = self.graph.call_module(path, tuple(args), dict(kwargs))
        if path in self.kept_blocks:
            self.block_calls.append(first)
        outputs = [a for a in signature.outputs]
        if signature.out_spec.is_leaf():
            flat = [out]
        else:
            tup = self.graph.call_function(_flat, (out,))
            flat = [self.graph.call_function(operator.getitem, (tup, k)) for k in range(len(outputs))]
        for arg, value in zip(outputs, flat):
            if isinstance(arg, ConstantArgument):
                continue
            if members.get(arg.name, (None, None))[1] != call:  # an input handed back unchanged
                continue
            self.env[arg.name] = value

    def _emit_glue(self, node: fx.Node) -> None:
        if node.target in _DROPPED:
            return
        self._user = node
        if node.target in _DROPOUTS:
            owner = _innermost(node)
            owner_module = self.module.get_submodule(owner) if owner is not None else None
            if isinstance(owner_module, _DropoutNd) and owner is not None:
                target = owner
                self.attrs[target] = owner_module
            else:
                target = f"_gpipe.dropout_{self._dropouts}"
                self._dropouts += 1
                self.attrs[target] = _Dropout(node.target, float(node.args[1]))  # type: ignore[arg-type]
            self.env[node.name] = self.graph.call_module(target, (self._arg(node.args[0]),))
            return
        args, kwargs = self._placed(self._arg(node.args)), self._placed(self._arg(node.kwargs))
        new = self.graph.call_function(node.target, args, kwargs)  # type: ignore[arg-type]
        new.meta = dict(node.meta)
        self.env[node.name] = new

    def _emit_output(self, node: fx.Node) -> None:
        specs = self.ep.graph_signature.output_specs
        values = node.args[0]
        assert isinstance(values, (list, tuple))
        user = []
        for spec, value in zip(specs, values):
            if spec.kind == OutputKind.USER_OUTPUT:
                user.append(self._arg(value))
            elif spec.kind == OutputKind.BUFFER_MUTATION:
                assert spec.target is not None and isinstance(value, fx.Node)
                if value.name not in self.env:  # computed inside a kept module, which updates its own buffer
                    continue
                self.graph.call_function(
                    torch.ops.aten.copy_.default, (self.graph.get_attr(spec.target), self._arg(value))
                )
            else:
                raise ToSequentialError(f"the traced module has an output of kind {spec.kind.name}, not supported")
        self.graph.output(tuple(user))
