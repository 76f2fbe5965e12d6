"""``--precision``: the dtype of a run's activations. ``fp32`` computes in float32; ``bf16`` runs the
training step and the evaluations under ``torch.autocast`` in bfloat16 (:func:`autocast`), which the
pipeline carries to every stage, worker and recomputation. Only the computation is in bf16: the
parameters (the master weights), their gradients, the clipping and the optimizer's state stay
float32, and the loss is computed in float32 from the logits (:func:`gpipe.recipe.label_smoothing_loss`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from gpipe.train.checks import ConfigError

__all__ = ["DTYPES", "PRECISIONS", "autocast", "check_supported", "device_type"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PRECISIONS = tuple(DTYPES)


def device_type(devices: Iterable[torch.device]) -> str:
    """The autocast device type of a pipeline's local ``devices``: ``cuda`` if a stage is on a GPU,
    else ``cpu``."""
    return "cuda" if any(d.type == "cuda" for d in devices) else "cpu"


def check_supported(precision: str, devices: Iterable[torch.device]) -> None:
    """Refuse bf16 on a GPU that does not compute in it (before Ampere), naming the fix."""
    if precision == "bf16" and device_type(devices) == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"--precision bf16: the GPU {torch.cuda.get_device_name()!r} does not compute in bfloat16; "
            "leave --precision out (fp32)"
        )


def autocast(precision: str, devices: Iterable[torch.device]) -> contextlib.AbstractContextManager[Any]:
    """The context a step or an evaluation of ``precision`` runs in on ``devices`` (this process's
    stages'): nothing for ``fp32``, ``torch.autocast`` in its dtype otherwise."""
    dtype = DTYPES[precision]
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type(devices), dtype=dtype)
