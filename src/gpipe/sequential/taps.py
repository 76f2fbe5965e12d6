"""Values a block computes for the code after it: a mixture-of-experts router's logits collected
for the load-balancing loss, the attention weights of ``output_attentions=True``. A Hugging Face
model collects them with forward hooks on modules inside the blocks, and its code after the blocks
reads them; a layer cut at the blocks must hand them on. :class:`_Recorder` notes, while the model
is exported, what every module inside a kept module returns; :func:`_find_tap` names the module
call and output leaf that a value read after the block is; :func:`_call_tapping` calls the block as
itself and returns, besides its output, those values, caught by forward hooks on those modules."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

__all__ = ["Tap", "_Recorder", "_call_tapping", "_find_tap"]

Tap = tuple[str, int, int]
"""A value a block computes: (the module inside the block, as a path relative to the block; which
of its calls within one call of the block, from 0; which leaf of that call's output)."""


@dataclass
class _Returned:
    """What one call of a module inside a kept module returned, seen during the export."""

    kept: str  # the kept module's path
    kept_call: int  # which call of the kept module, from 0
    path: str  # the module's path relative to the kept one
    call: int  # which of its calls within that call of the kept module, from 0
    leaves: list[Any]  # its output's leaves (fake tensors)


class _Recorder:
    """While active (around ``torch.export.export``), records what each module inside the kept
    modules returns, by forward hooks that compute nothing."""

    def __init__(self, module: nn.Module, kept: Sequence[str]) -> None:
        self.module, self.kept = module, list(kept)
        self.returned: list[_Returned] = []
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> _Recorder:
        self.returned = []
        active: list[str] = []  # the kept modules running, innermost last
        calls: dict[str, int] = {}
        inner: dict[tuple[str, str], int] = {}

        def enter(kept: str) -> None:
            calls[kept] = calls.get(kept, -1) + 1
            active.append(kept)
            for key in [k for k in inner if k[0] == kept]:
                del inner[key]

        def leave(kept: str) -> None:
            if active and active[-1] == kept:
                active.pop()

        def returned(kept: str, path: str, output: Any) -> None:
            if not active or active[-1] != kept:
                return
            n = inner[(kept, path)] = inner.get((kept, path), -1) + 1
            self.returned.append(_Returned(kept, calls[kept], path, n, pytree.tree_leaves(output)))

        for kept in self.kept:
            owner = self.module.get_submodule(kept)
            self._handles.append(owner.register_forward_pre_hook(lambda m, a, kept=kept: enter(kept)))
            self._handles.append(owner.register_forward_hook(lambda m, a, o, kept=kept: leave(kept), always_call=True))
            for path, sub in owner.named_modules():
                if path:
                    hook = sub.register_forward_hook(lambda m, a, o, kept=kept, path=path: returned(kept, path, o))
                    self._handles.append(hook)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _same(a: Any, b: Tensor) -> bool:
    """Whether ``a`` is the tensor ``b`` (or a view of its storage with the same geometry)."""
    return (
        isinstance(a, Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())  # type: ignore[no-untyped-call]
    )


def _find_tap(recorder: _Recorder, kept: str, kept_call: int, value: Tensor) -> Tap | None:
    """The module call inside call ``kept_call`` of ``kept`` that returned ``value`` (a traced
    node's fake tensor), as a :data:`Tap`; None where no module returned it."""
    for r in recorder.returned:
        if r.kept == kept and r.kept_call == kept_call:
            for i, leaf in enumerate(r.leaves):
                if _same(leaf, value):
                    return (r.path, r.call, i)
    return None


def _call_tapping(block: nn.Module, taps: tuple[Tap, ...], args: Any, kwargs: Any) -> tuple[Any, tuple[Any, ...]]:
    """``block(*args, **kwargs)``, and the values the taps name, caught by forward hooks on the
    block's modules for the length of the call (in this thread only: a block belongs to one stage)."""
    thread = threading.get_ident()
    counts: dict[str, int] = {}
    caught: dict[Tap, Any] = {}

    def hook(path: str, output: Any) -> None:
        if threading.get_ident() != thread:
            return
        n = counts[path] = counts.get(path, -1) + 1
        leaves = pytree.tree_leaves(output)
        for tap in taps:
            if tap[0] == path and tap[1] == n and tap[2] < len(leaves):
                caught[tap] = leaves[tap[2]]

    handles = [
        block.get_submodule(path).register_forward_hook(lambda m, a, o, path=path: hook(path, o))
        for path in dict.fromkeys(tap[0] for tap in taps)
    ]
    try:
        out = block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [tap for tap in taps if tap not in caught]
    if missing:
        path, call, leaf = missing[0]
        raise RuntimeError(
            f"{type(block).__name__}'s module {path!r} did not return, in call {call} of it, the output {leaf} "
            "that the model's code after the block reads, as it did when the model was traced; the block took "
            "another path (training mode, other settings): trace the model as it runs"
        )
    return out, tuple(caught[tap] for tap in taps)
