"""The checks of one setting of ``gpipe train`` on its own, shared by the flags, a ``--config`` file and
a resumed run's ``run.json``: the errors (:class:`ConfigError`, :class:`ConfigTypeError`), a value's
type (:func:`typed`), the ranges of numbers (:data:`RANGES`), a setting's flag (:func:`flag`), the
paths (:func:`check_paths`) and the checkpoint ``--resume`` continues from (:func:`checkpoint_to_resume`).
:class:`~gpipe.train.config.TrainConfig` checks the settings together."""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Any

from gpipe.commands.args import UsageError
from gpipe.data.prepared import PreparedError, is_prepared, read_manifest
from gpipe.data.records import is_records
from gpipe.distributed.devices import choose_devices
from gpipe.saving import CheckpointError, latest

__all__ = [
    "RANGES",
    "ROWS",
    "ConfigError",
    "ConfigTypeError",
    "check_paths",
    "checkpoint_to_resume",
    "choice_error",
    "data_flags_error",
    "devices_error",
    "flag",
    "moe_error",
    "newest_checkpoint",
    "shape_error",
    "typed",
]


class ConfigError(UsageError):
    """A bad setting of :class:`TrainConfig` (a flag, a config file's entry, a path), found before
    the work it would spoil: ``gpipe train`` prints it as one line and exits with status 2. A
    ``ValueError``; other exceptions, bugs, keep their traceback."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type, such as ``steps = "ten"`` in a TOML file; also a ``TypeError``."""


ConfigError.__module__ = ConfigTypeError.__module__ = "gpipe.train"  # their public name, which tracebacks print

_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def flag(name: str) -> str:
    """The command-line spelling of setting ``name``, without its dashes: ``clip_norm`` -> ``clip-norm``."""
    return name.replace("_", "-")


def typed(name: str, value: Any, kind: str, where: str = "") -> Any:
    """``value`` of setting ``name`` if it is of ``kind`` (``int`` given to a float setting becomes a
    float); otherwise a :class:`ConfigTypeError` naming both. ``where``: the config file it came from."""
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
    }[kind]
    if not ok:
        fix = ""
        if kind == "bool":
            fix = f"; write {name} = true or {name} = false, without quotes (flags: --{flag(name)}, --no-...)"
        elif isinstance(value, str) and kind in ("int", "float"):
            with contextlib.suppress(ValueError):
                fix = f"; write {name} = {int(value) if kind == 'int' else float(value)}, without quotes"
        place = f" in {where!r}" if where else ""
        got = f"{value!r}, of type {type(value).__name__}"
        raise ConfigTypeError(f"{name}{place} must be {_KINDS[kind]} (got {got}){fix}")
    return float(value) if kind == "float" else value


def _positive(v: float) -> bool:
    return 0 < v < math.inf


def _nonnegative(v: float) -> bool:
    return 0 <= v < math.inf


def _probability(v: float) -> bool:
    return 0 <= v < 1


RANGES = {
    "lr": (_positive, "a positive finite number"),
    "temperature": (_positive, "a positive finite number"),
    "clip_norm": (_nonnegative, "a finite number >= 0 (0: no clipping)"),
    "logit_clip": (_nonnegative, "a finite number >= 0 (0: no clipping)"),
    "dropout": (_probability, "in [0, 1)"),
    "label_smoothing": (_probability, "in [0, 1)"),
    "length_penalty": (_nonnegative, "a finite number >= 0"),
    "timeout": (_positive, "a positive finite number of seconds"),
    "health_every": (_nonnegative, "a number of steps >= 0 (0: off)"),
    "capacity_factor": (_positive, "a positive finite number"),
    "moe_loss_weight": (_nonnegative, "a finite number >= 0 (0: no load-balancing loss)"),
    "lr_hypergradient": (_probability, "in [0, 1): the learned rate's own rate (0: off)"),
}
"""The number settings with a range: the test (False for NaN) and what it asks, as the error says it."""


