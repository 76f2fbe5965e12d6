"""Run a function of tests/dist_cases.py in several processes over torch.distributed (gloo on CPU),
the way torchrun would start them, each bounded by a timeout; collect what each rank returns."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


_GIVEN: set[int] = set()  # the ports free_port handed out in this process
_GIVEN_LOCK = threading.Lock()


def free_port() -> int:
    """A port for a launch's rendezvous, free now, never handed out before in this process, and below
    the range the system takes ports from for outgoing connections: the many connections of the
    launches running beside each other (gloo's pairs) take ports from that range, and one of them
    could take a port chosen there before the launch binds it (EADDRINUSE)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    with _GIVEN_LOCK:
        for _ in range(1000):
            port = random.randrange(max(1024, low - 12000), low)
            if port in _GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    with socket.socket() as s:  # (no free port below the range: one from it)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RanksFailedError(AssertionError):
    def __init__(self, message: str, returncodes: list[int | None], outputs: list[str]) -> None:
        super().__init__(message + "\n" + "\n".join(f"--- rank {r} ---\n{o[-3000:]}" for r, o in enumerate(outputs)))
        self.returncodes = returncodes
        self.outputs = outputs


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # gloo on the CPU even beside a GPU (NCCL: one rank a GPU)
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),  # this checkout's gpipe and tests
    }


