"""The next batches made while the current step computes: :class:`StepLoader` yields ``make(step)``
for consecutive steps, made ahead in one background thread (``workers=0``) or in torch DataLoader
worker processes (``workers > 0``: ``make`` and the data set it reads are pickled to them; images are
decoded there). A batch is a pure function of its step, so the order, and a resumed run's batches,
are the same either way."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.utils.data

from gpipe import threads

__all__ = ["BatchError", "StepLoader"]


class BatchError(ValueError):
    """A batch that could not be made from the data (a file that cannot be read, say): the data set's
    ``ValueError``, naming the step, raised where the batch is taken (from a worker process too, as one
    line)."""


@dataclass(frozen=True)
class _Failed:
    message: str


def _made(make: Callable[[int], Any], step: int) -> Any:
    try:
        return make(step)
    except ValueError as exc:  # (bad data; any other exception is a bug and keeps its traceback)
        return _Failed(f"the batch of step {step}: {exc}")


class _Steps(torch.utils.data.Dataset[Any]):
    def __init__(self, make: Callable[[int], Any], start: int, stop: int) -> None:
        self.make, self.start, self.stop = make, start, stop

    def __len__(self) -> int:
        return max(self.stop - self.start + 1, 0)

    def __getitem__(self, i: int) -> Any:
        return _made(self.make, self.start + i)


def _taken(batch: Any) -> Any:
    if isinstance(batch, _Failed):
        raise BatchError(batch.message)
    return batch


def _unchanged(batch: Any) -> Any:
    return batch


class StepLoader:
    """The batches ``make(step)`` of steps ``start`` .. ``stop`` (both included), in order, made up to
    ``ahead`` steps ahead. An exception of ``make`` is raised where its batch is taken (a ``ValueError``,
    bad data, as a :class:`BatchError` naming the step). Close it (or
    use it as a context manager) to stop the thread or the worker processes early."""

    def __init__(self, make: Callable[[int], Any], start: int, stop: int, *, workers: int = 0, ahead: int = 2) -> None:
        if workers < 0 or ahead < 1:
            raise ValueError(f"StepLoader needs workers >= 0 and ahead >= 1 (workers: {workers}, ahead: {ahead})")
        self.make, self.start, self.stop, self.workers, self.ahead = make, start, stop, workers, ahead
        self._closed = threading.Event()
        self._loader: Iterator[Any] | None = None
        self._thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if self.workers:
            loader = torch.utils.data.DataLoader(
                _Steps(self.make, self.start, self.stop),
                batch_size=None,
                num_workers=self.workers,
                prefetch_factor=self.ahead,
                collate_fn=_unchanged,
                multiprocessing_context="fork",  # (no import of the caller's __main__; the data is inherited)
            )
            self._loader = iter(loader)
            for step, batch in zip(range(self.start, self.stop + 1), self._loader):
                yield step, _taken(batch)
            return
        made: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue(self.ahead)

        def produce() -> None:
            for step in range(self.start, self.stop + 1):
                try:
                    item: tuple[int, Any, BaseException | None] = (step, _made(self.make, step), None)
                except BaseException as exc:  # handed to the consumer
                    item = (step, None, exc)
                while not self._closed.is_set():
                    try:
                        made.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._closed.is_set() or item[2] is not None:
                    return

        self._thread = threads.start(produce, name="gpipe-batches", stop=self._closed.set)
        for _ in range(self.start, self.stop + 1):
            step, batch, error = made.get()
            if error is not None:
                raise error
            yield step, _taken(batch)

    def close(self) -> None:
        """Stop making batches (the thread ends; DataLoader's workers are shut down)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        shutdown = getattr(self._loader, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._loader = None

    def __enter__(self) -> StepLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
