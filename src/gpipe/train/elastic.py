"""Restarts of ``gpipe train`` by torchrun's elastic agent (``torchrun --max-restarts N``, or
``--nnodes MIN:MAX``): a restarted worker group continues the same job from its newest complete
checkpoint, with the same command line, and says what it lost.

A job is torchrun's run id (``TORCHELASTIC_RUN_ID``: a fresh one for each ``--standalone`` launch, the
``--rdzv-id`` given otherwise). When a job starts into its ``--out`` (the earlier-run check passed),
rank 0 writes ``OUT/.job.json`` with that id; a worker that finds its own job's id there is a restart:
it resumes from the newest complete checkpoint (or, with none yet, starts the job again from step 1,
replacing what the lost attempt wrote). ``metrics.jsonl`` and TensorBoard are written from the
checkpoint's step on, so they keep one row per step. A new job (another id) into a used ``--out`` is
refused as always. With torchrun's default ``--rdzv-id`` (``none``), which does not tell jobs apart, a
worker is a restart only when torchrun says it restarted it (``TORCHELASTIC_RESTART_COUNT`` > 0).

Every rank that sees the job fail (a lost rank, a silent one, a non-finite step) records why in
``OUT/.failures/rank-R.json``. The restart reads them: rank 0 logs the lost rank, the step it resumes
from, the steps run again and the time lost (to standard error and ``OUT/restarts.jsonl``, whose row
is written once the first step after the restart is done: ``seconds`` is then from the failure to
that step). A job that stopped on a non-finite value is not trained again by a restart: it stops at
once with the same error (exit status 3), instead of looping on the same bad step. A job that ends
well removes ``.job.json``."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from gpipe.saving import write_atomically
from gpipe.train.checks import newest_checkpoint

__all__ = ["FAILURES", "JOB", "RESTARTS", "Restart", "finished", "record_failure", "restart_of", "start_job"]

JOB = ".job.json"
FAILURES = ".failures"
RESTARTS = "restarts.jsonl"


def _job() -> str | None:
    """torchrun's run id, when under torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID") if "WORLD_SIZE" in os.environ else None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Restart:
    """A restarted worker group's view of the job: the failures its lost attempt recorded, and
    the log it writes."""

    def __init__(self, out: Path, failures: list[dict[str, Any]]) -> None:
        self.out, self.failures = out, failures
        self.checkpoint = newest_checkpoint(out)
        self.step = int(self.checkpoint.name.rsplit("-", 1)[1]) if self.checkpoint is not None else 0
        self.first = min(failures, key=lambda f: f["time"]) if failures else None
        self.reached = _last_step(out / "metrics.jsonl")

    def nonfinite(self) -> dict[str, Any] | None:
        """The lost attempt's stop on a non-finite value, if that is how it ended."""
        return next((f for f in self.failures if f.get("kind") == "nonfinite"), None)

    def describe(self) -> str:
        lost = self.first["message"] if self.first is not None else "no rank recorded why (killed all at once?)"
        again = f"; steps {self.step + 1}..{self.reached} run again" if self.reached > self.step else ""
        start = f"from its checkpoint of step {self.step}" if self.checkpoint is not None else "from step 1"
        return f"torchrun restarted the job (restart {_restarts()}): {lost}; it continues {start}{again}"

    def log(self, first_step_done: float, resumed_from: int) -> None:
        """After the first step of the restart (rank 0): the row of ``OUT/restarts.jsonl`` (``resumed_from``:
        the checkpoint loaded, an older one than :attr:`step` if that one was damaged)."""
        row = {
            "restart": _restarts(),
            "job": _job(),
            "lost": self.first["message"] if self.first is not None else None,
            "rank": self.first["rank"] if self.first is not None else None,
            "resumed_from": resumed_from,
            "steps_again": max(self.reached - resumed_from, 0),
            "seconds": round(first_step_done - self.first["time"], 3) if self.first is not None else None,
        }
        with open(self.out / RESTARTS, "a") as f:
            f.write(json.dumps(row) + "\n")


def _last_step(metrics: Path) -> int:
    step = 0
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            step = max(step, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return step


def restart_of(out: str) -> Restart | None:
    """This worker group's :class:`Restart` when torchrun restarted the job that ``out`` holds, else
    None (not under torchrun, or a new job)."""
    job = _job()
    folder = Path(out)
    if job is None:
        return None
    try:
        marked = json.loads((folder / JOB).read_text()).get("job")
    except (OSError, ValueError, AttributeError):
        return None
    if marked != job or (job == "none" and _restarts() == 0):
        return None
    failures = []
    for path in sorted((folder / FAILURES).glob("rank-*.json")):
        try:
            failures.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return Restart(folder, failures)


def start_job(out: Path, restart: Restart | None) -> None:
    """Rank 0, once every rank has looked at ``out`` (:func:`restart_of`; after a barrier): mark it as
    this job's (under torchrun), and clear the failures a restart has read."""
    job = _job()
    if job is None or _rank() != 0:
        return
    shutil.rmtree(out / FAILURES, ignore_errors=True)  # (read by the restart; or an earlier job's)
    if restart is not None:
        return
    write_atomically(out / JOB, lambda p: p.write_text(json.dumps({"job": job, "started": time.time()}) + "\n"))


def finished(out: Path) -> None:
    """Rank 0, when the job ends well: it is no longer restartable."""
    if _job() is not None and _rank() == 0:
        (out / JOB).unlink(missing_ok=True)


_provisional: dict[Path, float] = {}  # records this process wrote before it knew more: their failure's time


def record_failure(out: Path, kind: str, message: str, step: int | None = None, *, provisional: bool = False) -> None:
    """Why this rank saw the job fail (``kind``: "lost" or "nonfinite"), for the restart to read;
    only under torchrun. Never raises: the failure itself is what matters. A rank's first record
    stays, unless it was ``provisional``: written at once, before asking the other ranks' heartbeats
    who is lost (which takes a second or two, and torchrun's agent kills a rank a few seconds after
    telling it to stop); the next record replaces it, keeping its time."""
    path = out / FAILURES / f"rank-{_rank()}.json"
    if _job() is None or (path.exists() and path not in _provisional):  # (a rank's first record says the most)
        return
    now = _provisional.pop(path, time.time())
    record = {"rank": _rank(), "kind": kind, "message": message, "step": step, "time": now}
    try:
        (out / FAILURES).mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda p: p.write_text(json.dumps(record) + "\n"))
    except Exception as exc:
        print(f"warning: could not record the failure in {str(out / FAILURES)!r}: {exc}", file=sys.stderr)
        return
    if provisional:
        _provisional[path] = now
