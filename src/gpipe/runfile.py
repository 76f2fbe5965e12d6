"""A run of ``gpipe train`` as its checkpoints describe it, for every command that reads one (``--resume``,
``--init RUN``, ``gpipe eval``, ``translate``, ``export``, ``runs``): each checkpoint holds ``run.json``
(:data:`RUN`), whose ``config`` is the run's settings and whose other entries say what its model was sized
from (``data``: the kind of its data, ``vocab``, ...); :func:`read_run` reads it, checked, and
:data:`WHERE_AND_HOW` names the settings that say where and how a run ran rather than what it trained
(never a hyper-parameter in TensorBoard, never a column of ``gpipe runs``).

A run that trains holds ``OUT/.lock`` (:data:`LOCK`: an exclusive ``flock``, with ``PID HOST`` in it);
:func:`running` tells a live run from a dead one by that process, without taking the lock (looking
never gets in the way of a run starting).

An application module of the standard library alone: ``gpipe runs`` reads it without torch's training."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

__all__ = ["LOCK", "RUN", "WHERE_AND_HOW", "RunFileError", "lock_line", "read_run", "running"]

RUN = "run.json"
LOCK = ".lock"

WHERE_AND_HOW = ("out", "resume", "overwrite", "progress", "tensorboard", "timeout", "devices")
"""The settings of ``gpipe train`` that say where a run writes and how it runs, not what it trains."""


class RunFileError(ValueError):
    """A checkpoint's ``run.json`` that cannot be read: the message names the file and what is wrong
    (the caller adds the flag that named the checkpoint, and the fix)."""


def read_run(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """``checkpoint``'s ``run.json``: an object whose ``config`` is an object of settings. Raises
    :class:`RunFileError`."""
    path = Path(checkpoint) / RUN
    try:
        run = json.loads(path.read_text())
    except OSError as exc:
        raise RunFileError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise RunFileError(f"{str(path)!r} is not JSON ({exc})") from None
    if not isinstance(run, dict) or not isinstance(run.get("config"), dict):
        raise RunFileError(
            f"{str(path)!r} is not a run description of gpipe train: it holds no object of settings under 'config'"
        )
    return run


def lock_line() -> str:
    """What a run writes into its :data:`LOCK`: this process and its host."""
    return f"{os.getpid()} {socket.gethostname()}\n"


def running(folder: str | os.PathLike[str]) -> bool | None:
    """Whether a live process of gpipe holds the run in ``folder`` (by the PID in its :data:`LOCK`,
    read, not locked): False where there is no lock (never started) or its process is gone; None
    when that cannot be told from here: the holder is on another host, or is writing the lock."""
    try:
        words = (Path(folder) / LOCK).read_text().split()
    except OSError:
        return False
    try:
        pid = int(words[0])
    except (ValueError, IndexError):  # (a run starting: the lock taken, its PID not written yet)
        return None
    if len(words) > 1 and words[1] != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (alive, another user's)
        pass
    try:  # (a PID used again by another program since)
        return b"gpipe" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
