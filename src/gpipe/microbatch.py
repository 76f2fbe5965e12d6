"""Micro-batching: split a mini-batch into M micro-batches along dim 0 and gather them back.

A mini-batch is any pytree (:mod:`torch.utils._pytree`): a tensor, a tuple, a list, a dict (such as a
tokenizer's output), a namedtuple, a dataclass registered with pytree, a Hugging Face ``ModelOutput``,
``None``, nested at will. A :class:`~collections.abc.Mapping` that pytree does not know (a
``UserDict``, transformers' ``BatchEncoding``) is taken as a dict. Every tensor leaf with a batch
dimension is split along dim 0 (they must agree on that size); 0-dimensional tensors and any other
leaf (an int, a string) are handed unchanged to every micro-batch. As with :func:`torch.chunk`, an
uneven batch gives smaller last micro-batches and a batch smaller than M gives fewer than M
micro-batches. Gathering concatenates the tensor leaves and rebuilds the same structure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._pytree import TreeSpec

__all__ = [
    "Batch",
    "Share",
    "as_dicts",
    "batch_size",
    "concat",
    "flat_spec",
    "flatten",
    "gather",
    "is_flat_spec",
    "scatter",
    "scatter_pair",
]

# The leaves a plain tuple may hold and still skip pytree's flattening (they are pytree leaves).
_SCALARS = frozenset({int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device})
_FLAT: dict[int, TreeSpec] = {}  # n -> the spec of a tuple of n leaves


@dataclass(frozen=True)
class Share:
    """What :meth:`gpipe.Pipeline.step` needs to know of a mini-batch when a data-parallel replica is
    handed only its own share of it (the rows :func:`torch.chunk` gives replica r of D, which a data
    set can read alone): the mini-batch's ``size`` (rows) and, for a pipeline with ``loss_count``, the
    items ``count`` of the whole mini-batch's target (every replica's)."""

    size: int
    count: int | None = None

    def span(self, replicas: int, replica: int) -> slice:
        """Where the rows of replica ``replica`` of ``replicas`` are in the mini-batch (as
        :func:`torch.chunk` splits ``size`` rows: an empty span when it makes fewer shares)."""
        step = -(-self.size // replicas)
        return slice(min(replica * step, self.size), min((replica + 1) * step, self.size))

    def rows(self, replicas: int, replica: int) -> int:
        """How many rows replica ``replica`` of ``replicas`` takes (see :meth:`span`)."""
        return len(range(self.size)[self.span(replicas, replica)])


def is_flat_spec(spec: TreeSpec) -> bool:
    """Whether ``spec`` is a plain tuple whose children are all leaves (then the values are the tuple)."""
    return spec.type is tuple and spec.num_nodes == spec.num_leaves + 1


def flat_spec(n: int) -> TreeSpec:
    spec = _FLAT.get(n)
    if spec is None:
        spec = _FLAT[n] = pytree.treespec_tuple([pytree.treespec_leaf()] * n)
    return spec


def _is_flat(value: tuple[Any, ...]) -> bool:
    # A loop, not all(...): a generator costs more than the checks, on a hot path.
    for v in value:  # noqa: SIM110
        if not isinstance(v, Tensor) and type(v) not in _SCALARS:
            return False
    return True


def flatten(value: Any) -> tuple[tuple[Any, ...], TreeSpec | None]:
    """``value``'s leaves and the spec that rebuilds it: ``None`` for a bare tensor, the shared flat
    spec for a plain tuple of tensors and scalars (both without pytree's cost), else pytree's, with
    any Mapping pytree does not know turned into a dict."""
    if isinstance(value, Tensor):
        return (value,), None
    if type(value) is tuple and _is_flat(value):
        return value, flat_spec(len(value))
    leaves, spec = pytree.tree_flatten(value)
    if any(isinstance(v, Mapping) for v in leaves):
        return flatten(_mappings_as_dicts(leaves, spec))
    return tuple(leaves), spec


def as_dicts(value: Any) -> Any:
    """``value`` with every Mapping pytree does not know (a ``UserDict``, a tokenizer's
    ``BatchEncoding``) turned into a dict, at any depth."""
    leaves, spec = pytree.tree_flatten(value)
    return _mappings_as_dicts(leaves, spec) if any(isinstance(v, Mapping) for v in leaves) else value


def _mappings_as_dicts(leaves: list[Any], spec: TreeSpec) -> Any:
    return as_dicts(pytree.tree_unflatten([dict(v) if isinstance(v, Mapping) else v for v in leaves], spec))


@dataclass(frozen=True, slots=True)
class Batch:
    """One micro-batch, flat: its leaves (``values``) and the ``spec`` that rebuilds the structure
    a layer receives (``None``: a bare tensor; see :func:`flatten`).

    Flat because that is what travels between stages, gets gradients and is split and concatenated;
    the structure is rebuilt only where a layer or the loss is called (:attr:`value`).

    Between stages a batch also carries the skip connections stashed and not yet popped
    (:mod:`gpipe.skip`): their tensors are the last ``len(skips)`` values, ``skips`` their names;
    and ``needs_grad``, per value, whether it depends on something that requires grad (only those
    get a gradient back; ``None`` where not known, as for a mini-batch's own micro-batches, whose
    tensors say it themselves).
    """

    values: tuple[Any, ...]
    spec: TreeSpec | None
    skips: tuple[str, ...] = ()
    needs_grad: tuple[bool, ...] | None = None

    @staticmethod
    def of(value: Any) -> Batch:
        """The batch of a layer's output (or a mini-batch): any pytree."""
        if isinstance(value, Tensor):  # the hot paths: no pytree flattening for a bare tensor ...
            return Batch((value,), None)
        if type(value) is tuple and _is_flat(value):  # ... nor for a plain tuple of tensors
            return Batch(value, flat_spec(len(value)))
        values, spec = flatten(value)
        return Batch(values, spec)

    @property
    def value(self) -> Any:
        """What a layer receives: the tensor itself, or the rebuilt structure (without the skips)."""
        spec = self.spec
        if spec is None:
            return self.values[0]
        own = self.values[: len(self.values) - len(self.skips)] if self.skips else self.values
        if spec.type is tuple and spec.num_nodes == spec.num_leaves + 1:  # a tuple of leaves: ``own``
            return own
        return pytree.tree_unflatten(own, spec)

    def skip_items(self) -> dict[str, Any]:
        """The skip connections this batch carries, by name."""
        return dict(zip(self.skips, self.values[len(self.values) - len(self.skips) :])) if self.skips else {}

    def with_skips(self, skips: dict[str, Any]) -> Batch:
        """The same values, carrying ``skips`` (in name order) instead of any it carried."""
        names = tuple(sorted(skips))
        own = self.values[: len(self.values) - len(self.skips)]
        return Batch(own + tuple(skips[n] for n in names), self.spec, names)

    def tensors(self) -> Iterator[Tensor]:
        return (v for v in self.values if isinstance(v, Tensor))

    def map(self, fn: Callable[[Tensor], Any]) -> Batch:
        """Apply ``fn`` to every tensor, keeping the other values."""
        values = tuple(fn(v) if isinstance(v, Tensor) else v for v in self.values)
        return Batch(values, self.spec, self.skips, self.needs_grad)

    def grad_flags(self) -> tuple[bool, ...]:
        """Per value, whether it needs a gradient: ``needs_grad``, or what the tensors say."""
        if self.needs_grad is not None:
            return self.needs_grad
        return tuple(isinstance(v, Tensor) and v.requires_grad for v in self.values)

    def flagged(self, needs_grad: tuple[bool, ...]) -> Batch:
        return Batch(self.values, self.spec, self.skips, needs_grad)

    def __len__(self) -> int:
        return len(self.values)


def _paths(values: Sequence[Any], spec: TreeSpec | None) -> list[str]:
    """Where each leaf sits in the structure (``['mask']``, ``[1]``), for error messages."""
    if spec is None:
        return ["the tensor"]
    if is_flat_spec(spec):
        return [f"[{i}]" for i in range(len(values))]
    try:
        with_paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(values), spec))
        return [pytree.keystr(path) for path, _ in with_paths]
    except Exception:  # a node type registered without keys: number the leaves
        return [f"leaf {i}" for i in range(len(values))]


