"""tests/gpu: cuBLAS made deterministic before CUDA initializes; each check's numbers recorded.

``CUBLAS_WORKSPACE_CONFIG`` must be set before the first cuBLAS call of the process, so it is set
here, at import, before any test module of this folder runs. ``record`` appends a check's numbers
to the JSON-lines file named by ``GPIPE_GPU_RESULTS`` (``benchmarks/gpu_check.py`` sets it; without
it they are printed only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the test, restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``record(**numbers)``: this check's numbers, in the results file and printed."""

    def write(**numbers: Any) -> None:
        row = {"check": request.node.nodeid, **numbers}
        print("gpu-check:", json.dumps(row, default=str))
        path = os.environ.get("GPIPE_GPU_RESULTS")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    return write
