"""One run folder read back: its settings (the newest checkpoint's ``run.json``), its metrics
(``metrics.jsonl``: steps done, the final loss, the best evaluation, the wall time ``elapsed_s``), and
its status: running (a live ``gpipe train`` holds ``.lock``), finished (its last step done), interrupted,
or, for a sweep's trial, what ``trial.json`` says (pruned, failed)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpipe import runfile
from gpipe.saving import latest

__all__ = [
    "METRICS",
    "TRIAL",
    "Run",
    "best_of",
    "best_value",
    "cell",
    "duration",
    "find_runs",
    "metrics_rows",
    "read_run",
    "trial_record",
]

TRIAL = "trial.json"  # in a sweep's trial folder: the trial's number, state, parameters, error
# The evaluation metric a run is ranked by, the first its rows hold, and which way is better
METRICS = (("bleu", "maximize"), ("eval_accuracy", "maximize"), ("eval_perplexity", "minimize"),
           ("eval_loss", "minimize"))  # fmt: skip
_NOT_RUNS = {"checkpoints", "tensorboard", "eval", "prepared", "vocab"}  # folders a run keeps inside it


@dataclass(kw_only=True)
class Run:
    """What ``gpipe runs`` shows of one run folder."""

    path: Path
    settings: dict[str, Any]  # {} before its first checkpoint
    steps: int = 0  # steps done (the last metrics row's)
    total: int | None = None  # its --steps
    loss: float | None = None  # the last step's training loss
    metric: str = ""  # the evaluation metric it is ranked by ('' without an evaluation)
    best: float | None = None
    elapsed: float | None = None  # seconds trained (its resumes summed)
    status: str = "interrupted"
    error: str = ""  # a failed trial's
    dropped: float | None = None  # a mixture of experts': the last evaluation's fraction of tokens dropped

    def row(self) -> dict[str, Any]:
        return {"run": str(self.path), "steps": self.steps, "loss": self.loss, "metric": self.metric,
                "best": self.best, "time": self.elapsed, "status": self.status}  # fmt: skip


def best_value(values: Iterable[float], direction: str) -> float | None:
    """The best finite one of ``values`` (``direction``: "maximize" or "minimize"; None: none)."""
    finite = [float(v) for v in values if math.isfinite(v)]
    if not finite:
        return None
    return max(finite) if direction == "maximize" else min(finite)


def best_of(rows: Iterable[dict[str, Any]], metric: str, direction: str) -> float | None:
    """The best finite value of ``metric`` over ``rows`` (None: none)."""
    return best_value((r[metric] for r in rows if isinstance(r.get(metric), (int, float))), direction)


def duration(seconds: float | None) -> str:
    """``1h 02m``, ``3m 07s``, ``12.3s``; ``-`` for none."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}h {minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m {secs:02d}s"


def cell(value: Any) -> str:
    """A table's cell: a float to 4 significant digits, ``-`` for none."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def metrics_rows(folder: Path) -> list[dict[str, Any]]:
    """The rows of ``folder``'s ``metrics.jsonl`` (a torn last line left out: the run is writing it)."""
    rows = []
    with contextlib.suppress(OSError):
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    rows.append(row)
    return rows


def trial_record(folder: Path) -> dict[str, Any]:
    """A sweep trial's ``trial.json`` ({} for a run of its own, or one unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((folder / TRIAL).read_text())
        if isinstance(record, dict):
            return record
    return {}


def _running(folder: Path) -> bool:
    """A live process of gpipe on this host holds the run (:func:`gpipe.runfile.running`)."""
    return runfile.running(folder) is True


def read_run(folder: Path) -> Run:
    """``folder`` read as a run (see the module's docstring)."""
    run = Run(path=folder, settings={})
    checkpoint = None
    with contextlib.suppress(Exception), warnings.catch_warnings():  # (damaged: the run without its settings)
        warnings.simplefilter("ignore")
        checkpoint = latest(folder / "checkpoints")
    if checkpoint is not None:
        with contextlib.suppress(runfile.RunFileError):
            run.settings = dict(runfile.read_run(checkpoint)["config"])
    rows = metrics_rows(folder)
    if rows:
        last = rows[-1]
        run.steps = int(last["step"])
        run.loss = last.get("loss")
        run.elapsed = last.get("elapsed_s")
    run.dropped = next((r["moe_dropped"] for r in reversed(rows) if "moe_dropped" in r), None)
    for metric, direction in METRICS:
        if (best := best_of(rows, metric, direction)) is not None:
            run.metric, run.best = metric, best
            break
    total = run.settings.get("steps")
    run.total = total if isinstance(total, int) else None
    record = trial_record(folder)
    if _running(folder):
        run.status = "running"
    elif record.get("state") in ("pruned", "failed"):
        run.status, run.error = record["state"], str(record.get("error") or "")
    elif run.total is not None and run.steps >= run.total:
        run.status = "finished"
    return run


def _is_run(folder: Path) -> bool:
    return (folder / "metrics.jsonl").is_file() or (folder / "checkpoints").is_dir()


def find_runs(paths: Iterable[str | Path]) -> Iterator[Path]:
    """The run folders at or under ``paths`` (a run, a sweep's folder, a folder of runs), each once, in
    name order under each path; a path that does not exist is a ``FileNotFoundError``."""
    seen: set[Path] = set()
    for given in map(Path, paths):
        if not given.exists():
            raise FileNotFoundError(f"{str(given)!r} does not exist")
        if _is_run(given):
            found = [given]
        else:
            found = []
            for root, dirs, _ in os.walk(given):
                dirs[:] = sorted(d for d in dirs if d not in _NOT_RUNS and not d.startswith("."))
                if _is_run(Path(root)) and Path(root) != given:
                    found.append(Path(root))
                    dirs[:] = []  # (a run holds no runs)
        for folder in found:
            if folder.resolve() not in seen:
                seen.add(folder.resolve())
                yield folder
