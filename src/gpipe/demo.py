"""``gpipe demo``: the paper's translation workflow on the built-in synthetic corpus, what ``make demo`` runs.

    gpipe demo                                 # the corpus in runs/demo-corpus, the run in runs/demo
    gpipe demo --steps 500 --partitions 4      # any other flag goes to gpipe train (gpipe train -h)

writes the four synthetic language pairs as text files (``gpipe corpus --out CORPUS``), then trains on
them (``gpipe train --data CORPUS --vocab-size 270 --out OUT``): a shared SentencePiece vocabulary of
the 270 pieces the corpus supports (as many as ``gpipe vocab --data CORPUS`` makes), the Transformer on
2 pipeline stages (on the GPUs where there are: ``--devices``) for 200 steps with the pairs drawn at
temperature T=5, BLEU per pair at the end. Each run starts afresh (an earlier run in OUT is replaced),
unless ``--resume``.
"""

# An application: runs two others, gpipe corpus (gpipe.commands) and gpipe train (gpipe.train); only
# the command line (gpipe.cli) imports it.

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from gpipe.commands import corpus
from gpipe.commands.args import ArgumentParser, UsageError
from gpipe.train import main as train_main
from gpipe.train import parse

__all__ = ["main"]

VOCAB_SIZE = 270
"""Pieces of the demo's vocabulary: the most the built-in corpus supports (``gpipe vocab --data CORPUS``
without ``--size`` makes as many), so that nearly every word is one piece, the 150-sentence pair's too."""


def _parser() -> ArgumentParser:
    d = ArgumentParser(
        prog="gpipe demo",
        description=__doc__.replace("``", "") if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation is gpipe train's to expand
    )
    d.add_argument("--corpus", default="runs/demo-corpus", help="where the corpus is written (default: %(default)s)")
    d.add_argument("--out", default="runs/demo", help="the run's output directory (default: %(default)s)")
    return d


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe demo``; a bad flag, the demo's or gpipe train's, raises :class:`UsageError` before any
    work starts (one line from :mod:`gpipe.cli`)."""
    args, rest = _parser().parse_known_args(argv)
    given = [a for a in rest if a.split("=")[0] in ("--data", "--vocab")]
    if given:
        raise UsageError(
            f"gpipe demo trains on its own corpus (--corpus) and vocabulary ({given[0]} given); "
            "for your data, run gpipe train --data FOLDER"
        )
    train_argv = ["--data", args.corpus, "--vocab-size", str(VOCAB_SIZE), "--out", args.out, *rest]
    if "--resume" not in rest:
        train_argv.append("--overwrite")  # a demo is run again and again: each run replaces the last
    corpus_folder = Path(args.corpus)
    if corpus_folder.exists() and not corpus_folder.is_dir():
        raise UsageError(f"--corpus {args.corpus!r} is a file; name a folder (it is created if missing)")
    # gpipe train's flags are checked against the corpus folder, which must exist for that: created
    # here, and removed again (with the folders made for it) when a flag is refused.
    made = [p for p in (corpus_folder, *corpus_folder.parents) if not p.exists()]
    corpus_folder.mkdir(parents=True, exist_ok=True)
    try:
        parse(train_argv)
    except BaseException:
        for folder in made:
            folder.rmdir()
        raise
    return demo(args.corpus, train_argv)


def demo(corpus_folder: str, train_argv: list[str]) -> int:
    """Write the corpus into ``corpus_folder``, then run ``gpipe train train_argv`` (checked) on it."""
    status = corpus.main(["--out", corpus_folder])
    return status or train_main(train_argv)
