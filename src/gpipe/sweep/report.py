"""What a sweep leaves beside its trials: ``DIR/results.md``, a row per trial (its settings, steps,
final loss, best metric, wall time and state, a failed trial's error), and ``DIR/best.toml``, the fixed
settings with the best trial's, which ``gpipe train --config`` takes. Both rewritten after each trial."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gpipe.runs.folder import best_value, cell, duration, read_run
from gpipe.saving.folders import write_atomically
from gpipe.train.checks import flag

if TYPE_CHECKING:
    from pathlib import Path

    from gpipe.sweep.settings import SweepSettings
    from gpipe.sweep.space import Space

__all__ = ["STATES", "best_trial", "toml_value", "write_best", "write_results"]

# Optuna's trial states as the sweep names them
STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "interrupted",
           "WAITING": "waiting"}  # fmt: skip


def write_results(out: Path, study: Any, space: Space, settings: SweepSettings) -> None:
    """``out/results.md``: the sweep's settings, then one row per trial of ``study``."""
    trials = study.get_trials(deepcopy=False)
    names = [d.name for d in space.search]
    s = settings
    best = best_trial(study)
    lines = [
        f"# gpipe sweep {out}",
        "",
        f"- space: `{space.path}`: {'; '.join(d.describe() for d in space.search)}",
        f"- metric: {s.metric} ({s.direction}; a trial's value is its best evaluation)",
        f"- sampler: {s.sampler} (seed {s.seed}); pruner: {s.pruner}"
        + (f" (after {s.startup_trials} complete trials, from step {s.prune_after})" if s.pruner == "median" else ""),
        f"- trials: {len(trials)} of {s.trials}"
        + (f"; best: trial {best.number}, {s.metric} {best.value:.4g} (`best.toml`)" if best is not None else ""),
        "",
        "| trial | state | " + " | ".join(map(flag, names)) + f" | steps | final loss | best {s.metric} | wall time |",
        "|---" * (len(names) + 6) + "|",
    ]
    errors = []
    for t in trials:
        run = read_run(out / f"trial-{t.number:03d}")
        state = STATES.get(t.state.name, t.state.name.lower())
        value = t.value if t.state.name == "COMPLETE" else best_value(t.intermediate_values.values(), s.direction)
        cells = [str(t.number), state, *(cell(t.params.get(n)) for n in names), str(run.steps),
                 cell(run.loss), cell(value), duration(run.elapsed)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
        if error := t.user_attrs.get("error"):
            errors.append(f"- trial {t.number}: {error}")
    if errors:
        lines += ["", "Failed trials:", "", *errors]
    write_atomically(out / "results.md", lambda p: p.write_text("\n".join(lines) + "\n"))


def best_trial(study: Any) -> Any:
    """The study's best complete trial; None before there is one."""
    try:
        return study.best_trial
    except ValueError:  # (no complete trial yet)
        return None


def toml_value(value: Any) -> str:
    """``value`` (a setting: bool, int, float or str) written as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # (a TOML basic string: JSON's escapes are TOML's)


def write_best(out: Path, study: Any, space: Space, settings: SweepSettings) -> None:
    """``out/best.toml``: the fixed settings and the best complete trial's; nothing before there is one."""
    best = best_trial(study)
    if best is None:
        return
    lines = [
        f"# gpipe sweep {out}: trial {best.number}, the best {settings.metric} ({settings.direction}): "
        f"{best.value:.6g}",
        f"# its run: {out / f'trial-{best.number:03d}'}. Train with these settings:",
        f"#   gpipe train --config {out / 'best.toml'} --out runs/best",
    ]
    settings_ = {**space.fixed, **best.params}
    lines += [f"{flag(name)} = {toml_value(value)}" for name, value in settings_.items()]
    write_atomically(out / "best.toml", lambda p: p.write_text("\n".join(lines) + "\n"))