def batch_size(batch: Batch) -> int:
    """A micro-batch's number of samples: the batch dimension of its tensors (:func:`scatter`
    checked they agree; 0-dimensional ones have none)."""
    return next(t.size(0) for t in batch.tensors() if t.dim())


def scatter(inputs: Any, chunks: int) -> list[Batch]:
    """Split ``inputs`` (any pytree) into at most ``chunks`` micro-batches along dim 0."""
    if chunks <= 0:
        raise ValueError(f"chunks must be a positive integer (chunks: {chunks})")
    values, spec = flatten(inputs)
    if not any(isinstance(v, Tensor) for v in values):
        kinds = ", ".join(type(v).__name__ for v in values) or "nothing"
        holds = f" of ({kinds})" if spec is not None and not spec.is_leaf() else ""
        raise TypeError(
            f"expected a tensor, or a pytree (tuple, list, dict, ...) with at least one tensor to split "
            f"along dim 0, got {type(inputs).__name__}{holds}"
        )
    batched = [i for i, v in enumerate(values) if isinstance(v, Tensor) and v.dim()]
    if not batched:
        raise ValueError(
            "cannot split a 0-dimensional tensor into micro-batches; give a batch dimension (to at "
            "least one tensor: 0-dimensional ones are handed whole to every micro-batch)"
        )
    sizes = sorted({values[i].size(0) for i in batched})
    if len(sizes) != 1:
        paths = _paths(values, spec)
        where = ", ".join(f"{paths[i]}: {values[i].size(0)}" for i in batched)
        raise ValueError(f"all tensors of a batch must have the same size in dim 0, got sizes {sizes} ({where})")
    if sizes[0] == 0:
        raise ValueError("cannot split an empty batch (size 0 in dim 0) into micro-batches")
    split: list[tuple[Tensor, ...] | None] = [None] * len(values)
    for i in batched:
        split[i] = values[i].chunk(chunks)
    count = len(split[batched[0]] or ())
    return [Batch(tuple(v if s is None else s[m] for v, s in zip(values, split)), spec) for m in range(count)]


