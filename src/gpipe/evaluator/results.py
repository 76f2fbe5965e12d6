"""Where ``gpipe eval`` writes (:class:`Results`): a folder, ``RUN/eval`` by default, holding

- ``metrics.jsonl``: one row per evaluated step, ``step`` and the keys of training's own evaluation
  (``eval_loss``, ``bleu/<pair>``, ...), in step order; rewritten whole at each evaluation (a crash
  leaves the previous file), so that what it lists is what was done: a watcher started again skips it;
- ``loss.png``: the training's loss curve (the run's ``metrics.jsonl``) with these evaluations' losses and
  BLEU per pair over it, as training's own ``loss.png`` draws its evaluations;
- ``settings.json``: the evaluation settings its rows share (a later evaluation with others is refused);
- ``tensorboard/``: the same numbers as TensorBoard events, under training's names, so that
  ``tensorboard --logdir RUN`` draws them over the training run's;
- ``.lock``: one evaluation at a time writes here (an exclusive ``flock``, released when the process
  ends, however it ends).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import IO, Any

from gpipe.commands.args import UsageError
from gpipe.saving import write_atomically
from gpipe.train.config import has_tensorboard
from gpipe.train.metrics import curves_figure

__all__ = ["METRICS", "SETTINGS", "Results", "evaluated_steps"]

METRICS, SETTINGS = "metrics.jsonl", "settings.json"


def evaluated_steps(folder: Path) -> set[int]:
    """The steps ``folder/metrics.jsonl`` holds a row of (none if there is no file)."""
    return {row["step"] for row in _rows(folder / METRICS)}


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    rows.append(row)
    return rows


class Results:
    """The results folder ``folder`` of evaluations with ``settings`` (a dict of JSON values), open
    in this process (rank 0 under torchrun: the others keep no results). Opening it takes the lock
    and refuses a folder whose evaluations had other settings."""

    def __init__(self, folder: Path, settings: dict[str, Any], *, tensorboard: bool = True) -> None:
        self.folder = folder
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot write the evaluations into {str(folder)!r}: {exc.strerror}") from None
        self._lock: IO[str] | None = _lock(folder)
        saved = folder / SETTINGS
        if saved.is_file():
            try:
                earlier = json.loads(saved.read_text())
            except ValueError:
                earlier = None
            if earlier != settings:
                old = earlier if isinstance(earlier, dict) else {}
                differ = [f"--{k.replace('_', '-')} {old.get(k)} there, {v} here" for k, v in settings.items()
                          if old.get(k) != v]  # fmt: skip
                raise UsageError(
                    f"{str(folder)!r} holds evaluations with other settings ({'; '.join(differ) or 'unreadable'}): "
                    "give these their own folder with --out, or evaluate with the same settings"
                )
        else:
            write_atomically(saved, lambda p: p.write_text(json.dumps(settings, indent=1) + "\n"))
        self.board: Any = None
        if tensorboard and has_tensorboard():
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(log_dir=str(folder / "tensorboard"))

    def steps(self) -> set[int]:
        return evaluated_steps(self.folder)

    def add(self, row: dict[str, Any]) -> None:
        """Record ``row`` (with its ``step``), replacing the step's earlier row if there is one."""
        rows = [r for r in _rows(self.folder / METRICS) if r["step"] != row["step"]] + [row]
        rows.sort(key=lambda r: int(r["step"]))
        text = "".join(json.dumps(r) + "\n" for r in rows)
        write_atomically(self.folder / METRICS, lambda p: p.write_text(text))
        if self.board is not None:
            for name, value in row.items():
                if isinstance(value, str):
                    self.board.add_text(name, value, row["step"])
                elif name != "step" and value is not None:
                    self.board.add_scalar(name, value, row["step"])
            self.board.flush()

    def plot(self, run: Path, baseline: float, baseline_name: str) -> None:
        """``loss.png``: the run's training losses (``run/metrics.jsonl``) and the evaluations here."""
        evaluated = {r["step"]: r for r in _rows(self.folder / METRICS)}
        rows = [{**r, **evaluated.pop(r["step"], {})} for r in _rows(run / METRICS)]
        rows = sorted(rows + list(evaluated.values()), key=lambda r: int(r["step"]))
        figure = curves_figure(rows, baseline, baseline_name)
        write_atomically(self.folder / "loss.png", lambda p: figure.savefig(p, dpi=120, format="png"))
        import matplotlib.pyplot as plt

        plt.close(figure)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
        if self._lock is not None:
            self._lock.close()  # (releases the lock)
            self._lock = None


def _lock(folder: Path) -> IO[str]:
    """``folder/.lock``, held: a second evaluation writing into ``folder`` is refused, naming the first."""
    lock = open(folder / ".lock", "a+")  # noqa: SIM115 - held open while the results are
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        pid = lock.read().strip() or "unknown"
        lock.close()
        raise UsageError(
            f"another gpipe eval (PID {pid}) is writing into {str(folder)!r}; wait for it to end, stop it, or give "
            "another --out"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock
