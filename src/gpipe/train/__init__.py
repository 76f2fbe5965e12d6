"""``gpipe train``: train the paper's Transformer or AmoebaNet-D, or a Hugging Face causal LM, with
pipeline parallelism, on the local devices or under torchrun with the same flags.

    gpipe train                                   # the default: a small T(2, 256, 4) on synthetic data
    gpipe train --data corpus/                    # every language pair of a folder of parallel files (BLEU per pair)
    gpipe train --data corpus.prepared --batch-tokens 4096  # gpipe prepare's folder, batches of ~4096 tokens
    gpipe train --model amoebanet                 # a small AmoebaNet-D(6, 16) on synthetic 32x32 images
    gpipe train --model amoebanet --data cifar.npz --layers 18 --filters 64
    gpipe train --model amoebanet --data images/ --augment --workers 2  # a folder per class, decoded per batch
    gpipe train --model hf                        # a small GPT-2 (transformers), built-in corpus
    gpipe train --model hf --hf-config llama/config.json --data text.txt
    gpipe train --model hf --init llama-hf/ --data text.txt  # fine-tune a save_pretrained folder
    gpipe train --model hf --init llama-hf/ --data text.txt --lora 8  # LoRA adapters, the weights frozen
    gpipe train --init runs/base --data new-pairs/ --out runs/tuned  # a warm start: weights only, steps from 1
    gpipe train --partitions 4 --schedule zb-h1 --steps 500 --out runs/zb
    gpipe train --precision bf16                  # activations in bfloat16 (autocast); weights, optimizer, loss fp32
    gpipe train --devices cpu                     # on the CPU, whatever GPUs there are (default auto: the GPUs)
    gpipe train --out runs/zb --resume --steps 800  # continue a run, with its own settings
    torchrun --nproc-per-node 2 -m gpipe train    # one process per stage
    torchrun --nproc-per-node 4 -m gpipe train --partitions 2 --data-parallel 2 --fsdp  # 2 sharded replicas
    torchrun --nproc-per-node 2 --max-restarts 3 -m gpipe train  # a lost rank: the job goes on from its checkpoint
    gpipe train --config configs/t2-256-4.toml --steps 50  # a file of settings (flags override it)
    gpipe train --config t6-8192-16 --data corpus/  # one of the paper's configurations (configs/), by name
    gpipe train --on-nonfinite skip --max-skips 5  # a NaN or Inf is named where it appeared; its step skipped
    gpipe train --eval-every 0 --out runs/x        # never pause to evaluate: gpipe eval --watch runs/x does, beside it

Each writes into ``--out`` (default ``runs/default``), which another run may not share: give each its own.

Every ``--eval-every`` steps it evaluates (translation: loss and BLEU per language pair), every
``--health-every`` steps it logs the gradient norm, each layer's output-gradient norm and their ratio between
the first and last block; metrics go to ``OUT/metrics.jsonl``, TensorBoard's ``OUT/tensorboard`` and the
curves to ``OUT/loss.png`` and ``OUT/grad_norm_ratio.png``; a checkpoint (layers and optimizer state keyed
by global layer index) is written every ``--checkpoint-every`` steps, at the end, and on Ctrl-C. Batches
and dropout are a pure function of (seed, step), so ``--resume`` reproduces the uninterrupted run's losses
exactly, with another ``--partitions`` too. A resumed run keeps the settings it was started with; a flag
given with ``--resume`` overrides one, and is named. An ``OUT`` that holds an earlier run is refused unless
``--resume`` or ``--overwrite`` says what to do with it.

Under torchrun, ``--data-parallel D`` runs D replicas of the K-stage pipeline (D x K processes), each on
1/D of every mini-batch, with the losses of D=1; ``--fsdp`` shards each stage's parameters, gradients and
optimizer state over its D replicas. Checkpoints load into any layout: ``--resume`` may change
``--partitions``, ``--data-parallel`` and ``--fsdp``. With D > 1, evaluations give the held-out losses
but neither BLEU nor a sample (decoding does not run on replicated pipelines).
"""

# An application: imports the library, gpipe.data, gpipe.models and its own modules (config, layout, setup,
# checkpoints, metrics, loop, progress); only the command line (gpipe.cli) and gpipe translate import it.

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from gpipe.commands.args import ArgumentParser, UsageError, refuse
from gpipe.data.prepared import PreparedError
from gpipe.saving import CheckpointError, NoSpaceError
from gpipe.train import paper
from gpipe.train.config import PRECISIONS, ConfigError, ConfigTypeError, TrainConfig
from gpipe.train.config_file import read_config_file
from gpipe.train.guard import EXIT_NONFINITE, NonFiniteError
from gpipe.train.initial import started_settings
from gpipe.train.loop import one_run, train
from gpipe.train.resume import resumed_settings
from gpipe.train.setup import translation_model

__all__ = ["ConfigError", "ConfigTypeError", "TrainConfig", "main", "one_run", "parse", "train", "translation_model"]


