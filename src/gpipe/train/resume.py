"""``--resume`` and ``--overwrite``. A new run never writes over an earlier run's results in its
``--out`` unless ``--overwrite`` says to delete them (:func:`check_out`, :func:`delete_results`). A
resumed run keeps its own settings: the command line merges what a run saved in its newest checkpoint
(``run.json``) under the flags given (:func:`resumed_settings`); :func:`resume_point` then names every
setting that differs from the run's (the flags that overrode it), refuses those that cannot change in the
middle of a run (the model's size, its data, the optimizer) and a ``--steps`` before the checkpoint, and
tells a finished run from one with steps left. The layout (``--partitions``, ``--data-parallel``,
``--fsdp``, ``--expert-parallel``) may change: a checkpoint loads into any; a sharded run resumed with
``--data-parallel 1`` drops its ``--fsdp``, and one whose experts were split over more replicas than it
resumes with, its ``--expert-parallel``. So may ``--precision`` (named, like ``--lr``): a checkpoint's weights and
optimizer state are float32 whatever the run computed in. ``--devices`` is not the run's but this
invocation's (as ``--out``): a run resumes on other hardware with ``auto``, or the ``--devices`` given."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gpipe.runfile import RUN, RunFileError, read_run
from gpipe.saving import verify
from gpipe.train.checks import flag, typed
from gpipe.train.config import ConfigError, TrainConfig, checkpoint_to_resume, newest_checkpoint

__all__ = [
    "FIXED",
    "RESULTS",
    "ResumePoint",
    "check_out",
    "delete_results",
    "earlier_run",
    "resume_point",
    "resumed_settings",
    "saved_settings",
]


# Settings a resumed run cannot change, and what they fix: its checkpoint holds that model (and that
# optimizer's state), and its steps so far were drawn from that data.
FIXED = {
    "model": "the model",
    "hf_config": "the model",
    "init": "the model",
    "lora": "the model (its adapters)",
    "lora_targets": "the model (its adapters)",
    "layers": "the model's size",
    "hidden": "the model's size",
    "heads": "the model's size",
    "dim": "the model's size",
    "head_dim": "the model's size",
    "filters": "the model's size",
    "reference_cells": "the model (its cells)",
    "classes": "the model's size",
    "image_size": "the model's size",
    "transparent": "the model (its transparent attention)",
    "experts": "the model (its experts)",
    "expert_top_k": "the model (its experts)",
    "moe_every": "the model (its experts)",
    "norm": "the model (its normalization)",
    "init_scheme": "the model (Fixup's scalars)",
    "share_layers": "the model (its shared layers)",
    "lr_hypergradient_scope": "the learned learning rates' state",
    "vocab": "the vocabulary",
    "vocab_size": "the vocabulary",
    "tokenizer": "the vocabulary",
    "data": "the data",
    "max_length": "the training data (longer pairs are left out)",
    "eval_sentences": "the training data (the held-out sentences are taken from it)",
    "optimizer": "the optimizer's saved state",
}
# Not settings of the run: how this invocation runs.
_INVOCATION = ("resume", "overwrite", "out", "progress", "timeout", "devices")


# What a run writes into OUT: another run there would write over it (OUT/vocab.model, which
# `gpipe vocab` may have put there, is an input, not a result).
RESULTS = ("checkpoints", "metrics.jsonl", "tensorboard", "loss.png", "grad_norm_ratio.png", "restarts.jsonl", "eval")


def earlier_run(out: Path) -> list[str]:
    """The results of an earlier run in ``out``, named (empty: none)."""
    found = []
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        steps = sorted(int(p.name[5:]) for p in checkpoints.glob("step-*") if p.name[5:].isdigit())
        found.append(f"checkpoints up to step {steps[-1]}" if steps else "a checkpoints folder")
    found += [name for name in RESULTS[1:] if (out / name).exists()]
    return found


def check_out(cfg: TrainConfig) -> None:
    """Refuse an ``--out`` that holds an earlier run, unless ``--resume`` or ``--overwrite``."""
    earlier = earlier_run(Path(cfg.out))
    if earlier and not cfg.resume and not cfg.overwrite:
        raise ConfigError(
            f"--out {cfg.out!r} holds an earlier run ({', '.join(earlier)}); continue it with --resume, give "
            "another --out, or add --overwrite to delete it and start afresh"
        )


def delete_results(out: Path, keep: tuple[str, ...] = ()) -> list[str]:
    """Delete what an earlier run wrote into ``out`` (``--overwrite``) but ``keep``; returns what it was."""
    gone = earlier_run(out)
    for name in RESULTS:
        if name in keep:
            continue
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return gone


def saved_settings(checkpoint: Path) -> dict[str, Any]:
    """The settings the run saved in ``checkpoint``'s ``run.json`` (those this version knows; one of
    :data:`FIXED` it has not: the default)."""
    path = checkpoint / RUN
    try:
        config = read_run(checkpoint)["config"]
    except RunFileError as exc:
        raise ConfigError(f"--resume: {exc}; restore the file, or start afresh with another --out") from None
    kinds = {f.name: str(f.type) for f in fields(TrainConfig)}
    # A setting of the model newer than the run (--transparent) is the default, what the run had without it:
    # --resume then names it if it is given otherwise.
    older = {f.name: f.default for f in fields(TrainConfig) if f.name in FIXED and f.name not in config}
    return {**older, **{k: typed(k, v, kinds[k], where=str(path)) for k, v in config.items() if k in kinds}}


def resumed_settings(given: dict[str, Any]) -> dict[str, Any]:
    """The settings of ``gpipe train``: ``given`` (flags and the ``--config`` file) over, when it
    resumes, the settings its run saved — the run's own, not the defaults, for what is not given."""
    if not given.get("resume"):
        return given
    found = newest_checkpoint(given.get("out", TrainConfig.out))
    if found is None:
        return given  # TrainConfig.check() refuses, naming the folder
    saved = {k: v for k, v in saved_settings(found).items() if k not in _INVOCATION}
    settings = {**saved, **given}
    if "fsdp" not in given and settings.get("data_parallel", 1) < 2:
        settings["fsdp"] = False  # a sharded run resumed without replicas: nothing to shard over (named as changed)
    if "expert_parallel" not in given and settings.get("data_parallel", 1) % settings.get("expert_parallel", 1):
        settings["expert_parallel"] = 1  # the experts split over more replicas than resume: whole on each (named)
    return settings


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run stands: its newest checkpoint, that checkpoint's step, the settings that
    differ from the run's (``--steps 60 -> 100``) and whether it has steps left."""

    checkpoint: Path
    step: int
    changed: tuple[str, ...]
    finished: bool

    def describe(self, out: str) -> str:
        if self.finished:
            return (
                f"the run in {out!r} is finished: its checkpoint is of step {self.step}, its last (--steps "
                f"{self.step}); give --steps above {self.step} to train on, or another --out for a new run"
            )
        changed = f"; settings changed from the run's: {', '.join(self.changed)}" if self.changed else ""
        return f"resuming {out!r} from its checkpoint of step {self.step}, with the run's settings{changed}"


