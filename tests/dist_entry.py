"""Entry point of one rank for tests/dist_harness.py: python -m tests.dist_entry CASE OUT KWARGS
(CASE: a function of tests/dist_cases.py, or 'module:function' of another module of tests/), or
python -m tests.dist_entry --cases DIR (several cases, tests/dist_harness.py's run_launch)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import dist_cases, rendezvous


def resolve(case: str) -> Callable[..., Any]:
    """The function a case names: 'function' of tests/dist_cases.py, or 'module:function' of tests/."""
    module, _, name = case.rpartition(":")
    where = importlib.import_module(f"tests.{module}") if module else dist_cases
    return getattr(where, name)  # type: ignore[no-any-return]


def cases(out_dir: Path) -> None:
    """The cases of ``out_dir``/cases.json, (key, case, kwargs) each, one after the other in this
    process (one start, one import of torch, one process group for all of them), for
    tests/dist_harness.py's run_launch: as each case starts, a line in this rank's output and
    'start:N' in its progress file; as it ends, its result in caseN-rankR.pt, then 'done:N'."""
    rank = int(os.environ["RANK"])
    with (out_dir / f"rank{rank}.progress").open("a") as progress:
        for index, (key, case, kwargs) in enumerate(json.loads((out_dir / "cases.json").read_text())):
            print(f"=== case {index}: {key!r} ({case})", flush=True)
            progress.write(f"start:{index}\n")
            progress.flush()
            result = resolve(case)(**kwargs)
            torch.save(result, out_dir / f"case{index}-rank{rank}.pt")
            progress.write(f"done:{index}\n")
            progress.flush()


def main() -> None:
    torch.set_num_threads(1)
    if os.environ.get("GPIPE_TEST_P2P", "rendezvous") == "rendezvous":  # NCCL's semantics (tests/rendezvous.py)
        rendezvous.install()
    if sys.argv[1] == "--cases":
        cases(Path(sys.argv[2]))
    else:
        case, out, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        torch.save(resolve(case)(**kwargs), out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
