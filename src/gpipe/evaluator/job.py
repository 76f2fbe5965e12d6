"""A run's checkpoint evaluated apart from its training (:class:`Evaluator`): the run's settings read
from the checkpoint's ``run.json``, its data and model rebuilt as training built them
(:func:`gpipe.train.setup.make_data`, ``make_model``, ``make_losses``, ``make_pipeline``), the
checkpoint's weights loaded, and :func:`gpipe.evaluation.evaluate` run as training's own evaluation
runs it. At the run's ``--partitions`` and evaluation settings the numbers are those training logged
at that step, bit for bit; at another K, the same within float rounding.

Paths the run was given relative to where it started need not hold where the evaluation runs: the run
is ``RUN`` (where the checkpoint is), a folder of language pairs is read from the run's own
``RUN/prepared`` (what training read), a text's tokenizer and a Hugging Face model's config from the
checkpoint, which keeps both; only data the run read in place (a text file, images) is read from
``--data`` again (default: the path the run was given).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gpipe import runfile
from gpipe.commands.args import UsageError
from gpipe.data import Dataset
from gpipe.data.prepared import PreparedCorpus, is_prepared
from gpipe.distributed import init_from_env
from gpipe.evaluation import decoding_left_out, evaluate
from gpipe.models.hf import CONFIG
from gpipe.models.moe import routing_metrics
from gpipe.models.transparent import transparent_weights
from gpipe.runfile import RUN
from gpipe.saving import CheckpointError, load
from gpipe.train import ConfigError, TrainConfig
from gpipe.train.data import CACHE
from gpipe.train.precision import autocast, check_supported
from gpipe.train.setup import make_data, make_losses, make_model, make_pipeline

__all__ = ["EvalSettings", "Evaluator", "read_run", "run_folder"]


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """How a checkpoint is evaluated: training's ``--beam``, ``--length-penalty``, ``--batch`` and
    ``--eval-batches`` by default (:meth:`of_run`). They change the numbers: the evaluations of one
    results folder share them (``settings.json``)."""

    beam: int
    length_penalty: float
    batch: int
    eval_batches: int

    @classmethod
    def of_run(cls, cfg: TrainConfig, **given: Any) -> EvalSettings:
        """The run's own settings, overridden by those ``given`` that are not None."""
        own = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)}
        return cls(**{**own, **{k: v for k, v in given.items() if v is not None}})


def run_folder(checkpoint: Path) -> Path:
    """The run a checkpoint folder (``RUN/checkpoints/step-N``) belongs to: ``RUN``."""
    parent = checkpoint.resolve().parent
    return parent.parent if parent.name == "checkpoints" else parent


def read_run(checkpoint: Path) -> tuple[TrainConfig, str]:
    """The settings the run saved in ``checkpoint``'s ``run.json``, and the kind of its data."""
    path = checkpoint / RUN
    try:
        run = runfile.read_run(checkpoint)
    except runfile.RunFileError as exc:
        raise UsageError(str(exc)) from None
    if not isinstance(run.get("data"), str):
        raise UsageError(f"{str(path)!r} is not a run description of gpipe train: it does not say the kind of its data")
    settings, kind = dict(run["config"]), run["data"]
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig(**{k: v for k, v in settings.items() if k in known}), kind
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{str(path)!r}: {exc}") from None


def _relocated(cfg: TrainConfig, kind: str, checkpoint: Path, run: Path, data: str | None) -> TrainConfig:
    """``cfg`` with the paths that the evaluation reads where they are now: ``--out`` the run folder,
    ``--data`` as given, a text's (or records') tokenizer and chat template and a Hugging Face model's
    config from the checkpoint.
    As a resumed run, so that nothing is trained or prepared (a vocabulary, the data) and no
    pretrained weights are read: the checkpoint's are loaded."""
    changes: dict[str, Any] = {"out": str(run), "resume": True, "overwrite": False, "init": "", "progress": False}
    if data is not None:
        changes["data"] = data
    if cfg.model == "hf" and (checkpoint / CONFIG).is_file():
        changes["hf_config"] = str(checkpoint / CONFIG)
    if kind in ("TextLines", "InstructionData"):  # (read with a tokenizer: the checkpoint keeps its files)
        found = next((checkpoint / n for n in ("tokenizer.json", "vocab.model") if (checkpoint / n).is_file()), None)
        if found is None:
            raise UsageError(f"{str(checkpoint)!r} keeps no tokenizer (tokenizer.json, vocab.model) to read its text")
        changes["tokenizer"] = str(found)
        changes["chat_template"] = ""  # (its copy beside the tokenizer: chat_template.jinja or tokenizer_config.json)
    return dataclasses.replace(cfg, **changes)


