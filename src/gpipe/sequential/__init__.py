"""``gpipe.to_sequential``: any PyTorch module as a sequence of pipeline layers.

A pipeline needs its model as a sequence of layers, each passing the next what it needs. Models as
people write them are not sequences: a Hugging Face GPT-2 builds position ids and a causal mask
before its blocks and hands both to every block; BERT threads a padding mask; T5 runs an encoder,
then a decoder whose every block reads the encoder's output; they take keyword arguments and return
``ModelOutput`` objects. :func:`to_sequential` turns such a module into an ``nn.Sequential``
without glue code:

1. **Trace** the module with :func:`torch.export.export` on an example input (non-strict, the
   training IR, every dimension of every input tensor dynamic). Why export and not ``torch.fx``
   symbolic tracing: the Python-level fx tracer cannot run Hugging Face models (their argument
   decorators assign into proxies, their mask builders branch on values), while export runs the
   real Python code on fake tensors and records what it does — control flow resolved, data
   structures flattened, parameters named.
2. **Keep the blocks as modules.** The repeated blocks (every element of the outermost
   ``ModuleList``/``Sequential`` of same-typed blocks: GPT-2's ``transformer.h.*``, ResNet's
   ``layer1.0`` ... ``layer4.2``) — or the modules named in ``split_points`` — and any batch norm
   outside them are exported with their call signatures preserved, and their traced operators are
   replaced by calls of the *original* modules with the traced arguments. So the blocks are the
   user's own objects: training mode, dropout, batch-norm statistics, hooks and ``torch.compile``
   behave as in the model, and parameters are shared, not copied.
3. **Cut** the graph before every block: one layer per block (the code between two blocks goes
   with the block before it), one for the code before the first block and one for the code after
   the last. A layer passes the next, as a tuple, exactly the values a later layer still reads
   (the hidden state, masks, position ids, the encoder's output); the first layer takes the
   module's input, packed as one value, and the last returns the module's output structure.

The code between blocks (the *glue*) runs as the traced operators, with three adjustments: its
dropout follows the layer's training mode (it is traced in training mode; an ``nn.Dropout`` module
there is called as itself), tensors it creates go to the layer's device (the trace's device is not
baked in), and the traced device/dtype assertions are dropped. What the glue does by branching on
``self.training`` or on tensor values is fixed at tracing time, as in any export.

Applied in order to the example input, the layers give the module's output — bitwise in eval mode.
Parameters and buffers keep their qualified names in each layer's ``state_dict`` (layer 3 of a
GPT-2 holds ``transformer.h.2.attn.c_attn.weight``). A parameter used by two layers (GPT-2's token
embedding and its tied LM head) is the same object in both: :class:`gpipe.Pipeline` and
:class:`gpipe.GPipe` find such parameters and tie the copies when the layers land on different
stages.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    InputKind,
    OutputKind,
    SymBoolArgument,
    SymFloatArgument,
    SymIntArgument,
    TensorArgument,
)
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.dropout import _DropoutNd
from torch.utils import _pytree as pytree

from gpipe.microbatch import as_dicts

__all__ = ["ToSequentialError", "as_layers", "pack", "repeated_blocks", "to_sequential", "unpack"]


class ToSequentialError(RuntimeError):
    """A module :func:`to_sequential` cannot turn into layers, with the construct and the way out."""


_WAYS_OUT = (
    "Ways out: trace with inputs shaped as in training (Hugging Face models: use_cache=False is passed "
    "for you when the forward takes it); name other cut points with split_points=[...]; or write the "
    "model as an nn.Sequential of layers, which gpipe takes as it is."
)


def repeated_blocks(module: nn.Module) -> list[str]:
    """The default cut points: the qualified names of the elements of the outermost
    ``ModuleList``/``Sequential`` containers whose (two or more) elements are of one type and hold
    parameters — a transformer's blocks, a ResNet's bottlenecks. Without any, the module's direct
    children that hold parameters."""
    found: list[str] = []

    def visit(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            path = prefix + name
            kids = list(child.children())
            if (
                isinstance(child, (nn.ModuleList, nn.Sequential))
                and len(kids) >= 2
                and len({type(k) for k in kids}) == 1
                and any(True for _ in kids[0].parameters())
            ):
                found.extend(f"{path}.{n}" for n, _ in child.named_children())
            else:
                visit(child, path + ".")

    visit(module, "")
    if not found:
        found = [name for name, child in module.named_children() if any(True for _ in child.parameters())]
    return found


def pack(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The one value a pipeline's first layer takes for ``module(*args, **kwargs)``: the argument
    itself for one positional argument, a tuple for several, a dict for keyword arguments only."""
    if args and kwargs:
        raise ToSequentialError(
            f"the example passes both positional arguments ({len(args)}) and tensors by keyword "
            f"({', '.join(kwargs)}); a pipeline's input is one value: pass them all by keyword (a dict) "
            "or all positionally (a tuple)"
        )
    if kwargs:
        return dict(kwargs)
    return args[0] if len(args) == 1 else tuple(args)


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, Tensor) for leaf in pytree.tree_leaves(value))


