"""Tracing a repeated block once: where blocks are alike, the export runs the code inside one of
them, and the others' calls are answered by a stand-in returning what that call returned.

Why the layers are the same: a block is a kept module, whose traced operators the coarse graph
replaces by a call of the block itself (:mod:`~gpipe.sequential.glue`); of its inside, the layers
keep nothing. What the code after a block sees of it is what its call returns: the structure of
its output and each tensor's dtype, device, shape and strides (expressions of the input's
symbolic sizes), or which argument it hands back. Blocks are *alike* (:func:`alike_blocks`) when
they are of one class, with modules of the same classes at the same paths holding parameters and
buffers of the same names, shapes, dtypes and devices, and no hooks. A call of such a block with
arguments of the structure, non-tensor values and tensor metadata (symbolic sizes included) of an
alike block's traced call is answered with that call's outputs: tensors made anew by an operator
of its own, ``gpipe::stand_in`` (registered the first time it is needed; it never runs, the layers
call the block), arguments handed back as such. Another call is traced, and answers later ones.

Blocks alike in all that may still differ in code that reads their other attributes (a flag that
changes the output's layout), so the answers are checked after the export
(:meth:`StandIns.faithful`): each answered block and the block whose call answered it run on the
meta device on the example's sizes and must return the same structure, dtypes, shapes and
strides; and the code after a traced call must read nothing from inside it but what it returns
(values caught inside it, :mod:`~gpipe.sequential.taps`: the answered calls would lack them).
Where either fails, or the export with stand-ins fails, :func:`gpipe.to_sequential` traces again
without them.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

__all__ = ["StandIns", "alike_blocks"]

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")  # fmt: skip


def _structure(block: nn.Module) -> tuple[Any, ...] | None:
    """What alike blocks share: their modules' paths and classes, their parameters' and buffers'
    names, shapes, dtypes and devices, whether each requires grad or is saved; None for a block
    with a hook on it or on a module inside it (a hook may collect what a call returns)."""
    modules = []
    for path, sub in block.named_modules(remove_duplicate=False):
        if any(getattr(sub, name, None) for name in _HOOKS):
            return None
        tensors = tuple(
            (kind, name, tuple(t.shape), t.dtype, t.device, t.requires_grad, name in sub._non_persistent_buffers_set)
            for kind, named in (("parameter", sub._parameters), ("buffer", sub._buffers))
            for name, t in named.items()
            if t is not None
        )
        modules.append((path, type(sub), tensors))
    return tuple(modules)


def alike_blocks(module: nn.Module, blocks: Sequence[str]) -> list[list[str]]:
    """The groups of two or more blocks of ``blocks`` that are alike (see the module docstring);
    none while global module hooks are registered."""
    from torch.nn.modules import module as torch_module

    if any(getattr(torch_module, name, None) for name in _GLOBAL_HOOKS):
        return []
    groups: dict[Any, list[str]] = {}
    for path in blocks:
        key = _structure(module.get_submodule(path))
        if key is not None:
            groups.setdefault(key, []).append(path)
    return [group for group in groups.values() if len(group) > 1]


def _expr(value: Any) -> Any:
    """A size as what it stands for: a symbolic size's expression, as the sizes found equal so far
    make it (compared without adding a guard)."""
    return value.node.expr if isinstance(value, _SYMBOLIC) else value


def _meta(value: Any) -> Any:
    """What a call's argument is to the code inside: a tensor's metadata, a size's expression, a value."""
    if isinstance(value, Tensor):
        return ("tensor", value.dtype, value.device, value.layout, value.requires_grad,
                tuple(_expr(s) for s in value.shape), tuple(_expr(s) for s in value.stride()),
                _expr(value.storage_offset()))  # fmt: skip
    if isinstance(value, _SYMBOLIC):
        return ("size", type(value), _expr(value))
    return ("value", type(value), value)


@dataclass
class _Call:
    """A block's traced call in the export: its arguments and what it returned."""

    path: str
    leaves: list[Any]  # the arguments' leaves (fake tensors, sizes, values)
    spec: pytree.TreeSpec
    outputs: list[tuple[str, Any]]  # per output leaf: ("input", j), ("tensor", fake tensor) or ("value", v)
    out_spec: pytree.TreeSpec


