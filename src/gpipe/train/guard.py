"""Bad steps of ``gpipe train``: ``--on-nonfinite stop|skip``, ``--max-skips`` and ``--skip-spikes``
(:class:`StepGuard`), and the stop they end in (:class:`NonFiniteError`, exit status 3).

After every step, before the optimizer's update, :func:`gpipe.nonfinite.all_finite` checks the loss and
every gradient. When a value is NaN or Inf the step is run again, seeded as it was, with every layer
watched (:func:`gpipe.nonfinite.locate`), to name where it first appeared. ``stop`` ends the run there
(the checkpoint of the step before is written, unless the bad step changed running statistics that
were not kept: then the newest checkpoint stays the last); ``skip`` drops the step's update: the weights and the
optimizer's state stay as they were (and the running statistics the step changed are put back); the
learning-rate schedule follows the step number. ``--max-skips`` skips in a row end the run as ``stop``
does: a run never loops on a bad batch.

``--skip-spikes`` also skips a step whose gradient norm is an outlier, by Lingvo's rule: over 4
standard deviations above the moving mean of its logarithm (moving averages with decay 0.995, norms
below 0.01 counted as 0.01), once 20 steps were accepted. The norm is the training health's
(:func:`gpipe.health.global_grad_norm`, the ``grad_norm`` of ``--health-every``: a tied weight, a
data-parallel replica's copy and a tensor-parallel-replicated weight counted once). Its state
travels in the checkpoints (``guard.json``), so that a resumed run skips the same steps."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _NormBase

from gpipe.health import global_grad_norm
from gpipe.nonfinite import all_finite
from gpipe.pipeline import Pipeline
from gpipe.train.config import TrainConfig

__all__ = ["EXIT_NONFINITE", "GUARD", "NonFiniteError", "SpikeTracker", "StepGuard"]

GUARD = "guard.json"  # in every checkpoint: the skips in a row and the spike tracker's state
EXIT_NONFINITE = 3  # gpipe train's exit status when it stops on a non-finite (or too many skipped) step


class NonFiniteError(RuntimeError):
    """The run stopped on a bad step (``--on-nonfinite stop``, or ``--max-skips`` skips in a row)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step
        self.kept = 0  # the step of the newest checkpoint kept (0: none)


NonFiniteError.__module__ = "gpipe.train"


class SpikeTracker:
    """Lingvo's gradient-norm tracker: moving mean and variance of log(norm), an outlier over
    ``sigmas`` standard deviations above the mean (after ``warmup`` accepted steps)."""

    def __init__(self, decay: float = 0.995, sigmas: float = 4.0, floor: float = 1e-2, warmup: int = 20) -> None:
        self.decay, self.sigmas, self.floor, self.warmup = decay, sigmas, floor, warmup
        self.weight = self.mean = self.square = 0.0  # the moving sums of 1, log(norm) and its square
        self.accepted = 0

    def outlier(self, norm: float) -> str | None:
        """Why a step of gradient norm ``norm`` is a spike (None: it is not; then it counts)."""
        log = math.log(max(norm, self.floor))
        if self.accepted >= self.warmup:
            mean = self.mean / self.weight
            std = math.sqrt(max(self.square / self.weight - mean * mean, 0.0))
            if log > mean + self.sigmas * std:
                return (
                    f"gradient norm {norm:.4g} is over {self.sigmas:g} standard deviations above its moving "
                    f"mean (limit {math.exp(mean + self.sigmas * std):.4g})"
                )
        self.weight = self.decay * self.weight + 1.0
        self.mean = self.decay * self.mean + log
        self.square = self.decay * self.square + log * log
        self.accepted += 1
        return None

    def state_dict(self) -> dict[str, float]:
        return {"weight": self.weight, "mean": self.mean, "square": self.square, "accepted": self.accepted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight, self.mean, self.square = float(state["weight"]), float(state["mean"]), float(state["square"])
        self.accepted = int(state["accepted"])


class StepGuard:
    """The checks of every step (see the module's docstring): :meth:`begin` before the step,
    :meth:`check` after it, before the update."""

    def __init__(self, cfg: TrainConfig, pipe: Pipeline) -> None:
        self.cfg, self.pipe = cfg, pipe
        self.in_a_row = 0
        self.skips = 0  # the run's skipped steps (the metrics' "skips")
        self.spikes = SpikeTracker() if cfg.skip_spikes else None
        self._buffers: list[tuple[Tensor, Tensor]] = []

    def begin(self) -> None:
        """Before a step: with skip, keep the buffers (running statistics) the step may change."""
        if self.cfg.on_nonfinite == "skip" or self.spikes is not None:
            self._buffers = [(b, b.clone()) for b in self.pipe.buffers() if b.is_floating_point()]

    @property
    def clean(self) -> bool:
        """Whether the model is as it was before the bad step: nothing but the gradients changed (no
        running statistics), or what changed was put back. Only then is it saved at a stop."""
        if self._buffers:
            return True
        return not any(isinstance(m, _NormBase) and m.track_running_stats for m in self.pipe.modules())

    def _restore(self) -> None:
        with torch.no_grad():
            for b, before in self._buffers:
                b.copy_(before)

    def check(
        self,
        step: int,
        loss: float,
        again: Callable[[], Any],
        norms: Sequence[tuple[Tensor, float]] | None = None,
        grad_norm: float | None = None,
    ) -> str | None:
        """After step ``step`` (mean loss ``loss``): None if its update goes ahead; else why it is
        skipped. ``again`` runs the step again, seeded as before, and returns :func:`locate`'s answer;
        ``norms``: every parameter and its gradient's norm if computed already (to clip them);
        ``grad_norm``: the global norm if known (the training health's). Raises
        :class:`NonFiniteError` to stop."""
        why = None
        if not all_finite(self.pipe, loss, norms=None if norms is None else [n for _, n in norms]):
            where = again()
            self._restore()  # (the first run's running statistics, and the second's)
            why = (
                str(where)
                if where is not None
                else ("a NaN or Inf that the step run again did not show (or a gradient norm beyond float range)")
            )
            if self.cfg.on_nonfinite == "stop":
                raise NonFiniteError(f"step {step}: {why}; --on-nonfinite skip would skip such steps", step)
        elif self.spikes is not None:
            why = self.spikes.outlier(global_grad_norm(self.pipe, norms) if grad_norm is None else grad_norm)
            if why is not None:
                self._restore()
        if why is None:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        self.skips += 1
        if self.in_a_row > self.cfg.max_skips:
            raise NonFiniteError(
                f"step {step}: {why}; that is {self.in_a_row} skipped steps in a row, more than --max-skips "
                f"{self.cfg.max_skips}: stopped (the data or the learning rate needs a look)",
                step,
            )
        for p in self.pipe.parameters():
            p.grad = None
        return why

    def state(self) -> str:
        """What a checkpoint keeps (``guard.json``): the skips in a row, the spike tracker's state."""
        state: dict[str, Any] = {"in_a_row": self.in_a_row, "skips": self.skips}
        if self.spikes is not None:
            state["spikes"] = self.spikes.state_dict()
        return json.dumps(state) + "\n"

    def load(self, path: Path) -> None:
        """A checkpoint's state (one written before ``guard.json`` existed has none: kept as new)."""
        if not path.exists():
            return
        state = json.loads(path.read_text())
        self.in_a_row, self.skips = int(state.get("in_a_row", 0)), int(state.get("skips", 0))
        if self.spikes is not None and "spikes" in state:
            self.spikes.load_state_dict(state["spikes"])
