"""``gpipe train --lr-hypergradient BETA``: the run's :class:`~gpipe.hypergradient.LearnedRates`, and
their factors in every checkpoint (``learned_rates.json``; the last updates travel in the optimizer's
state), so that ``--resume`` learns on exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpipe.hypergradient import LearnedRates
from gpipe.pipeline import Pipeline
from gpipe.train.config import ConfigError, TrainConfig

__all__ = ["RATES", "learned_rates", "load_rates"]

RATES = "learned_rates.json"  # in every checkpoint of a run with --lr-hypergradient: the learned factors


def learned_rates(cfg: TrainConfig, pipe: Pipeline, optimizer: torch.optim.Optimizer) -> LearnedRates | None:
    """The learned rates of a run with ``--lr-hypergradient`` (None without)."""
    if not cfg.lr_hypergradient:
        return None
    return LearnedRates(pipe, optimizer, beta=cfg.lr_hypergradient, scope=cfg.lr_hypergradient_scope)


def load_rates(rates: LearnedRates | None, checkpoint: Path) -> None:
    """The factors a checkpoint holds, into ``rates``; a checkpoint of a run without learned rates
    starts them at 1."""
    path = checkpoint / RATES
    if rates is None or not path.exists():
        return
    try:
        rates.load_state_dict(json.loads(path.read_text()))
    except ValueError as exc:  # (not JSON, or of another scope or model)
        raise ConfigError(f"--resume: {path}: {exc}") from exc
