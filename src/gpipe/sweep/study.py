"""A sweep's trials, one after another, through an Optuna study kept in ``DIR/study.db``.

Rank 0 owns the study: it asks for the next trial (or takes up an interrupted one), and every rank
follows it: rank 0 broadcasts the trial, its settings and, at each evaluation, whether it is pruned.
(optuna-integration's ``TorchDistributedTrial`` does this too, but sends a float setting as float32:
the ranks would train with a learning rate other than the one the study records.)

Each trial is an ordinary ``gpipe train`` run in ``DIR/trial-NNN``, reporting its evaluation metric at
each evaluation; the median pruner may stop it there. Its value is the best evaluation of the run.
After each trial rank 0 rewrites ``results.md`` and ``best.toml`` (:mod:`gpipe.sweep.report`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gpipe.distributed import init_from_env
from gpipe.runs.folder import TRIAL, best_of, metrics_rows
from gpipe.saving import CheckpointError, NoSpaceError
from gpipe.saving.folders import write_atomically
from gpipe.sweep.report import STATES, best_trial, write_best, write_results
from gpipe.sweep.settings import SweepSettings
from gpipe.sweep.space import Space, SpaceError
from gpipe.train.checks import ConfigError, flag, newest_checkpoint
from gpipe.train.guard import NonFiniteError
from gpipe.train.loop import one_run, train

__all__ = ["STUDY", "SWEEP", "Sweep"]

STUDY = "study.db"  # Optuna's study (SQLite)
SWEEP = "sweep.json"  # the sweep's settings and space: a continued study must keep them
_NAME = "gpipe-sweep"


class _MetricMissingError(SpaceError):
    pass


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (itself when not distributed)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Sweep:
    """The trials of ``space`` into ``out``, as ``settings`` say (:meth:`run`)."""

    def __init__(self, space: Space, settings: SweepSettings, out: Path) -> None:
        self.space, self.settings, self.out = space, settings, out
        self.distributed = False

    def run(self) -> int:
        """Run the trials left (up to ``settings.trials`` in all); 0, or 2 when the metric is not one the
        runs' evaluations give (the sweep stops at its first evaluation)."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            fixed = self.space.config({}, out=str(self.out))
            self.distributed = init_from_env(float(fixed.timeout), devices=fixed.devices)
        error = None
        if _rank() == 0:
            try:
                self._check_out()
            except SpaceError as exc:
                error = str(exc)
        if (error := _broadcast(error)) is not None:
            raise SpaceError(error)
        with one_run(self.out, command="gpipe sweep"):
            study = self._study() if _rank() == 0 else None
            while True:
                plan = self._next(study) if study is not None else None
                said = _broadcast(None if plan is None else (plan[0].number, plan[1]))
                if said is None:
                    break
                self._trial(study, plan[0] if plan is not None else None, *said)
            if study is not None:
                self._say_done(study)
        return 0

    # -- rank 0: the study -------------------------------------------------------------------------

    def _check_out(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise SpaceError(f"--out {str(out)!r} is a file; name a folder for the sweep (it is created if missing)")
        saved = out / SWEEP
        now = {"space": self.space.as_dict(), **self.settings.kept()}
        if not saved.exists():
            trials = sorted(p.name for p in out.glob("trial-*")) if out.is_dir() else []
            if trials or (out / STUDY).exists():
                raise SpaceError(f"--out {str(out)!r} holds {', '.join(trials[:3]) or STUDY} but no {SWEEP}: not a "
                                 "sweep this command can continue; give another --out")  # fmt: skip
            out.mkdir(parents=True, exist_ok=True)
            write_atomically(saved, lambda p: p.write_text(json.dumps(now, indent=1) + "\n"))
            return
        try:
            before = json.loads(saved.read_text())
        except (OSError, ValueError) as exc:
            raise SpaceError(f"cannot read {str(saved)!r} ({exc}); restore it, or give another --out") from None
        differ = [k for k in now if before.get(k) != json.loads(json.dumps(now[k]))]
        if differ:
            said = ", ".join("the space" if k == "space" else f"--{flag(k)} {before.get(k)!r}" for k in differ)
            raise SpaceError(f"the sweep in {str(out)!r} was started with {said}; this command differs. Give the "
                             "same space and flags to continue it, or another --out for a new sweep")  # fmt: skip

    def _study(self) -> Any:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        s = self.settings
        pruner = None
        if s.pruner == "median":
            pruner = optuna.pruners.MedianPruner(n_startup_trials=s.startup_trials, n_warmup_steps=s.prune_after)
        study = optuna.create_study(
            storage=f"sqlite:///{(self.out / STUDY).resolve()}", study_name=_NAME,
            direction="maximize" if s.direction == "maximize" else "minimize",
            pruner=pruner or optuna.pruners.NopPruner(), load_if_exists=True,
        )  # fmt: skip
        seed = s.seed + len(study.trials)  # (a continued study draws afresh, not its first trials again)
        if s.sampler == "grid":

            class Grid(optuna.samplers.GridSampler):
                def after_trial(self, *args: Any) -> None:
                    pass  # (it stops an exhausted study with Study.stop, for optimize(); _next asks itself)

            study.sampler = Grid(self.space.grid(), seed=seed)
        elif s.sampler == "random":
            study.sampler = optuna.samplers.RandomSampler(seed=seed)
        else:
            study.sampler = optuna.samplers.TPESampler(seed=seed)
        return study

    def _next(self, study: Any) -> tuple[Any, str] | None:
        """The next trial and how its folder starts: an interrupted one first ("resume" from its checkpoint,
        or "restart" without one), else a new one while the study has fewer than ``trials``."""
        import optuna

        trials = study.get_trials(deepcopy=False)
        for t in trials:
            if t.state == optuna.trial.TrialState.RUNNING:  # (interrupted: DIR's lock says no sweep runs it)
                folder = self._folder(t.number)
                mode = "resume" if newest_checkpoint(folder) else "restart" if folder.exists() else "new"
                print(f"trial {t.number} was interrupted: it is run again ({mode})", file=sys.stderr)
                return optuna.trial.Trial(study, t._trial_id), mode  # (FrozenTrial's id: no public name)
        if len(trials) >= self.settings.trials:
            return None
        if self.settings.sampler == "grid" and study.sampler.is_exhausted(study):
            print(f"the grid's {len(trials)} points are all tried: the sweep ends", file=sys.stderr)
            return None
        return study.ask(), "new"

    def _folder(self, number: int) -> Path:
        return self.out / f"trial-{number:03d}"

    # -- every rank: a trial -----------------------------------------------------------------------

    def _trial(self, study: Any, trial: Any, number: int, mode: str) -> None:
        params = _broadcast({d.name: d.suggest(trial) for d in self.space.search} if _rank() == 0 else None)
        folder = self._folder(number)
        if _rank() == 0:
            said = ", ".join(
                f"{flag(k)} {v:.4g}" if isinstance(v, float) else f"{flag(k)} {v}" for k, v in params.items()
            )
            print(f"trial {number} ({number + 1} of {self.settings.trials}): {said} -> {folder}", file=sys.stderr)
        cfg = self.space.config(params, out=str(folder), resume=mode == "resume", overwrite=mode == "restart")
        error = None
        stopped = False
        try:
            stopped = "stopped" in train(cfg, on_eval=self._hook(trial, cfg.steps))
        except _MetricMissingError as exc:
            if _rank() == 0:
                self._finish(study, trial, params, "failed", str(exc))
            raise
        except (ConfigError, CheckpointError, NonFiniteError, NoSpaceError) as exc:  # (the same on every rank)
            error = str(exc)
        except Exception as exc:
            if self.distributed:  # (a rank's own failure: the others cannot go on with it; re-run, it is resumed)
                raise
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"
        if _rank() == 0:
            state = "failed" if error is not None else "pruned" if stopped else "complete"
            self._finish(study, trial, params, state, error)

    def _hook(self, trial: Any, last: int) -> Any:
        """What the run does after an evaluation: rank 0 reports the metric to the trial and asks the pruner
        (not at the run's ``last`` step: nothing is left to save); every rank does as it says."""
        metric, prune = self.settings.metric, self.settings.pruner != "none"

        def on_eval(step: int, row: dict[str, Any]) -> bool:
            decision: bool | None = None  # (None: the metric is missing)
            if _rank() == 0 and metric in row:
                value = row[metric]
                trial.report(math.nan if value is None else float(value), step)  # (NaN: the pruner prunes it)
                decision = bool(prune and step < last and trial.should_prune())
            if (decision := _broadcast(decision)) is None:
                keys = sorted(k for k, v in row.items() if isinstance(v, (int, float)) and k != "step")
                raise _MetricMissingError(
                    f"--metric {metric!r} is not among the metrics of the runs' evaluations; they give "
                    f"{', '.join(keys)}"
                )
            return bool(decision)

        return on_eval

    def _finish(self, study: Any, trial: Any, params: dict[str, Any], state: str, error: str | None) -> None:
        """Rank 0: the trial told to the study, its ``trial.json``, and the sweep's reports rewritten."""
        import optuna

        folder = self._folder(trial.number)
        rows = metrics_rows(folder)
        s = self.settings
        value = best_of(rows, s.metric, s.direction)
        if state == "complete" and value is None:
            state, error = "failed", f"its evaluations gave no finite {s.metric}"
        trial.set_user_attr("error", error or "")
        states = {"complete": optuna.trial.TrialState.COMPLETE, "pruned": optuna.trial.TrialState.PRUNED,
                  "failed": optuna.trial.TrialState.FAIL}  # fmt: skip
        study.tell(trial, value if state == "complete" else None, state=states[state])
        if folder.is_dir():
            record = {"sweep": str(self.out), "trial": trial.number, "state": state, "metric": s.metric,
                      "value": value, "params": params, "error": error}  # fmt: skip
            write_atomically(folder / TRIAL, lambda p: p.write_text(json.dumps(record, indent=1) + "\n"))
        write_results(self.out, study, self.space, s)
        write_best(self.out, study, self.space, s)
        shown = "-" if value is None else f"{value:.4g}"
        step = rows[-1]["step"] if rows else 0
        line = f"trial {trial.number}: {state}, best {s.metric} {shown} at step {step}"
        print(line + (f": {error}" if error else ""), file=sys.stderr)

    def _say_done(self, study: Any) -> None:
        best = best_trial(study)
        states = [STATES.get(t.state.name) for t in study.get_trials(deepcopy=False)]
        summary = ", ".join(f"{states.count(name)} {name}" for name in ("complete", "pruned", "failed"))
        found = (f"; best: trial {best.number}, {self.settings.metric} {best.value:.4g} "
                 f"({self.out / 'best.toml'})") if best is not None else ""  # fmt: skip
        print(f"sweep {self.out}: {len(states)} trials ({summary}){found}; {self.out / 'results.md'}")
