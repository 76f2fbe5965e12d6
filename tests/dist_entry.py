"""Entry point of one rank for tests/dist_harness.py: python -m tests.dist_entry CASE OUT KWARGS
(CASE: a function of tests/dist_cases.py, or 'module:function' of another module of tests/)."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests import dist_cases


def resolve(case: str) -> Callable[..., Any]:
    """The function a case names: 'function' of tests/dist_cases.py, or 'module:function' of tests/."""
    module, _, name = case.rpartition(":")
    where = importlib.import_module(f"tests.{module}") if module else dist_cases
    return getattr(where, name)  # type: ignore[no-any-return]


def several(cases: list[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    """Cases given as (key, case, kwargs), run one after the other in this process (one start, one
    import of torch, one process group for all of them): each one's result by its key. Each case's
    key is printed as it starts: a failure's output says which case failed."""
    results = {}
    for key, case, kwargs in cases:
        print(f"--- case {key!r}: {case}", flush=True)
        results[key] = resolve(case)(**kwargs)
    return results


def main() -> None:
    case, out, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    result = resolve(case)(**kwargs)
    torch.save(result, out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
