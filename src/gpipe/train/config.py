"""The settings of ``gpipe train``: :class:`TrainConfig` (its fields are the flags) and its checks,
the errors they raise (:class:`ConfigError`, :class:`ConfigTypeError`, from :mod:`gpipe.train.checks`
with the checks of one setting) and the choices (models, optimizers, schedules, precisions, ...). A
``--config`` file is read by :mod:`gpipe.train.config_file`."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gpipe.checkpoint import CHECKPOINT_MODES
from gpipe.data.prepared import is_prepared
from gpipe.models import hf
from gpipe.schedule import SCHEDULES
from gpipe.train.checks import (
    RANGES,
    ConfigError,
    ConfigTypeError,
    check_paths,
    checkpoint_to_resume,
    choice_error,
    data_flags_error,
    devices_error,
    flag,
    moe_error,
    newest_checkpoint,
    shape_error,
    typed,
)
from gpipe.train.initial import hf_config_path, model_flags_error
from gpipe.train.layout import layout_error
from gpipe.train.model_settings import MODELS, ModelSettings, aids_error, tensor_parallel_error
from gpipe.train.precision import PRECISIONS

__all__ = [
    "DEFAULT_LAYERS",
    "MODELS",
    "NONFINITE",
    "OPTIMIZERS",
    "PRECISIONS",
    "TENSORBOARD_MODES",
    "V_SCHEDULES",
    "ConfigError",
    "ConfigTypeError",
    "TrainConfig",
    "checkpoint_to_resume",
    "has_tensorboard",
    "newest_checkpoint",
]

V_SCHEDULES = ("zb-v", "dualpipev", "v-half", "v-min")  # two stages per worker
TENSORBOARD_MODES = ("auto", "on", "off")


def has_tensorboard() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


DEFAULT_LAYERS = {"transformer": 2, "amoebanet": 6}
OPTIMIZERS = ("adam", "adafactor", "rmsprop", "sgd")
NONFINITE = ("stop", "skip")  # --on-nonfinite


@dataclass(kw_only=True)
class TrainConfig(ModelSettings):
    """Everything ``gpipe train`` needs (the model: ``ModelSettings``' fields, first); each field is
    also a command-line flag."""

    partitions: int = field(default=2, metadata={"help": "K: pipeline stages (devices, or ranks under torchrun)"})
    data_parallel: int = field(
        default=1,
        metadata={
            "help": "D: replicas of the pipeline under torchrun (D x K processes), each training on 1/D of every "
            "mini-batch, their gradients summed: the losses of D=1; 0: as many as torchrun's processes make "
            "(derived again when an elastic job restarts on fewer nodes)"
        },
    )
    fsdp: bool = field(
        default=False,
        metadata={
            "help": "with --data-parallel D >= 2: shard each stage's parameters, gradients and optimizer state over "
            "its D replicas (FSDP2) instead of copying them; a rank keeps 1/D of them"
        },
    )
    expert_parallel: int = field(
        default=1, metadata={"help": "N: split each mixture's --experts over N of the --data-parallel replicas"}
    )
    tensor_parallel: int = field(
        default=1,
        metadata={
            "help": "T: split each layer that has a tensor-parallel plan over T processes under torchrun (D x K x T "
            "in all): --model hf with a Hugging Face plan (Llama, Qwen2, Mistral via --hf-config), or the "
            "transformer with --head-dim"
        },
    )
    devices: str = field(
        default="auto",
        metadata={
            "help": "where the stages run: auto (the visible GPUs round robin, under torchrun cuda:LOCAL_RANK; the CPU "
            "without CUDA), cpu, cuda (refused without CUDA), or cuda:0,cuda:1,...: one device, or one per partition"
        },
    )
    chunks: int = field(
        default=4, metadata={"help": "M: micro-batches per mini-batch (per replica's share with --data-parallel)"}
    )
    schedule: str = field(
        default="1f1b", metadata={"help": f"the schedule: {', '.join(SCHEDULES)}, auto (planned from measured costs)"}
    )
    checkpoint: str = field(
        default="except_last",
        metadata={
            "help": "re-materialization: always, except_last, never, or matmuls (all but the last micro-batch "
            "keep their matrix products' and attention's outputs and recompute the rest: gpipe.Selective)"
        },
    )
    threads: int = field(
        default=1, metadata={"help": "intra-op threads per stage, fixed so that runs are bitwise equal whatever K"}
    )
    batch: int = field(default=64, metadata={"help": "mini-batch size (sentence pairs or images)"})
    batch_tokens: int = field(
        default=0,
        metadata={
            "help": "translation on --data FOLDER or PREPARED: mini-batches of about N tokens, padding included, "
            "drawn from length buckets, instead of --batch sentences (0: --batch)"
        },
    )
    steps: int = field(default=200, metadata={"help": "training steps"})
    optimizer: str = field(default="adam", metadata={"help": f"the optimizer: {', '.join(OPTIMIZERS)}"})
    lr: float = field(default=1e-2, metadata={"help": "peak learning rate of the inverse-sqrt schedule"})
    warmup: int = field(default=30, metadata={"help": "warm-up steps of the inverse-sqrt schedule"})
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing"})
    clip_norm: float = field(default=1.0, metadata={"help": "per-parameter gradient-norm clipping (0: none)"})
    lr_hypergradient: float = field(
        default=0.0,
        metadata={
            "help": "learn the learning rate as it trains, by hypergradient descent (Baydin et al. 2017) at rate "
            "BETA in [0, 1): each step multiplies it by 1 + BETA x the cosine between the gradient and the last "
            "update (0: off); the learned rates are logged as lr/NNN (per layer) or lr/model"
        },
    )
    lr_hypergradient_scope: str = field(
        default="layer",
        metadata={"help": "--lr-hypergradient: one learned rate per layer (a tied weight its own), or global"},
    )
    precision: str = field(
        default="fp32",
        metadata={
            "help": f"the activations' precision: {', '.join(PRECISIONS)} (bf16: the step and the evaluations under "
            "torch.autocast in bfloat16; the weights, their gradients, the optimizer and the loss stay float32)"
        },
    )
    temperature: float = field(
        default=5.0, metadata={"help": "T of the language-pair sampling (training batches and the vocabulary)"}
    )
    data: str = field(
        default="",
        metadata={
            "help": "transformer: a folder of parallel files, one per language pair (xx-yy.tsv, or xx-yy.xx + "
            "xx-yy.yy; held-out ones in its eval/ folder; prepared into OUT/prepared once), a folder gpipe prepare "
            "wrote, or one file of source<TAB>target lines; amoebanet: a .npz (x, y) or a folder of class "
            "sub-folders of images; hf: source<TAB>target lines, text (a document a line) or its gpipe prepare "
            "folder (default: synthetic data)"
        },
    )
    vocab: str = field(
        default="",
        metadata={
            "help": "--data FOLDER: a SentencePiece model to use ('': OUT/vocab.model, trained on the first run "
            "from text sampled at --temperature)"
        },
    )
    vocab_size: int = field(
        default=0,
        metadata={
            "help": "--data FOLDER: pieces of the vocabulary trained, refused if the text cannot make as many (0: as "
            "many as it supports, up to 8000)"
        },
    )
    workers: int = field(
        default=0,
        metadata={
            "help": "data loader worker processes preparing the next batches (0: one background thread); images are "
            "decoded in them"
        },
    )
    augment: bool = field(
        default=False,
        metadata={"help": "amoebanet, --data FOLDER or .npz: random-resized crops and horizontal flips, seeded"},
    )
    max_length: int = field(
        default=64,
        metadata={
            "help": "--data FOLDER: most tokens of a side, longer pairs left out; hf, --data FILE.jsonl: of a row "
            "(longer records lose their prompt's first tokens)"
        },
    )
    pack: bool = field(
        default=False,
        metadata={"help": "hf, --data FILE.jsonl: lay the examples end to end in rows of --max-length tokens"},
    )
    train_on_prompt: bool = field(
        default=False, metadata={"help": "hf, --data FILE.jsonl: the loss counts every token, not the answers' only"}
    )
    chat_template: str = field(
        default="", metadata={"help": "hf, --data FILE.jsonl: a Jinja chat template ('': the tokenizer's own)"}
    )
    skip_bad: bool = field(
        default=False, metadata={"help": "hf, --data FILE.jsonl: leave out and count bad records, not refuse them"}
    )
    eval_every: int = field(
        default=50,
        metadata={"help": "evaluate every N steps and at the last (0: never; gpipe eval --watch evaluates apart)"},
    )
    health_every: int = field(
        default=10,
        metadata={
            "help": "every N steps metrics.jsonl and TensorBoard get grad_norm (before clipping), output_grad/NNN (the "
            "norm of the loss's gradient by layer NNN's output) and grad_norm_ratio (Bapna et al.'s: first / last "
            "block's); 0: off"
        },
    )
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
    keep: int = field(
        default=0,
        metadata={"help": "keep the newest N checkpoints, deleting older ones as new ones complete (0: keep all)"},
    )
    async_checkpoint: bool = field(
        default=False,
        metadata={
            "help": "write the every-N-steps checkpoints in the background (the state is copied first; the final "
            "one and Ctrl-C's are written at once)"
        },
    )
    on_nonfinite: str = field(
        default="stop",
        metadata={
            "help": "a step whose loss or gradients hold NaN or Inf, named where it appeared: stop (exit status 3), "
            "or skip its update (weights and optimizer state untouched; counted in the metrics)"
        },
    )
    max_skips: int = field(
        default=5, metadata={"help": "the most steps skipped in a row; one more stops the run (exit status 3)"}
    )
    skip_spikes: bool = field(
        default=False,
        metadata={
            "help": "also skip a step whose gradient norm is over 4 standard deviations above its moving mean "
            "(Lingvo's rule, on the log of the norm; counted against --max-skips)"
        },
    )
    timeout: float = field(
        default=60.0,
        metadata={
            "help": "under torchrun: seconds a rank waits for another (a transfer, a collective, a silent heartbeat) "
            "before the job fails, so that torchrun --max-restarts can restart it"
        },
    )
    out: str = field(default="runs/default", metadata={"help": "output directory"})
    resume: bool = field(
        default=False,
        metadata={"help": "continue from the newest checkpoint in OUT, with the run's settings unless flags override"},
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "start afresh in an OUT that holds an earlier run, deleting its checkpoints, metrics and "
            "TensorBoard files first (without it such an OUT is refused)"
        },
    )
    seed: int = field(default=0, metadata={"help": "random seed"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    tensorboard: str = field(
        default="auto",
        metadata={
            "help": "TensorBoard event files in OUT/tensorboard: auto (when the tensorboard package is "
            "installed), on (refuse to run without it), off"
        },
    )

    def __post_init__(self) -> None:
        if self.data_parallel == 0 and isinstance(self.partitions, int) and isinstance(self.tensor_parallel, int):
            world = int(os.environ.get("WORLD_SIZE", "1"))  # --data-parallel 0: the replicas the world holds
            per_replica = max(self.partitions, 1) * max(self.tensor_parallel, 1)
            if world % per_replica == 0:
                self.data_parallel = max(world // per_replica, 1)

    @property
    def virtual(self) -> int:
        """Stages per worker: two in the V schedules (zb-v, dualpipev), else one."""
        return 2 if self.schedule in V_SCHEDULES else 1

    def check(self) -> None:
        """Refuse bad settings, naming them and the fix, before any work starts: a wrong type
        (:class:`ConfigTypeError`, a ``TypeError``), a value out of range, or paths that cannot work
        (``--data``, ``--out``, ``--resume``): :class:`ConfigError`, a ``ValueError``."""
        for f in fields(self):
            typed(f.name, getattr(self, f.name), str(f.type))
        choices = {"model": ("model", MODELS), "schedule": ("schedule", (*SCHEDULES, "auto")),
                   "tensorboard": ("--tensorboard", TENSORBOARD_MODES),
                   "checkpoint": ("checkpoint mode", (*CHECKPOINT_MODES, "matmuls")),
                   "on_nonfinite": ("--on-nonfinite", NONFINITE), "optimizer": ("optimizer", OPTIMIZERS),
                   "precision": ("--precision", PRECISIONS)}  # fmt: skip
        if (error := choice_error(self, choices)) is not None:
            raise ConfigError(error)
        if self.tensorboard == "on" and not has_tensorboard():
            raise ConfigError(
                "--tensorboard on needs the tensorboard package (pip install tensorboard), or use --tensorboard off"
            )
        if self.data_parallel == 0:
            raise ConfigError(
                f"--data-parallel 0 takes as many replicas as torchrun's {os.environ.get('WORLD_SIZE', '1')} processes "
                f"hold, but they are not a multiple of --partitions {self.partitions} x --tensor-parallel "
                f"{self.tensor_parallel}; start torchrun with a multiple, or give --data-parallel"
            )
        positive = ("hidden", "heads", "dim", "filters", "image_size", "partitions", "data_parallel",
                    "expert_parallel", "tensor_parallel", "chunks", "batch", "steps", "warmup", "threads",
                    "eval_batches", "checkpoint_every", "eval_sentences", "beam", "max_skips")  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{flag(name)} must be positive (got {getattr(self, name)})")
        for name, (ok, requirement) in RANGES.items():
            if not ok(getattr(self, name)):  # (NaN fails every comparison)
                raise ConfigError(f"--{flag(name)} must be {requirement} (got {getattr(self, name)})")
        if self.eval_every < 0:
            raise ConfigError(f"--eval-every must be 0 (never) or positive (got {self.eval_every})")
        if self.max_length < 2:
            raise ConfigError(f"--max-length must be at least 2 (got {self.max_length})")
        if error := data_flags_error(self) or devices_error(self) or aids_error(self) or tensor_parallel_error(self):
            raise ConfigError(error)
        if (error := shape_error(self)) is not None:
            raise ConfigError(error)
        if (error := model_flags_error(self) or moe_error(self, {f.name: f.default for f in fields(self)})) is not None:
            raise ConfigError(error)
        layers, formula = self.model_layers()
        if self.partitions * self.virtual > layers:
            v = f" x {self.virtual} stages each ({self.schedule})" if self.virtual > 1 else ""
            raise ConfigError(
                f"--partitions {self.partitions}{v} exceeds the model's {layers} layers "
                f"({formula}); use fewer partitions or more layers"
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        error = layout_error(partitions=self.partitions, data_parallel=self.data_parallel, fsdp=self.fsdp,
                             batch=self.batch, world=world, tensor_parallel=self.tensor_parallel)  # fmt: skip
        if error is not None:
            raise ConfigError(error)
        check_paths(self)

    def hf_model_config(self) -> Any:
        """``--hf-config``'s transformers config (read afresh; or the ``--init`` folder's, or the one
        its checkpoint keeps), or None for the built-in GPT-2."""
        path, given = hf_config_path(self)
        if not path:
            return None
        try:
            return hf.load_config(path, given)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def parallel_folder(self) -> bool:
        """Whether the data is a folder of parallel files: many language pairs, a shared vocabulary."""
        return self.model == "transformer" and bool(self.data) and Path(self.data).is_dir()

    @property
    def prepared(self) -> bool:
        """Whether ``--data`` is a folder ``gpipe prepare`` wrote."""
        return bool(self.data) and is_prepared(self.data)

    def vocab_path(self) -> Path:
        """The SentencePiece model of ``--data FOLDER``: ``--vocab``, else ``OUT/vocab.model``; of
        ``--data PREPARED``: its own."""
        if self.prepared:
            return Path(self.data) / "vocab.model"
        return Path(self.vocab) if self.vocab else Path(self.out) / "vocab.model"

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
            where = "the built-in GPT-2"
            if config is not None:
                where = f"--hf-config {self.hf_config!r}" if self.hf_config else f"--init {self.init!r}'s config"
            return blocks + 2, f"{where} has {blocks} blocks, + 2: the embeddings, the head"
        return 2 * self.depth + 3, f"T({self.depth}, ...) has 2L + 3"
