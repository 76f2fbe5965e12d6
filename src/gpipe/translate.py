"""``gpipe translate``: translate sentences with a checkpoint of ``gpipe train --data FOLDER``.

    gpipe translate --checkpoint runs/mt --to de < sentences.txt > translations.txt
    gpipe translate --checkpoint runs/mt/checkpoints/step-00001000 --input test.en --beam 4
    echo "<2fr> a sentence" | gpipe translate --checkpoint runs/mt
    torchrun --nproc-per-node 2 -m gpipe translate --checkpoint runs/mt --partitions 2 --input test.en
    gpipe translate --checkpoint runs/mt --partitions 2 --devices cuda:0 --input test.en  # both stages on one GPU

``--checkpoint``: a run's ``--out`` (its newest checkpoint), its ``checkpoints`` folder, or one
``step-*`` folder. Each checkpoint holds what rebuilds the model: ``run.json`` (the training
settings, the vocabulary's size, the longest sentence) and ``vocab.model`` (the shared
SentencePiece vocabulary), beside the weights; the weights load into ``--partitions`` stages
whatever the number the run trained with.

Input: one sentence a line (stdin, or ``--input``); output: its translation on the same line
number (stdout, or ``--output``); a blank line stays blank. The target language is a line's leading
tag ``<2xx>``, else ``--to``, else the only language the model knows. Sources longer than the run's
``--max-length`` are cut to it; a translation has at most twice the source's tokens + 10 (and at
most ``--max-length``). Decoding is beam search (``--beam``, GNMT's length penalty
``--length-penalty``), or greedy with ``--beam 1``, through the pipeline's stages
(:mod:`gpipe.decode`): each stage keeps its layers' keys and values, and ``--groups`` batches of
``--batch`` sentences are in flight at once (default: one per stage, so that every stage works);
under torchrun every rank decodes and rank 0 writes. Progress (sentences, tokens/s) and the caches'
memory per stage go to standard error (``--quiet``: none).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from gpipe.balance import balance_by_flops
from gpipe.commands.args import ArgumentParser, UsageError, refuse
from gpipe.data import EOS, PAD
from gpipe.data.vocab import Vocab
from gpipe.decode import decode_batches
from gpipe.distributed import choose_devices, init_from_env
from gpipe.evaluation import translation_chunk
from gpipe.pipeline import Pipeline
from gpipe.runfile import RunFileError, read_run
from gpipe.saving import CheckpointError, find, load, write_atomically

__all__ = ["Translator", "find_checkpoint", "main"]

VOCAB = "vocab.model"
_TAG = re.compile(r"^\s*<2([A-Za-z0-9_]+)>\s*")


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint folder ``path`` names: itself (a ``step-*`` folder), the newest of a
    ``checkpoints`` folder, or the newest of a run's ``OUT/checkpoints``. Raises ``UsageError``."""
    root = Path(path)
    try:
        found = find(root)
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint {str(path)!r}: {exc}") from None
    if found is not None:
        return found
    if not root.exists():
        raise UsageError(f"--checkpoint {str(path)!r}: no such folder")
    raise UsageError(
        f"--checkpoint {str(path)!r} holds no checkpoint of gpipe train: give a run's --out, its checkpoints "
        "folder, or a step-* folder"
    )


_NEEDS = "gpipe translate needs a run of gpipe train --data FOLDER (a folder of parallel files)"
_NO_VOCAB = "with no vocabulary to read sentences with; " + _NEEDS
_RUNS = {  # what a run that gpipe translate cannot read is, by its --model and the kind of its data
    ("hf", "CausalPairs"): "a causal language model (gpipe train --model hf) trained on language pairs as token "
    "ids (the built-in corpus, or source<TAB>target lines), " + _NO_VOCAB,
    ("transformer", "SyntheticTranslation"): "a translation model trained on the built-in corpus as token ids "
    "(no --data), " + _NO_VOCAB,
    ("transformer", "TextPairs"): "a translation model trained on one file of source<TAB>target lines as words "
    "split at white space, " + _NO_VOCAB,
}