def scatter_pair(inputs: Any, target: Any, chunks: int) -> tuple[list[Batch], list[Batch], list[int]]:
    """Inputs and targets split alike into micro-batches, and the micro-batches' sizes."""
    batches, targets = scatter(inputs, chunks), scatter(target, chunks)
    sizes = [batch_size(b) for b in batches]
    if [batch_size(t) for t in targets] != sizes:
        raise ValueError(
            f"inputs and target split into different micro-batches (inputs: {sizes}, "
            f"target: {[batch_size(t) for t in targets]}); give them the same size in dim 0"
        )
    return batches, targets, sizes


def concat(batches: Sequence[Batch]) -> Batch:
    """The micro-batches concatenated back into one batch, in order, flat (see :func:`gather`)."""
    if not batches:
        raise ValueError("nothing to gather: no micro-batches")
    first = batches[0]
    own = len(first.values) - len(first.skips)
    for m, b in enumerate(batches[1:], 1):
        if len(b.values) - len(b.skips) != own or (b.spec is not first.spec and b.spec != first.spec):
            raise ValueError(
                f"micro-batch {m} has another structure than micro-batch 0 ({_describe(b)} vs "
                f"{_describe(first)}); the layers must give every micro-batch the same structure to gather"
            )
    out: list[Any] = []
    for i in range(own):
        v = first.values[i]
        if isinstance(v, Tensor):
            parts = [b.values[i] for b in batches]
            out.append(torch.stack(parts) if v.dim() == 0 else torch.cat(parts))
        else:
            out.append(v)
    return Batch(tuple(out), first.spec)


def _describe(batch: Batch) -> str:
    own = len(batch.values) - len(batch.skips)
    return "a tensor" if batch.spec is None else f"{own} leaves in {pytree.treespec_pprint(batch.spec)}"


def gather(batches: Sequence[Batch]) -> Any:
    """Concatenate micro-batches back into one batch, in order, with the micro-batches' structure.

    Tensors are concatenated along dim 0 (0-dimensional ones, such as a per-micro-batch loss, are
    stacked); any other leaf is taken from the first micro-batch.
    """
    return concat(batches).value
