"""The weights a run of ``gpipe train`` starts from (``--init``), and the flags of ``--model hf``
checked together (:func:`model_flags_error`).

``--init`` names one of two things (:func:`init_source`):

- **a folder** ``save_pretrained`` **wrote** (``config.json``, ``model.safetensors`` or its shards):
  ``--model hf`` fine-tunes it. Its config is the model's, its tokenizer reads ``--data TEXT``
  (unless ``--tokenizer`` is given), and each stage reads its own tensors from the files
  (:mod:`gpipe.models.pretrained`).
- **a run or a checkpoint of gpipe train** (its ``--out``, its ``checkpoints`` folder, or a
  ``step-*`` folder): a warm start, for every model. The new run takes that run's model
  (:func:`started_settings`: its ``--model`` and size flags, its vocabulary for a folder of
  language pairs, the config and tokenizer a ``--model hf`` checkpoint keeps) and its weights only:
  a new optimizer, a learning-rate schedule and a step count from the start.

A resumed run has its own weights: ``--init`` with ``--resume`` is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpipe.models import pretrained
from gpipe.runfile import RunFileError, read_run
from gpipe.saving import CheckpointError, find, latest
from gpipe.train.checks import ConfigError, flag

__all__ = [
    "MODEL_SETTINGS",
    "PRETRAINED",
    "RUN",
    "hf_config_path",
    "init_source",
    "init_tokenizer",
    "model_flags_error",
    "started_settings",
    "warm_start",
]

PRETRAINED, RUN = "pretrained", "run"

# What a warm start takes from the run it starts from: the settings that shape the model's weights.
MODEL_SETTINGS = ("model", "hf_config", "lora", "lora_targets", "layers", "hidden", "heads", "dim", "head_dim",
                  "filters", "reference_cells", "logit_clip", "transparent", "experts", "expert_top_k",
                  "moe_every")  # fmt: skip

# The built-in models' size flags: --model hf takes its size from its config instead.
_SIZE_FLAGS = ("layers", "hidden", "heads", "dim", "head_dim", "logit_clip", "filters", "reference_cells", "classes",
               "image_size")  # fmt: skip


def init_source(path: str) -> tuple[str, Path]:
    """What ``--init path`` is: ``("pretrained", folder)`` for a ``save_pretrained`` folder, or
    ``("run", step folder)`` for the newest checkpoint of a run of gpipe train; a
    :class:`ConfigError` saying what it is not."""
    given = Path(path)
    if not given.exists():
        raise ConfigError(
            f"--init {path!r}: no such folder; give a folder save_pretrained wrote, or a run or checkpoint of "
            "gpipe train"
        )
    if pretrained.is_pretrained(given):
        return PRETRAINED, given
    try:
        found = find(given)
    except CheckpointError as exc:
        raise ConfigError(f"--init {path!r}: {exc}") from None
    if found is not None:
        return RUN, found
    raise ConfigError(
        f"--init {path!r} holds neither a model save_pretrained wrote (config.json with model.safetensors) nor a "
        "checkpoint of gpipe train (a run's --out, its checkpoints folder, or a step-* folder)"
    )


def _run(checkpoint: Path) -> dict[str, Any]:
    """The ``run.json`` of ``checkpoint``: the settings its run saved (``config``), and what its model
    was sized from (``vocab``, ...)."""
    try:
        return read_run(checkpoint)
    except RunFileError as exc:
        raise ConfigError(f"--init: {exc}") from None


def _saved(checkpoint: Path) -> dict[str, Any]:
    """The settings the run of ``checkpoint`` saved."""
    return dict(_run(checkpoint)["config"])


def started_settings(given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run started with ``--init RUN``: the model settings of RUN
    (:data:`MODEL_SETTINGS`) beneath ``given``, a given one that differs refused (the weights are of
    RUN's model); RUN's vocabulary for a folder of language pairs. Any other ``given`` is returned
    as it is. ``--init`` with ``--resume`` is refused here."""
    init = given.get("init")
    if not init:
        return given
    if given.get("resume"):
        raise ConfigError(
            f"--init {init!r} starts a run from those weights, and --resume continues the run in --out from its own "
            "checkpoint: give one of them"
        )
    kind, folder = init_source(str(init))
    if kind != RUN:
        return given
    saved = _saved(folder)
    settings = dict(given)
    for name in MODEL_SETTINGS:
        if name not in saved:
            continue
        if name in given and given[name] != saved[name]:
            raise ConfigError(
                f"--{flag(name)} {given[name]!r} differs from the --init run's {saved[name]!r}: a warm start trains "
                f"that run's model ({str(folder)!r}); leave --{flag(name)} out"
            )
        if name == "hf_config":
            continue  # (a --model hf checkpoint keeps its config.json: that is the model's)
        if saved[name] != defaults.get(name):
            settings[name] = saved[name]
    vocab = folder / "vocab.model"
    data = str(settings.get("data") or "")
    folder_of_pairs = bool(data) and Path(data).is_dir() and not (Path(data) / "manifest.json").is_file()
    translation = settings.get("model", "transformer") == "transformer"
    if translation and vocab.is_file() and folder_of_pairs and not settings.get("vocab"):
        settings["vocab"] = str(vocab)  # (the same ids for the same pieces; prepared data brings its own)
    return settings


