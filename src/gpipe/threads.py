"""gpipe's background threads, and how they end when the interpreter exits.

A daemon thread that is inside a torch or c10d call when the interpreter finalizes aborts the
process: CPython ends such a thread as it takes the GIL back, and that unwinding meets C++ code
that may not throw ("terminate called without an active exception", SIGABRT). A training run that
had finished its work would then exit with a crash, and torchrun would restart it.

So every daemon thread of gpipe's that calls into torch (a process group's store, a collective's
wait, the batches made ahead) is started by :func:`start`, with a way to ask it to stop. At exit,
after gpipe's other exit handlers (they may still use them), each is asked and waited for, a few
seconds in all (:func:`settle`). One still running after that waits on a peer that does not
answer: where the process's exit status is known (the ``gpipe`` command records it with
:func:`exiting`), the process then ends at once with that status, without finalizing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SETTLE_SECONDS", "exiting", "settle", "start"]

SETTLE_SECONDS = 3.0  # how long the exit waits, in all, for gpipe's threads to end

_lock = threading.Lock()
_threads: list[tuple[threading.Thread, Callable[[], None]]] = []
_status: int | None = None  # the exit status the gpipe command returns (:func:`exiting`)


def start(
    target: Callable[..., Any], *, name: str, stop: Callable[[], None], args: tuple[Any, ...] = ()
) -> threading.Thread:
    """Start ``target(*args)`` in a daemon thread named ``name``; ``stop()`` asks it to end soon (it
    may be called more than once, and after the thread ended), which :func:`settle` does at exit."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _lock:
        _threads[:] = [(t, s) for t, s in _threads if t.is_alive()]
        _threads.append((thread, stop))
    thread.start()
    return thread


def settle(seconds: float = SETTLE_SECONDS) -> list[str]:
    """Ask each live thread :func:`start` started to stop, and wait for them, ``seconds`` at most in
    all; the names of those still running."""
    with _lock:
        live = [(t, s) for t, s in _threads if t.is_alive() and t is not threading.current_thread()]
    for _, stop in live:
        with contextlib.suppress(Exception):  # (at exit: one that cannot be asked is waited for all the same)
            stop()
    deadline = time.monotonic() + seconds
    for thread, _ in live:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t, _ in live if t.is_alive()]


def exiting(status: int) -> int:
    """Record ``status`` as the status this process exits with (the ``gpipe`` command does, as it
    returns), and return it: should a thread not end at exit, the process ends with it at once."""
    global _status
    _status = status
    return status


def _at_exit() -> None:
    stuck = settle(SETTLE_SECONDS)
    if stuck and _status is not None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # (a closed stream)
                stream.flush()
        os._exit(_status)


# Registered as this module is imported, before any thread starts and before gpipe's other exit
# handlers (the process group's, the heartbeat's): exit handlers run last-registered first, so this one
# runs after them.
atexit.register(_at_exit)