_LOCK = threading.Lock()
_KEYS = itertools.count()
_MADE: dict[int, list[Tensor]] = {}  # per answered call: the fake tensors whose like the operator returns


@functools.cache
def _operator() -> Any:
    """``gpipe::stand_in(inputs, key)``: new tensors like a traced call's outputs."""

    @torch.library.custom_op("gpipe::stand_in", mutates_args=())
    def stand_in(inputs: list[Tensor], key: int) -> list[Tensor]:
        raise RuntimeError("gpipe::stand_in runs only in a trace: the layers call the block itself")

    @stand_in.register_fake
    def _(inputs: list[Tensor], key: int) -> list[Tensor]:
        return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in _MADE[key]]

    return stand_in


def _contiguous(t: Tensor) -> bool:
    """Whether ``t`` has a contiguous tensor's strides, as expressions (no guard added): its clone
    then has them too."""
    expected: Any = 1
    strides = []
    for size in reversed([_expr(s) for s in t.shape]):
        strides.append(expected)
        expected = expected * size
    differences = [a - b for a, b in zip(reversed(strides), (_expr(s) for s in t.stride()))]
    return _expr(t.storage_offset()) == 0 and all((d if isinstance(d, int) else d.expand()) == 0 for d in differences)


def _returned(leaves: list[Any], output: Any) -> tuple[list[tuple[str, Any]], pytree.TreeSpec] | None:
    """A call's output leaves as :class:`_Call` keeps them; None where one is a size (computed
    inside: not answered)."""
    outs, out_spec = pytree.tree_flatten(output)
    described: list[tuple[str, Any]] = []
    for out in outs:
        same = next((j for j, leaf in enumerate(leaves) if leaf is out), None)
        if same is not None:
            described.append(("input", same))
        elif isinstance(out, Tensor):
            described.append(("tensor", out))
        elif isinstance(out, _SYMBOLIC):
            return None
        else:
            described.append(("value", out))
    return described, out_spec


