"""``gpipe prepare --data DIR --out PREPARED``: every language pair of a folder tokenized once into
memory-mapped token arrays with an offsets index (:mod:`gpipe.data.prepare`), which
``gpipe train --data PREPARED`` reads with memory that does not grow with the corpus. A text file, a
document a line, is prepared alike for ``gpipe train --model hf`` (:mod:`gpipe.data.prepare_text`), and
instruction or chat records (``.jsonl``, or a folder of them) with their answers marked and fitted to
``--max-length`` (:mod:`gpipe.data.prepare_records`).

    gpipe prepare --data corpus/ --out corpus.prepared --workers 4
    gpipe train --data corpus.prepared --batch-tokens 4096
    gpipe prepare --data text.txt --out text.prepared --tokenizer tokenizer.json
    gpipe train --model hf --data text.prepared
    gpipe prepare --data chats.jsonl --out chats.prepared --tokenizer qwen-hf/ --max-length 1024
    gpipe train --model hf --init qwen-hf/ --data chats.prepared --max-length 1024 --pack
    gpipe prepare --verify corpus.prepared                 # every file against its checksum, and its structure

The files are streamed (never held whole), the shared SentencePiece vocabulary is trained on a
bounded, seeded sample (or ``--vocab`` is used), each pair's held-out sentences are taken out as
``gpipe train --data DIR`` takes them (``DIR/eval/``, else a seeded tenth, at most ``--held-out``), and
everything is written beside ``PREPARED`` and renamed into place at the end. A bad line (no single tab,
not UTF-8, an empty side) is refused with its file and line, or skipped and counted with ``--skip-bad``.
``PREPARED/manifest.json`` says what was prepared: pairs, sentences, tokens, lengths, the vocabulary's
hash, and every file's size and SHA-256. A reader checks the files' sizes and the offsets' ends when
it opens the folder, and each block of offsets and lengths the first time a batch reads it
(:mod:`gpipe.data.integrity`); ``--verify`` checks it whole: the checksums, every offset and length
against the manifest, every token id against the vocabulary."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gpipe.commands.args import ArgumentParser, positive, refuse

__all__ = ["main"]


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="gpipe prepare",
        description=__doc__.replace("``", "") if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--verify",
        metavar="PREPARED",
        help="check a prepared folder whole instead (its files against their checksums, offsets, lengths and token "
        "ids against its manifest): exit status 1 with each problem found",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="a folder of pair files (xx-yy.tsv, or xx-yy.xx + xx-yy.yy), or a text file, a document a line, or "
        "instruction or chat records (FILE.jsonl or a folder of them; for gpipe train --model hf)",
    )
    p.add_argument("--out", metavar="PREPARED", help="the folder to write (new, or with --overwrite)")
    p.add_argument(
        "--vocab", metavar="PATH", help="a folder: the SentencePiece .model to use (default: train one on a sample)"
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a text file: a tokenizer.json (or its folder) or a SentencePiece .model to read it with (default: train "
        "a SentencePiece vocabulary on a sample of its lines)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        metavar="N",
        help="pieces of the vocabulary trained, refused if the sample cannot make as many (default 0: as many as it "
        "supports, up to 8000)",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=1_000_000,
        metavar="N",
        help="sentence pairs drawn (at --temperature) to train the vocabulary on, at most (default: 1000000)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=5.0,
        metavar="T",
        help="the vocabulary sample's pair temperature (default: 5)",
    )
    p.add_argument(
        "--held-out",
        type=int,
        default=100,
        metavar="N",
        help="held-out sentences per pair without a file in DIR/eval (at most a tenth; default: 100)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=256,
        metavar="N",
        help="records: the most tokens of a row (a longer record's prompt is cut from the start; default: 256)",
    )
    p.add_argument("--chat-template", metavar="PATH", help="records: a Jinja chat template (default: the tokenizer's)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the held-out sentences and the sample (default: 0)")
    p.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        metavar="N",
        help="processes that read and encode (default: the cores, at most 4; 1: this process alone)",
    )
    p.add_argument("--skip-bad", action="store_true", help="skip and count bad lines instead of refusing them")
    p.add_argument("--overwrite", action="store_true", help="replace the prepared data already in --out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe prepare``; a bad flag raises :class:`UsageError` (one line from :mod:`gpipe.cli`)."""
    args = _parser().parse_args(argv)
    if args.verify is not None:
        return _verify(args.verify, [a for a in ("data", "out", "vocab", "tokenizer") if getattr(args, a)])
    if args.data is None or args.out is None:
        return refuse("gpipe prepare needs --data and --out (or --verify PREPARED to check a prepared folder)")
    positive(args, "sample", "temperature", "held_out", "workers")
    if args.vocab_size < 0:
        return refuse(f"--vocab-size must be 0 or more (got {args.vocab_size})")
    if args.vocab and args.vocab_size:
        return refuse("--vocab brings its own vocabulary and --vocab-size sizes one to train: give one of them")
    from gpipe.data.records import is_records

    if Path(args.data).exists() and is_records(args.data):
        return _records(args)
    if args.chat_template:
        return refuse(f"--chat-template renders chat records (--data FILE.jsonl; --data {args.data!r} is not)")
    text = Path(args.data).is_file()
    if not text and not Path(args.data).is_dir():
        return refuse(f"--data {args.data!r}: no such folder or file")
    if args.tokenizer and not text:
        return refuse(f"--tokenizer reads a text file's documents (--data {args.data!r} is a folder): use --vocab")
    if args.vocab and text:
        return refuse(f"--vocab is the shared vocabulary of a folder of language pairs (--data {args.data!r} is a "
                      "text file): use --tokenizer")  # fmt: skip
    if args.tokenizer and args.vocab_size:
        return refuse("--tokenizer brings its own vocabulary and --vocab-size sizes one to train: give one of them")
    try:
        if text:
            from gpipe.data.prepare_text import prepare_text

            out = prepare_text(args.data, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                               sample=args.sample, seed=args.seed, workers=args.workers, skip_bad=args.skip_bad,
                               overwrite=args.overwrite)  # fmt: skip
        else:
            from gpipe.data.prepare import prepare

            out = prepare(args.data, args.out, vocab=args.vocab, vocab_size=args.vocab_size,
                          temperature=args.temperature, sample=args.sample, held_out=args.held_out, seed=args.seed,
                          workers=args.workers, skip_bad=args.skip_bad, overwrite=args.overwrite)  # fmt: skip
    except (ValueError, ImportError) as exc:
        return refuse(exc)
    except OSError as exc:  # no permission, a full disk: the old --out is intact
        return refuse(f"cannot write --out {args.out!r}: {exc.strerror or exc}; it is left as it was")
    from gpipe.data.prepared import read_manifest

    manifest = read_manifest(out)
    seconds = max(manifest["seconds"], 1e-9)
    if text:
        print(f"wrote {out}: {manifest['documents']} documents ({manifest['train']} training, {manifest['eval']} "
              f"held out), {manifest['tokens']} tokens, {manifest['tokenizer']['size']} tokens in the vocabulary, in "
              f"{manifest['seconds']:.1f} s ({manifest['documents'] / seconds:.0f} documents/s, {args.workers} "
              "worker(s))")  # fmt: skip
        if manifest["bad_lines"]:
            print(f"skipped bad lines: {sum(manifest['bad_lines'].values())} (manifest.json: by kind)")
        return 0
    print(f"wrote {out}: {len(manifest['pairs'])} language pairs, {manifest['sentences']} sentence pairs, "
          f"{manifest['tokens']} tokens, {manifest['vocab']['size']} pieces, in {manifest['seconds']:.1f} s "
          f"({manifest['sentences'] / seconds:.0f} sentence pairs/s, {args.workers} worker(s))")  # fmt: skip
    bad = {name: sum(e["bad_lines"].values()) for name, e in manifest["pairs"].items() if e["bad_lines"]}
    if bad:
        print(f"skipped bad lines: {', '.join(f'{name} {n}' for name, n in bad.items())} (manifest.json: by kind)")
    return 0


