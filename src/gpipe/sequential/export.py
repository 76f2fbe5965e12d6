"""Exporting the module: the default cut points, the split points' check, the module's device,
the export itself (training mode, dynamic dimensions, the kept modules' signatures), the modules
drawing random numbers outside them, and the packing of a call's arguments into one input."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import Dim, ExportedProgram
from torch.utils import _pytree as pytree

from gpipe.microbatch import as_dicts
from gpipe.sequential.reuse import StandIns

__all__ = [
    "_WAYS_OUT",
    "ToSequentialError",
    "_call_key",
    "_check_split_points",
    "_device_of",
    "_drawing_outside",
    "_export",
    "_has_tensor",
    "_innermost",
    "pack",
    "repeated_blocks",
    "unpack",
]


class ToSequentialError(RuntimeError):
    """A module :func:`to_sequential` cannot turn into layers, with the construct and the way out."""


ToSequentialError.__module__ = "gpipe.sequential"  # its public name, which tracebacks print

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


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, Tensor) for leaf in pytree.tree_leaves(value))


def _export(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    kept: Sequence[str],
    stand_ins: StandIns | None = None,
) -> ExportedProgram:
    """Export ``module`` in training mode, every input dimension dynamic, the kept modules' call
    signatures preserved; the calls of alike blocks answered by ``stand_ins`` where they can be."""

    def dims(value: Any) -> Any:
        return pytree.tree_map(
            lambda v: {d: Dim.AUTO for d in range(v.dim())} if isinstance(v, Tensor) else None, value
        )

    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise ToSequentialError(f"the example does not fit {type(module).__name__}.forward: {e}") from e
    dynamic = {name: dims(value) for name, value in bound.arguments.items()}
    spread = _spread_var_keyword(module, bound)
    if spread is not None:
        dynamic = {name: dims(value) for name, value in spread.arguments.items()}
    modes = {m: m.training for m in module.modules()}
    module.train()
    handles = [
        module.get_submodule(path).register_forward_pre_hook(functools.partial(_sizes_fixed, path), with_kwargs=True)
        for path in kept
    ]
    try:
        with stand_ins if stand_ins is not None else contextlib.nullcontext():
            return torch.export.export(
                module, args, kwargs, dynamic_shapes=dynamic, strict=False, preserve_module_call_signature=tuple(kept)
            )
    except ToSequentialError:
        raise
    except Exception as e:  # every kind of tracing failure: name the construct, say the way out
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ToSequentialError(
            f"torch.export could not trace {type(module).__name__} on the example: {type(e).__name__}: {first}. "
            f"{_WAYS_OUT}"
        ) from e
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes.items():
            m.training = training
        if spread is not None:
            del module.forward  # the class's own again


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _sizes_fixed(path: str, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """A kept module's arguments, as export may keep them: a size computed from the input
    (BEiT's ``resolution=pixel_values.shape[2:]``), symbolic while tracing, becomes the number it
    is in the example (export then fixes the dimensions it comes from, and the first layer checks
    them); an argument that is neither a tensor nor a number is refused, named."""
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    fixed = []
    for key, leaf in leaves:
        if isinstance(leaf, _SYMBOLIC):
            leaf = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(leaf)](leaf)
        elif not (leaf is None or isinstance(leaf, (Tensor, str, int, float, bool))):
            raise ToSequentialError(
                f"{path} is called with {_argument(key)} = {type(leaf).__name__} {leaf!r:.60}, which torch.export "
                "cannot keep as an argument of a module it cuts at (tensors, numbers, strings and None only); "
                "name other cut points with split_points=[...]: modules called with those"
            )
        fixed.append(leaf)
    args, kwargs = pytree.tree_unflatten(fixed, spec)
    return args, kwargs


def _argument(key: tuple[Any, ...]) -> str:
    """The argument a leaf of ``(args, kwargs)`` is in, by its key path: ``resolution[0]``, ``argument 1``."""
    head, rest = key[1], pytree.keystr(key[2:])
    if key[0] == pytree.SequenceKey(0):
        return f"argument {getattr(head, 'idx', head)}{rest}"
    return f"{getattr(head, 'key', head)}{rest}"


def _spread_var_keyword(module: nn.Module, bound: inspect.BoundArguments) -> inspect.BoundArguments | None:
    """Where the example passes arguments through the forward's ``**kwargs`` (a Hugging Face
    model's ``output_hidden_states``), give the module, for the export, a forward whose signature
    names them: torch.export pairs the dynamic shapes with the arguments wrongly otherwise (it
    lists them both under ``kwargs`` and by their own names: "Must provide a tree_name when there
    might be a mismatch"). Returns the example bound to that signature; None where nothing is spread."""
    signature = bound.signature
    var = next((p for p in signature.parameters.values() if p.kind == inspect.Parameter.VAR_KEYWORD), None)
    if var is None or not bound.arguments.get(var.name):
        return None
    params = [p for p in signature.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in bound.arguments[var.name]]
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    spread = signature.replace(parameters=params)
    forward.__signature__ = spread  # type: ignore[attr-defined]
    module.forward = forward
    return spread.bind(*bound.args, **bound.kwargs)


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