def start(case: str, world: int, out_dir: Path, **kwargs: Any) -> list[subprocess.Popen[str]]:
    port = free_port()
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        out = out_dir / f"rank{rank}.pt"
        cmd = [sys.executable, "-m", "tests.dist_entry", case, str(out), json.dumps(kwargs)]
        procs.append(
            subprocess.Popen(
                cmd,
                env=_rank_env(rank, world, port),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def wait(procs: list[subprocess.Popen[str]], timeout: float) -> tuple[list[int | None], list[str], float]:
    """Wait for every process (killing all of them at the deadline, or when the wait itself is
    interrupted: pytest-timeout, Ctrl-C); return codes, outputs, seconds."""
    start_time = time.monotonic()
    deadline = start_time + timeout
    outputs = [""] * len(procs)
    try:
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
    except BaseException:
        for q in procs:
            if q.poll() is None:
                q.send_signal(signal.SIGKILL)
        for q in procs:
            q.wait()
        raise
    return [p.returncode for p in procs], outputs, time.monotonic() - start_time


def run_ranks(case: str, world: int, out_dir: Path, *, timeout: float = 180, **kwargs: Any) -> list[Any]:
    """Run ``case`` on ``world`` ranks; every rank must succeed within ``timeout`` seconds."""
    codes, outputs, _ = wait(start(case, world, out_dir, **kwargs), timeout)
    if any(c != 0 for c in codes):
        raise RanksFailedError(f"{case} on {world} ranks failed (exit codes {codes})", codes, outputs)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


Case = tuple[str, str, dict[str, Any]]
"""A case of a launch: (key, case, kwargs), the case a function as :func:`run_ranks` names it."""


@dataclass
class Launch:
    """What a launch of several cases left: each finished case's results by rank, the message of the
    case that failed (or of each case, when the launch failed outside of them), the cases that did
    not run to their end because another failed first or the wait was interrupted (to run again, in
    other processes), and what interrupted the wait, if anything did (to raise again, once the rest
    is recorded)."""

    results: dict[str, list[Any]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    rest: list[str] = field(default_factory=list)
    interrupted: BaseException | None = None


def _progress(out_dir: Path, rank: int) -> tuple[int, int]:
    """(cases this rank finished, the case it started last or -1), from its progress file."""
    try:
        lines = (out_dir / f"rank{rank}.progress").read_text().split("\n")[:-1]  # (whole lines alone)
    except FileNotFoundError:
        return 0, -1
    done = sum(1 for line in lines if line.startswith("done:"))
    started = max((int(line[6:]) for line in lines if line.startswith("start:")), default=-1)
    return done, started


def _section(output: str, index: int) -> str:
    """The part of a rank's output from case ``index``'s start on (tests.dist_entry prints a line as
    each case starts), its end if that is long."""
    at = re.search(rf"^=== case {index}: ", output, re.MULTILINE)
    text = output if at is None else output[at.start() :]
    return text if len(text) <= 6000 else "...\n" + text[-6000:]


def run_launch(
    world: int, out_dir: Path, cases: list[Case], *, case_timeout: float | list[float] = 180, grace: float = 20
) -> Launch:
    """Run ``cases`` one after the other in one launch of ``world`` ranks (each launch costs seconds:
    processes, ``import torch``, the process group). Each rank writes each case's result as it ends
    it: a case that fails, on any rank, fails alone, with each rank's output of it; the cases before
    it have their results, those after it are to run again. Bounds: a case (the first one with the
    start) not finished by every rank within ``case_timeout`` seconds (one for all, or each its own)
    fails, as timed out; once a rank failed the others have ``grace`` seconds to end; then the
    processes (and theirs) are killed."""
    limits = case_timeout if isinstance(case_timeout, list) else [case_timeout] * len(cases)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cases.json").write_text(json.dumps(cases))
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = [out_dir / f"rank{rank}.log" for rank in range(world)]
    launch = Launch()
    timed_out = False
    first_failure: float | None = None
    try:
        for rank in range(world):
            with logs[rank].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.dist_entry", "--cases", str(out_dir)],
                        env={**_rank_env(rank, world, port), "PYTHONUNBUFFERED": "1"},
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # a group of its own: killed with whatever it starts
                    )
                )
        finished, deadline = 0, time.monotonic() + limits[0]
        while not all([p.poll() is not None for p in procs]):  # (a list: each one polled)
            now = time.monotonic()
            done = min(_progress(out_dir, rank)[0] for rank in range(world))
            if done > finished:
                finished, deadline = done, now + limits[min(done, len(cases) - 1)]
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now > first_failure + grace):
                timed_out = now > deadline and first_failure is None
                break
            time.sleep(0.1)
    except BaseException as e:  # (pytest-timeout, Ctrl-C): what finished is kept, the rest is to run again
        launch.interrupted = e
    finally:
        failed_alone = [p.poll() not in (None, 0) for p in procs]  # before any was killed
        for p in procs:  # (each one's group: what it started too)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    codes = [p.returncode for p in procs]
    progress = [_progress(out_dir, rank) for rank in range(world)]
    complete = min((done for done, _ in progress), default=0) if len(procs) == world else 0
    for index in range(complete):
        key = cases[index][0]
        launch.results[key] = [torch.load(out_dir / f"case{index}-rank{rank}.pt") for rank in range(world)]
    if complete == len(cases) and all(c == 0 for c in codes):
        return launch
    if launch.interrupted is not None:  # no case to blame: the unfinished ones run again (a hang then times out)
        launch.rest = [key for key, _, _ in cases[complete:]]
        return launch
    outputs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    # The case that failed: where a rank that failed by itself was, the first one (a rank that lost
    # another fails too, in that case or the next); timed out, the first one a rank had not finished.
    at = [started for (done, started), alone in zip(progress, failed_alone) if alone and started >= done]
    if timed_out:
        at = [started for done, started in progress if started >= done]
    culprit = min(at) if at else None
    codes_text = ", ".join(f"rank {r}: {c}" for r, c in enumerate(codes))
    if culprit is None or culprit < complete:  # failed outside of any case: the launch's failure is each one's
        message = f"the launch of {len(cases)} cases on {world} ranks failed outside of them (exit codes: {codes_text})"
        for key, _, _ in cases[complete:]:
            launch.failed[key] = message + "".join(f"\n--- rank {r} ---\n{o[-3000:]}" for r, o in enumerate(outputs))
        return launch
    key, case, _ = cases[culprit]
    if timed_out:
        why = f"not finished by every rank within {limits[culprit]:g} s (timed out: the ranks were killed)"
    else:
        failed = [r for r, alone in enumerate(failed_alone) if alone]
        why = f"rank(s) {failed} failed" + (f"; the others were killed {grace:g} s later" if -9 in codes else "")
    launch.failed[key] = f"case {key!r} ({case} on {world} ranks) failed: {why} (exit codes: {codes_text})" + "".join(
        f"\n--- rank {r}, from the case's start ---\n{_section(o, culprit)}" for r, o in enumerate(outputs)
    )
    launch.rest = [k for k, _, _ in cases[complete:] if k != key]
    return launch


class PoolCaseError(AssertionError):
    """A case of the pool failed (or a case it loads from did): the message says how, with each rank's
    output of it."""


@dataclass
class _Entry:
    world: int
    case: str
    kwargs: dict[str, Any]
    after: str | None
    module: str
    prepare: Callable[[Path], object] | None
    timeout: float


