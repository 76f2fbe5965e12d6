"""Progress reports: tqdm's bar on a terminal; elsewhere (a CI log, output redirected to a file) one
plain line every few seconds, since a bar redrawn with carriage returns at every step turns into
thousands of lines, or one unreadable line, in a log."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any, Protocol

__all__ = ["LINE_INTERVAL", "LineProgress", "Progress", "is_terminal", "progress"]

LINE_INTERVAL = 5.0
"""Seconds between two lines of a :class:`LineProgress`."""


class Progress(Protocol):
    """What ``gpipe train`` asks of a progress report: tqdm's ``set_postfix``, ``update`` and ``close``."""

    def set_postfix(self, **values: Any) -> None: ...

    def update(self, n: int = 1) -> Any: ...

    def close(self) -> None: ...


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an open terminal (not a pipe, a file, or a captured stream)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress(
    total: int,
    *,
    initial: int = 0,
    desc: str = "",
    unit: str = "it",
    file: IO[str] | None = None,
    interval: float = LINE_INTERVAL,
) -> Progress:
    """A progress report of ``total`` units on ``file`` (default: standard error): tqdm's bar if it
    is a terminal, else a :class:`LineProgress` writing a line every ``interval`` seconds."""
    stream = file if file is not None else sys.stderr
    if is_terminal(stream):
        from tqdm import tqdm

        bar: Progress = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=stream)
        return bar
    return LineProgress(total, initial=initial, desc=desc, unit=unit, file=stream, interval=interval)


class LineProgress:
    """Progress as plain lines, for a stream that is not a terminal: a line after the first update,
    then at most one every ``interval`` seconds, and a last one on :meth:`close` (if anything
    changed since the line before); never a carriage return. ``clock`` is for tests."""

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        desc: str = "",
        unit: str = "it",
        file: IO[str] | None = None,
        interval: float = LINE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.file, self.interval, self.clock = file, interval, clock
        self.postfix: dict[str, Any] = {}
        self._initial = initial
        self._start = clock()
        self._last_line: float | None = None  # when the last line was written
        self._written_n: int | None = None  # self.n at that line
        self._closed = False

    def set_postfix(self, **values: Any) -> None:
        """Values shown at the end of the next line, like tqdm's postfix."""
        self.postfix = dict(values)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self._last_line is None or now - self._last_line >= self.interval:
            self._write(now)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._written_n != self.n:
            self._write(self.clock())

    def line(self, now: float | None = None) -> str:
        """The line for the current state: count, share, rate, time elapsed and left, postfix."""
        elapsed = (self.clock() if now is None else now) - self._start
        done = self.n - self._initial
        rate = done / elapsed if elapsed > 0 else 0.0
        count = f"{self.n}/{self.total} {self.unit}s ({100 * self.n / self.total:.0f}%)" if self.total else None
        parts = [count or f"{self.n} {self.unit}s"]
        timing = f"{_clock_time(elapsed)} elapsed"
        if rate > 0:
            timing += f", {rate:.3g} {self.unit}/s"
            if self.total and self.n < self.total:
                timing += f", {_clock_time((self.total - self.n) / rate)} left"
        parts.append(timing)
        if self.postfix:
            parts.append(", ".join(f"{k}={v}" for k, v in self.postfix.items()))
        prefix = f"{self.desc}: " if self.desc else ""
        return prefix + "; ".join(parts)

    def _write(self, now: float) -> None:
        stream = self.file if self.file is not None else sys.stderr
        stream.write(self.line(now) + "\n")
        stream.flush()
        self._last_line, self._written_n = now, self.n


def _clock_time(seconds: float) -> str:
    """``seconds`` as ``M:SS``, or ``H:MM:SS`` from an hour on."""
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
