"""``gpipe corpus --out DIR``: the built-in synthetic multilingual corpus written as parallel text files
(the layout ``gpipe train --data DIR`` reads), to try the translation workflow without data.

    gpipe corpus --out corpus/                     # 4 pairs of 20000, 4000, 800 and 150 sentence pairs
    gpipe corpus --out small/ --sizes 1500,300,60 --held-out 16 --seed 1
    gpipe vocab --data corpus/                     # then its shared vocabulary (270 pieces), or
    gpipe train --data corpus/ --out runs/mt       # train on it (gpipe demo runs corpus and train)

Pair p, ``xs-ya`` the first and largest, translates one source language xs into its own target
language (ya, yb, ...): ``DIR/xs-ya.tsv`` holds its sentence pairs, a ``source<TAB>target`` line each,
8 made-up words a side that translate word by word; ``DIR/eval/xs-ya.tsv`` its ``--held-out`` others
(training holds them out and scores BLEU on them). The same ``--sizes`` and ``--seed`` write the
same files.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from gpipe.commands.args import ArgumentParser, description, positive, refuse

__all__ = ["main"]


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes such as 20000,4000,800 (got {text!r})") from None
    if not 1 <= len(sizes) <= 26 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"give 1 to 26 positive sizes (got {text!r})")
    return sizes


def _parser() -> ArgumentParser:
    c = ArgumentParser(prog="gpipe corpus", description=description(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    c.add_argument("--out", required=True, help="the folder to write (created if missing)")
    c.add_argument("--sizes", type=_sizes, default=(20000, 4000, 800, 150),
                   help="sentence pairs of each language pair (default: 20000,4000,800,150)")  # fmt: skip
    c.add_argument(
        "--held-out", type=int, default=64, help="held-out sentence pairs per pair, in OUT/eval (default: 64)"
    )
    c.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return c


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe corpus``; a bad flag raises :class:`UsageError` (one line from :mod:`gpipe.cli`)."""
    args = _parser().parse_args(argv)
    positive(args, "held_out")
    from gpipe.data import SyntheticTranslation

    out = Path(args.out)
    try:
        above = next((p for p in (out, *out.parents) if p.exists()), None)
    except OSError as exc:
        return refuse(f"--out {args.out!r} cannot be reached: {exc.strerror or exc}")
    if above == out and not out.is_dir():
        return refuse(f"--out {args.out!r} is a file; name a folder (it is created if missing)")
    if above is not None and not above.is_dir():
        return refuse(f"--out {args.out!r} is inside {str(above)!r}, which is a file; name a folder")
    data = SyntheticTranslation(sizes=args.sizes, held_out=args.held_out, seed=args.seed)
    try:
        files = data.write(out)
    except OSError as exc:  # no permission, a full disk
        return refuse(f"cannot write --out {args.out!r}: {exc.strerror or exc}")
    for name, size in data.pair_sizes.items():
        print(f"  {name}: {size} sentence pairs, {args.held_out} held out")
    print(f"wrote {len(files)} files to {out}; next: gpipe train --data {out}")
    return 0