def model_flags_error(cfg: Any) -> str | None:
    """What is wrong with ``cfg``'s (a ``TrainConfig``) flags of the model together, if anything:
    ``--hf-config`` only with ``--model hf``; with it, no size flag of the built-in models (they
    would be silently ignored: the config says the size), nor ``--dropout`` with a config.
    ``--tokenizer`` only with ``--model hf`` on a text file, a file that is there, and not with
    ``--vocab-size``. ``--init`` a folder that is there; a pretrained one for ``--model hf``, without
    ``--hf-config`` (it brings its own) or ``--resume``. ``--lora`` for ``--model hf``, and
    ``--lora-targets`` with it."""
    if cfg.hf_config and cfg.model != "hf":
        return f"--hf-config is for --model hf (model: {cfg.model!r}); add --model hf or leave --hf-config out"
    if cfg.tokenizer and (cfg.model != "hf" or not cfg.data):
        return (
            f"--tokenizer is for --model hf on --data TEXT, a text file (model: {cfg.model!r}, data: {cfg.data!r}); "
            "give both, or leave --tokenizer out"
        )
    if cfg.tokenizer and not Path(cfg.tokenizer).exists():
        return (
            f"--tokenizer {cfg.tokenizer!r}: no such file or folder; give a tokenizer.json (or its folder) or a "
            "SentencePiece .model, or leave --tokenizer out to train a vocabulary on the text"
        )
    if cfg.tokenizer and cfg.vocab_size:
        return (
            f"--vocab-size {cfg.vocab_size} sizes the vocabulary trained on the text, and --tokenizer "
            f"{cfg.tokenizer!r} brings its own; leave one of them out"
        )
    if cfg.init and not cfg.resume and (error := _init_error(cfg)) is not None:
        return error
    if cfg.lora < 0:
        return f"--lora must be a rank of 1 or more, or 0 to train every weight (got {cfg.lora})"
    if cfg.lora and cfg.model != "hf":
        return f"--lora {cfg.lora} adapts a Hugging Face model (peft): add --model hf (model: {cfg.model!r})"
    if cfg.lora_targets and not cfg.lora:
        return f"--lora-targets {cfg.lora_targets!r} names the modules --lora R adapts: give --lora R too"
    if cfg.model != "hf":
        return None
    defaults = type(cfg)()
    for name in _SIZE_FLAGS:
        if getattr(cfg, name) != getattr(defaults, name):
            return (
                f"--{flag(name)} {getattr(cfg, name)} sizes the built-in models, not --model hf, whose size comes "
                f"from --hf-config (a config.json: n_layer, n_embd, ...) or is the built-in GPT-2's; leave "
                f"--{flag(name)} out"
            )
    if (cfg.hf_config or cfg.init) and cfg.dropout:
        where = "--hf-config" if cfg.hf_config else "--init"
        return (
            f"--dropout {cfg.dropout} applies to the built-in GPT-2 only: with {where} the config's own dropout "
            "settings apply (resid_pdrop, attention_dropout, ... in the config.json); leave --dropout out"
        )
    return None


def _init_error(cfg: Any) -> str | None:
    kind, folder = init_source(cfg.init)
    if kind == PRETRAINED and cfg.model != "hf":
        return (
            f"--init {cfg.init!r} is a Hugging Face model (config.json, safetensors): fine-tune it with --model hf "
            f"(model: {cfg.model!r})"
        )
    if kind == PRETRAINED and cfg.hf_config:
        return (
            f"--init {cfg.init!r} brings its own config.json, and --hf-config {cfg.hf_config!r} another; leave "
            "--hf-config out"
        )
    if kind == RUN:
        saved = _saved(folder).get("model", "transformer")
        if saved != cfg.model:
            return (
                f"--init {cfg.init!r} is a checkpoint of a --model {saved} run, and this run trains --model "
                f"{cfg.model}: a warm start trains the same model; leave --model out"
            )
        if cfg.model == "transformer" and (folder / "vocab.model").is_file() and cfg.data and Path(cfg.data).is_dir():
            return _vocabulary_error(cfg, folder / "vocab.model")
    return None


