"""Tensor parallelism for a pipeline's stages: each layer of a stage split over the ranks of its
``"tp"`` group with DTensor's ``parallelize_module`` (Megatron's column/row split of a block's
projections: the first of a pair split by output features, the second by input features, one
all-reduce per pair in forward and one in backward).

The ranks of a tp group run the same stage on the same micro-batches; what travels between stages
is whole (replicated) on every one of them, so the pipeline's channels, schedules and collectives
are those of a pipeline per tp rank (``Placement.replicas``: one per (dp, tp) coordinate).

Which modules are split, and how, is a *plan*: names of modules inside a layer (``fnmatch``
patterns, e.g. ``"*.self_attn.q_proj"``) mapped to DTensor ``ParallelStyle``s. ``tp_plan="auto"``
takes, per layer,

- the layer's own ``tensor_parallel_plan(tp)`` if it has one (gpipe's Transformer layers do), or
- the Hugging Face plan of the model the layer was cut from (``config.base_model_tp_plan`` of a
  module inside it: Llama, Qwen2, Mistral, ...; its ``"colwise"`` / ``"rowwise"`` entries), with the
  model's head counts checked against the tp degree;

layers without a plan (embeddings, norms, the head) stay whole on every tp rank. A plan may also be
given as that mapping for every layer, or as a function ``plan(layer, tp_mesh)`` that parallelizes
a layer itself.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

__all__ = ["TpPlan", "check_plan", "parallelize", "plan_of"]

TpPlan = str | Mapping[str, ParallelStyle] | Callable[[nn.Module, DeviceMesh], None]
"""``"auto"``, module-name patterns to styles (for every layer), or a function parallelizing a layer."""

_HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def check_plan(plan: Any) -> None:
    """Refuse a ``tp_plan`` that is none of the three forms, in one line."""
    if plan == "auto" or callable(plan):
        return
    if isinstance(plan, Mapping) and all(isinstance(k, str) and isinstance(v, ParallelStyle) for k, v in plan.items()):
        return
    raise TypeError(
        f"tp_plan must be 'auto', a dict of module-name patterns to torch.distributed.tensor.parallel styles "
        f"(ColwiseParallel(), RowwiseParallel(), ...), or a function plan(layer, tp_mesh) (tp_plan: {plan!r})"
    )


def _hf_plan(layer: nn.Module, tp: int) -> dict[str, ParallelStyle] | None:
    """The Hugging Face tensor-parallel plan of the model ``layer`` was cut from, if it has one."""
    config = None
    for module in layer.modules():
        found = getattr(module, "config", None)
        if isinstance(getattr(found, "base_model_tp_plan", None), dict):
            config = found
            break
    if config is None:
        return None
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"tensor_parallel={tp} does not divide the model's {name} ({heads}): give a tensor_parallel "
                "that divides both head counts"
            )
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in config.base_model_tp_plan.items():
        if style not in _HF_STYLES:
            raise ValueError(
                f"the model's tensor-parallel plan splits {pattern!r} as {style!r}, which gpipe does not map to a "
                f"DTensor style (it maps {', '.join(_HF_STYLES)}): give tp_plan= yourself"
            )
        plan["*" + pattern] = _HF_STYLES[style]()
    return plan


def plan_of(layer: nn.Module, tp: int, plan: TpPlan) -> dict[str, ParallelStyle] | None:
    """The styles for ``layer``'s modules by name under ``plan`` (None: the layer stays whole)."""
    if isinstance(plan, Mapping):
        styles: Mapping[str, ParallelStyle] = plan
    else:
        own = getattr(layer, "tensor_parallel_plan", None)
        found = own(tp) if callable(own) else _hf_plan(layer, tp)
        if found is None:
            return None
        styles = found
    names = [name for name, _ in layer.named_modules() if name]
    chosen: dict[str, ParallelStyle] = {}
    for name in names:
        for pattern, style in styles.items():
            if fnmatch.fnmatchcase(name, pattern):
                chosen[name] = style
                break
    return chosen or None


def _check_divisible(layer: nn.Module, styles: Mapping[str, ParallelStyle], tp: int, where: str) -> None:
    for name, style in styles.items():
        module = layer.get_submodule(name)
        if not isinstance(module, nn.Linear):
            continue
        if isinstance(style, ColwiseParallel):
            size, what = module.out_features, "output"
        elif isinstance(style, RowwiseParallel):
            size, what = module.in_features, "input"
        else:
            continue
        if size % tp:
            raise ValueError(
                f"{where}: {name} ({module.in_features} -> {module.out_features}) is split by {what} features, "
                f"which tensor_parallel={tp} does not divide: give a tensor_parallel that divides {size}"
            )


def parallelize(partitions: Mapping[int, nn.Module], mesh: DeviceMesh, plan: TpPlan) -> int:
    """Split this rank's layers over the 1-D tp ``mesh`` under ``plan``; returns how many layers
    were split. A partition names its layers by their global index."""
    tp, split = mesh.size(), 0
    for s, partition in partitions.items():
        for index, layer in partition.named_children():
            where = f"layer {index} ({type(layer).__name__}) of stage {s}"
            if callable(plan):
                plan(layer, mesh)
                split += 1
                continue
            styles = plan_of(layer, tp, plan)
            if styles is None:
                continue
            _check_divisible(layer, styles, tp, where)
            parallelize_module(layer, mesh, styles)
            split += 1
    return split