def _records(args: argparse.Namespace) -> int:
    """``gpipe prepare --data FILE.jsonl``: instruction or chat records."""
    from gpipe.data.prepare_records import prepare_records
    from gpipe.data.prepared import read_manifest

    if not args.tokenizer:
        return refuse(f"--data {args.data!r} holds instruction records, read with the model's own tokenizer: give "
                      "--tokenizer (a tokenizer.json or its folder)")  # fmt: skip
    if args.vocab or args.vocab_size:
        return refuse("--vocab and --vocab-size are for language pairs and text: records are read with --tokenizer")
    if args.max_length < 2:
        return refuse(f"--max-length must be at least 2 (got {args.max_length})")
    try:
        out = prepare_records(args.data, args.out, tokenizer=args.tokenizer, chat_template=args.chat_template,
                              max_length=args.max_length, seed=args.seed, workers=args.workers,
                              skip_bad=args.skip_bad, overwrite=args.overwrite)  # fmt: skip
    except (ValueError, ImportError) as exc:
        return refuse(exc)
    except OSError as exc:
        return refuse(f"cannot write --out {args.out!r}: {exc.strerror or exc}; it is left as it was")
    manifest = read_manifest(out)
    print(f"wrote {out}: {manifest['records']} records ({manifest['train']} training, {manifest['eval']} held out), "
          f"{manifest['tokens']} tokens, {manifest['cut']} cut to --max-length {args.max_length}, in "
          f"{manifest['seconds']:.1f} s ({args.workers} worker(s))")  # fmt: skip
    if manifest["bad_records"]:
        print(f"skipped bad records: {sum(manifest['bad_records'].values())} (manifest.json: by kind)")
    return 0


def _verify(folder: str, others: list[str]) -> int:
    """``--verify``: 0 when ``folder`` is intact, 1 with each problem (a line each) when it is not."""
    from gpipe.data.integrity import verify
    from gpipe.data.prepared import PreparedError, is_prepared, read_manifest

    if others:
        return refuse(f"--verify checks a prepared folder alone: leave out --{' --'.join(others)}")
    if not is_prepared(folder):
        return refuse(f"--verify {folder!r} is not prepared data (no manifest.json): give a folder gpipe prepare wrote")
    try:
        problems = verify(Path(folder), read_manifest(folder), print)
    except PreparedError as exc:  # (its manifest)
        problems = [str(exc)]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        print(f"gpipe prepare --verify: {folder!r} is damaged: prepare the data again (gpipe prepare --overwrite)",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"{folder}: intact")
    return 0
