"""``gpipe generate``: continue prompts with a checkpoint of ``gpipe train --model hf``.

    gpipe generate --checkpoint runs/lm < prompts.txt > continuations.txt
    echo "the cat" | gpipe generate --checkpoint runs/lm --max-new-tokens 20
    gpipe generate --checkpoint runs/lm --input prompts.txt --beam 4
    echo "where is the cat?" | gpipe generate --checkpoint runs/chat --chat --system "Answer briefly."
    gpipe generate --checkpoint runs/lm --input prompts.txt --sample --temperature 0.8 --top-p 0.9 --seed 1
    torchrun --nproc-per-node 2 -m gpipe generate --checkpoint runs/lm --partitions 2 --input prompts.txt

``--checkpoint``: a run's ``--out`` (its newest checkpoint), its ``checkpoints`` folder, or one
``step-*`` folder, of a run that read text (``--data`` a text file): each checkpoint keeps the
model's ``config.json`` and the run's tokenizer beside the weights, which load into ``--partitions``
stages whatever the number the run trained with.

Input: one prompt a line (stdin, or ``--input``), read with the run's tokenizer as training read a
document (its start token first, when it has one); a blank line is refused. With ``--chat`` each line
is a user's turn (after a system turn, ``--system TEXT``), rendered with the run's chat template and
its generation prompt, as training rendered chats: the model writes the assistant's answer. Output: each prompt's
continuation on the same line number (stdout, or ``--output``, written whole or not at all): the new
tokens only, up to the end-of-document token, as text (a line break in it reads as a space, so that
line numbers stay aligned). ``--max-new-tokens``: at most that many, and a prompt that leaves too
few of the model's positions for them is refused; without it, at most 32 and no more than the
positions left after the longest prompt of the prompts decoded together.

Decoding is greedy (the default), beam search (``--beam N``), or sampling (``--sample``, with
``--temperature``, ``--top-k``, ``--top-p``), as transformers' ``generate`` chooses tokens, through
the pipeline's stages (``Pipeline.generate``): each stage keeps its layers' keys and values, and
``--groups`` groups of ``--batch`` prompts are in flight at once (default: one group per stage, so
that every stage works); prompts of similar lengths go together, left-padded. ``--seed``: every
prompt draws from a random stream of its own, so that the same prompts, ``--batch`` and ``--groups``
give the same text whatever ``--partitions``. Under torchrun every rank decodes and rank 0 writes.
Progress (prompts, new tokens/s) and the caches' memory per stage go to standard error
(``--quiet``: none).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpipe.balance import balance_by_flops
from gpipe.commands.args import ArgumentParser, UsageError, refuse
from gpipe.distributed import choose_devices
from gpipe.pipeline import Pipeline
from gpipe.saving import CheckpointError, load
from gpipe.translate import (
    _input,
    _write,
    add_io_flags,
    add_stage_flags,
    find_checkpoint,
    report_cache_bytes,
    start_devices,
)

__all__ = ["Generator", "Options", "main"]

# transformers' generate's sampling defaults
TEMPERATURE, TOP_K, TOP_P = 1.0, 50, 1.0
NEW_TOKENS = 32
"""The most new tokens without ``--max-new-tokens`` (fewer where the model's positions end)."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """How :meth:`Generator.generate` chooses the tokens: greedy (``beam`` 1, no ``sample``), beam
    search, or sampling (None: transformers' defaults); checked by :meth:`check` with the flags' names."""

    max_new_tokens: int | None = None  # None: NEW_TOKENS, fewer where the model's positions end
    beam: int = 1
    sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def check(self) -> None:
        """One :class:`UsageError` for the first bad setting, naming it and the fix."""
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if self.beam < 1:
            raise UsageError(f"--beam must be positive (got {self.beam}); 1 is greedy")
        given = [f"--{n}" for n in ("temperature", "top-k", "top-p", "seed")
                 if getattr(self, n.replace("-", "_")) is not None]  # fmt: skip
        if not self.sample and given:
            one = len(given) == 1
            raise UsageError(
                f"{', '.join(given)} {'applies' if one else 'apply'} to --sample only: add --sample, or leave "
                f"{'it' if one else 'them'} out"
            )
        if self.sample and self.beam > 1:
            raise UsageError(f"--beam {self.beam} with --sample: beam sampling is not supported; choose one of them")
        if self.temperature is not None and not self.temperature > 0:
            raise UsageError(
                f"--temperature must be > 0 (got {self.temperature}); for the most likely tokens leave --sample out"
            )
        if self.top_k is not None and self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (got {self.top_k}); 0 keeps every token")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1] (got {self.top_p}); 1 keeps every token")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be in [0, 2**32) (got {self.seed})")

    def settings(self, call: int) -> dict[str, Any]:
        """``Pipeline.generate``'s arguments for the ``call``-th group of prompts (each call its own seed)."""
        if not self.sample:
            return {"num_beams": self.beam}
        return {
            "do_sample": True,
            "temperature": TEMPERATURE if self.temperature is None else self.temperature,
            "top_k": TOP_K if self.top_k is None else self.top_k,
            "top_p": TOP_P if self.top_p is None else self.top_p,
            "seed": None if self.seed is None else self.seed + call,
        }


class Generator:
    """A checkpoint's causal LM as cached pipeline layers (:func:`gpipe.generation.traced.cached_layers`)
    in a :class:`~gpipe.Pipeline` of ``partitions`` stages on ``devices`` (``--devices``), with the run's
    tokenizer. Under torchrun, ``partitions`` is the world size, one stage per rank. The run is read
    here (its config and tokenizer: what the prompts and settings are checked against); the model is
    traced, its pipeline built and the weights loaded at the first :meth:`generate`."""

    def __init__(self, checkpoint: str | os.PathLike[str], *, partitions: int = 1, devices: str = "auto") -> None:
        from gpipe.data import tokenizer as tokenizers
        from gpipe.export import _config, _run_model
        from gpipe.models.hf import layer_count

        self.folder = find_checkpoint(checkpoint)
        kind = _run_model(self.folder)
        if kind != "hf":
            other = " (for a translation run: gpipe translate)" if kind == "transformer" else ""
            raise UsageError(
                f"--checkpoint {str(checkpoint)!r} is of a --model {kind} run: gpipe generate continues text with "
                f"runs of gpipe train --model hf{other}"
            )
        try:  # (a tokenizer file or a config that does not read, transformers missing: one line each)
            tokenizer = tokenizers.of_checkpoint(self.folder)
            if tokenizer is None:
                raise UsageError(
                    f"--checkpoint {str(checkpoint)!r} is of a run that read token ids, not text (the built-in "
                    "corpus, or source<TAB>target lines), and keeps no tokenizer: gpipe generate needs a run of "
                    "gpipe train --model hf --data TEXT (a text file, a document a line)"
                )
            self.config = _config(self.folder)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.tokenizer = tokenizer
        self.vocab = int(self.config.vocab_size)
        most = getattr(self.config, "max_position_embeddings", None)  # (GPT-2's n_positions too)
        self.positions: int | None = most if isinstance(most, int) else None
        # Training ended every document with the tokenizer's end (the config's, if it names one, is the same).
        eos = tokenizer.eos if tokenizer.eos is not None else self.config.eos_token_id
        self.eos: set[int] = {eos} if isinstance(eos, int) else set(eos or ())
        if partitions > layer_count(self.config):
            raise UsageError(f"--partitions {partitions} exceeds the model's {layer_count(self.config)} layers")
        try:  # (checked now; the process group starts with the pipeline)
            choose_devices(devices, partitions)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.partitions, self.devices = partitions, devices
        self.pipe: Pipeline | None = None
        self.step: int | None = None

    def _pipeline(self) -> Pipeline:
        """The pipeline of the checkpoint's weights (built at the first call)."""
        if self.pipe is not None:
            return self.pipe
        from gpipe.data.tokenizer import _transformers
        from gpipe.generation.traced import cached_layers
        from gpipe.models.lora import LORA, add_adapters, read_lora

        with torch.device("meta"):
            model = _transformers().AutoModelForCausalLM.from_config(
                self.config, trust_remote_code=False, dtype=torch.float32
            )
        if (self.folder / LORA).is_file():  # a run with --lora: its checkpoints hold the adapters beside the weights
            try:
                settings = read_lora(self.folder)
                names = settings.target_modules
                targets = [names] if isinstance(names, str) else sorted(names or [])
                add_adapters(model, rank=int(settings.r), targets=targets, alpha=settings.lora_alpha)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        try:
            layers = cached_layers(model)
        except ValueError as exc:
            raise UsageError(
                f"{str(self.folder)!r}: the run's model cannot generate through a pipeline: {exc}"
            ) from None
        if self.partitions > len(layers):
            raise UsageError(f"--partitions {self.partitions} exceeds the model's {len(layers)} layers")
        placed = start_devices(self.devices, self.partitions)
        sample = torch.zeros(1, min(4, self.positions or 4), dtype=torch.long)
        balance = balance_by_flops(self.partitions, layers, sample, state_bytes=4)  # (the weights alone: no training)
        self.pipe = Pipeline(layers, balance, chunks=1, devices=placed)
        self.step = load(self.pipe, self.folder)
        self.pipe.eval()
        return self.pipe

    def encode(
        self, lines: Sequence[str], options: Options, *, where: str = "the input", chat: bool = False,
        system: str | None = None,
    ) -> list[list[int]]:  # fmt: skip
        """Each line's prompt ids (the tokenizer's start token, then the text's; with ``chat``, the
        line as a user's turn after ``system``'s, rendered with the run's chat template); a
        :class:`UsageError` naming the first line that is blank or too long for the model's
        positions with ``options.max_new_tokens`` new tokens (without: one)."""
        start = [] if self.tokenizer.bos is None else [self.tokenizer.bos]
        for number, line in enumerate(lines, 1):
            if not line.strip():
                raise UsageError(f"line {number} of {where} is empty: give one prompt a line, none blank")
        if chat:
            from gpipe.data.chat import Encoder

            encoder, first = Encoder(self.tokenizer), [("system", system)] if system else []
            try:
                prompts = [encoder.prompt([*first, ("user", line)]) for line in lines]
            except ValueError as exc:  # (no template; a template that refuses the turns)
                raise UsageError(f"--chat: {exc}") from None
        else:
            prompts = [[*start, *ids] for ids in self.tokenizer.encode_lines(list(lines))]
        most, new = self.positions, options.max_new_tokens or 1
        for number, ids in enumerate(prompts, 1):
            if most is None or len(ids) + new <= most:
                continue
            if len(ids) >= most:
                raise UsageError(
                    f"line {number} of {where}: a prompt of {len(ids)} tokens leaves none of the model's {most} "
                    f"positions for new tokens: shorten it to at most {most - 1} tokens"
                )
            raise UsageError(  # (only with --max-new-tokens: the default fits into the positions left)
                f"line {number} of {where}: a prompt of {len(ids)} tokens and --max-new-tokens {new} make "
                f"{len(ids) + new} positions, more than the model's {most}: lower --max-new-tokens to "
                f"{most - len(ids)}, or shorten the prompt"
            )
        return prompts

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        options: Options,
        *,
        batch: int = 16,
        groups: int | None = None,
        progress: bool = False,
    ) -> list[str]:
        """The continuations of ``prompts`` (ids, from :meth:`encode`) as text, in their order:
        ``groups`` (default: one per stage) groups of ``batch`` prompts in flight per
        ``Pipeline.generate``, prompts of similar lengths together, left-padded;
        at most ``options.max_new_tokens`` new tokens, or without it :data:`NEW_TOKENS` and no more
        than the model's positions leave after the longest prompt of the call."""
        if not prompts:
            return []
        pipe = self._pipeline()
        groups = groups or pipe.engine.placement.num_stages
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths together
        calls = [order[first : first + groups * batch] for first in range(0, len(order), groups * batch)]
        placement = pipe.engine.placement
        report = _Report(len(prompts)) if progress and placement.holds(placement.num_stages - 1) else None
        out = [""] * len(prompts)
        for call, rows in enumerate(calls):
            width = max(len(prompts[i]) for i in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]) :] = 1
            new = options.max_new_tokens or min(NEW_TOKENS, (self.positions or NEW_TOKENS + width) - width)
            sequences = pipe.generate(
                ids, attention_mask=mask, max_new_tokens=new, groups=min(groups, len(rows)),
                eos_token_id=sorted(self.eos) or None, **options.settings(call),
            )  # fmt: skip
            made = 0
            for i, row in zip(rows, sequences[:, width:].tolist()):
                cut = next((t for t, token in enumerate(row) if token in self.eos), len(row))
                made += cut
                out[i] = " ".join(self.text(row[:cut]).splitlines())
            if report is not None:
                report.call_done(len(rows), made, pipe)
        if report is not None:
            report.close()
        return out

    def text(self, ids: Sequence[int]) -> str:
        """``ids`` read with the run's tokenizer (an id beyond it reads ``<id N>``)."""
        from gpipe.data.text import decode_text

        return decode_text(self.tokenizer, ids)