def _data(cfg: TrainConfig, kind: str, run: Path) -> Dataset:
    """The run's data, for its held-out sets: a folder of language pairs as the run prepared it."""
    try:
        if kind == "PreparedCorpus":
            folder = Path(cfg.data) if cfg.data and is_prepared(cfg.data) else run / CACHE
            if not is_prepared(folder):
                raise UsageError(
                    f"the run's prepared data {str(folder)!r} is missing: it holds the held-out sentences the run "
                    f"read; give the folder gpipe prepare wrote with --data"
                )
            return PreparedCorpus(folder, length=cfg.max_length, temperature=cfg.temperature, seed=cfg.seed)
        return make_data(cfg)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    except (ValueError, OSError) as exc:
        where = f"--data {cfg.data!r}: " if cfg.data else ""
        raise UsageError(f"{where}{exc} (give the run's data where it is now with --data)") from None


class Evaluator:
    """The model of a run's checkpoint ``first`` (its settings and data), in a pipeline of
    ``partitions`` stages (default: the run's); :meth:`evaluate` loads a checkpoint of the run into it
    and evaluates it. Under torchrun every rank builds it alike: ``partitions`` stages times the
    replicas the world holds (held-out losses only with replicas, as in training). ``devices``: this
    machine's ``--devices``, not the run's."""

    def __init__(
        self,
        first: Path,
        *,
        partitions: int | None = None,
        data: str | None = None,
        devices: str = "auto",
        **given: Any,
    ) -> None:
        self.run = run_folder(first)
        saved, self.kind = read_run(first)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        k = saved.partitions if partitions is None else partitions
        if world > 1 and world % k:
            raise UsageError(f"--partitions {k} does not divide torchrun's {world} processes: give one that does")
        self.cfg = dataclasses.replace(_relocated(saved, self.kind, first, self.run, data), partitions=k,
                                       data_parallel=max(world // k, 1), fsdp=False, tensor_parallel=1,
                                       devices=devices)  # fmt: skip
        self.settings = EvalSettings.of_run(self.cfg, **given)
        try:
            distributed = init_from_env(self.cfg.timeout, devices=devices)
        except ValueError as exc:  # (--devices: a list under torchrun, more local ranks than GPUs)
            raise UsageError(str(exc)) from None
        self.data = _data(self.cfg, self.kind, self.run)
        try:
            model = make_model(self.cfg, self.data)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if k * self.cfg.virtual > len(model):
            raise UsageError(f"--partitions {k} exceeds the model's {len(model)} layers")
        self.losses = make_losses(self.cfg, self.data)
        self.pipe = make_pipeline(self.cfg, model, self.data, self.losses, distributed=distributed)
        check_supported(self.cfg.precision, self.pipe.devices)
        self.left_out = decoding_left_out(self.pipe, self.data)

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def load(self, checkpoint: Path) -> tuple[int, str | None]:
        """Load ``checkpoint``'s weights: its step, and None; or 0 and why it did not load (a damaged
        or deleted checkpoint), the ranks agreeing (each reads its own files)."""
        try:
            step, error = load(self.pipe, checkpoint), None
        except (CheckpointError, OSError) as exc:
            step, error = 0, str(exc)
        if dist.is_initialized():
            errors: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e), None)
        return step, error

    def evaluate(self, step: int) -> dict[str, Any]:
        """The held-out metrics of the weights loaded (of ``step``), with ``step`` first: the keys
        of training's own evaluation."""
        s = self.settings
        with autocast(self.cfg.precision, self.pipe.devices):
            metrics = evaluate(
                self.pipe,
                self.data,
                self.losses.loss_fn,
                batch=s.batch,
                batches=s.eval_batches,
                beam=s.beam,
                length_penalty=s.length_penalty,
                cross_entropy=self.losses.cross_entropy,
            )
        if self.cfg.transparent:  # (as training logs them with its evaluations)
            metrics.update(transparent_weights(self.pipe))
        if self.cfg.experts:  # (the routing of the held-out batches, as training logs it)
            metrics.update(routing_metrics(self.pipe) or {})
        return {"step": step, **metrics}
