"""The first and last layers' ends: :class:`_Inputs` checks the packed input against the trace
and flattens it, :class:`_Outputs` rebuilds the module's output structure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from gpipe.microbatch import as_dicts

__all__ = ["_Inputs", "_Outputs", "_Shared", "_shape_of", "bring_init"]


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
        if expr.is_number:  # a dynamic size the model's code fixed while it was traced (len(x), a config's size)
            dims.append(int(expr))
            continue
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
    trace must not run silently on what the trace does not cover). The settings (keyword arguments
    without tensors, fixed at tracing) may come along in a dict input, with the traced values."""

    def __init__(
        self,
        spec: pytree.TreeSpec,
        constants: dict[int, Any],
        shapes: dict[int, Shape],
        names: Sequence[str] = (),
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._spec, self.constants, self.shapes = _Shared(spec), constants, shapes
        self.names, self.settings = list(names), dict(settings or {})

    @property
    def spec(self) -> pytree.TreeSpec:
        spec: pytree.TreeSpec = self._spec.value
        return spec

    def forward(self, inputs: Any) -> list[Any]:
        inputs = as_dicts(inputs)
        if self.settings and isinstance(inputs, dict):
            inputs = self._without_settings(inputs)
        leaves, spec = pytree.tree_flatten(inputs)
        if spec != self.spec:
            expected = self._expected(inputs, spec)
            raise TypeError(f"the first layer takes inputs structured as the example it was traced with: {expected}")
        for i, value in self.constants.items():
            if not _equal(leaves[i], value):
                raise ValueError(
                    f"{self._name(i)} of the first layer is {leaves[i]!r}, but the module was traced with {value!r} "
                    "(non-tensor inputs are fixed at tracing); trace it again with this value"
                )
        sizes: dict[str, int] = {}
        for i, shape in self.shapes.items():
            reason = self._misfit(leaves[i], shape, sizes)
            if reason is None:
                continue
            got = tuple(leaves[i].shape) if isinstance(leaves[i], Tensor) else type(leaves[i]).__name__
            raise ValueError(
                f"{self._name(i)} of the first layer has shape {got}, which the trace does not cover "
                f"({self._describe(shape)}): {reason}"
            )
        return leaves

    def _name(self, i: int) -> str:
        return self.names[i] if i < len(self.names) else f"input {i}"

    def _without_settings(self, inputs: dict[str, Any]) -> dict[str, Any]:
        for key, traced in self.settings.items():
            if key in inputs and not _equal(inputs[key], traced):
                raise ValueError(
                    f"input {key!r} is {inputs[key]!r}, but the module was traced with {key}={traced!r} (keyword "
                    f"arguments without tensors are settings, fixed at tracing); trace it again with "
                    f"{key}={inputs[key]!r}, or leave {key!r} out of the input"
                )
        return {k: v for k, v in inputs.items() if k not in self.settings}

    def _expected(self, inputs: Any, spec: pytree.TreeSpec) -> str:
        if self.spec.type is dict and isinstance(inputs, dict):
            want, got = list(self.spec.context), list(inputs)
            missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
            settings = f" (and the settings it was traced with: {self.settings})" if self.settings else ""
            return (
                f"a dict with the keys {want}{settings}, got the keys {got}"
                + (f"; missing: {missing}" if missing else "")
                + (f"; not traced: {extra} (trace the module with them)" if extra else "")
            )
        return f"{self.spec}, got {spec}"

    @staticmethod
    def _misfit(t: Any, shape: Shape, sizes: dict[str, int]) -> str | None:
        """Why ``t`` does not fit the traced ``shape`` (None where it does)."""
        if not isinstance(t, Tensor):
            return f"a {type(t).__name__} where the trace has a tensor"
        if t.dim() != len(shape):
            return f"{t.dim()} dimensions where the trace has {len(shape)}"
        for d, (size, dim) in enumerate(zip(t.shape, shape)):
            if isinstance(dim, int):
                if size != dim:
                    hint = (
                        "; dim 0 is the batch: trace the module on an example shaped as what the first layer gets, "
                        "one micro-batch (gpipe.Pipeline and gpipe.GPipe trace on the sample's first micro-batch)"
                        if d == 0
                        else "; trace the module on an example of the size it will run on"
                    )
                    return (
                        f"the module's code fixed dim {d} at {dim} when it was traced (it uses that size as a number: "
                        f"len(x) in a loss, a configured size){hint}"
                    )
            elif dim is not None:
                name, lower, upper = dim
                # Export assumes a dynamic size is not 0 or 1 when it traces; sizes 1 run as well.
                if size < min(lower, 1) or (upper is not None and size > upper):
                    return f"dim {d} ({name}) is {size}, outside the traced range {lower}..{upper}"
                if sizes.setdefault(name, size) != size:
                    return (
                        f"dim {d} is {size} where another input's dim named {name} is {sizes[name]} (sizes named alike "
                        "must agree); trace the module with such an example"
                    )
        return None

    @staticmethod
    def _describe(shape: Shape) -> str:
        return "[" + ", ".join("?" if d is None else str(d) if isinstance(d, int) else d[0] for d in shape) + "]"


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for non-tensor values (False where the comparison is not a plain truth value)."""
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # a comparison that is not a truth value (arrays): not equal
        return False


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


def bring_init(layer: nn.Module, init: Any) -> None:
    """Make ``init(layer)`` the initialization ``layer`` brings: what the pipeline runs when it
    materializes the layer from the meta device (:func:`gpipe.runtime.partition.init_of`). Kept
    outside the module's children (a :class:`_Shared`), and, for a traced layer, by ``copy.deepcopy``
    too, which rebuilds a ``GraphModule`` with only the attributes its ``meta`` names."""
    shared = _Shared(init)
    layer.__dict__["gpipe_init"] = shared
    if isinstance(layer, fx.GraphModule):
        layer.meta.setdefault("_user_preserved_attributes", {})["gpipe_init"] = shared
