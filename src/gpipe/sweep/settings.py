"""``gpipe sweep``'s own settings (its flags, beside the space): :class:`SweepSettings` and the choices."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DIRECTIONS", "PRUNERS", "SAMPLERS", "SweepSettings", "default_direction"]

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "none")
DIRECTIONS = ("maximize", "minimize")


def default_direction(metric: str) -> str | None:
    """Which way ``metric`` is better, if its name says (BLEU and accuracy up; losses and perplexity down)."""
    if metric.startswith("bleu") or "accuracy" in metric:
        return "maximize"
    if "loss" in metric or "perplexity" in metric:
        return "minimize"
    return None


@dataclass(frozen=True, kw_only=True)
class SweepSettings:
    """``gpipe sweep``'s flags: the trials in all, the metric and direction, sampler and pruner."""

    trials: int
    metric: str
    direction: str
    sampler: str = "tpe"
    pruner: str = "median"
    startup_trials: int = 3  # complete trials before the median pruner prunes
    prune_after: int = 0  # the step before which it prunes no trial (a metric that says little early on)
    seed: int = 0

    def kept(self) -> dict[str, Any]:
        """What a continued study must keep (all but the number of trials)."""
        return {k: v for k, v in asdict(self).items() if k != "trials"}
