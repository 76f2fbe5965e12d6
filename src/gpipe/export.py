"""``gpipe export``: a checkpoint of ``gpipe train --model hf`` as a transformers model folder.

    gpipe export --checkpoint runs/lm --out lm-hf
    gpipe export --checkpoint runs/lm/checkpoints/step-00000500 --out lm-hf --overwrite

``--checkpoint``: a run's ``--out`` (its newest checkpoint), its ``checkpoints`` folder, or one
``step-*`` folder. ``--out`` gets what ``save_pretrained`` writes: ``config.json`` (the run's model
config, kept in every checkpoint), ``model.safetensors`` (the checkpoint's weights, float32, put back
into the plain model with :func:`gpipe.saving.load_module`, whatever the run's ``--partitions``) and
``generation_config.json``; and the tokenizer when the run read text: its ``tokenizer.json``, or the
SentencePiece vocabulary it trained converted into one (``vocab.model`` beside it, the original). A run
started from pretrained weights (``--init``) is written in their dtype. A run with ``--lora`` gives its
adapter, a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``) for
``PeftModel.from_pretrained`` on the base model; with ``--merge``, the model with the adapters merged.
Then::

    model = transformers.AutoModelForCausalLM.from_pretrained("lm-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained("lm-hf")

``--out`` must be new or empty; ``--overwrite`` replaces a folder that holds something else, but
never one that holds the checkpoint or a run of ``gpipe train``. The folder is written aside and put
in place whole: a failure leaves ``--out`` as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpipe.commands.args import ArgumentParser, UsageError, refuse
from gpipe.models.lora import LORA
from gpipe.runfile import RUN, RunFileError, read_run
from gpipe.saving import CheckpointError, load_module
from gpipe.translate import find_checkpoint

__all__ = ["export", "main"]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="gpipe export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="a run's --out, its checkpoints folder, or a step-* folder")
    parser.add_argument("--out", required=True, help="the folder to write (created; it must be new or empty)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a run with --lora: write the model with the adapters merged into its weights (default: the adapter "
        "alone, a PEFT folder for PeftModel.from_pretrained on the base model)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out if it holds something (never the checkpoint's run, nor another run of gpipe train)",
    )
    return parser


def _run_model(folder: Path) -> str:
    """The ``--model`` of the run that wrote the checkpoint ``folder``."""
    try:
        model = read_run(folder)["config"].get("model")
    except RunFileError as exc:
        raise UsageError(str(exc)) from None
    if not isinstance(model, str):
        raise UsageError(f"{str(folder / RUN)!r} is not a run description of gpipe train: it names no 'model'")
    return model


def _check_out(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that is a file, that holds something (without ``--overwrite``), or that
    holds the checkpoint or a run of ``gpipe train``, which ``--overwrite`` would delete."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file; name a folder (it is created)")
    if checkpoint.resolve() in out.resolve().parents:
        raise UsageError(f"--out {str(out)!r} is inside the checkpoint being exported; give a folder outside it")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise UsageError(f"--out {str(out)!r} is inside {str(above)!r}, which is a file; name a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    held = sorted(p.name for p in out.iterdir())
    if not overwrite:
        raise UsageError(
            f"--out {str(out)!r} is not empty (it holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); "
            "give a new or empty folder, or add --overwrite to replace it"
        )
    resolved = out.resolve()
    if resolved == checkpoint.resolve() or resolved in checkpoint.resolve().parents:
        raise UsageError(f"--out {str(out)!r} holds the checkpoint being exported; give another folder")
    if (out / RUN).is_file() or (out / "checkpoints").is_dir():
        raise UsageError(
            f"--out {str(out)!r} holds a run of gpipe train, which --overwrite does not delete; give another folder"
        )


def _config(folder: Path) -> Any:
    """The transformers config the checkpoint ``folder`` keeps."""
    from gpipe.data.tokenizer import _transformers
    from gpipe.models.hf import CONFIG

    file = folder / CONFIG
    if not file.is_file():
        text = read_run(folder).get("data") == "TextLines"
        fix = (
            "it read its text as words split at white space, which no tokenizer repeats: train it again"
            if text
            else "run the training on (gpipe train --resume --out RUN --steps N, N above its last step) for a "
            "checkpoint with one"
        )
        raise UsageError(
            f"{str(folder)!r} holds no {CONFIG}: a checkpoint of a gpipe train older than gpipe export; {fix}"
        )
    transformers = _transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(file), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        detail = " ".join(str(exc).split())
        raise UsageError(f"cannot read {str(file)!r} as a transformers config: {detail}") from None


def export(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False, merge: bool = False
) -> str:
    """Write the checkpoint ``checkpoint`` of a ``--model hf`` run into ``out`` as a transformers
    model folder (see the module's docstring); returns what was written, in one line. A bad
    checkpoint or ``out`` raises :class:`UsageError` or ``CheckpointError``, naming it."""
    folder = find_checkpoint(checkpoint)
    model_kind = _run_model(folder)
    if model_kind != "hf":
        raise UsageError(
            f"--checkpoint {str(checkpoint)!r} is of a --model {model_kind} run: gpipe export writes transformers "
            "models, of runs of gpipe train --model hf"
        )
    target = Path(out)
    _check_out(target, folder, overwrite)
    config = _config(folder)
    if (folder / LORA).is_file():
        return _export_lora(folder, config, target, merge)
    if merge:
        raise UsageError(f"--merge: {str(folder)!r} is of a run without --lora, whose weights are whole already")
    from gpipe.data import tokenizer as tokenizers
    from gpipe.data.tokenizer import _transformers
    from gpipe.models.hf import export_dtype

    dtype = export_dtype(config)  # (float32, or the dtype the weights of a run started with --init came in)
    model = _transformers().AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    step = load_module(model, folder)
    if dtype is not None and dtype != torch.float32:
        model.to(dtype)
    tokenizer, source = tokenizers.exported(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.export-{os.getpid()}"
    try:
        model.save_pretrained(staging)
        if (folder / tokenizers.VOCAB).is_file():
            shutil.copyfile(folder / tokenizers.VOCAB, staging / tokenizers.VOCAB)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        _put_in_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    written = f"exported step {step} of {str(folder)!r} to {str(target)!r}: config.json, model.safetensors"
    if tokenizer is not None:
        return f"{written}, and the tokenizer ({source})"
    if (target / tokenizers.VOCAB).is_file():
        return (
            f"{written}, and {tokenizers.VOCAB}, the run's SentencePiece vocabulary, but no tokenizer transformers "
            f"loads: {source}; read it with sentencepiece.SentencePieceProcessor(model_file=...) and start a text "
            "with its <s> (id 1), as training did"
        )
    return f"{written}, and no tokenizer: {source}"


def _export_lora(folder: Path, config: Any, target: Path, merge: bool) -> str:
    """A checkpoint of a run with ``--lora``: its adapter as a PEFT folder (with the run's tokenizer),
    for the base model the run started from (``--init``), or with ``merge`` the model with the adapters
    merged into its weights (a transformers folder, in the source's dtype)."""
    from gpipe.data import tokenizer as tokenizers
    from gpipe.models import lora
    from gpipe.models.hf import export_dtype

    settings = read_run(folder)["config"]
    base = str(Path(settings["init"]).resolve()) if settings.get("init") else None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.export-{os.getpid()}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (transformers' deprecations, called by peft)
            dtype = export_dtype(config)
            written = lora.write_adapter(config, lora.read_lora(folder), folder, staging, merge=merge, base=base,
                                         dtype=dtype)  # fmt: skip
        tokenizer, _ = tokenizers.exported(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        _put_in_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written.replace(repr(str(staging)), repr(str(target)))


def _put_in_place(staging: Path, target: Path) -> None:
    """``staging`` becomes ``target``; an earlier ``target`` (checked by :func:`_check_out`) is moved
    aside first and deleted once the new one is there."""
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        os.replace(target, old)
    try:
        os.replace(staging, target)
    except OSError:
        if old.exists():
            os.replace(old, target)
        raise
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(old)


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe export``; a bad flag, checkpoint or ``--out`` is one line ``error: ...``, status 2."""
    try:
        args = _parser().parse_args(argv)
    except UsageError as exc:
        return refuse(exc)
    try:
        with contextlib.suppress(ImportError):  # (a command's output is its one line: no bars of transformers')
            importlib.import_module("transformers").utils.logging.disable_progress_bar()
        print(export(args.checkpoint, args.out, overwrite=args.overwrite, merge=args.merge))
    except (CheckpointError, ValueError) as exc:  # (UsageError too; ValueError: transformers or a tokenizer file)
        return refuse(exc)
    except OSError as exc:  # a folder that cannot be made, no permission, a full disk
        return refuse(f"cannot write --out {args.out!r}: {exc.strerror or exc}")
    return 0