class _Report:
    """Prompts done and new tokens/s as the calls finish; the caches' peak bytes per stage at the end."""

    def __init__(self, prompts: int) -> None:
        from gpipe.train.progress import progress

        self.bar = progress(prompts, desc="generating", unit="prompt")
        self.tokens, self.start = 0, time.perf_counter()
        self.cache_bytes: dict[int, int] = {}

    def call_done(self, prompts: int, tokens: int, pipe: Pipeline) -> None:
        self.tokens += tokens
        elapsed = time.perf_counter() - self.start
        self.bar.set_postfix(tokens_per_s=f"{self.tokens / elapsed:.0f}" if elapsed > 0 else "-")
        self.bar.update(prompts)
        trace = pipe.last_decode
        for stage, size in (trace.cache_bytes if trace is not None else {}).items():
            self.cache_bytes[stage] = max(size, self.cache_bytes.get(stage, 0))

    def close(self) -> None:
        self.bar.close()
        report_cache_bytes(self.cache_bytes, "generated")


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="gpipe generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_io_flags(parser, "prompts", "continuations")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"new tokens per prompt, at most (default: {NEW_TOKENS}, or fewer where the model's positions end)",
    )
    parser.add_argument("--beam", type=int, default=1, help="beam size; 1: greedy (default: 1)")
    parser.add_argument("--sample", action="store_true", help="sample the tokens instead of choosing the likeliest")
    parser.add_argument("--temperature", type=float, help=f"--sample: divide the logits by it (default: {TEMPERATURE})")
    parser.add_argument("--top-k", type=int, help=f"--sample: draw among the k likeliest; 0: all (default: {TOP_K})")
    parser.add_argument(
        "--top-p",
        type=float,
        help=f"--sample: draw among the likeliest tokens holding p of the mass (default: {TOP_P})",
    )
    parser.add_argument("--seed", type=int, help="--sample: each prompt's own random stream (default: unseeded)")
    parser.add_argument("--batch", type=int, default=16, help="prompts per group (default: 16)")
    parser.add_argument(
        "--chat", action="store_true", help="each line a user's turn, rendered with the run's chat template"
    )
    parser.add_argument("--system", metavar="TEXT", help="--chat: a system turn before each user's")
    add_stage_flags(parser, "groups of prompts in flight")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe generate``; a bad flag, checkpoint or prompt is one line ``error: ...``, status 2."""
    try:
        args = _parser().parse_args(argv)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        partitions = args.partitions if args.partitions is not None else world
        for name, value in (("batch", args.batch), ("partitions", partitions), ("groups", args.groups)):
            if value is not None and value <= 0:
                raise UsageError(f"--{name} must be positive (got {value})")
        options = Options(max_new_tokens=args.max_new_tokens, beam=args.beam, sample=args.sample,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)  # fmt: skip
        options.check()
        if args.system is not None and not args.chat:
            raise UsageError("--system adds a system turn to --chat's prompts: give --chat too, or leave it out")
        if world > 1 and partitions != world:
            raise UsageError(f"--partitions {partitions} differs from the {world} processes of torchrun")
        if args.input is not None and not Path(args.input).is_file():
            raise UsageError(f"--input {args.input!r}: no such file")
        with contextlib.suppress(ImportError):  # (what goes to standard error is the report: no bars of transformers')
            importlib.import_module("transformers").utils.logging.disable_progress_bar()
        generator = Generator(args.checkpoint, partitions=partitions, devices=args.devices)
        if options.beam > generator.vocab:
            raise UsageError(
                f"--beam {options.beam} exceeds the model's vocabulary of {generator.vocab} tokens: give at most "
                f"{generator.vocab}"
            )
        with _input(args.input) as f:
            try:
                lines = f.read().splitlines()
            except UnicodeDecodeError as exc:
                raise UsageError(f"{args.input or 'standard input'} is not UTF-8 text: {exc}") from None
        where = f"--input {args.input!r}" if args.input is not None else "standard input"
        prompts = generator.encode(lines, options, where=where, chat=args.chat, system=args.system)
        texts = generator.generate(prompts, options, batch=args.batch, groups=args.groups, progress=not args.quiet)
        if not dist.is_initialized() or dist.get_rank() == 0:
            _write(args.output, [t + "\n" for t in texts])
    except (UsageError, CheckpointError) as exc:
        return refuse(exc)
    return 0