Shape = tuple[int | tuple[str, int, int | None] | None, ...]
"""Per dimension of a traced input tensor: its size, or (symbol, lowest, highest) where it is
dynamic, or None where it is an expression of symbols (not checked)."""


def _shape_of(node: fx.Node, ranges: Mapping[Any, Any]) -> Shape:
    dims: list[int | tuple[str, int, int | None] | None] = []
    for d in node.meta["val"].shape:
        if isinstance(d, int):
            dims.append(d)
            continue
        expr = d.node.expr
        if not expr.is_symbol:
            dims.append(None)
            continue
        bounds = ranges.get(expr)
        lower = _bound(bounds.lower) if bounds is not None else None
        upper = _bound(bounds.upper) if bounds is not None else None
        dims.append((str(expr), lower or 0, upper))
    return tuple(dims)


def _bound(value: Any) -> int | None:
    """A range bound as an int, None where it is infinite."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


class _Inputs(nn.Module):
    """The first layer's entry: the packed input flattened to the traced inputs, checked against
    the structure, non-tensor values and shapes the module was traced with (a layer cut from a
    trace must not run silently on what the trace does not cover)."""

    def __init__(self, spec: pytree.TreeSpec, constants: dict[int, Any], shapes: dict[int, Shape]) -> None:
        super().__init__()
        self._spec, self.constants, self.shapes = _Shared(spec), constants, shapes

    @property
    def spec(self) -> pytree.TreeSpec:
        spec: pytree.TreeSpec = self._spec.value
        return spec

    def forward(self, inputs: Any) -> list[Any]:
        leaves, spec = pytree.tree_flatten(as_dicts(inputs))
        if spec != self.spec:
            raise TypeError(
                f"the first layer takes inputs structured as the example it was traced with: {self.spec}, got {spec}"
            )
        for i, value in self.constants.items():
            if leaves[i] is not value and leaves[i] != value:
                raise ValueError(
                    f"input {i} of the first layer is {leaves[i]!r}, but the module was traced with {value!r} "
                    "(non-tensor inputs are fixed at tracing); trace it again with this value"
                )
        sizes: dict[str, int] = {}
        for i, shape in self.shapes.items():
            if self._fits(leaves[i], shape, sizes):
                continue
            raise ValueError(
                f"input {i} of the first layer has shape {tuple(leaves[i].shape)}, which the trace does not cover "
                f"({self._describe(shape)}; sizes named alike must agree); trace the module with such an example"
            )
        return leaves

    @staticmethod
    def _fits(t: Any, shape: Shape, sizes: dict[str, int]) -> bool:
        if not isinstance(t, Tensor) or t.dim() != len(shape):
            return False
        for size, dim in zip(t.shape, shape):
            if isinstance(dim, int):
                if size != dim:
                    return False
            elif dim is not None:
                name, lower, upper = dim
                # Export assumes a dynamic size is not 0 or 1 when it traces; sizes 1 run as well.
                if size < min(lower, 1) or (upper is not None and size > upper) or sizes.setdefault(name, size) != size:
                    return False
        return True

    @staticmethod
    def _describe(shape: Shape) -> str:
        return "[" + ", ".join("?" if d is None else str(d) if isinstance(d, int) else d[0] for d in shape) + "]"


class _Shared:
    """An immutable value a copied layer shares with the original (a TreeSpec: copying one warns)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


class _Outputs(nn.Module):
    """The last layer's exit: the traced outputs rebuilt into the module's output structure."""

    def __init__(self, spec: pytree.TreeSpec) -> None:
        super().__init__()
        self.spec = _Shared(spec)

    def forward(self, leaves: Sequence[Any]) -> Any:
        return pytree.tree_unflatten(list(leaves), self.spec.value)


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


def _call_key(node: fx.Node, paths: set[str]) -> tuple[str, str] | None:
    """(module path, call id) of the outermost kept module whose call computed ``node``."""
    for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
        if path in paths:
            suffix = key.rpartition("@")[2] if "@" in key.rpartition(".")[2] else ""
            return path, f"{path}@{suffix}" if suffix else path
    return None


