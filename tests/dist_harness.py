"""Run a function of tests/dist_cases.py in several processes over torch.distributed (gloo on CPU),
the way torchrun would start them, each bounded by a timeout; collect what each rank returns."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RanksFailedError(AssertionError):
    def __init__(self, message: str, returncodes: list[int | None], outputs: list[str]) -> None:
        super().__init__(message + "\n" + "\n".join(f"--- rank {r} ---\n{o[-3000:]}" for r, o in enumerate(outputs)))
        self.returncodes = returncodes
        self.outputs = outputs


def start(case: str, world: int, out_dir: Path, **kwargs: Any) -> list[subprocess.Popen[str]]:
    port = free_port()
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),  # this checkout's gpipe and tests
        }
        out = out_dir / f"rank{rank}.pt"
        cmd = [sys.executable, "-m", "tests.dist_entry", case, str(out), json.dumps(kwargs)]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return procs


def wait(procs: list[subprocess.Popen[str]], timeout: float) -> tuple[list[int | None], list[str], float]:
    """Wait for every process (killing all of them at the deadline); return codes, outputs, seconds."""
    start_time = time.monotonic()
    deadline = start_time + timeout
    outputs = [""] * len(procs)
    for i, p in enumerate(procs):
        try:
            outputs[i], _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.send_signal(signal.SIGKILL)
            for j, q in enumerate(procs):
                out, _ = q.communicate()
                outputs[j] = outputs[j] or out
            break
    return [p.returncode for p in procs], outputs, time.monotonic() - start_time


def run_ranks(case: str, world: int, out_dir: Path, *, timeout: float = 180, **kwargs: Any) -> list[Any]:
    """Run ``case`` on ``world`` ranks; every rank must succeed within ``timeout`` seconds."""
    codes, outputs, _ = wait(start(case, world, out_dir, **kwargs), timeout)
    if any(c != 0 for c in codes):
        raise RanksFailedError(f"{case} on {world} ranks failed (exit codes {codes})", codes, outputs)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


Cases = dict[str, tuple[str, dict[str, Any]]]
"""Cases of one launch: ``{key: (case, kwargs)}``, a case as :func:`run_ranks` names it."""


def run_cases(world: int, out_dir: Path, cases: Cases, *, timeout: float = 180) -> dict[str, list[Any]]:
    """Run several cases, ``{key: (case, kwargs)}``, one after the other in one launch of ``world``
    ranks (each launch costs seconds: processes, ``import torch``, the process group); every rank
    must succeed within ``timeout`` seconds for all of them. Each case's results by rank, by key."""
    several = [(key, case, kwargs) for key, (case, kwargs) in cases.items()]
    ranks = run_ranks("dist_entry:several", world, out_dir, timeout=timeout, cases=several)
    return {key: [r[key] for r in ranks] for key in cases}


class Pool:
    """The multi-process cases of every test module pytest imports, run a few launches in all instead
    of one or more per module (each launch costs seconds: processes, ``import torch``, the process
    group). A module adds its cases as it is imported (:meth:`add`: at collection, before any test
    runs), and its tests read their results through the session's ``pool`` fixture
    (tests/conftest.py). The first result asked for starts the launch that holds its case: the cases
    of one world size, in the order added, at most ``MAX_CASES`` a launch (each holds its process
    groups to the end: a bound on the sockets); a case that loads what another saved (``after``) runs
    in a later launch, in other processes, once that one ran. So a run of one module launches its own
    cases alone, and a test's duration may hold a launch of other modules' cases with its own.
    Paths in a case's arguments are written '{pool}/...', the session's folder (:meth:`path`); what a
    case reads there its ``prepare`` writes, in this process, before its launch. A failed launch fails
    the check of each of its cases with its error, whose output names the case that failed; the launch
    does not start again."""

    MAX_CASES = 16

    def __init__(self) -> None:
        self.root: Path | None = None
        self.cases: dict[str, tuple[int, str, dict[str, Any], str | None]] = {}  # key: world, case, kwargs, after
        self.launch_of: dict[str, int] = {}  # key: its launch, once launches are planned
        self.launches: list[tuple[int, list[str]]] = []  # world, keys
        self.done: dict[int, dict[str, list[Any]] | BaseException] = {}
        self.prepare: dict[str, Callable[[Path], object]] = {}  # key: what writes its inputs
        self.prepared: set[Callable[[Path], object]] = set()

    def add(
        self,
        world: int,
        key: str,
        case: str,
        *,
        after: str | None = None,
        prepare: Callable[[Path], object] | None = None,
        **kwargs: Any,
    ) -> str:
        """Case ``key`` (unique over the modules): ``case`` with ``kwargs`` on ``world`` ranks, after
        case ``after`` in an earlier launch, and after ``prepare(pool folder)`` (once for all the
        cases that give it). Returns the key."""
        entry = (world, case, kwargs, after)
        if self.cases.setdefault(key, entry) != entry:
            raise ValueError(f"the pool holds another case {key!r}")
        if prepare is not None:
            self.prepare[key] = prepare
        return key

    def path(self, *parts: str) -> Path:
        """What '{pool}/<parts>' names in a case's arguments."""
        assert self.root is not None, "the pool's folder is set by the session's pool fixture"
        return self.root.joinpath(*parts)

    def _level(self, key: str) -> int:
        after = self.cases[key][3]
        return 0 if after is None else 1 + self._level(after)

    def _plan(self) -> None:
        """Launches for the cases not yet in one: by world and level (after's), in the order added."""
        groups: dict[tuple[int, int], list[str]] = {}
        for key, (world, _, _, _) in self.cases.items():
            if key not in self.launch_of:
                groups.setdefault((world, self._level(key)), []).append(key)
        for (world, _), keys in sorted(groups.items(), key=lambda item: item[0][1]):
            for start in range(0, len(keys), self.MAX_CASES):
                chunk = keys[start : start + self.MAX_CASES]
                self.launch_of |= {k: len(self.launches) for k in chunk}
                self.launches.append((world, chunk))

    def _kwargs(self, value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("{pool}", str(self.path()))
        if isinstance(value, dict):
            return {k: self._kwargs(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._kwargs(v) for v in value]
        return value

    def _run(self, index: int) -> dict[str, list[Any]]:
        if index not in self.done:
            world, keys = self.launches[index]
            try:
                for key in keys:  # what the cases load was saved, what they read written
                    if self.cases[key][3] is not None:
                        self(self.cases[key][3])
                    prepare = self.prepare.get(key)
                    if prepare is not None and prepare not in self.prepared:
                        prepare(self.path())
                        self.prepared.add(prepare)
                cases = {key: (self.cases[key][1], self._kwargs(self.cases[key][2])) for key in keys}
                self.done[index] = run_cases(world, self.path(f"launch-{index}"), cases, timeout=280)
            except Exception as e:
                self.done[index] = e
        done = self.done[index]
        if isinstance(done, BaseException):
            raise AssertionError(f"launch {index} of the pool failed: {self.launches[index]}") from done
        return done

    def __call__(self, key: str) -> list[Any]:
        """Case ``key``'s results, by rank."""
        if key not in self.launch_of:
            self._plan()
        return self._run(self.launch_of[key])[key]


POOL = Pool()
"""The session's pool: test modules add their cases to it as they are imported."""
