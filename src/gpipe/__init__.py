"""gpipe: GPipe pipeline-parallel training on PyTorch.

The front end :class:`GPipe` wraps an ``nn.Sequential``; the engine beneath it is built around the
schedule IR in :mod:`gpipe.schedule`.
"""

from gpipe.batchnorm import DeferredBatchNorm
from gpipe.checkpoint import is_checkpointing, is_recomputing
from gpipe.gpipe import GPipe, MovingPartitionError
from gpipe.pipeline import Pipeline
from gpipe.saving import load as load_checkpoint
from gpipe.saving import save as save_checkpoint
from gpipe.schedule import Schedule, ScheduleError, make_schedule, simulate
from gpipe.trace import StepTrace

__all__ = [
    "DeferredBatchNorm",
    "GPipe",
    "MovingPartitionError",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "StepTrace",
    "is_checkpointing",
    "is_recomputing",
    "load_checkpoint",
    "make_schedule",
    "save_checkpoint",
    "simulate",
]

__version__ = "0.1.0"