def _innermost(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None


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


class _Coarse:
    """The exported graph with every kept module's traced operators replaced by a call of the
    module, every parameter, buffer and constant fetched where it is used, and the glue adjusted."""

    def __init__(
        self, module: nn.Module, ep: ExportedProgram, blocks: Sequence[str], norms: Sequence[str], device: torch.device
    ) -> None:
        self.module, self.ep, self.device = module, ep, device
        self.kept_blocks = set(blocks)
        self.graph = fx.Graph()
        self.attrs: dict[str, Any] = {}
        self.kept = set(blocks) | set(norms)
        self.calls: dict[str, Any] = {e.fqn: e.signature for e in ep.module_call_graph if e.signature is not None}
        self.env: dict[str, Any] = {}
        self.inputs: list[fx.Node] = []  # the user-input placeholders, in the traced order
        self.input_sources: dict[str, tuple[str, str]] = {}
        self.block_calls: list[fx.Node] = []
        self._dropouts = 0
        self._user: fx.Node | None = None  # the traced node being copied (whose parameters are named after it)
        self._nodes: dict[str, fx.Node] = {n.name: n for n in ep.graph.nodes}
        self._build()

    # -- what a node's argument becomes ---------------------------------------------------------
    def _fetch(self, name: str) -> Any:
        source = self.input_sources.get(name)
        if source is None:
            found = self.env.get(name)
            return found if found is not None or name in self.env else self._size_from_inside(name)
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
        members: dict[str, tuple[str, str]] = {}
        for node in self.ep.graph.nodes:
            if node.op == "call_function":
                key = _call_key(node, self.kept)
                if key is not None:
                    members[node.name] = key
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
        out = self.graph.call_module(path, tuple(args), dict(kwargs))
        if path in self.kept_blocks:
            self.block_calls.append(out)
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


def _export(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], kept: Sequence[str]) -> ExportedProgram:
    """Export ``module`` in training mode, every input dimension dynamic, the kept modules' call
    signatures preserved."""

    def dims(value: Any) -> Any:
        return pytree.tree_map(
            lambda v: {d: Dim.AUTO for d in range(v.dim())} if isinstance(v, Tensor) else None, value
        )

    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise ToSequentialError(f"the example does not fit {type(module).__name__}.forward: {e}") from e
    dynamic = {name: dims(value) for name, value in bound.arguments.items()}
    modes = {m: m.training for m in module.modules()}
    module.train()
    try:
        return torch.export.export(
            module, args, kwargs, dynamic_shapes=dynamic, strict=False, preserve_module_call_signature=tuple(kept)
        )
    except Exception as e:  # every kind of tracing failure: name the construct, say the way out
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ToSequentialError(
            f"torch.export could not trace {type(module).__name__} on the example: {type(e).__name__}: {first}. "
            f"{_WAYS_OUT}"
        ) from e
    finally:
        for m, training in modes.items():
            m.training = training


def _check_split_points(module: nn.Module, names: Iterable[str]) -> list[str]:
    names = list(names)
    if isinstance(names, str) or not names:
        raise ValueError(f"split_points must be a non-empty list of qualified module names (split_points: {names!r})")
    for name in names:
        try:
            module.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"split point {name!r} is not a submodule of {type(module).__name__} "
                f"(its children: {[n for n, _ in module.named_children()]})"
            ) from None
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(
                    f"split points {a!r} and {b!r} are nested; give modules that do not contain each other"
                )
    return names


def _device_of(module: nn.Module, example: Any) -> torch.device:
    for t in (
        *module.parameters(),
        *module.buffers(),
        *(v for v in pytree.tree_leaves(example) if isinstance(v, Tensor)),
    ):
        return t.device
    return torch.device("cpu")


