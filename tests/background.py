"""Jobs that start with the session and run in threads beside the tests, each taken by the test that
reads it: processes that mostly wait (a fault scenario waiting out a timeout) overlap the tests of this
process instead of holding the session up.

A test module registers a job for a test at import (:meth:`Background.add`); when the session starts
(tests/conftest.py) the jobs of the selected tests start, a few at a time, in the order they were
added, and the test takes its job's result (:meth:`Background.result`: waiting for it, or running it
then if it never started). A job only starts processes and watches them: it must not use torch or gpipe
in its thread, whose global state (the random generators, the thread counts) it would share with the
tests running beside it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any


class Background:
    def __init__(self, workers: int = 3) -> None:
        self.workers = workers
        self.jobs: dict[str, Callable[[Path], Any]] = {}
        self.selected: set[str] | None = None  # the keys of the session's tests; None: all
        self.futures: dict[str, Future[Any]] = {}
        self.root: Path | None = None
        self._executor: ThreadPoolExecutor | None = None

    @staticmethod
    def key(module: str, test: str) -> str:
        """The key of test ``test`` (its name, parameters included) of module ``module``."""
        return f"{module}::{test}"

    def add(self, module: str, test: str, job: Callable[[Path], Any]) -> None:
        """Run ``job(folder)`` (a fresh folder of its own) for test ``test`` of ``module``."""
        key = self.key(module, test)
        if key in self.jobs:
            raise ValueError(f"a background job for {key!r} is already registered")
        self.jobs[key] = job

    def _folder(self, key: str) -> Path:
        assert self.root is not None
        folder = self.root / f"job{list(self.jobs).index(key)}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def start(self, root: Path) -> None:
        """Start the selected tests' jobs, ``workers`` at a time."""
        self.root = root
        wanted = [k for k in self.jobs if self.selected is None or k in self.selected]
        if not wanted:
            return
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="background-job")
        for key in wanted:
            self.futures[key] = self._executor.submit(self.jobs[key], self._folder(key))

    def result(self, module: str, test: str) -> Any:
        """The result of the job of ``test`` (its error raised), once it has ended."""
        key = self.key(module, test)
        if key not in self.futures:  # (not started with the session: run it now)
            if self.root is None:
                raise RuntimeError("the session's background jobs have no folder: tests/conftest.py starts them")
            return self.jobs[key](self._folder(key))
        return self.futures[key].result()

    def stop(self) -> None:
        """Wait for the jobs still running (each bounds its own processes)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)


BACKGROUND = Background()
"""The session's background jobs: test modules add theirs as they are imported."""