def _vocabulary_error(cfg: Any, kept: Path) -> str | None:
    """A warm start of a translation model keeps its vocabulary (its embeddings are its pieces'),
    or one that extends it (``gpipe vocab --extend``: new tags appended, the embeddings grown by
    their rows): refuse data prepared with another, or pairs into a language without a tag."""
    from gpipe.data.files import find_pairs
    from gpipe.data.prepared import is_prepared
    from gpipe.data.vocab import Vocab, extends

    prepared = is_prepared(cfg.data)
    vocab = Path(cfg.data) / "vocab.model" if prepared else Path(cfg.vocab) if cfg.vocab else kept
    grow = f"gpipe vocab --data {str(cfg.data)!r} --extend {str(kept)!r} --out grown"
    try:
        base, given = Vocab(kept), Vocab(vocab)
        pairs = {} if prepared else find_pairs(cfg.data)
    except ValueError:
        return None  # (said where the data is read, naming the file)
    if not extends(given, base):
        where = f"--data {cfg.data!r} was prepared with" if prepared else f"--vocab {cfg.vocab!r} is"
        return (
            f"{where} another vocabulary than the --init run's ({str(kept)!r}), whose embeddings the model has: "
            f"use that one, or one that extends it ({grow})"
        )
    missing = sorted({p.tgt for p in pairs.values()} - set(given.languages))
    if missing:
        into = ", ".join(name for name, p in pairs.items() if p.tgt in missing)
        return (
            f"--data {cfg.data!r} has pairs into {', '.join(missing)} ({into}), and the vocabulary of the --init run "
            f"({str(vocab)!r}) has no tag for them (it has {', '.join(sorted(given.languages))}): a warm start keeps "
            f"that run's vocabulary and embeddings; grow it with the new tags ({grow}, then --vocab grown.model), "
            "or train on pairs into its languages"
        )
    return None


def _started_from(cfg: Any) -> tuple[str, Path]:
    """Where ``cfg``'s model and tokenizer come from: the ``--init`` folder, or, when the run
    resumes, its own newest checkpoint (which keeps them: the --init folder may be gone)."""
    if cfg.resume:
        found = latest(Path(cfg.out) / "checkpoints")
        if found is not None:
            return RUN, found
    return init_source(cfg.init)


def hf_config_path(cfg: Any) -> tuple[str, str | None]:
    """The config.json of ``cfg``'s Hugging Face model: ``--hf-config``, the ``--init`` folder's, or
    the config a ``--init`` checkpoint (or the checkpoint ``--resume`` continues) keeps; '' for the
    built-in GPT-2. With it, how the user named that file, for the messages (None: ``--hf-config``)."""
    if cfg.hf_config or not cfg.init:
        return str(cfg.hf_config), None
    kind, folder = _started_from(cfg)
    resumed = cfg.resume and Path(cfg.out) in folder.parents  # (the run's own newest checkpoint)
    given = (
        f"the config.json of --resume's checkpoint {str(folder)!r}"
        if resumed
        else f"the config.json of --init {cfg.init!r}"
    )
    if kind == PRETRAINED:
        return str(folder), given
    kept = folder / "config.json"
    if not kept.is_file():
        raise ConfigError(
            f"--init {cfg.init!r}: its checkpoint {str(folder)!r} holds no config.json (written by gpipe train since "
            "gpipe export): run that training on (--resume) for a checkpoint with one"
        )
    return str(kept), given


def init_tokenizer(cfg: Any) -> str:
    """The tokenizer ``--model hf --data TEXT`` reads with: ``--tokenizer``, else the one the
    ``--init`` folder or checkpoint brings ('' where there is none: a vocabulary is trained)."""
    if cfg.tokenizer or not cfg.init:
        return str(cfg.tokenizer)
    kind, folder = _started_from(cfg)
    if kind == PRETRAINED:
        found = pretrained.tokenizer_path(folder)
        if found is None:
            raise ConfigError(
                f"--init {cfg.init!r} brings no tokenizer (tokenizer.json, tokenizer.model), and a vocabulary trained "
                "on the text would not be the model's: give its tokenizer with --tokenizer"
            )
        return str(found)
    for name in ("tokenizer.json", "vocab.model"):
        if (folder / name).is_file():
            return str(folder / name)
    return ""


def warm_start(cfg: Any, pipe: Any, data: Any, folder: Path) -> str:
    """Load the weights of the ``--init`` run's checkpoint ``folder`` into ``pipe`` (a warm start:
    this run's optimizer and schedule start afresh); returns what was done, in a line. A translation
    model whose vocabulary grew (``gpipe vocab --extend``) keeps its rows and adds the new pieces'
    (their initialization)."""
    from gpipe.saving import load

    before = _saved_vocab(folder)
    grown = cfg.model == "transformer" and before is not None and getattr(data, "vocab", before) > before
    try:
        step = load(pipe, folder, grow_rows=grown)
    except CheckpointError as exc:
        raise ConfigError(
            f"--init {cfg.init!r}: {exc}; a warm start trains the model of that run: give its model settings"
        ) from exc
    said = f"starting from the weights of {str(folder)!r} (step {step} of that run)"
    return f"{said}, its vocabulary of {before} pieces grown to {data.vocab}" if grown else said


def _saved_vocab(checkpoint: Path) -> int | None:
    """The vocabulary size a run's checkpoint says its model has (``run.json``'s ``vocab``)."""
    value = _run(checkpoint).get("vocab")
    return value if isinstance(value, int) else None
