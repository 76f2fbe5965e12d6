"""``gpipe runs``: the runs under some folders side by side, a row each.

    gpipe runs runs/                       # every run under runs/ (a sweep's trials too)
    gpipe runs runs/lr --sort best         # the best evaluation first
    gpipe runs runs/a runs/b --sort lr     # by a setting
    gpipe runs runs/lr --csv > lr.csv

The columns: the settings in which the runs differ (from each run's newest checkpoint), the steps done,
the final training loss, the best evaluation (BLEU for translation, the accuracy for images, the
perplexity of a causal LM, else the held-out loss), where runs have experts the fraction of tokens the
last evaluation dropped, the wall time trained, and the status: running,
finished, interrupted (stopped before its last step: ``gpipe train --resume`` continues it), or a
sweep trial's pruned or failed. ``tensorboard --logdir`` over the same folders shows the table in its
HParams tab: each run writes its settings when it starts and its metrics at each evaluation.
"""

# An application: imports gpipe.saving (a run's newest checkpoint) and nothing of the training; only the command
# line (gpipe.cli) and gpipe sweep import it.

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections.abc import Sequence
from typing import Any

from gpipe.commands.args import ArgumentParser, UsageError, refuse
from gpipe.runfile import WHERE_AND_HOW
from gpipe.runs.folder import METRICS, Run, cell, duration, find_runs, read_run

__all__ = ["Run", "columns", "find_runs", "main", "read_run", "table"]

_SORTS = ("run", "steps", "loss", "best", "time", "status")


def columns(runs: Sequence[Run]) -> list[str]:
    """The settings whose values differ between ``runs``, in TrainConfig's order."""
    names: list[str] = []
    for run in runs:
        names += [k for k in run.settings if k not in names and k not in WHERE_AND_HOW]
    return [k for k in names if len({repr(r.settings.get(k)) for r in runs}) > 1]


def _sort_key(key: str) -> Any:
    """Runs ordered by ``key``: a column of :data:`_SORTS` (the best evaluation best first, each metric
    its own way) or a setting; runs without the value last."""
    better = dict(METRICS)

    def order(run: Run) -> tuple[Any, ...]:
        value: Any
        if key == "best":
            value = run.best if better.get(run.metric) == "minimize" or run.best is None else -run.best
        elif key in _SORTS:
            value = str(run.path) if key == "run" else {"steps": run.steps, "loss": run.loss, "time": run.elapsed,
                                                        "status": run.status}[key]  # fmt: skip
        else:
            value = run.settings.get(key)
        return (value is None, str(type(value)), value if value is not None else 0)

    return order


def table(runs: Sequence[Run], *, as_csv: bool = False) -> str:
    """The runs as a table: aligned text (markdown), or CSV with full precision."""
    names = columns(runs)
    experts = any(r.dropped is not None for r in runs)  # (a mixture of experts: the tokens dropped)
    header = ["run", *names, "steps", "loss", "metric", "best", *(["dropped"] if experts else []), "time", "status"]
    rows = []
    for r in runs:
        steps = f"{r.steps}/{r.total}" if r.total is not None and not as_csv else r.steps
        if as_csv:
            rows.append([str(r.path), *(r.settings.get(n) for n in names), steps, r.loss, r.metric, r.best,
                         *([r.dropped] if experts else []), r.elapsed, r.status])  # fmt: skip
        else:
            status = f"{r.status}: {r.error}" if r.error else r.status
            rows.append([str(r.path), *(cell(r.settings.get(n)) for n in names), str(steps), cell(r.loss),
                         r.metric or "-", cell(r.best), *([cell(r.dropped)] if experts else []),
                         duration(r.elapsed), status])  # fmt: skip
    if as_csv:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(header)
        writer.writerows([["" if v is None else v for v in row] for row in rows])
        return buffer.getvalue()
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]) + "\n"


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="gpipe runs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="a run's --out, a sweep's, or a folder of runs")
    parser.add_argument("--sort", metavar="KEY", default="run",
                        help=f"order the rows by {', '.join(_SORTS)} or a setting (default: run)")  # fmt: skip
    parser.add_argument("--csv", action="store_true", help="CSV on standard output, full precision")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe runs``: the table on standard output; 0, or 2 for a bad path or flag (one line)."""
    try:
        args = _parser().parse_args(argv)
        try:
            runs = [read_run(folder) for folder in find_runs(args.paths)]
        except FileNotFoundError as exc:
            raise UsageError(f"{exc}; give run folders or folders that hold runs") from None
        if not runs:
            raise UsageError(f"no run under {', '.join(map(repr, args.paths))} (a run's folder holds metrics.jsonl)")
        known = {k for r in runs for k in r.settings}
        if args.sort not in _SORTS and args.sort not in known:
            raise UsageError(f"--sort {args.sort!r} is neither a column ({', '.join(_SORTS)}) nor a setting of the "
                             "runs (e.g. lr, partitions)")  # fmt: skip
        runs.sort(key=_sort_key(args.sort))
        sys.stdout.write(table(runs, as_csv=args.csv))
    except UsageError as exc:
        return refuse(exc)
    return 0