class Pool:
    """The multi-process cases of every test module pytest imports, run a few launches in all instead
    of one or more per module (each launch costs seconds: processes, ``import torch``, the process
    group). A module adds its cases as it is imported (:meth:`add`: at collection, before any test
    runs), and its tests read their results through the session's ``pool`` fixture
    (tests/conftest.py). The first result asked for starts the launch that holds its case: the cases
    of one world size, in the order added, at most ``MAX_CASES`` a launch (each holds its process
    groups to the end: a bound on the sockets), of the modules that have a test selected
    (:meth:`select`, from the conftest once pytest collected: ``-k``, a node id or ``-m`` run no case of
    a module none of whose tests runs); a case that loads what another saved (``after``) runs in a
    later launch, in other processes, once that one ran.

    A case that fails fails the tests that read it alone, with its message (each rank's output of
    it); the cases of its launch that had not ended run again in another launch; one that loads from
    a failed case fails, saying so. Each case must end within its ``timeout`` (seconds, counted from
    the end of the one before it in the launch), or fails as timed out, its processes killed. A wait
    interrupted (pytest-timeout, Ctrl-C) kills the processes and raises on; the cases that had not
    ended run again when asked for.

    Paths in a case's arguments are written '{pool}/...', the session's folder (:meth:`path`); what a
    case reads there its ``prepare`` writes, in this process, before its launch (a test reading it too
    asks :meth:`written` for it: written once, whoever asks first).

    :meth:`start` runs the planned launches in a thread of their own, in order, while the tests of
    this process run (the session starts it once collected): a test asking for a case waits for its
    launch alone, and the launches' processes wait on their peers while this one computes. One lock
    keeps the pool's state: a launch, a test's wait and a ``prepare`` hold it in turn. Every
    ``prepare`` of the planned launches runs before that thread starts, in the session's thread: a
    ``prepare`` seeds torch's global random generator to write a model, and in a thread of its own
    it would draw from the generator the tests draw from beside it (and its ``fork_rng`` would
    rewind theirs): the files, and the tests' numbers, would change from run to run."""

    MAX_CASES = 16

    def __init__(self, root: Path | None = None, *, grace: float = 20) -> None:
        self.root = root
        self.grace = grace
        self.entries: dict[str, _Entry] = {}
        self.modules: set[str] | None = None  # those with a selected test (None: all)
        self.launch_of: dict[str, int] = {}  # key: its launch, once launches are planned
        self.launches: list[tuple[int, list[str]]] = []  # world, keys
        self.ran: set[int] = set()
        self.results: dict[str, list[Any]] = {}
        self.failed: dict[str, str] = {}
        self.prepared: dict[Callable[[Path], object], str | None] = {}  # what went wrong, if anything
        self.timings: list[tuple[int, int, int, int, float]] = []  # launch, world, cases, failed, seconds
        self.made: dict[Callable[[Path], object], object] = {}  # what each prepare returned
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def add(
        self,
        world: int,
        key: str,
        case: str,
        *,
        after: str | None = None,
        prepare: Callable[[Path], object] | None = None,
        timeout: float = 180,
        **kwargs: Any,
    ) -> str:
        """Case ``key`` (unique over the modules): ``case`` with ``kwargs`` on ``world`` ranks, after
        case ``after`` in an earlier launch, and after ``prepare(pool folder)`` (once for all the
        cases that give it), within ``timeout`` seconds. Returns the key."""
        if after is not None and after not in self.entries:
            raise ValueError(f"case {key!r} comes after {after!r}, which the pool does not hold")
        module = str(sys._getframe(1).f_globals.get("__name__", "?"))  # the module adding it
        entry = _Entry(world, case, kwargs, after, module, prepare, timeout)
        if self.entries.setdefault(key, entry) != entry:
            raise ValueError(f"the pool holds another case {key!r}")
        return key

    def select(self, modules: set[str]) -> None:
        """Plan the cases of ``modules`` alone (and what they load from); others only when asked for."""
        self.modules = modules

    def path(self, *parts: str) -> Path:
        """What '{pool}/<parts>' names in a case's arguments."""
        assert self.root is not None, "the pool's folder is set by the session's pool fixture"
        return self.root.joinpath(*parts)

    def _level(self, key: str) -> int:
        after = self.entries[key].after
        return 0 if after is None else 1 + self._level(after)

    def _plan(self, key: str) -> None:
        """Launches for the cases not yet in one (of the selected modules, ``key``, and what they load
        from): by level (after's) and world, in the order added."""
        wanted = {k for k, e in self.entries.items() if self.modules is None or e.module in self.modules} | {key}
        for k in list(wanted):
            while (k := self.entries[k].after) is not None:  # type: ignore[assignment]
                wanted.add(k)
        groups: dict[tuple[int, int], list[str]] = {}
        for k, entry in self.entries.items():
            if k in wanted and k not in self.launch_of:
                groups.setdefault((self._level(k), entry.world), []).append(k)
        for (_, world), keys in sorted(groups.items(), key=lambda item: item[0][0]):
            self._launch(world, keys)

    def _launch(self, world: int, keys: list[str]) -> None:
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

    def _ready(self, key: str) -> bool:
        """Whether ``key`` can run: what it loads from ran, what it reads written (or it failed, saying why)."""
        entry = self.entries[key]
        if entry.after is not None:
            try:
                self(entry.after)
            except PoolCaseError as e:
                self.failed[key] = f"case {key!r} loads what case {entry.after!r} saved, which failed:\n{e}"
                return False
        if entry.prepare is not None:
            with contextlib.suppress(Exception):  # (its traceback is kept: the case fails with it)
                self.written(entry.prepare)
            if self.prepared[entry.prepare] is not None:
                self.failed[key] = f"what case {key!r} reads was not written:\n{self.prepared[entry.prepare]}"
                return False
        return True

    def _run(self, index: int) -> None:
        if index in self.ran:
            return
        self.ran.add(index)
        world, keys = self.launches[index]
        keys = [key for key in keys if self._ready(key)]
        if not keys:
            return
        cases = [(key, self.entries[key].case, self._kwargs(self.entries[key].kwargs)) for key in keys]
        timeouts = [self.entries[key].timeout for key in keys]
        began = time.monotonic()
        try:
            launch = run_launch(world, self.path(f"launch-{index}"), cases, case_timeout=timeouts, grace=self.grace)
        except Exception:  # (the harness's own failure: each case's)
            launch = Launch(failed=dict.fromkeys(keys, f"the launch of {keys} failed:\n{traceback.format_exc()}"))
        self.timings.append((index, world, len(keys), len(launch.failed), time.monotonic() - began))
        self.results |= launch.results
        self.failed |= launch.failed
        if launch.rest:
            self._launch(world, launch.rest)
        if launch.interrupted is not None:
            raise launch.interrupted

    def __call__(self, key: str) -> list[Any]:
        """Case ``key``'s results, by rank."""
        with self._lock:
            while key not in self.results and key not in self.failed:
                if key not in self.launch_of:
                    self._plan(key)
                index = self.launch_of[key]
                assert index not in self.ran, f"case {key!r} was in launch {index}, which left it undecided"
                self._run(index)
            if key in self.failed:
                raise PoolCaseError(self.failed[key])
            return self.results[key]

    def written(self, prepare: Callable[[Path], Any]) -> Any:
        """What ``prepare(pool folder)`` returns, written once whoever asks first (a case's launch or
        a test); its error, if it failed."""
        with self._lock:
            if prepare not in self.prepared:
                try:
                    self.made[prepare] = prepare(self.path())
                    self.prepared[prepare] = None
                except Exception:
                    self.prepared[prepare] = traceback.format_exc()
                    raise
            if self.prepared[prepare] is not None:
                raise AssertionError(f"writing the pool's files failed:\n{self.prepared[prepare]}")
            return self.made[prepare]

    def start(self) -> None:
        """Run every planned launch (the selected modules' cases) in a background thread, in order."""
        if self._thread is not None or self.root is None or self.modules == set():
            return
        with self._lock:
            for key, entry in self.entries.items():
                if (self.modules is None or entry.module in self.modules) and key not in self.launch_of:
                    self._plan(key)
            prepares = dict.fromkeys(self.entries[key].prepare for _, keys in self.launches for key in keys)
        for prepare in prepares:  # (here, not in the thread: see the class's docstring)
            if prepare is not None:
                with contextlib.suppress(Exception):  # (its traceback is kept: its cases fail with it)
                    self.written(prepare)

        def work() -> None:
            index = 0
            while not self._stop.is_set():
                with self._lock:
                    if index >= len(self.launches):
                        return
                    try:
                        self._run(index)
                    except BaseException:  # (a launch interrupted: its cases run again when asked for)
                        self.ran.discard(index)
                        return
                index += 1

        self._thread = threading.Thread(target=work, name="pool-launches", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Let the background launches end after the one running (the session's end)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


POOL = Pool()
"""The session's pool: test modules add their cases to it as they are imported."""
