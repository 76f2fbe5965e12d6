"""The layout of a checkpoint's entries: their keys (``model.``, ``optimizer.state.``,
``optimizer.param_groups.``), the layers of a pipeline by global index, and the entries of this
process's layers and optimizer."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.engine import Engine
from gpipe.runtime.stage import Stage

__all__ = [
    "FORMAT",
    "GROUPS",
    "MODEL",
    "STATE",
    "_engine",
    "_entries",
    "_layers",
    "_optimizer_kind",
    "_optimizer_params",
    "layer_state",
]

FORMAT = "gpipe-dcp-1"
"""The manifest's ``format``: DCP entries keyed as gpipe.saving's docstring says."""

MODEL = "model."
STATE = "optimizer.state."
GROUPS = "optimizer.param_groups."


def _engine(model: nn.Module) -> Engine:
    from gpipe.gpipe import GPipe
    from gpipe.pipeline import Pipeline

    if not isinstance(model, (Pipeline, GPipe)):
        raise TypeError(f"expected a gpipe.Pipeline or gpipe.GPipe, got {type(model).__name__}")
    return model.engine


def _stages(model: nn.Module) -> list[Stage]:
    return _engine(model).stages


def _layers(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    for stage in _stages(model):
        for j, layer in enumerate(stage.module):
            yield stage.first + j, layer


def layer_state(model: nn.Module) -> dict[str, Tensor]:
    """This process's layers' parameters and buffers, keyed ``"<global layer index>.<name>"``."""
    return {f"{i}.{name}": t.detach() for i, layer in _layers(model) for name, t in layer.state_dict().items()}


def _parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """The global names (``"12.weight"``) of this process's parameters, by ``id``."""
    names: dict[int, list[str]] = {}
    for i, layer in _layers(model):
        for name, p in layer.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(f"{i}.{name}")
    return names


def _optimizer_kind(optimizer: torch.optim.Optimizer | None) -> str | None:
    """What kind of state ``optimizer`` keeps: its class, or the class whose state it keeps alike
    (``gpipe_state_like``: a subclass whose checkpoints load in its base and back)."""
    if optimizer is None:
        return None
    kind = getattr(optimizer, "gpipe_state_like", type(optimizer))
    return f"{kind.__module__}.{kind.__qualname__}"


def _optimizer_params(
    model: nn.Module, optimizer: torch.optim.Optimizer, packed: Mapping[str, Any]
) -> list[list[tuple[int, list[str]]]]:
    """For each of ``optimizer``'s groups: its parameters' indices in ``packed`` (its state_dict)
    with their global names."""
    names = _parameter_names(model)
    groups = []
    for group, saved in zip(optimizer.param_groups, packed["param_groups"], strict=True):
        members = []
        for p, index in zip(group["params"], saved["params"], strict=True):
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is none of the parameters "
                    "of this process's layers: a checkpoint keys optimizer state by the layers' parameter names"
                )
            members.append((index, names[id(p)]))
        groups.append(members)
    return groups


def _hyper_parameters(group: Mapping[str, Any]) -> dict[str, Any]:
    # param_names (an optimizer over named_parameters) are this layout's names: not saved, kept on load
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _entries(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This process's DCP entries: its layers' state, and its optimizer's by parameter name."""
    entries: dict[str, Any] = {
        f"{MODEL}{i}.{name}": t.detach() if isinstance(t, Tensor) else t
        for i, layer in _layers(model)
        for name, t in layer.state_dict().items()
    }
    if optimizer is None:
        return entries
    packed = optimizer.state_dict()
    for members, saved in zip(_optimizer_params(model, optimizer, packed), packed["param_groups"]):
        hyper = _hyper_parameters(saved)
        for index, names in members:
            for name in names:
                entries[f"{GROUPS}{name}"] = hyper
                for key, value in packed["state"].get(index, {}).items():
                    entries[f"{STATE}{name}.{key}"] = value.detach() if isinstance(value, Tensor) else value
    return entries
