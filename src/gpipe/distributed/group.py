"""The default process group: :func:`init_from_env` starts it from torchrun's environment, and it
is destroyed at interpreter exit."""

from __future__ import annotations

import atexit
import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_from_env"]


def init_from_env(timeout: float = 60.0) -> bool:
    """Initialize the default process group from torchrun's environment (``WORLD_SIZE`` > 1), with
    NCCL when there is a GPU and gloo otherwise. Returns whether the process is distributed."""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout))
    atexit.register(_shutdown)
    return True


def _shutdown() -> None:
    """Destroy the process group gpipe created, at interpreter exit."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
