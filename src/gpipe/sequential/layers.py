"""The first and last layers' ends: :class:`_Inputs` checks the packed input against the trace
and flattens it, :class:`_Outputs` rebuilds the module's output structure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from gpipe.microbatch import as_dicts

__all__ = ["_Inputs", "_Outputs", "_Shared", "_shape_of"]


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
