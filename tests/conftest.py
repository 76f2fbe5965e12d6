from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def no_leftover_workers() -> Iterator[None]:
    """Every test must leave no pipeline worker thread behind."""
    yield
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("gpipe-worker")]
    assert not leftover, f"worker threads outlived the call: {leftover}"
