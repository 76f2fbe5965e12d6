"""The session's pool of multi-process cases (tests/dist_harness.py): a case that fails, hangs or is
interrupted fails alone, with its own message; the cases after it in its launch run again in another;
a case that loads from a failed one says so; every process ends; selection plans the selected
modules' cases alone."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from tests.dist_harness import Pool, PoolCaseError


def probe(value: int, fail_on: int = -1, hang_on: int = -1) -> int:
    """A case (tests.dist_entry): ``value * 10 + rank``; rank ``fail_on`` raises, rank ``hang_on`` hangs."""
    rank = int(os.environ["RANK"])
    if rank == fail_on:
        raise ValueError(f"probe {value} fails on rank {rank} on purpose")
    if rank == hang_on:
        time.sleep(600)
    return value * 10 + rank


def _running(root: Path) -> list[str]:
    """The command lines of the processes still running that were given a folder under ``root``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(root) in cmdline:
            found.append(cmdline)
    return found


def test_a_failing_or_hanging_case_fails_alone_and_the_rest_run_again(tmp_path: Path) -> None:
    pool = Pool(tmp_path, grace=2)
    a = pool.add(2, "a", "test_dist_harness:probe", value=1)
    b = pool.add(2, "b", "test_dist_harness:probe", value=2, fail_on=1)
    c = pool.add(2, "c", "test_dist_harness:probe", value=3)
    d = pool.add(2, "d", "test_dist_harness:probe", value=4, hang_on=0, timeout=3)
    f = pool.add(2, "f", "test_dist_harness:probe", after=b, value=5)

    assert pool(a) == [10, 11]
    with pytest.raises(PoolCaseError) as failed:
        pool(b)
    message = str(failed.value)
    assert "case 'b' (test_dist_harness:probe on 2 ranks) failed: rank(s) [1] failed" in message
    assert "ValueError: probe 2 fails on rank 1 on purpose" in message
    assert "=== case 0: 'a'" not in message  # each rank's output from b's start on
    with pytest.raises(PoolCaseError, match=r"case 'f' loads what case 'b' saved, which failed:\ncase 'b'"):
        pool(f)

    assert pool(c) == [30, 31]  # (rank 0 ran it in the first launch too, rank 1 never did: again)
    with pytest.raises(PoolCaseError, match=r"case 'd' .* not finished by every rank within 3 s"):
        pool(d)
    assert pool.launches == [(2, [a, b, c, d]), (2, [f]), (2, [c, d])]  # (f's without processes)
    assert _running(tmp_path) == []


class Interrupted(Exception):  # noqa: N818 (what pytest-timeout or Ctrl-C raises, as far as the pool knows)
    pass


@pytest.fixture
def interrupt_once_started(tmp_path: Path) -> Iterator[None]:
    """SIGUSR1, raising Interrupted, as soon as rank 1 of the pool's first launch started its first case."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted("the test's time is up")

    def watch() -> None:
        progress = tmp_path / "launch-0" / "rank1.progress"
        while not (progress.exists() and "start:0\n" in progress.read_text()):
            if stop.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    stop = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)


def test_an_interrupted_launch_kills_its_processes_and_its_unfinished_cases_run_again(
    tmp_path: Path, interrupt_once_started: None
) -> None:
    pool = Pool(tmp_path)
    hang = pool.add(2, "hang", "test_dist_harness:probe", value=1, hang_on=1)
    later = pool.add(2, "later", "test_dist_harness:probe", value=2)
    with pytest.raises(Interrupted):
        pool(hang)
    assert _running(tmp_path) == []
    assert not pool.results and not pool.failed  # no case blamed: each one unfinished runs again when asked for
    assert pool.launches == [(2, [hang, later]), (2, [hang, later])]


def test_the_selected_modules_cases_alone_are_planned(tmp_path: Path) -> None:
    pool = Pool(tmp_path)
    mine = pool.add(2, "mine", "test_dist_harness:probe", value=1)
    saved = pool.add(2, "saved", "test_dist_harness:probe", value=2)
    loads = pool.add(4, "loads", "test_dist_harness:probe", after=saved, value=3)
    other = pool.add(2, "other", "test_dist_harness:probe", value=4)
    for key in (saved, other):
        pool.entries[key].module = "tests.test_other"  # (added by a module none of whose tests is selected)
    pool.select({__name__})
    pool._plan(mine)
    assert pool.launches == [(2, [mine, saved]), (4, [loads])]  # what a selected case loads from, too
    pool._plan(other)  # a case asked for is planned, selected or not
    assert pool.launches[2:] == [(2, [other])]
    with pytest.raises(ValueError, match="another case 'mine'"):
        pool.add(2, "mine", "test_dist_harness:probe", value=5)
    with pytest.raises(ValueError, match="which the pool does not hold"):
        pool.add(2, "orphan", "test_dist_harness:probe", after="nothing", value=6)


def test_the_background_launches_files_are_written_in_the_sessions_thread(tmp_path: Path) -> None:
    """Pool.start writes what the planned cases read before its thread starts, in the caller's
    thread: a ``prepare`` seeds torch's global generator, which a thread would share with the tests
    running beside it (a model written from it, and the tests' numbers, changed from run to run)."""
    threads: list[str] = []

    def prepare(root: Path) -> Path:
        threads.append(threading.current_thread().name)
        return root

    pool = Pool(tmp_path)
    key = pool.add(2, "reads", "test_dist_harness:probe", prepare=prepare, value=1)
    pool.select({__name__})
    pool.start()
    try:
        assert threads == [threading.current_thread().name]
        assert pool(key) == [10, 11]
    finally:
        pool.stop()
    assert threads == [threading.current_thread().name]  # (written once)
