from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from tests.background import BACKGROUND
from tests.dist_harness import POOL, Pool

# Every process the tests start prints each thread's Python stack should it crash (SIGSEGV, SIGABRT):
# a crash in a torchrun worker then says where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(autouse=True)
def no_leftover_workers() -> Iterator[None]:
    """Every test must leave no pipeline worker thread behind."""
    yield
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("gpipe-worker")]
    assert not leftover, f"worker threads outlived the call: {leftover}"


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Pool:
    """The multi-process cases of the test modules, run a few launches in all (tests/dist_harness.py)."""
    if POOL.root is None:
        POOL.root = tmp_path_factory.mktemp("pool")
    return POOL


@pytest.fixture(scope="session", autouse=True)
def pool_in_background(pool: Pool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The pool's launches run in a thread while the tests of this process run (Pool.start), and the
    selected tests' background jobs in threads of their own (tests/background.py)."""
    pool.start()
    BACKGROUND.start(tmp_path_factory.mktemp("background"))
    yield
    pool.stop()
    BACKGROUND.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests whose ranks run in the pool run them under NCCL's point-to-point semantics
    (tests/rendezvous.py, installed by tests/dist_entry.py): marked ``rendezvous``."""
    for item in items:
        if "pool" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.rendezvous)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The pool runs the cases of the modules that have a selected test reading it alone (-k, node
    ids, -m, --lf: no other module's cases run); the background jobs of the selected tests alone start."""
    readers = [item for item in session.items if "pool" in getattr(item, "fixturenames", ())]
    POOL.select({module.__name__ for item in readers if (module := getattr(item, "module", None)) is not None})
    BACKGROUND.selected = {
        BACKGROUND.key(module.__name__, item.name)
        for item in session.items
        if (module := getattr(item, "module", None)) is not None
    }


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The pool's launches: how many cases each ran, in how long."""
    if POOL.timings:
        lines = [f"launch {i}: {n} cases on {w} ranks ({f} failed), {s:.1f} s" for i, w, n, f, s in POOL.timings]
        terminalreporter.write_sep("-", f"the pool's {len(lines)} launches, {sum(t[4] for t in POOL.timings):.0f} s")
        for line in lines:
            terminalreporter.write_line(line)