ROWS = 8
"""``--batch-tokens``' batches hold a multiple of this many sentences: the same batches for 1, 2, 4 and 8
data-parallel replicas (:mod:`gpipe.train.data`)."""


def _prepared_records(data: str) -> bool:
    """Whether ``--data`` is instruction records ``gpipe prepare`` made (a damaged manifest: no, the
    data's reader names what is wrong)."""
    try:
        return bool(data) and is_prepared(data) and read_manifest(data).get("kind") == "records"
    except PreparedError:
        return False


def data_flags_error(cfg: Any) -> str | None:
    """What is wrong with the data flags of ``cfg`` (a ``TrainConfig``) together, if anything:
    ``--batch-tokens`` and ``--workers`` (0 or more), ``--batch-tokens`` only on language pairs, at least
    one batch of the longest sentences (:data:`ROWS` of ``--max-length``), that batch holding a row for
    each micro-batch of each replica, ``--augment`` only on
    image files."""
    if cfg.batch_tokens < 0 or cfg.workers < 0:
        name = "batch_tokens" if cfg.batch_tokens < 0 else "workers"
        return f"--{flag(name)} must be 0 or more (got {getattr(cfg, name)})"
    if cfg.batch_tokens and not cfg.parallel_folder:
        return (
            f"--batch-tokens {cfg.batch_tokens} batches the sentences of --data FOLDER or PREPARED by length for the "
            f"transformer (model: {cfg.model!r}, data: {cfg.data!r}); give such --data, or use --batch"
        )
    if cfg.batch_tokens and cfg.batch_tokens < ROWS * cfg.max_length:  # (else its batches would hold more)
        return (
            f"--batch-tokens {cfg.batch_tokens} is below {ROWS * cfg.max_length} tokens, the smallest batch of the "
            f"longest sentences ({ROWS} of --max-length {cfg.max_length} tokens: batches are multiples of {ROWS} "
            f"rows); give --batch-tokens {ROWS * cfg.max_length} or more, or a smaller --max-length"
        )
    rows = cfg.batch_tokens // cfg.max_length // ROWS * ROWS  # (the longest bucket's)
    if cfg.batch_tokens and (ROWS % cfg.data_parallel or rows < cfg.chunks * cfg.data_parallel):
        return (
            f"--batch-tokens {cfg.batch_tokens} makes batches of multiples of {ROWS} sentences, {rows} of the longest "
            f"(--max-length {cfg.max_length}): --data-parallel {cfg.data_parallel} must divide {ROWS} and --chunks "
            f"{cfg.chunks} x --data-parallel {cfg.data_parallel} be at most {rows}"
        )
    records = [name for name in ("pack", "train_on_prompt", "chat_template", "skip_bad") if getattr(cfg, name)]
    prepared = _prepared_records(cfg.data)
    if records and not (cfg.model == "hf" and cfg.data and (prepared or is_records(cfg.data))):
        return (
            f"--{flag(records[0])} is for instruction or chat records, --model hf --data FILE.jsonl (or a folder of "
            f"them, or what gpipe prepare made of them) (model: {cfg.model!r}, data: {cfg.data!r}); give such "
            "--data, or leave it out"
        )
    if prepared and (given := [name for name in ("chat_template", "skip_bad") if getattr(cfg, name)]):
        return (
            f"--{flag(given[0])} applies where the records are read: --data {cfg.data!r} was prepared with its own "
            "(its manifest.json's settings); give it to gpipe prepare, or leave it out"
        )
    if cfg.augment and not (cfg.model == "amoebanet" and cfg.data):
        return (
            f"--augment crops and flips the images of --model amoebanet --data FOLDER or .npz (model: {cfg.model!r}, "
            f"data: {cfg.data!r}); give both, or leave --augment out"
        )
    return None


