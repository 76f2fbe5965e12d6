"""The ``gpipe`` command line: ``gpipe COMMAND [flags]`` hands the flags to the command, which owns
its parser (``gpipe COMMAND -h`` lists them).

- ``gpipe train``: the paper's Transformer or AmoebaNet-D, or a Hugging Face causal LM (:mod:`gpipe.train`).
- ``gpipe sweep``: a hyper-parameter search over ``gpipe train``'s settings with Optuna (:mod:`gpipe.sweep`).
- ``gpipe runs``: the runs under some folders side by side, settings and results (:mod:`gpipe.runs`).
- ``gpipe eval``: a run's checkpoints evaluated apart from its training, once or as they come (:mod:`gpipe.evaluator`).
- ``gpipe translate``: sentences through a checkpoint of ``gpipe train --data DIR`` (:mod:`gpipe.translate`).
- ``gpipe generate``: prompts continued by a checkpoint of ``gpipe train --model hf`` (:mod:`gpipe.generate`).
- ``gpipe export``: a checkpoint of ``gpipe train --model hf`` as a transformers model folder (:mod:`gpipe.export`).
- ``gpipe bench``: the paper's tables on this machine, beside peers (:mod:`gpipe.bench`).
- ``gpipe demo``: ``gpipe corpus`` then ``gpipe train`` on it, what ``make demo`` runs (:mod:`gpipe.demo`).
- ``gpipe schedule``, ``corpus``, ``vocab``, ``prepare``: the small commands (:mod:`gpipe.commands`).

The top of the applications: it imports the commands, and nothing imports it. A command is imported
only when it runs, so ``gpipe schedule`` loads neither SentencePiece nor sacrebleu nor transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from gpipe import threads
from gpipe.commands.args import ArgumentParser, UsageError, refuse

__all__ = ["COMMANDS", "command_parser", "main", "run"]

COMMANDS = {
    "train": "train the paper's Transformer or AmoebaNet-D, or a Hugging Face causal LM, pipelined (see -h)",
    "sweep": "search gpipe train's settings with Optuna: SPACE.toml's trials, pruned, one after another (see -h)",
    "runs": "the runs under some folders (a sweep's trials) side by side: settings and results (see -h)",
    "eval": "evaluate a run's checkpoints apart from training: once, or --watch as they come (see -h)",
    "translate": "translate sentences with a checkpoint of gpipe train --data DIR (see -h)",
    "generate": "continue prompts with a checkpoint of gpipe train --model hf on text (see -h)",
    "export": "write a checkpoint of gpipe train --model hf as a transformers model folder (see -h)",
    "bench": "reproduce the paper's tables here, beside peers; a markdown report (see -h)",
    "schedule": "generate, validate and simulate a schedule; draw its timeline",
    "demo": "the translation workflow on the built-in synthetic corpus: gpipe corpus, then gpipe train (see -h)",
    "corpus": "write the built-in synthetic multilingual corpus as parallel text files",
    "prepare": "tokenize a folder of language pairs once into memory-mapped arrays for gpipe train (see -h)",
    "vocab": "train one SentencePiece vocabulary for every language pair of a data directory",
}


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="gpipe", description="GPipe pipeline-parallel training on PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help in COMMANDS.items():
        sub.add_parser(name, help=help, add_help=False)
    return parser


def _command(name: str) -> Callable[[Sequence[str]], int]:
    """The command's entry point, imported now that it runs."""
    if name == "train":
        from gpipe.train import main
    elif name == "sweep":
        from gpipe.sweep import main
    elif name == "runs":
        from gpipe.runs import main
    elif name == "eval":
        from gpipe.evaluator import main
    elif name == "translate":
        from gpipe.translate import main
    elif name == "generate":
        from gpipe.generate import main
    elif name == "export":
        from gpipe.export import main
    elif name == "bench":
        from gpipe.bench import main
    elif name == "schedule":
        from gpipe.commands.schedule import main
    elif name == "demo":
        from gpipe.demo import main
    elif name == "corpus":
        from gpipe.commands.corpus import main
    elif name == "prepare":
        from gpipe.commands.prepare import main
    else:
        from gpipe.commands.vocab import main
    return main


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``gpipe NAME`` (what ``gpipe NAME -h`` prints): the command module's own ``_parser()``.
    The documentation's command-line reference is drawn from it (docs/_ext/gpipe_cli.py)."""
    module = importlib.import_module(_command(name).__module__)
    parser: argparse.ArgumentParser = module._parser()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe``: run the command ``argv[0]`` with the rest of ``argv``; its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _command(_parser().parse_args(argv[:1]).command)(argv[1:])
    except UsageError as exc:  # a bad flag or setting: one line, status 2 (the big commands print their own)
        return refuse(exc)


def run() -> NoReturn:
    """The ``gpipe`` program (and ``python -m gpipe``): :func:`main`, whose status the process exits
    with, even should one of gpipe's threads not end in time (:func:`gpipe.threads.exiting`)."""
    sys.exit(threads.exiting(main()))


if __name__ == "__main__":
    run()
