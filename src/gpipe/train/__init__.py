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

# An application: imports the library, gpipe.data, gpipe.models and its own modules (config, setup,
# checkpoints, metrics, loop, progress); only the command line (gpipe.cli) and gpipe translate import it.

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from gpipe.commands.args import ArgumentParser, UsageError, refuse
from gpipe.saving import CheckpointError, NoSpaceError
from gpipe.train.config import ConfigError, ConfigTypeError, TrainConfig, read_config_file
from gpipe.train.loop import one_run, train
from gpipe.train.setup import translation_model

__all__ = ["ConfigError", "ConfigTypeError", "TrainConfig", "main", "one_run", "parse", "train", "translation_model"]


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
    settings = read_config_file(path) if path else {}
    cfg = TrainConfig(**{**settings, **args})
    cfg.check()
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe train``. A bad flag, setting, path or checkpoint (:class:`ConfigError`,
    ``CheckpointError``, a full disk) is one line ``error: ...`` and exit status 2; any other exception is a bug
    and keeps its traceback."""
    try:
        train(parse(argv))
    except (UsageError, CheckpointError) as exc:
        return refuse(exc)
    except NoSpaceError as exc:  # the checkpoints before it are intact (a save commits whole or not at all)
        return refuse(f"{exc.strerror}; the earlier checkpoints are intact: free space, then --resume")
    except KeyboardInterrupt:
        return 130
    return 0
