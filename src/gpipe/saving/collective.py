"""The ranks' agreement during a save: the process group of the checkpoint collectives, and each
step's gathering of every rank's outcome, so that a rank's failure fails the save on every rank."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from gpipe.saving.folders import NoSpaceError
from gpipe.saving.keys import _engine

__all__ = ["_agree", "_failed_on", "_group", "_report", "_run"]

_GROUP_TIMEOUT = timedelta(minutes=30)  # how long a rank waits for another in a save's collectives

_group_lock = threading.Lock()
_group_of_world: tuple[Any, Any] | None = None  # (the default group, the checkpoints' group)


def _group(model: nn.Module) -> Any:
    """The process group of the checkpoint collectives (None in one process): gloo, over every rank,
    made at the first save (a collective: every rank saves)."""
    global _group_of_world
    if not _engine(model).placement.is_distributed:
        return None
    world = dist.group.WORLD
    with _group_lock:
        if _group_of_world is None or _group_of_world[0] is not world:
            _group_of_world = (world, dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT))
        return _group_of_world[1]


def _run(what: Callable[[], Any] | None) -> tuple[Any, BaseException | None]:
    if what is None:
        return None, None
    try:
        return what(), None
    except Exception as e:
        return None, e


Report = tuple[int | None, str, str]


def _report(error: BaseException) -> Report:
    code = error.errno if isinstance(error, OSError) else None
    text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return code, text, type(error).__name__


def _failed_on(rank: int, report: Report) -> BaseException:
    """The error that ranks other than ``rank`` raise when it failed."""
    code, message, kind = report
    text = f"checkpoint not saved: rank {rank} failed: {kind}: {message}"
    if code == errno.ENOSPC and kind == NoSpaceError.__name__:
        return NoSpaceError(errno.ENOSPC, f"{message} (on rank {rank})")
    return OSError(code, text) if code is not None else RuntimeError(text)


def _agree(group: Any, value: Any, error: BaseException | None) -> list[Any]:
    """Every rank's ``value``, once every rank got here; raises on every rank if one failed: the
    failing rank its own error, the others one naming it."""
    report = None if error is None else _report(error)
    if group is not None:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (value, report), group=group)
    else:
        gathered = [(value, report)]
    if error is not None:
        raise error
    for rank, (_, failed) in enumerate(gathered):
        if failed is not None:
            raise _failed_on(rank, failed)
    return [v for v, _ in gathered]