def shape_error(cfg: Any) -> str | None:
    """What is wrong with the sizes of ``cfg``'s model (a ``TrainConfig``) on their own, if anything:
    ``--layers``, ``--keep``, ``--vocab-size``, ``--classes``, ``--head-dim`` and ``--dim``, and the
    flags of one model given to another."""
    if cfg.layers < 0:
        return f"--layers must be positive, or 0 for the model's default (got {cfg.layers})"
    if cfg.keep < 0:
        return f"--keep must be a number of checkpoints, or 0 to keep all (got {cfg.keep})"
    if cfg.vocab_size < 0:
        return f"--vocab-size must be positive, or 0 for as many as the text supports (got {cfg.vocab_size})"
    if cfg.classes < 2:
        return f"--classes must be at least 2 (got {cfg.classes})"
    if cfg.head_dim < 0:
        return f"--head-dim must be positive, or 0 for --dim / --heads (got {cfg.head_dim})"
    if cfg.dim % cfg.heads and not cfg.head_dim:
        return f"--dim must be a multiple of --heads (dim: {cfg.dim}, heads: {cfg.heads}), or give --head-dim"
    if cfg.reference_cells and cfg.model != "amoebanet":
        return f"--reference-cells builds the cells of --model amoebanet (model: {cfg.model!r}); leave it out"
    if cfg.transparent and cfg.model != "transformer":
        return (
            f"--transparent mixes the encoder layers of --model transformer for its decoder (model: "
            f"{cfg.model!r}); leave --transparent out, or use --model transformer"
        )
    if cfg.model == "amoebanet" and cfg.filters < 4:
        return f"--filters must be at least 4 (got {cfg.filters})"
    if cfg.model == "amoebanet" and cfg.image_size < 4:
        return f"--image-size must be at least 4 (got {cfg.image_size})"
    return None


def choice_error(cfg: Any, choices: dict[str, tuple[str, tuple[str, ...]]]) -> str | None:
    """The first setting of ``cfg`` not among its choices (``choices``: name -> (what the error calls
    it, the choices)), said with them."""
    for name, (called, allowed) in choices.items():
        if getattr(cfg, name) not in allowed:
            return f"unknown {called} {getattr(cfg, name)!r}; choose one of {', '.join(allowed)}"
    return None


_MOE_FLAGS = ("expert_top_k", "capacity_factor", "moe_every", "moe_loss_weight")


def moe_error(cfg: Any, defaults: dict[str, Any]) -> str | None:
    """What is wrong with the mixture-of-experts settings of ``cfg`` (a ``TrainConfig``), if anything:
    one of them without ``--experts``, experts of a model other than the Transformer, fewer experts than
    a token takes, a ``--moe-every`` that leaves no layer a mixture, with tensor parallelism."""
    n = cfg.expert_parallel
    if cfg.model == "hf" and n > 1:  # (the model's own experts: gpipe.models.hf_moe checks them)
        if cfg.data_parallel % n:
            return (
                f"--expert-parallel {n} splits the model's experts over {n} of the replicas: it must divide "
                f"--data-parallel {cfg.data_parallel}"
            )
        if cfg.fsdp:
            return (
                f"--expert-parallel {n} with --model hf and --fsdp is not supported yet (a Hugging Face model's "
                "experts are split, not sharded); leave one of them out"
            )
    if not cfg.experts:
        given = [name for name in (*_MOE_FLAGS, "expert_parallel") if cfg.model != "hf" or name != "expert_parallel"]
        given = [name for name in given if getattr(cfg, name) != defaults[name]]
        if given:
            return (
                f"--{flag(given[0])} is for a mixture of experts: give --experts E too (the experts of every "
                f"--moe-every'th layer), or leave --{flag(given[0])} out"
            )
        return None
    if cfg.model != "transformer":
        return (
            f"--experts makes the feed-forward blocks of --model transformer mixtures of experts (model: "
            f"{cfg.model!r}); leave it out (a Hugging Face MoE model brings its own experts: --model hf --hf-config)"
        )
    if cfg.experts < cfg.expert_top_k or cfg.expert_top_k < 1:
        return (
            f"--experts {cfg.experts} with --expert-top-k {cfg.expert_top_k}: a mixture needs at least as many "
            "experts as each token takes (and --expert-top-k >= 1)"
        )
    layers = cfg.depth  # (the Transformer's L)
    if not 1 <= cfg.moe_every <= layers:
        return (
            f"--moe-every {cfg.moe_every} makes no layer of the {layers} encoder and decoder layers a mixture of "
            f"experts; give 1 (every layer) to {layers}"
        )
    if n > 1 and (cfg.data_parallel % n or cfg.experts % n):
        return (
            f"--expert-parallel {n} splits the experts over {n} of the replicas: it must divide --data-parallel "
            f"{cfg.data_parallel} and --experts {cfg.experts}"
        )
    return None