def to_sequential(
    module: nn.Module, *example_args: Any, split_points: Sequence[str] | None = None, **example_kwargs: Any
) -> nn.Sequential:
    """``module`` as an ``nn.Sequential`` of pipeline layers, traced on ``module(*example_args,
    **example_kwargs)`` (see the module docstring for what that means and what it keeps).

    The first layer takes the example's inputs packed as one value — the tensor for ``module(x)``,
    a tuple for ``module(x, y)``, a dict for ``module(**batch)`` — and checks what it is given
    against them (structure, non-tensor values, shapes the trace depends on). Keyword arguments
    without tensors (``use_cache=False``) are settings: fixed at tracing, not part of the input.
    The last layer returns what the module returns (a tensor, a tuple, a ``ModelOutput``).

    ``split_points``: qualified names of the modules where layers start, instead of the repeated
    blocks (:func:`repeated_blocks`): the layers are the code before the first, then from each to
    the next, the last running to the end. (Modules not named are traced into operators, like the
    rest of the code between them.) An ``nn.Sequential`` is returned as it is.
    """
    if isinstance(module, nn.Sequential):
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"to_sequential takes an nn.Module, not {type(module).__name__}")
    blocks = _check_split_points(module, split_points) if split_points is not None else repeated_blocks(module)
    if not blocks:
        raise ToSequentialError(
            f"{type(module).__name__} has no repeated blocks or children with parameters to cut at; "
            "name the cut points with split_points=[...]"
        )
    kwargs = {k: as_dicts(v) for k, v in example_kwargs.items()}
    args = tuple(as_dicts(a) for a in example_args)
    if "use_cache" in inspect.signature(module.forward).parameters and "use_cache" not in kwargs:
        kwargs["use_cache"] = False  # a training pipeline has no use for a key/value cache
    settings = {k: v for k, v in kwargs.items() if not _has_tensor(v)}
    packed = pack(args, {k: v for k, v in kwargs.items() if k not in settings})
    inside = tuple(b + "." for b in blocks)
    norms = [
        name
        for name, m in module.named_modules(remove_duplicate=False)
        if isinstance(m, _NormBase) and m.track_running_stats and not name.startswith(inside) and name not in blocks
    ]
    device = _device_of(module, packed)
    if device.type == "meta":  # a model built on the meta device traces on meta inputs
        args, kwargs, packed = pytree.tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs, packed))
    ep = _export(module, args, kwargs, blocks + norms)
    drawing = _drawing_outside(ep, set(blocks + norms))
    if drawing:  # modules drawing random numbers in the glue (stochastic depth) run as themselves
        norms = norms + drawing
        ep = _export(module, args, kwargs, blocks + norms)
    coarse = _Coarse(module, ep, blocks, norms, device)
    return _cut(module, ep, coarse, args, kwargs, packed, tail=split_points is None)


_RANDOM = frozenset(
    {"bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
     "normal", "normal_", "uniform_", "exponential_", "multinomial", "native_dropout", "rrelu_with_noise"}
)  # fmt: skip


def _drawing_outside(ep: ExportedProgram, kept: set[str]) -> list[str]:
    """Modules outside the kept ones whose traced operators draw random numbers (other than a
    dropout, which the glue follows the mode for): traced in training mode, they would draw in
    eval too (torchvision's ``StochasticDepth`` branches on ``self.training``). Kept as modules,
    they decide at run time. The innermost module of each such operator; none for the root's own."""
    found: list[str] = []
    for node in ep.graph.nodes:
        if node.op != "call_function" or _call_key(node, kept) is not None:
            continue
        name = getattr(node.target, "__name__", "").split(".")[0]
        if name not in _RANDOM:
            continue
        owner = _innermost(node)
        if owner and owner not in found:
            found.append(owner)
    return found


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
    while last < len(nodes) and nodes[last].target in (_flat, operator.getitem) and nodes[last].op == "call_function":
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
    checker = _Inputs(leaf_spec, constants, shapes)
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
            layer.__dict__["gpipe_init"] = _Shared(_ApplyInit(init))  # (see gpipe.runtime.partition.materialize)
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


def unpack(module: nn.Module, sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call ``module(*args, **kwargs)`` a packed input stands for (the inverse of :func:`pack`):
    a dict is keyword arguments (unless the forward takes it as its one argument), a tuple
    positional arguments, anything else the one argument."""
    sample = as_dicts(sample)
    if isinstance(sample, dict):
        try:
            inspect.signature(module.forward).bind(**sample)
            return (), sample
        except TypeError:
            return (sample,), {}
    if type(sample) is tuple:
        return sample, {}
    return (sample,), {}


def as_layers(module: Any, sample: Any) -> Any:
    """What a front end makes of the model it is given: an ``nn.Sequential`` (or a list of layer
    factories) as it is, any other module traced into layers on ``sample``."""
    if isinstance(module, (list, tuple)) and all(callable(f) for f in module):
        return module  # layer factories
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"module must be nn.Sequential, another nn.Module (traced on sample=...) or a list of layer factories "
            f"(module: {type(module).__name__})"
        )
    if isinstance(module, nn.Sequential):
        return module
    if sample is None:
        raise ValueError(
            f"{type(module).__name__} is not an nn.Sequential: pass sample=<an input mini-batch> to trace it into "
            "pipeline layers (gpipe.to_sequential), or give an nn.Sequential of layers"
        )
    args, kwargs = unpack(module, sample)
    return to_sequential(module, *args, **kwargs)


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