def _not_a_translation_run(checkpoint: str, folder: Path, model: str, kind: str) -> str | None:
    """Why gpipe translate cannot read ``folder``, the checkpoint found for ``--checkpoint checkpoint``,
    of a ``--model model`` run on data of kind ``kind`` (None: it can)."""
    if model == "transformer" and kind in ("ParallelCorpus", "PreparedCorpus"):
        if (folder / VOCAB).is_file():
            return None
        return f"{str(folder)!r} keeps no {VOCAB}, the run's vocabulary, which gpipe translate reads sentences with"
    if model == "hf" and kind in ("TextLines", "PreparedText"):  # (a text file, or one gpipe prepare prepared)
        what = (
            "a causal language model (gpipe train --model hf) trained on text, which continues text rather than "
            f"translating it: continue prompts with gpipe generate --checkpoint {shlex.quote(checkpoint)}"
        )
    elif (model, kind) in _RUNS:
        what = _RUNS[model, kind]
    elif model == "amoebanet":
        what = f"an image classifier (gpipe train --model amoebanet); {_NEEDS}"
    else:
        what = f"a --model {model} run on {kind}; {_NEEDS}"
    return f"--checkpoint {checkpoint!r} is of {what}"


def start_devices(devices: str, partitions: int) -> list[torch.device] | None:
    """``--devices``: the devices of a decoding command's ``partitions`` stages
    (:func:`~gpipe.distributed.choose_devices`; None under torchrun, each rank on its own), the process
    group started on this rank's under torchrun. A bad one is a ``UsageError``."""
    try:
        placed = choose_devices(devices, partitions)
        init_from_env(devices=devices)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return placed


class Translator:
    """A checkpoint's translation model in a :class:`~gpipe.Pipeline` of ``partitions`` stages,
    with its vocabulary, on ``devices`` (``--devices``: :func:`start_devices`). Under torchrun,
    ``partitions`` is the world size, one stage per rank."""

    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        partitions: int = 1,
        groups: int | None = None,
        devices: str = "auto",
    ) -> None:
        from gpipe.train import TrainConfig, translation_model

        self.folder = find_checkpoint(checkpoint)
        try:
            run = read_run(self.folder)
        except RunFileError as exc:
            raise UsageError(str(exc)) from None
        settings, kind = dict(run["config"]), run.get("data")
        why = _not_a_translation_run(str(checkpoint), self.folder, str(settings.get("model", "transformer")), str(kind))
        if why is not None:
            raise UsageError(why)
        known = set(TrainConfig.__dataclass_fields__)
        self.config = TrainConfig(**{k: v for k, v in settings.items() if k in known})
        self.vocab = Vocab(self.folder / VOCAB)
        self.length = int(run["length"])
        if self.vocab.size != int(run["vocab"]):
            raise UsageError(
                f"{str(self.folder / VOCAB)!r} has {self.vocab.size} pieces, the model {run['vocab']}: not the "
                "run's vocabulary"
            )
        with torch.device("meta"):
            model = translation_model(self.config, self.vocab.size, self.length)
        layers = len(model)
        if partitions > layers:
            raise UsageError(f"--partitions {partitions} exceeds the model's {layers} layers")
        placed = start_devices(devices, partitions)
        sample = (torch.full((2, 4), 5), torch.full((2, 4), 5))
        self.pipe = Pipeline(model, balance_by_flops(partitions, model, sample), chunks=1, devices=placed)
        self.groups = groups
        self.step = load(self.pipe, self.folder)
        self.pipe.eval()

    def language(self, requested: str | None) -> str:
        """The target language: ``requested``, or the model's only one."""
        languages = self.vocab.languages
        if requested is None:
            if len(languages) != 1:
                raise UsageError(
                    f"the model translates into {', '.join(languages)}: say which with --to, or start each "
                    "line with its tag, e.g. <2" + languages[0] + ">"
                )
            return languages[0]
        if requested not in languages:
            raise UsageError(f"the model does not translate into {requested!r}; it knows {', '.join(languages)}")
        return requested

    def encode(self, line: str, to: str | None) -> tuple[list[int], int]:
        """A line's source ids (cut to the run's length, EOS last) and its target language's tag."""
        tag = _TAG.match(line)
        if tag is not None:
            line = line[tag.end() :]
        language = self.language(tag[1] if tag is not None else to)
        ids = [*self.vocab.encode(line)[: self.length - 1], EOS]
        return ids, self.vocab.tag(language)

    def translate(
        self,
        lines: Sequence[str],
        *,
        to: str | None = None,
        beam: int = 4,
        length_penalty: float = 0.6,
        batch: int = 32,
        progress: bool = False,
    ) -> list[str]:
        """The translations of ``lines`` (a blank line translates to a blank line). ``progress``:
        sentences done and tokens/s on standard error (a bar on a terminal), where the last stage
        runs."""
        encoded = {i: self.encode(line, to) for i, line in enumerate(lines) if line.strip()}
        out = [""] * len(lines)
        order = sorted(encoded, key=lambda i: len(encoded[i][0]))  # similar lengths batch together
        batches = [order[first : first + batch] for first in range(0, len(order), batch)]
        chunks = []
        for rows in batches:
            longest = max(len(encoded[i][0]) for i in rows)
            source = torch.tensor([[*encoded[i][0], *[PAD] * (longest - len(encoded[i][0]))] for i in rows])
            start = torch.tensor([encoded[i][1] for i in rows])
            chunks.append(translation_chunk(source, start, max_len=self.length))
        report = _Report(sum(len(rows) for rows in batches)) if progress and self._decides() else None
        decoded = decode_batches(
            self.pipe, chunks, beam=beam, length_penalty=length_penalty, groups=self.groups,
            on_batch=report.batch_done if report is not None else None,
        )  # fmt: skip
        if report is not None:
            report.close(self.pipe)
        for rows, ids in zip(batches, decoded):
            for i, row in zip(rows, ids.tolist()):
                out[i] = self.vocab.decode(row[: row.index(EOS)] if EOS in row else row)
        return out

    def _decides(self) -> bool:
        """Whether this process chooses the tokens (holds the last stage)."""
        return self.pipe.engine.placement.holds(self.pipe.engine.placement.num_stages - 1)


