"""Entry point of one rank for tests/dist_harness.py: python -m tests.dist_entry CASE OUT KWARGS
(CASE: a function of tests/dist_cases.py, or 'module:function' of another module of tests/)."""

from __future__ import annotations

import importlib
import json
import sys

import torch
import torch.distributed as dist

from tests import dist_cases


def main() -> None:
    case, out, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    module, _, name = case.rpartition(":")
    where = importlib.import_module(f"tests.{module}") if module else dist_cases
    result = getattr(where, name)(**kwargs)
    torch.save(result, out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
