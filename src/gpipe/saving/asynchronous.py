"""Asynchronous saves: the copy of this rank's entries into CPU memory (into buffers kept for the
next save), :class:`AsyncSave`, and the wait for the save under way."""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gpipe.engine import Engine

__all__ = ["AsyncSave", "_stage", "_under_way", "_wait_for_the_last_save"]

_buffers: tuple[weakref.ref[Engine], dict[str, Tensor]] | None = None
"""The CPU buffers of the last asynchronous save, and its pipeline's engine: the next one copies
into them (free of the page faults of new memory: several times faster)."""


def _forget_buffers(engine: weakref.ref[Engine]) -> None:
    global _buffers
    if _buffers is not None and _buffers[0] is engine:  # its pipeline is gone
        _buffers = None


def _stage(engine: Engine, entries: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``entries`` in CPU memory, which later changes to the model do not reach: into the
    buffers of the previous asynchronous save of ``engine``'s pipeline, which is over (every save
    waits for the one before), where the shapes and dtypes are the same."""
    global _buffers
    if _buffers is None or _buffers[0]() is not engine:
        _buffers = (weakref.ref(engine, _forget_buffers), {})
    buffers = _buffers[1]
    staged: dict[str, Any] = {}
    memo: dict[int, Any] = {}
    for key, value in entries.items():
        if not isinstance(value, Tensor):
            staged[key] = copy.deepcopy(value, memo)
            continue
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = buffers[key] = torch.empty_like(value, device="cpu")
        staged[key] = buffer.copy_(value.detach())
    for key in buffers.keys() - staged.keys():
        del buffers[key]
    return staged


class AsyncSave:
    """A checkpoint that :func:`save` writes in the background (``asynchronous=True``): its step and
    folder, :meth:`done` and :meth:`wait`. The checkpoint appears in ``latest`` once it is complete,
    whether or not anyone waits for it. (Under torch.distributed, wait before destroying the process
    group: the write and the commit use it.)"""

    def __init__(self, step: int, path: Path, work: Callable[[], None]) -> None:
        self.step = step
        self.path = path
        """The checkpoint's folder, once committed."""
        self._error: BaseException | None = None
        self._seen = False
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"gpipe-save-{path.name}")

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # kept for wait(): the thread itself has no one to tell
            self._error = e

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error is not None else "done"
        return f"<AsyncSave of step {self.step} into {str(self.path)!r}: {state}>"

    def done(self) -> bool:
        """Whether the save is over: committed, or failed."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait until the checkpoint is written and committed (at most ``timeout`` seconds: then
        :class:`TimeoutError`); return its folder, or raise what made the save fail."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the checkpoint of step {self.step} is still being written after {timeout} s")
        if self._error is not None:
            self._seen = True
            raise self._error
        return self.path


_under_way: list[AsyncSave] = []  # at most one: each save waits for the one before


def _wait_for_the_last_save() -> None:
    if not _under_way:
        return
    last = _under_way.pop()
    last._thread.join()
    if last._error is not None and not last._seen:
        last._seen = True
        last._error.add_note(f"(in the asynchronous save of step {last.step}, which a later save waited for)")
        raise last._error