class StandIns:
    """While active (around the export), the blocks of each group of alike blocks run
    :meth:`_answer` instead of their forward (see the module docstring)."""

    def __init__(self, module: nn.Module, groups: Sequence[Sequence[str]]) -> None:
        self.module = module
        self.group = {path: g for g, group in enumerate(groups) for path in group}
        self.traced: dict[int, list[_Call]] = {}  # per group: its blocks' traced calls
        self.answered: list[tuple[str, list[Any], pytree.TreeSpec, _Call]] = []  # (block, its call, the answer's)
        self._patched: list[nn.Module] = []
        self._keys: list[int] = []

    def __enter__(self) -> StandIns:
        for path in self.group:
            block = self.module.get_submodule(path)
            if "forward" not in block.__dict__:  # (an instance's own forward: left be, traced)
                block.forward = functools.partial(self._answer, path, block)
                self._patched.append(block)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for block in self._patched:
            del block.forward
        self._patched = []
        with _LOCK:
            for key in self._keys:
                _MADE.pop(key, None)

    def _answer(self, path: str, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """A block's forward in the export: an alike block's traced call's outputs, where one
        matches the call; else the block's own forward, traced, and kept for later calls."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        with torch._C.DisableTorchFunction():  # (metadata read directly, not through the export's handlers)
            found = self._match(path, leaves, spec, tensors)
        if found is None:
            output = type(block).forward(block, *args, **kwargs)
            returned = _returned(leaves, output)
            if returned is not None:
                self.traced.setdefault(self.group[path], []).append(_Call(path, leaves, spec, *returned))
            return output
        call, sources = found
        made = [value for kind, value in call.outputs if kind == "tensor"]
        rest = [t for t, source in zip(made, sources) if source is None]
        others: Any = iter(())
        if rest:
            with _LOCK:
                key = next(_KEYS)
                _MADE[key] = rest
            self._keys.append(key)
            others = iter(_operator()(tensors, key))
        fresh = iter([source.clone() if source is not None else next(others) for source in sources])
        outs = [leaves[value] if kind == "input" else next(fresh) if kind == "tensor" else value
                for kind, value in call.outputs]  # fmt: skip
        self.answered.append((path, leaves, spec, call))
        return pytree.tree_unflatten(outs, call.out_spec)

    def _match(
        self, path: str, leaves: list[Any], spec: pytree.TreeSpec, tensors: list[Tensor]
    ) -> tuple[_Call, list[Tensor | None]] | None:
        """The traced call of an alike block that answers this call (the same argument structure
        and :func:`_meta`, its sizes as known now, and outputs needing a gradient as the answer's
        will), and for each of its output tensors an argument whose clone is like it (None: the
        stand-in operator makes it); None where no call answers."""
        meta = [_meta(leaf) for leaf in leaves]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)  # (the answer's outputs')
        for call in self.traced.get(self.group[path], []):
            made = [value for kind, value in call.outputs if kind == "tensor"]
            if call.spec != spec or [_meta(leaf) for leaf in call.leaves] != meta:
                continue
            if any(t.requires_grad != (grad and (t.is_floating_point() or t.is_complex())) for t in made):
                continue
            like = {_meta(t)[:4] + _meta(t)[5:]: t for t in reversed(tensors) if _contiguous(t)}  # (but grad)
            sources = [like.get(_meta(t)[:4] + _meta(t)[5:]) for t in made]
            return call, [s if s is not None and t.requires_grad == (grad and s.requires_grad) else None
                          for s, t in zip(sources, made)]  # fmt: skip
        return None

    def faithful(self, read_inside: Callable[[str], bool]) -> bool:
        """Whether the export is the one without stand-ins: the code after a block whose call
        answered others reads nothing from inside that block (``read_inside(path)``), and each
        answered block, run on the meta device on the example's sizes in training mode (as
        exported), returns what the block whose call answered it returns. True where none was
        answered."""
        if not self.answered:
            return True
        answering = {call.path: call for *_, call in self.answered}
        if any(read_inside(path) for path in answering):
            return False
        modes = {m: m.training for m in self.module.modules()}
        self.module.train()
        try:
            returns = {id(call): _run(self.module.get_submodule(path), call.leaves, call.spec)
                       for path, call in answering.items()}  # fmt: skip
            return all(
                _run(self.module.get_submodule(path), leaves, spec) == returns[id(call)]
                for path, leaves, spec, call in self.answered
            )
        except Exception:  # (a block that does not run on the meta device: traced)
            return False
        finally:
            for m, training in modes.items():
                m.training = training


def _run(block: nn.Module, leaves: list[Any], spec: pytree.TreeSpec) -> tuple[Any, ...]:
    """What ``block`` returns, called as in the export (``leaves`` of ``spec``: fake tensors,
    sizes, values) but on the meta device on the example's sizes, its parameters and buffers too:
    its output's structure, and each leaf's metadata or which argument it is."""
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

    def hint(value: Any) -> Any:
        return guarding_hint_or_throw(value) if isinstance(value, (torch.SymInt, torch.SymBool)) else value

    def meta(t: Tensor) -> Tensor:
        sizes, strides = [hint(s) for s in t.shape], [hint(s) for s in t.stride()]
        return torch.empty_strided(sizes, strides, dtype=t.dtype, device="meta")

    own = {name: meta(t) for name, t in (*block.named_parameters(remove_duplicate=False),
                                         *block.named_buffers(remove_duplicate=False))}  # fmt: skip
    concrete = [meta(leaf) if isinstance(leaf, Tensor) else hint(leaf) for leaf in leaves]
    args, kwargs = pytree.tree_unflatten(concrete, spec)
    with torch.no_grad():
        output = torch.func.functional_call(block, own, tuple(args), dict(kwargs))
    outs, out_spec = pytree.tree_flatten(output)
    described: list[Any] = []
    for out in outs:
        same = next((j for j, leaf in enumerate(concrete) if leaf is out), None)
        if same is not None:
            described.append(("input", same))
        elif isinstance(out, Tensor):
            described.append(("tensor", out.dtype, tuple(out.shape), out.stride()))
        else:
            described.append(("value", type(out), out))
    return out_spec, tuple(described)