def _same(name: str, saved: Any, now: Any) -> bool:
    if name == "data" and saved and now:  # one file or folder, however it is spelled
        return bool(saved == now or Path(saved).resolve() == Path(now).resolve())
    return bool(saved == now)


def resume_point(cfg: TrainConfig) -> ResumePoint:
    """Check ``cfg`` (with ``resume`` set) against its run's newest checkpoint: a setting of
    :data:`FIXED` that differs, or ``--steps`` below the checkpoint's step, is a :class:`ConfigError`.
    The run is finished if that checkpoint is of step ``--steps`` and intact (its files checked
    against their checksums; a damaged one is passed over when the run resumes)."""
    found = checkpoint_to_resume(cfg.out)
    step = int(m.group(1)) if (m := re.search(r"step-(\d+)", found.name)) else 0
    saved = saved_settings(found)
    changed = []
    for name, before in saved.items():
        now = getattr(cfg, name)
        if name in _INVOCATION or _same(name, before, now):
            continue
        if name in FIXED:
            raise ConfigError(
                f"--resume: --{flag(name)} {now!r} differs from the run's {before!r}, and {FIXED[name]} cannot "
                f"change in the middle of a run; leave --{flag(name)} out to keep the run's, or start a new run "
                "with another --out"
            )
        changed.append(f"--{flag(name)} {before} -> {now}")
    if cfg.steps < step:
        raise ConfigError(
            f"--resume: --steps {cfg.steps} is before the checkpoint's step {step} ({found}); give --steps above "
            f"{step} to train on, or leave --steps out to take the run's ({saved.get('steps', cfg.steps)})"
        )
    # A run whose last checkpoint is damaged is not finished: it trains again from the one before.
    return ResumePoint(found, step, tuple(changed), finished=cfg.steps == step and not verify(found))