class _Report:
    """Sentences translated and tokens/s as the batches finish; the caches' peak bytes at the end."""

    def __init__(self, sentences: int) -> None:
        from gpipe.train.progress import progress

        self.bar = progress(sentences, desc="translating", unit="sentence")
        self.tokens, self.start = 0, time.perf_counter()

    def batch_done(self, index: int, tokens: torch.Tensor) -> None:
        self.tokens += int((tokens != PAD).sum())
        elapsed = time.perf_counter() - self.start
        self.bar.set_postfix(tokens_per_s=f"{self.tokens / elapsed:.0f}" if elapsed > 0 else "-")
        self.bar.update(tokens.size(0))

    def close(self, pipe: Pipeline) -> None:
        self.bar.close()
        trace = pipe.last_decode
        report_cache_bytes(trace.cache_bytes if trace is not None else {}, "translated")


def report_cache_bytes(cache_bytes: Mapping[int, int], done: str) -> None:
    """On stderr, the most bytes the caches of this process's stages held (nothing without caches)."""
    if cache_bytes:
        cached = ", ".join(f"stage {s}: {b / 2**20:.1f} MiB" for s, b in sorted(cache_bytes.items()))
        print(f"{done} with caches of at most {cached} (this process's stages)", file=sys.stderr)


def add_io_flags(parser: ArgumentParser, lines: str, results: str) -> None:
    """The flags of a command that decodes a run's checkpoint: the checkpoint, the file of ``lines``
    and the file of ``results``."""
    parser.add_argument("--checkpoint", required=True, help="a run's --out, its checkpoints folder, or a step-* folder")
    parser.add_argument("--input", help=f"a file of {lines}, one a line (default: standard input)")
    parser.add_argument("--output", help=f"the file to write the {results} to (default, or -: standard output)")


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="gpipe translate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_io_flags(parser, "sentences", "translations")
    parser.add_argument("--to", help="the target language of lines without a <2xx> tag (default: the model's only one)")
    parser.add_argument("--beam", type=int, default=4, help="beam size; 1: greedy (default: 4)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="alpha of the length penalty (default: 0.6)")
    parser.add_argument("--batch", type=int, default=32, help="sentences decoded together (default: 32)")
    add_stage_flags(parser, "batches decoded at once")
    return parser


def add_stage_flags(parser: ArgumentParser, groups: str) -> None:
    """The flags of a decoding command's pipeline: --partitions, --devices, --groups (``groups`` says what
    a group is), --quiet."""
    parser.add_argument(
        "--partitions", type=int, default=None, help="pipeline stages (default: 1; under torchrun, the world size)"
    )
    add_devices_flag(parser)
    parser.add_argument(
        "--groups", type=int, default=None, help=f"{groups}, each on another stage (default: one per stage)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress report on standard error")


def add_devices_flag(parser: ArgumentParser) -> None:
    """``--devices``, as gpipe train takes it."""
    parser.add_argument(
        "--devices", default="auto", metavar="DEVICES",
        help="where the stages run: auto (the visible GPUs round robin, under torchrun cuda:LOCAL_RANK; the CPU "
        "without CUDA), cpu, cuda (refused without CUDA), or cuda:0,cuda:1,...: one device, or one per stage "
        "(default: auto)",
    )  # fmt: skip


@contextlib.contextmanager
def _input(path: str | None) -> Iterator[IO[str]]:
    """The file ``path`` to read, or standard input."""
    if path is None:
        yield sys.stdin
        return
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise UsageError(f"cannot open {path!r}: {exc.strerror}") from None
    with f:
        yield f


def _write(path: str | None, lines: list[str]) -> None:
    """The translations to standard output (``path`` None or ``-``), or to the file ``path`` whole or not
    at all: written aside and renamed into place, so that a kill or a full disk leaves the file as it
    was (a device or a pipe is written in place, a symbolic link's target replaced:
    :func:`gpipe.saving.write_atomically`)."""
    if path is None or path == "-":
        try:
            sys.stdout.writelines(lines)
            sys.stdout.flush()
        except OSError as exc:
            raise UsageError(f"cannot write the output: {exc.strerror or exc}") from None
        return

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)

    try:
        write_atomically(Path(path), write)
    except OSError as exc:  # a full disk (NoSpaceError), a folder that is not there, no permission
        raise UsageError(f"cannot write --output {path!r}: {exc.strerror or exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe translate``; a bad flag, checkpoint or input line is one line ``error: ...``, status 2."""
    try:
        args = _parser().parse_args(argv)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        partitions = args.partitions if args.partitions is not None else world
        for name, value in (("beam", args.beam), ("batch", args.batch), ("partitions", partitions),
                            ("groups", args.groups)):  # fmt: skip
            if value is not None and value <= 0:
                raise UsageError(f"--{name} must be positive (got {value})")
        if not args.length_penalty >= 0:
            raise UsageError(f"--length-penalty must be >= 0 (got {args.length_penalty})")
        if world > 1 and partitions != world:
            raise UsageError(f"--partitions {partitions} differs from the {world} processes of torchrun")
        if args.input is not None and not Path(args.input).is_file():
            raise UsageError(f"--input {args.input!r}: no such file")
        translator = Translator(args.checkpoint, partitions=partitions, groups=args.groups, devices=args.devices)
        if args.to is not None:
            translator.language(args.to)
        with _input(args.input) as f:
            try:
                lines = f.read().splitlines()
            except UnicodeDecodeError as exc:
                raise UsageError(f"{args.input or 'standard input'} is not UTF-8 text: {exc}") from None
        translations = translator.translate(
            lines, to=args.to, beam=args.beam, length_penalty=args.length_penalty, batch=args.batch,
            progress=not args.quiet,
        )  # fmt: skip
        if not dist.is_initialized() or dist.get_rank() == 0:
            _write(args.output, [t + "\n" for t in translations])
    except (UsageError, CheckpointError) as exc:
        return refuse(exc)
    return 0
