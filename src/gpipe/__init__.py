"""gpipe: GPipe pipeline-parallel training on PyTorch.

The front ends :class:`GPipe` and :class:`Pipeline` take an ``nn.Sequential`` or any module
(traced into layers by :func:`to_sequential`); the engine beneath them is built around the schedule
IR in :mod:`gpipe.schedule`.

This is the library: importing it loads none of the applications built on it (``gpipe train``,
``translate``, ``bench``, the models and data sets) nor their dependencies. The parts and what flows
between them: docs/architecture.md.
"""

from gpipe import balance, batchnorm, skip  # torchgpipe's module paths: gpipe.balance, gpipe.skip, ...
from gpipe.batchnorm import DeferredBatchNorm
from gpipe.checkpoint import Selective, is_checkpointing, is_recomputing
from gpipe.gpipe import GPipe, MovingPartitionError
from gpipe.pipeline import Pipeline
from gpipe.runtime.planner import AutoSchedule
from gpipe.runtime.trace import StepTrace
from gpipe.saving import load as load_checkpoint
from gpipe.saving import save as save_checkpoint
from gpipe.schedule import Schedule, ScheduleError, make_schedule, simulate
from gpipe.sequential import ToSequentialError, to_sequential

__all__ = [
    "AutoSchedule",
    "DeferredBatchNorm",
    "GPipe",
    "MovingPartitionError",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "Selective",
    "StepTrace",
    "ToSequentialError",
    "balance",
    "batchnorm",
    "is_checkpointing",
    "is_recomputing",
    "load_checkpoint",
    "make_schedule",
    "save_checkpoint",
    "simulate",
    "skip",
    "to_sequential",
]

__version__ = "0.1.0"