def devices_error(cfg: Any) -> str | None:
    """What is wrong with ``--devices`` of ``cfg`` (a ``TrainConfig``) here, if anything: a device that is
    not there, a list of other than 1 or ``--partitions`` devices, a list under torchrun, more local ranks
    than GPUs (:func:`gpipe.distributed.choose_devices`)."""
    try:
        choose_devices(cfg.devices, cfg.partitions)
    except ValueError as exc:
        return str(exc)
    return None


def newest_checkpoint(out: str | Path) -> Path | None:
    """The newest complete checkpoint of the run in ``out``, if any (a fallback to an older one is said
    once, when it is loaded, not here)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return latest(Path(out) / "checkpoints")
    except CheckpointError as exc:
        raise ConfigError(f"--resume: {exc}") from exc


def checkpoint_to_resume(out: str | Path) -> Path:
    """The checkpoint ``--resume`` continues from: :func:`newest_checkpoint`, or a :class:`ConfigError`."""
    found = newest_checkpoint(out)
    if found is None:
        raise ConfigError(
            f"--resume: no checkpoint in {str(Path(out) / 'checkpoints')!r}; leave --resume out to start afresh, "
            "or give the --out of the run to continue"
        )
    return found


def check_paths(cfg: Any) -> None:
    """Refuse the paths of ``cfg`` (a ``TrainConfig``) that cannot work: ``--data``, ``--vocab``, ``--out``
    and ``--resume``'s checkpoint."""
    if cfg.data and not Path(cfg.data).exists():
        raise ConfigError(
            f"cannot read the data file {cfg.data!r}: there is no such file or folder "
            "(leave --data out for synthetic data)"
        )
    if cfg.model == "hf" and cfg.data and Path(cfg.data).is_dir() and not cfg.prepared:
        raise ConfigError(
            f"--model hf reads one file (--data {cfg.data!r} is a folder); a folder of language pairs trains "
            "the encoder-decoder transformer: leave --model out"
        )
    if cfg.vocab and not cfg.parallel_folder:
        raise ConfigError(
            f"--vocab {cfg.vocab!r} is for --data FOLDER (a folder of parallel files) with the transformer; "
            "leave --vocab out"
        )
    if (cfg.vocab or cfg.tokenizer) and cfg.prepared:
        name = "vocab" if cfg.vocab else "tokenizer"
        raise ConfigError(
            f"--data {cfg.data!r} is prepared data, with its own vocabulary; leave --{name} out (gpipe prepare "
            f"--{name} chooses it)"
        )
    if cfg.vocab and not Path(cfg.vocab).is_file():
        raise ConfigError(
            f"--vocab {cfg.vocab!r}: no such file; give a SentencePiece .model (gpipe vocab makes one), or "
            "leave --vocab out to train one on the data"
        )
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {cfg.out!r} is a file; name a directory (it is created if missing)")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ConfigError(f"--out {cfg.out!r} is inside {str(above)!r}, which is a file; name a directory")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in OUT, --overwrite deletes it: give one of them")
    if cfg.resume:
        checkpoint_to_resume(out)
