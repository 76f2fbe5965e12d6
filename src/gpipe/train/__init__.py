"""``gpipe train``: train the paper's Transformer or AmoebaNet-D, or a Hugging Face causal LM, with
pipeline parallelism, on the local devices or under torchrun with the same flags.

    gpipe train                                   # the default: a small T(2, 256, 4) on synthetic data
    gpipe train --data corpus/                    # every language pair of a folder of parallel files (BLEU per pair)
    gpipe train --model amoebanet                 # a small AmoebaNet-D(6, 16) on synthetic 32x32 images
    gpipe train --model amoebanet --data cifar.npz --layers 18 --filters 64
    gpipe train --model hf                        # a small GPT-2 (transformers), built-in corpus
    gpipe train --model hf --hf-config llama/config.json --data text.txt
    gpipe train --partitions 4 --schedule zb-h1 --steps 500 --out runs/zb
    gpipe train --config run.toml --resume        # continue exactly where the last checkpoint left off
    torchrun --nproc-per-node 2 -m gpipe train    # one process per stage

Every ``--eval-every`` steps it evaluates (translation: loss and BLEU per language pair, see
:mod:`gpipe.evaluation`); metrics go to ``OUT/metrics.jsonl``, TensorBoard's ``OUT/tensorboard`` and
the curves to ``OUT/loss.png``; a checkpoint (torch.distributed.checkpoint: layers and optimizer
state keyed by global layer index, see :class:`Checkpoints`) is written every ``--checkpoint-every``
steps, at the end, and on Ctrl-C. Batches and dropout are a pure function of (seed, step), so
``--resume`` reproduces the uninterrupted run's losses exactly, with another ``--partitions`` too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import fcntl
import functools
import importlib.util
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpipe.balance import balance_by_flops
from gpipe.checkpoint import CHECKPOINT_MODES
from gpipe.commands.args import ArgumentParser, UsageError
from gpipe.data import (
    PAD,
    Dataset,
    ImageDataset,
    ImageFiles,
    ParallelCorpus,
    SyntheticImages,
    SyntheticTranslation,
    TextPairs,
    TokenDataset,
    TranslationDataset,
)
from gpipe.data.vocab import Vocab, read_pairs, train_vocab
from gpipe.distributed import init_from_env
from gpipe.evaluation import evaluate, resource_groups
from gpipe.models import amoebanet_d, hf, transformer
from gpipe.pipeline import Pipeline
from gpipe.recipe import (
    adafactor,
    clip_grad_norm_per_parameter,
    count_tokens,
    inverse_sqrt_schedule,
    label_smoothing_loss,
    rmsprop,
)
from gpipe.rng import derive_seed
from gpipe.saving import AsyncSave, CheckpointError, latest, load, save, write_atomically
from gpipe.schedule import SCHEDULES, simulate
from gpipe.sequential import to_sequential

__all__ = ["ConfigError", "ConfigTypeError", "TrainConfig", "main", "parse", "train"]

V_SCHEDULES = ("zb-v", "dualpipev")  # two stages per worker
TENSORBOARD_MODES = ("auto", "on", "off")


def _has_tensorboard() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


MODELS = ("transformer", "amoebanet", "hf")
DEFAULT_LAYERS = {"transformer": 2, "amoebanet": 6}
OPTIMIZERS = ("adam", "adafactor", "rmsprop")


class ConfigError(UsageError):
    """A bad setting of :class:`TrainConfig` (a flag, a config file's entry, a path), found before
    the work it would spoil: ``gpipe train`` prints it as one line and exits with status 2. A
    ``ValueError``; other exceptions, bugs, keep their traceback."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type, such as ``steps = "ten"`` in a TOML file; also a ``TypeError``."""


# The built-in models' size flags: --model hf takes its size from its config instead.
_SIZE_FLAGS = ("layers", "hidden", "heads", "dim", "logit_clip", "filters", "classes", "image_size")

_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _typed(name: str, value: Any, kind: str, where: str = "") -> Any:
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
            fix = f"; write {name} = true or {name} = false, without quotes (flags: --{_flag(name)}, --no-...)"
        elif isinstance(value, str) and kind in ("int", "float"):
            with contextlib.suppress(ValueError):
                fix = f"; write {name} = {int(value) if kind == 'int' else float(value)}, without quotes"
        place = f" in {where!r}" if where else ""
        got = f"{value!r}, of type {type(value).__name__}"
        raise ConfigTypeError(f"{name}{place} must be {_KINDS[kind]} (got {got}){fix}")
    return float(value) if kind == "float" else value


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _positive(v: float) -> bool:
    return 0 < v < math.inf


def _nonnegative(v: float) -> bool:
    return 0 <= v < math.inf


def _probability(v: float) -> bool:
    return 0 <= v < 1


_RANGES = {
    "lr": (_positive, "a positive finite number"),
    "temperature": (_positive, "a positive finite number"),
    "clip_norm": (_nonnegative, "a finite number >= 0 (0: no clipping)"),
    "logit_clip": (_nonnegative, "a finite number >= 0 (0: no clipping)"),
    "dropout": (_probability, "in [0, 1)"),
    "label_smoothing": (_probability, "in [0, 1)"),
    "length_penalty": (_nonnegative, "a finite number >= 0"),
}


@dataclass(kw_only=True)
class TrainConfig:
    """Everything ``gpipe train`` needs; each field is also a command-line flag."""

    model: str = field(
        default="transformer",
        metadata={"help": f"the model: {', '.join(MODELS)} (hf: a Hugging Face causal LM, built from --hf-config)"},
    )
    hf_config: str = field(
        default="",
        metadata={
            "help": "hf: a transformers config.json (or its folder) of a causal LM, read locally, weights random; "
            f"'': a GPT-2 of {hf.DEFAULT['n_layer']} layers, n_embd {hf.DEFAULT['n_embd']}, "
            f"{hf.DEFAULT['n_head']} heads, the data's vocabulary and length"
        },
    )
    layers: int = field(
        default=0,
        metadata={
            "help": "L: encoder layers (as many decoder layers) of the transformer, normal cells of AmoebaNet-D; "
            "0: the model's default (transformer 2, amoebanet 6)"
        },
    )
    hidden: int = field(default=256, metadata={"help": "transformer: H, the feed-forward size"})
    heads: int = field(default=4, metadata={"help": "transformer: A, the attention heads"})
    dim: int = field(default=64, metadata={"help": "transformer: the model dimension"})
    filters: int = field(default=16, metadata={"help": "amoebanet: D, the filters of the first stack"})
    classes: int = field(default=10, metadata={"help": "amoebanet: classes of the synthetic images (--data: its own)"})
    image_size: int = field(
        default=32,
        metadata={"help": "amoebanet: image side of the synthetic images and of a folder's images (.npz keep theirs)"},
    )
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})
    logit_clip: float = field(default=0.0, metadata={"help": "clip logits to +-this (0: no clipping)"})
    partitions: int = field(default=2, metadata={"help": "K: pipeline stages (devices, or ranks under torchrun)"})
    chunks: int = field(default=4, metadata={"help": "M: micro-batches per mini-batch"})
    schedule: str = field(
        default="1f1b", metadata={"help": f"the schedule: {', '.join(SCHEDULES)}, auto (planned from measured costs)"}
    )
    checkpoint: str = field(default="except_last", metadata={"help": "re-materialization: always, except_last, never"})
    threads: int = field(
        default=1, metadata={"help": "intra-op threads per stage, fixed so that runs are bitwise equal whatever K"}
    )
    batch: int = field(default=64, metadata={"help": "mini-batch size (sentence pairs or images)"})
    steps: int = field(default=200, metadata={"help": "training steps"})
    optimizer: str = field(default="adam", metadata={"help": f"the optimizer: {', '.join(OPTIMIZERS)}"})
    lr: float = field(default=1e-2, metadata={"help": "peak learning rate of the inverse-sqrt schedule"})
    warmup: int = field(default=30, metadata={"help": "warm-up steps of the inverse-sqrt schedule"})
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing"})
    clip_norm: float = field(default=1.0, metadata={"help": "per-parameter gradient-norm clipping (0: none)"})
    temperature: float = field(
        default=5.0, metadata={"help": "T of the language-pair sampling (training batches and the vocabulary)"}
    )
    data: str = field(
        default="",
        metadata={
            "help": "transformer: a folder of parallel files, one per language pair (xx-yy.tsv, or xx-yy.xx + "
            "xx-yy.yy; held-out ones in its eval/ folder), or one file of source<TAB>target lines; amoebanet: a "
            ".npz (x, y) or a folder of class sub-folders of images; hf: source<TAB>target lines, or text, a "
            "document a line (default: synthetic data)"
        },
    )
    vocab: str = field(
        default="",
        metadata={
            "help": "--data FOLDER: a SentencePiece model to use ('': OUT/vocab.model, trained on the first run "
            "from text sampled at --temperature)"
        },
    )
    vocab_size: int = field(default=8000, metadata={"help": "--data FOLDER: pieces of the vocabulary trained"})
    max_length: int = field(
        default=64, metadata={"help": "--data FOLDER: most tokens of a side; longer pairs are left out of training"}
    )
    eval_every: int = field(default=50, metadata={"help": "evaluate every N steps"})
    eval_batches: int = field(default=4, metadata={"help": "batches per evaluation (not translation: see below)"})
    eval_sentences: int = field(
        default=100,
        metadata={"help": "--data FOLDER: held-out sentences per pair without a file in FOLDER/eval"},
    )
    beam: int = field(default=1, metadata={"help": "translation: beam size of evaluation's decoding (1: greedy)"})
    length_penalty: float = field(
        default=0.6, metadata={"help": "translation: alpha of beam search's length penalty ((5 + len) / 6) ** alpha"}
    )
    checkpoint_every: int = field(default=100, metadata={"help": "write a checkpoint every N steps"})
    async_checkpoint: bool = field(
        default=False,
        metadata={
            "help": "write the every-N-steps checkpoints in the background (the state is copied first; the final "
            "one and Ctrl-C's are written at once)"
        },
    )
    out: str = field(default="runs/default", metadata={"help": "output directory"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest checkpoint in OUT"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    tensorboard: str = field(
        default="auto",
        metadata={
            "help": "TensorBoard event files in OUT/tensorboard: auto (when the tensorboard package is "
            "installed), on (refuse to run without it), off"
        },
    )

    @property
    def virtual(self) -> int:
        """Stages per worker: two in the V schedules (zb-v, dualpipev), else one."""
        return 2 if self.schedule in V_SCHEDULES else 1

    def check(self) -> None:
        """Refuse bad settings, naming them and the fix, before any work starts: a wrong type
        (:class:`ConfigTypeError`, a ``TypeError``), a value out of range, or paths that cannot work
        (``--data``, ``--out``, ``--resume``): :class:`ConfigError`, a ``ValueError``."""
        for f in fields(self):
            _typed(f.name, getattr(self, f.name), str(f.type))
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        if self.schedule not in (*SCHEDULES, "auto"):
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}, auto")
        if self.tensorboard not in TENSORBOARD_MODES:
            raise ConfigError(
                f"unknown --tensorboard {self.tensorboard!r}; choose one of {', '.join(TENSORBOARD_MODES)}"
            )
        if self.tensorboard == "on" and not _has_tensorboard():
            raise ConfigError(
                "--tensorboard on needs the tensorboard package (pip install tensorboard), or use --tensorboard off"
            )
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ConfigError(
                f"unknown checkpoint mode {self.checkpoint!r}; choose one of {', '.join(CHECKPOINT_MODES)}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        positive = ("hidden", "heads", "dim", "filters", "image_size", "partitions", "chunks", "batch", "steps",
                    "warmup", "threads", "eval_every", "eval_batches", "checkpoint_every", "vocab_size",
                    "eval_sentences", "beam")  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag(name)} must be positive (got {getattr(self, name)})")
        for name, (ok, requirement) in _RANGES.items():
            if not ok(getattr(self, name)):  # (NaN fails every comparison)
                raise ConfigError(f"--{_flag(name)} must be {requirement} (got {getattr(self, name)})")
        if self.max_length < 2:
            raise ConfigError(f"--max-length must be at least 2 (got {self.max_length})")
        if self.layers < 0:
            raise ConfigError(f"--layers must be positive, or 0 for the model's default (got {self.layers})")
        if self.classes < 2:
            raise ConfigError(f"--classes must be at least 2 (got {self.classes})")
        if self.dim % self.heads:
            raise ConfigError(f"--dim must be a multiple of --heads (dim: {self.dim}, heads: {self.heads})")
        if self.model == "amoebanet" and self.filters < 4:
            raise ConfigError(f"--filters must be at least 4 (got {self.filters})")
        if self.model == "amoebanet" and self.image_size < 4:
            raise ConfigError(f"--image-size must be at least 4 (got {self.image_size})")
        self._check_hf()
        layers, formula = self.model_layers()
        if self.partitions * self.virtual > layers:
            v = f" x {self.virtual} stages each ({self.schedule})" if self.virtual > 1 else ""
            raise ConfigError(
                f"--partitions {self.partitions}{v} exceeds the model's {layers} layers "
                f"({formula}); use fewer partitions or more layers"
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and world != self.partitions:
            raise ConfigError(
                f"--partitions {self.partitions} differs from the {world} processes of torchrun: give "
                f"--partitions {world}, or start torchrun with --nproc-per-node {self.partitions}"
            )
        self._check_paths()

    def _check_hf(self) -> None:
        """``--hf-config`` only with ``--model hf``; with it, no size flag of the built-in models (they
        would be silently ignored: the config says the size), nor ``--dropout`` with a config."""
        if self.hf_config and self.model != "hf":
            raise ConfigError(
                f"--hf-config is for --model hf (model: {self.model!r}); add --model hf or leave --hf-config out"
            )
        if self.model != "hf":
            return
        defaults = {f.name: f.default for f in fields(self)}
        for name in _SIZE_FLAGS:
            if getattr(self, name) != defaults[name]:
                raise ConfigError(
                    f"--{_flag(name)} {getattr(self, name)} sizes the built-in models, not --model hf, whose size "
                    "comes from --hf-config (a config.json: n_layer, n_embd, ...) or is the built-in GPT-2's; "
                    f"leave --{_flag(name)} out"
                )
        if self.hf_config and self.dropout:
            raise ConfigError(
                f"--dropout {self.dropout} applies to the built-in GPT-2 only: with --hf-config the config's own "
                "dropout settings apply (resid_pdrop, attention_dropout, ... in the config.json); leave --dropout out"
            )

    def hf_model_config(self) -> Any:
        """``--hf-config``'s transformers config (read afresh), or None for the built-in GPT-2."""
        if not self.hf_config:
            return None
        try:
            return hf.load_config(self.hf_config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def parallel_folder(self) -> bool:
        """Whether the data is a folder of parallel files: many language pairs, a shared vocabulary."""
        return self.model == "transformer" and bool(self.data) and Path(self.data).is_dir()

    def vocab_path(self) -> Path:
        """The SentencePiece model of ``--data FOLDER``: ``--vocab``, else ``OUT/vocab.model``."""
        return Path(self.vocab) if self.vocab else Path(self.out) / "vocab.model"

    def _check_paths(self) -> None:
        if self.data and not Path(self.data).exists():
            raise ConfigError(
                f"cannot read the data file {self.data!r}: there is no such file or folder "
                "(leave --data out for synthetic data)"
            )
        if self.model == "hf" and self.data and Path(self.data).is_dir():
            raise ConfigError(
                f"--model hf reads one file (--data {self.data!r} is a folder); a folder of language pairs trains "
                "the encoder-decoder transformer: leave --model out"
            )
        if self.vocab and not self.parallel_folder:
            raise ConfigError(
                f"--vocab {self.vocab!r} is for --data FOLDER (a folder of parallel files) with the transformer; "
                "leave --vocab out"
            )
        if self.vocab and not Path(self.vocab).is_file():
            raise ConfigError(
                f"--vocab {self.vocab!r}: no such file; give a SentencePiece .model (gpipe vocab makes one), or "
                "leave --vocab out to train one on the data"
            )
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {self.out!r} is a file; name a directory (it is created if missing)")
        above = next((p for p in out.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise ConfigError(f"--out {self.out!r} is inside {str(above)!r}, which is a file; name a directory")
        if self.resume:
            checkpoints = out / "checkpoints"
            try:
                found = latest(checkpoints)
            except CheckpointError as exc:
                raise ConfigError(f"--resume: {exc}") from exc
            if found is None:
                raise ConfigError(
                    f"--resume: no checkpoint in {str(checkpoints)!r}; leave --resume out to start afresh, "
                    "or give the --out of the run to continue"
                )

    @property
    def depth(self) -> int:
        """L, the model's default where ``layers`` is 0."""
        return self.layers or DEFAULT_LAYERS[self.model]

    @property
    def stem_cells(self) -> int:
        """AmoebaNet-D's stem reduction cells: ImageNet's two for large images, none for small ones."""
        return 2 if self.image_size >= 128 else 0

    def model_layers(self) -> tuple[int, str]:
        """The model's number of layers (the units a partition is made of), and how it is counted."""
        if self.model == "amoebanet":
            extra = 4 + self.stem_cells
            return self.depth + extra, f"AmoebaNet-D({self.depth}, ...) has L + {extra}"
        if self.model == "hf":
            config = self.hf_model_config()
            blocks = config.num_hidden_layers if config is not None else hf.DEFAULT["n_layer"]
            where = f"--hf-config {self.hf_config!r}" if config is not None else "the built-in GPT-2"
            return blocks + 2, f"{where} has {blocks} blocks, + 2: the embeddings, the head"
        return 2 * self.depth + 3, f"T({self.depth}, ...) has 2L + 3"


def _flag_type(f: dataclasses.Field[Any]) -> Any:
    kind = {"int": int, "float": float, "str": str, "bool": bool}[str(f.type)]
    return (lambda v: v.lower() in ("1", "true", "yes", "on")) if kind is bool else kind


def parse(argv: Sequence[str] | None = None) -> TrainConfig:
    """The configuration from an optional ``--config`` file (TOML or JSON), overridden by flags;
    checked (:meth:`TrainConfig.check`): a bad flag or setting raises :class:`ConfigError`."""
    parser = ArgumentParser(
        prog="gpipe train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="a TOML or JSON file of settings; flags override it")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=f"{f.metadata['help']} (default: {f.default})")  # fmt: skip
        else:
            parser.add_argument(flag, dest=f.name, type=_flag_type(f), default=argparse.SUPPRESS,
                                help=f"{f.metadata['help']} (default: {f.default!r})")  # fmt: skip
    args = vars(parser.parse_args(argv))
    path = args.pop("config", None)
    settings = _read_config(path) if path else {}
    cfg = TrainConfig(**{**settings, **args})
    cfg.check()
    return cfg


def _read_config(path: str) -> dict[str, Any]:
    """The settings of a TOML or JSON file, each a known setting of its field's type."""
    try:
        text = Path(path).read_text()
        data = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the config file {path!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"the config file {path!r} holds a {type(data).__name__}; it must hold an object of settings, "
            'e.g. {"steps": 500, "partitions": 4}'
        )
    kinds = {f.name: str(f.type) for f in fields(TrainConfig)}
    settings = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in kinds:
            close = difflib.get_close_matches(name, kinds, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"known: {', '.join(kinds)}"
            raise ConfigError(f"unknown setting {key!r} in the config file {path!r}; {hint}")
        settings[name] = _typed(key, value, kinds[name], where=path)
    return settings


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _optimizer(cfg: TrainConfig, params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "adafactor":
        return adafactor(params)
    if cfg.optimizer == "rmsprop":
        return rmsprop(params, lr=1.0)
    return torch.optim.Adam(params, lr=1.0, betas=(0.9, 0.98), eps=1e-9)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the final metrics. One run at a time per ``cfg.out``."""
    cfg.check()
    with one_run(Path(cfg.out)):
        return _train(cfg)


@contextlib.contextmanager
def one_run(out: Path) -> Iterator[None]:
    """Hold ``OUT/.lock`` (an exclusive ``flock``, with this process's PID in it) for the run: a
    second run on the same ``--out`` is refused, naming the first. The kernel releases the lock
    when the process ends, however it ends, so a crash leaves no stale lock. Under torchrun rank 0
    holds it for the job."""
    if int(os.environ.get("RANK", "0")) != 0:  # (the process group does not exist yet)
        yield
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; name a directory (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".lock", "a+")  # noqa: SIM115 - held open for the whole run
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            pid = lock.read().strip() or "unknown"
            raise ConfigError(
                f"another gpipe train (PID {pid}) is running on --out {str(out)!r}; wait for it to end, "
                "stop it, or give another --out"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield
    finally:
        lock.close()  # closing releases the lock


def _train(cfg: TrainConfig) -> dict[str, Any]:
    out = Path(cfg.out)
    distributed = init_from_env()  # (before the data: rank 0 alone trains a vocabulary)
    try:
        data = _data(cfg)
    except ConfigError:
        raise
    except ValueError as exc:
        if not cfg.data:
            raise  # synthetic data: the settings were checked, so this is a bug
        raise ConfigError(str(exc)) from exc  # (data.py's errors name the file and what is wrong)
    model = _model(cfg, data)
    tokens = data.unit != "images"
    # Token losses leave out padding, and a step's loss is the mini-batch's token mean however the
    # padding falls into micro-batches: each micro-batch sums, the step divides by the tokens counted.
    ignore = PAD if tokens else -100  # (-100: F.cross_entropy's default, no class index)
    loss_fn: Any = functools.partial(label_smoothing_loss, smoothing=cfg.label_smoothing, ignore_index=ignore)
    if cfg.model == "hf":  # its last layer returns the model's ModelOutput
        loss_fn = functools.partial(hf.logits_loss, loss_fn)
    sample = data.batch(cfg.batch, 0, split="eval").inputs
    pipe = Pipeline(
        model,
        balance_by_flops(cfg.partitions * cfg.virtual, model, sample, chunks=cfg.chunks),  # from shapes, on 'meta'
        virtual=cfg.virtual,
        chunks=cfg.chunks,
        deferred_batch_norm=cfg.model == "amoebanet",
        schedule=cfg.schedule,
        loss_fn=functools.partial(loss_fn, reduction="sum") if tokens else loss_fn,
        loss_count=count_tokens(PAD) if tokens else None,
        checkpoint=cfg.checkpoint,
        devices=None if distributed else ["cpu"] * cfg.partitions,
        init_seed=cfg.seed,
        cpu_threads=cfg.threads,
    )
    optimizer = _optimizer(cfg, pipe.parameters())
    scheduler = inverse_sqrt_schedule(optimizer, cfg.lr, cfg.warmup)
    checkpoints = Checkpoints(cfg, pipe, optimizer, scheduler, out, data)
    start = checkpoints.resume() if cfg.resume else 1
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    if _rank() == 0:
        _truncate(metrics_path, start)
    baseline = data.baseline()
    rate = f"{data.unit}_per_s"
    bubble = simulate(pipe.schedule_for(cfg.chunks)).bubble
    bar = _progress(cfg, start)
    board = _board(cfg, out, start)
    last: dict[str, Any] = {}
    shown: dict[str, str] = {}  # the latest evaluation, in the progress bar
    done = start - 1  # the last step whose update is complete: what a checkpoint holds
    interrupts = Interrupts()
    try:
        for step in range(start, cfg.steps + 1):
            torch.manual_seed(derive_seed(cfg.seed, 2, step))  # dropout follows the step, for --resume
            batch = data.batch(cfg.batch, step)
            began = time.perf_counter()
            optimizer.zero_grad()
            loss = float(pipe.step(batch.inputs, batch.target))
            if cfg.clip_norm:
                clip_grad_norm_per_parameter(pipe.parameters(), cfg.clip_norm)
            # From the update to the step's metrics line, Ctrl-C and SIGTERM wait: a checkpoint written
            # on interruption is then labelled with the step whose update its weights hold.
            with interrupts.held():
                optimizer.step()
                scheduler.step()
                done = step
                seconds = time.perf_counter() - began
                last = {
                    "step": step,
                    "loss": loss,
                    "lr": scheduler.get_last_lr()[0],
                    rate: batch.count / seconds,
                    "bubble": bubble,
                }
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    last.update(
                        evaluate(
                            pipe,
                            data,
                            loss_fn,
                            batch=cfg.batch,
                            batches=cfg.eval_batches,
                            beam=cfg.beam,
                            length_penalty=cfg.length_penalty,
                        )
                    )
                    shown = {"eval": f"{last['eval_loss']:.3f}"}
                    if "bleu" in last:
                        shown["bleu"] = f"{last['bleu']:.1f}"
                if _rank() == 0:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(last) + "\n")
                if board is not None:
                    for name, value in last.items():
                        if name != "step":
                            board.add_scalar(name, value, step)
                if bar is not None:
                    speed = {f"{data.unit[:3]}_s": f"{last[rate]:.0f}"}
                    bar.set_postfix(loss=f"{loss:.3f}", **speed, bubble=f"{bubble:.2f}", **shown)
                    bar.update(1)
            if step % cfg.checkpoint_every == 0:
                checkpoints.save(step, background=True)
    except KeyboardInterrupt:
        interrupts.restore()
        if bar is not None:
            bar.close()
        checkpoints.save(done)
        checkpoints.finish()
        print(f"\ninterrupted: checkpoint of step {done} written to {out / 'checkpoints'}", file=sys.stderr)
        raise
    finally:
        interrupts.restore()
        if board is not None:
            board.close()
    if bar is not None:
        bar.close()
    checkpoints.save(done)
    checkpoints.finish()
    if _rank() == 0:
        _plot(metrics_path, out / "loss.png", baseline, data.baseline_name)
        nan = float("nan")
        accuracy = f", eval accuracy {last['eval_accuracy']:.3f}" if "eval_accuracy" in last else ""
        bleu = f", BLEU {last['bleu']:.1f}" if "bleu" in last else ""
        print(
            f"step {done}: loss {last.get('loss', nan):.4f}, eval loss {last.get('eval_loss', nan):.4f}{accuracy}"
            f"{bleu} ({data.baseline_name} baseline {baseline:.4f}); metrics in {metrics_path}, curves in "
            f"{out / 'loss.png'}"
        )
        if isinstance(data, TranslationDataset) and "bleu" in last:
            print(_bleu_table(last, data.pair_sizes))
    return {**last, "baseline": baseline}


def _bleu_table(metrics: dict[str, Any], sizes: dict[str, int]) -> str:
    """The final evaluation per language pair: training sentences, group, eval loss, BLEU."""
    groups = resource_groups(sizes)
    lines = [f"{'pair':<12} {'sentences':>10} {'group':<5} {'eval loss':>9} {'BLEU':>6}"]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lines.append(
            f"{name:<12} {sizes[name]:>10} {groups[name]:<5} {metrics[f'eval_loss/{name}']:>9.3f} "
            f"{metrics[f'bleu/{name}']:>6.1f}"
        )
    for group in ("high", "low"):
        if f"bleu/{group}" in metrics:
            lines.append(f"{'average ' + group:<29} {'':>9} {metrics[f'bleu/{group}']:>6.1f}")
    return "\n".join(lines)


def _data(cfg: TrainConfig) -> Dataset:
    if cfg.model == "hf":  # a causal LM: one sequence of pairs' tokens, or a text file's lines
        if cfg.data:
            return hf.text_data(cfg.data, seed=cfg.seed)
        return hf.CausalPairs(SyntheticTranslation(temperature=cfg.temperature, seed=cfg.seed))
    if cfg.model == "amoebanet":
        if cfg.data:
            return ImageFiles(cfg.data, size=cfg.image_size, seed=cfg.seed)
        return SyntheticImages(classes=cfg.classes, size=cfg.image_size, seed=cfg.seed)
    if cfg.parallel_folder:
        return ParallelCorpus(cfg.data, _vocab(cfg), length=cfg.max_length, temperature=cfg.temperature,
                              held_out=cfg.eval_sentences, seed=cfg.seed)  # fmt: skip
    if cfg.data:
        return TextPairs(cfg.data, seed=cfg.seed)
    return SyntheticTranslation(temperature=cfg.temperature, seed=cfg.seed)


def _model(cfg: TrainConfig, data: Dataset) -> torch.nn.Sequential:
    """The model on the meta device: each stage materializes only its own layers."""
    if cfg.model == "hf":
        return _hf_model(cfg, _tokens(data))
    with torch.device("meta"):
        if cfg.model == "amoebanet":
            data = _images(data)
            return amoebanet_d(cfg.depth, cfg.filters, classes=data.classes, in_channels=data.channels,
                               stem_cells=cfg.stem_cells)  # fmt: skip
        tokens = _tokens(data)
        return translation_model(cfg, tokens.vocab, tokens.length)


def translation_model(cfg: TrainConfig, vocab: int, length: int) -> torch.nn.Sequential:
    """The transformer ``cfg`` describes, for ``vocab`` tokens and sentences of up to ``length``
    (positions: at least 64). ``gpipe translate`` rebuilds a checkpoint's model with it."""
    return transformer(cfg.depth, cfg.hidden, cfg.heads, dim=cfg.dim, vocab=vocab, max_len=max(64, length),
                       dropout=cfg.dropout, logit_clip=cfg.logit_clip or None)  # fmt: skip


def _vocab(cfg: TrainConfig) -> Vocab:
    """``--data FOLDER``'s shared vocabulary: ``--vocab``, or ``OUT/vocab.model``, trained by rank 0
    on the first run (from ``min(10^6, sentence pairs)`` draws at ``--temperature``) and written
    whole or not at all."""
    path = cfg.vocab_path()
    if not path.exists():
        if cfg.resume:
            raise ConfigError(f"--resume: the run's vocabulary {str(path)!r} is missing; restore it, or start afresh")
        error = None
        if _rank() == 0:
            try:
                _train_vocab(cfg, path)
            except ValueError as exc:
                error = f"--data {cfg.data!r}: {exc}"
        if dist.is_initialized():
            shared = [error]
            dist.broadcast_object_list(shared, src=0)
            error = shared[0]
        if error is not None:
            raise ConfigError(error)
    elif not cfg.vocab and not cfg.resume and _rank() == 0:
        print(f"using the vocabulary {path} of an earlier run (delete it to train a new one)", file=sys.stderr)
    try:
        return Vocab(path)
    except ValueError as exc:
        raise ConfigError(f"{exc}; give a SentencePiece .model as --vocab") from exc


def _train_vocab(cfg: TrainConfig, path: Path) -> None:
    pairs = read_pairs(cfg.data)
    draws = min(1_000_000, sum(len(p) for p in pairs.values()))
    print(f"training a vocabulary of {cfg.vocab_size} pieces on {draws} sentence pairs of {cfg.data} "
          f"(T={cfg.temperature:g}) into {path}", file=sys.stderr)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.stem}.tmp-{os.getpid()}"
    try:
        model = train_vocab(pairs, staging, size=cfg.vocab_size, temperature=cfg.temperature, sample=draws,
                            seed=cfg.seed)  # fmt: skip
        os.replace(f"{staging}.vocab", path.with_suffix(".vocab"))
        os.replace(model, path)  # last: a complete vocabulary appears at once
    finally:
        for leftover in (f"{staging}.vocab", f"{staging}.model"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)


def _tokens(data: Dataset) -> TokenDataset:
    if not isinstance(data, TokenDataset):
        raise TypeError(f"a language model needs token data, got {type(data).__name__}")
    return data


def _images(data: Dataset) -> ImageDataset:
    if not isinstance(data, ImageDataset):
        raise TypeError(f"an image classifier needs image data, got {type(data).__name__}")
    return data


def _hf_model(cfg: TrainConfig, data: TokenDataset) -> torch.nn.Sequential:
    """The Hugging Face model as pipeline layers, on the meta device like the built-in models: each
    process materializes its own stages' layers, initialized by the model's ``_init_weights``
    seeded per layer from ``--seed``, alike in every process and for every partition count."""
    config = cfg.hf_model_config()
    where = f"--hf-config {cfg.hf_config!r}" if config is not None else "the built-in GPT-2"
    try:
        if config is None:
            config = hf.default_config(data.vocab, data.length, cfg.dropout)
        else:
            hf.check_config(config, where, data.vocab, data.length)
    except ValueError as exc:  # (its messages name the config)
        raise ConfigError(str(exc)) from exc
    try:
        model = hf.build(config)
    except ValueError as exc:  # a setting from_config refuses, or a model that is not causal
        raise ConfigError(f"{where}: {exc}") from exc
    return to_sequential(model, data.batch(2, 0, split="eval").inputs)


def _board(cfg: TrainConfig, out: Path, start: int) -> Any:
    """TensorBoard's writer of OUT/tensorboard on rank 0 (None when off, or auto without the package).
    A resumed run purges what an earlier run wrote from its first step on, as metrics.jsonl does."""
    if _rank() != 0 or cfg.tensorboard == "off" or not _has_tensorboard():
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start if start > 1 else None)


def _progress(cfg: TrainConfig, start: int) -> Any:
    """tqdm's bar on a terminal; in a log (standard error not a terminal), a line every few seconds."""
    if not cfg.progress or _rank() != 0:
        return None
    from gpipe.train.progress import progress

    return progress(cfg.steps, initial=start - 1, desc="gpipe train", unit="step")


RUN = "run.json"  # in every checkpoint: the settings and what the model was sized from
SCHEDULER = "scheduler.json"  # in every checkpoint: the learning-rate schedule's state


class Checkpoints:
    """``OUT/checkpoints`` of a run: the layers and the optimizer's state through
    :func:`gpipe.saving.save` (torch.distributed.checkpoint, keyed by global layer index, so that
    ``--resume`` may change ``--partitions``), beside them the learning-rate schedule's state,
    ``run.json`` and the vocabulary. With ``--async-checkpoint`` a save returns once the state is
    copied and writes in the background; the next save, and :meth:`finish`, wait for it."""

    def __init__(
        self, cfg: TrainConfig, pipe: Pipeline, optimizer: Any, scheduler: Any, out: Path, data: Dataset
    ) -> None:
        self.cfg, self.pipe, self.optimizer, self.scheduler, self.data = cfg, pipe, optimizer, scheduler, data
        self.root = out / "checkpoints"
        self.pending: AsyncSave | None = None
        self.saved = 0  # the step of the newest save started

    def _extra(self) -> dict[str, Any]:
        if _rank() != 0:
            return {}
        scheduler = json.dumps(self.scheduler.state_dict())
        extra: dict[str, Any] = {SCHEDULER: lambda p: p.write_text(scheduler + "\n")}
        data = self.data  # what `gpipe translate` rebuilds the model from, beside its weights
        run: dict[str, Any] = {"config": dataclasses.asdict(self.cfg), "data": type(data).__name__}
        if isinstance(data, TokenDataset):
            run |= {"vocab": data.vocab, "length": data.length}
        if isinstance(data, TranslationDataset):
            run["pairs"] = data.pair_sizes
        extra[RUN] = lambda p: p.write_text(json.dumps(run, indent=1) + "\n")
        if isinstance(data, ParallelCorpus):
            extra["vocab.model"] = lambda p: shutil.copyfile(data.vocab_model.path, p)
        return extra

    def save(self, step: int, *, background: bool = False) -> None:
        """Checkpoint ``step`` (the last step whose update is complete); in the background if
        asked and ``--async-checkpoint`` is on. A step already saved is not saved again."""
        if step < 1 or step == self.saved:
            return
        self.saved = step
        if background and self.cfg.async_checkpoint:
            self.pending = save(self.pipe, self.root, step, optimizer=self.optimizer, extra=self._extra(),
                                asynchronous=True)  # fmt: skip
            return
        self.pending = None  # (a save waits for the one under way)
        save(self.pipe, self.root, step, optimizer=self.optimizer, extra=self._extra())

    def finish(self) -> None:
        """Wait for a save under way (raising its error)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def resume(self) -> int:
        """Load the newest checkpoint into the pipeline, the optimizer and the schedule; returns the
        first step to run."""
        found = latest(self.root)
        if found is None:
            raise ConfigError(f"--resume: no checkpoint in {str(self.root)!r}")
        step = load(self.pipe, self.root, optimizer=self.optimizer)
        try:
            self.scheduler.load_state_dict(json.loads((found / SCHEDULER).read_text()))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{str(found / SCHEDULER)!r}: the learning-rate schedule's state: {exc}") from None
        self.saved = step
        return step + 1


def _truncate(path: Path, start: int) -> None:
    """Drop metrics of steps at or after ``start`` (a resumed run writes them again), and a torn last
    line (a crash in the middle of writing it)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, TypeError, KeyError):
            if i == len(lines) - 1:
                break  # torn by a crash while it was written
            raise ConfigError(
                f"{str(path)!r} line {i + 1} is not a metrics record: {line[:80]!r}; repair or remove the file"
            ) from None
        if step < start:
            kept.append(line)
    write_atomically(path, lambda p: p.write_text("".join(line + "\n" for line in kept)))


class Interrupts:
    """Ctrl-C (SIGINT) and SIGTERM raise ``KeyboardInterrupt`` — except inside :meth:`held`, where
    the signal waits until the block ends. (In the main thread only; elsewhere signals are as they were.)"""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._held = 0
        self._pending: int | None = None
        self._before: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._before[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._held:
            self._pending = signum
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held and self._pending is not None:
            signum, self._pending = self._pending, None
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._before.items():
            signal.signal(sig, handler)
        self._before = {}


def _plot(metrics: Path, path: Path, baseline: float, baseline_name: str) -> None:
    """The loss curves, and BLEU per language pair beside them when there is any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    evals = [r for r in rows if "eval_loss" in r]
    pairs = sorted({k.split("/", 1)[1] for r in evals for k in r if k.startswith("bleu/")} - {"high", "low"})
    fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(12 if pairs else 7, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss", lw=1)
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.axhline(baseline, color="gray", ls="--", label=f"{baseline_name} {baseline:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.legend()
    if pairs:
        ax = axes[0][1]
        for name in pairs:
            points = [(r["step"], r[f"bleu/{name}"]) for r in evals if f"bleu/{name}" in r]
            ax.plot(*zip(*points), "o-", label=name, lw=1, ms=3)
        for group, style in (("high", "--"), ("low", ":")):
            points = [(r["step"], r[f"bleu/{group}"]) for r in evals if f"bleu/{group}" in r]
            if points:
                ax.plot(*zip(*points), style, color="black", label=f"{group}-resource mean")
        ax.set_xlabel("step")
        ax.set_ylabel("BLEU")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe train``. A bad flag, setting, path or checkpoint (:class:`ConfigError`,
    ``CheckpointError``) is one line ``error: ...`` and exit status 2; any other exception is a bug
    and keeps its traceback."""
    try:
        train(parse(argv))
    except (UsageError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