# The flags of -h in groups (every TrainConfig field in one; tests/test_train.py holds it).
_GROUPS = {
    "model": ("model", "hf_config", "init", "lora", "lora_targets", "layers", "hidden", "heads", "dim", "head_dim",
              "filters", "reference_cells", "classes", "image_size", "dropout", "logit_clip", "transparent"),
    "mixture of experts": ("experts", "expert_top_k", "capacity_factor", "moe_every", "moe_loss_weight"),
    "training aids": ("norm", "init_scheme", "share_layers", "lr_hypergradient", "lr_hypergradient_scope"),
    "pipeline": ("partitions", "devices", "data_parallel", "fsdp", "expert_parallel", "tensor_parallel", "chunks",
                 "schedule", "checkpoint", "threads"),
    "training": ("batch", "batch_tokens", "steps", "optimizer", "lr", "warmup", "label_smoothing", "clip_norm",
                 "precision", "seed"),
    "data": ("data", "temperature", "vocab", "vocab_size", "tokenizer", "max_length", "workers", "augment"),
    "instruction data": ("pack", "train_on_prompt", "chat_template", "skip_bad"),
    "evaluation": ("eval_every", "health_every", "eval_batches", "eval_sentences", "beam", "length_penalty"),
    "output": ("out", "resume", "overwrite", "checkpoint_every", "keep", "async_checkpoint", "progress",
               "tensorboard"),
    "faults": ("on_nonfinite", "max_skips", "skip_spikes", "timeout"),
}  # fmt: skip
_METAVARS = {"int": "N", "float": "X", "str": "NAME", "hf_config": "PATH", "init": "PATH", "lora": "R",
             "lora_targets": "NAMES", "data": "PATH", "vocab": "PATH", "tokenizer": "PATH", "out": "PATH",
             "checkpoint": "MODE", "devices": "DEVICES", "tensorboard": "MODE", "on_nonfinite": "{stop,skip}",
             "timeout": "SECONDS", "chat_template": "PATH", "precision": "{" + ",".join(PRECISIONS) + "}",
             "norm": "{auto,none}", "init_scheme": "{default,fixup}", "lr_hypergradient": "BETA",
             "lr_hypergradient_scope": "{layer,global}"}  # fmt: skip


def _flag_type(f: dataclasses.Field[Any]) -> Any:
    kind = {"int": int, "float": float, "str": str, "bool": bool}[str(f.type)]
    return (lambda v: v.lower() in ("1", "true", "yes", "on")) if kind is bool else kind


def _parser() -> ArgumentParser:
    """``gpipe train``'s parser: ``--config`` and a flag per :class:`TrainConfig` field, in groups."""
    parser = ArgumentParser(
        prog="gpipe train",
        usage="%(prog)s [--config FILE] [--SETTING VALUE ...]",
        description=__doc__.replace("``", "") if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML or JSON file of settings, or the name of one of the paper's configurations "
        "(configs/: t6-8192-16, amoebanet-d-18-256, ...); flags override it",
    )
    groups = {title: parser.add_argument_group(title) for title in _GROUPS}
    for f in fields(TrainConfig):
        group = groups[next(title for title, names in _GROUPS.items() if f.name in names)]
        flag = "--" + f.name.replace("_", "-")
        default = f"{f.default!r}" if f.default == "" else f"{f.default}"
        if f.type == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=f"{f.metadata['help']} (default: {default})")  # fmt: skip
        else:
            metavar = _METAVARS.get(f.name) or _METAVARS[str(f.type)]
            group.add_argument(flag, dest=f.name, type=_flag_type(f), default=argparse.SUPPRESS, metavar=metavar,
                               help=f"{f.metadata['help']} (default: {default})")  # fmt: skip
    return parser


def parse(argv: Sequence[str] | None = None) -> TrainConfig:
    """The configuration from an optional ``--config`` file (TOML or JSON), overridden by flags;
    checked (:meth:`TrainConfig.check`): a bad flag or setting raises :class:`ConfigError`."""
    args = vars(_parser().parse_args(argv))
    path = args.pop("config", None)
    settings = read_config_file(str(paper.find(path, missing_ok=True))) if path else {}  # (a file, or a paper's name)
    given = started_settings({**settings, **args}, {f.name: f.default for f in fields(TrainConfig)})
    cfg = TrainConfig(**resumed_settings(given))  # --resume: the run's own settings beneath; --init RUN: its model
    cfg.check()
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe train``. A bad flag, setting, path, checkpoint or prepared folder (:class:`ConfigError`,
    ``CheckpointError``, ``PreparedError``, a full disk) is one line ``error: ...`` and exit status 2; any
    other exception is a bug and keeps its traceback."""
    try:
        train(parse(argv))
    except (UsageError, CheckpointError, PreparedError) as exc:  # (damaged prepared data: read at open, or a batch)
        return refuse(exc)
    except NoSpaceError as exc:  # the checkpoints before it are intact (a save commits whole or not at all)
        return refuse(f"{exc.strerror}; the earlier checkpoints are intact: free space, then --resume")
    except NonFiniteError as exc:  # a NaN or Inf, named where it appeared (or too many skips in a row)
        kept = f"the checkpoint of step {exc.kept} is kept" if exc.kept else "no checkpoint was written yet"
        print(f"error: {exc} ({kept})", file=sys.stderr)
        return EXIT_NONFINITE
    except KeyboardInterrupt:
        return 130
    return 0
