from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tests.dist_harness import POOL, Pool


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
