"""``gpipe vocab --data DIR``: one SentencePiece vocabulary for every language pair in DIR (the kind
``gpipe train --data DIR`` trains, to give it with ``--vocab``), and each pair's share of the data
and of the sample.

    gpipe vocab --data corpus/                            # as many pieces as the text supports: corpus/vocab.model
    gpipe vocab --data corpus/ --size 8000 --out shared   # exactly 8000 pieces: shared.model, shared.vocab
    gpipe train --data corpus/ --vocab shared.model       # a run with it
    gpipe vocab --data new-pairs/ --extend runs/base/checkpoints/step-00001000/vocab.model --out grown

The text is sampled with temperature T=5, the paper's (pair l, holding D_l sentence pairs, drawn with
p ∝ (D_l/ΣD)^(1/T)), so low-resource pairs get more of the vocabulary than their share of the data;
character coverage 0.999995, a ``<2xx>`` piece per target language xx, fixed ids for pad, bos, eos
and unk (0 to 3). Without ``--size``: as many pieces as the sampled text supports, up to 32000 (said
when fewer); ``--size N`` is exact, and refused, naming the most that works, when the text cannot
make N. ``--extend BASE.model`` trains nothing: BASE, every id kept, with the tags of DIR's target
languages it lacks appended, for fine-tuning a run on new pairs (``gpipe train --init RUN --vocab
PREFIX.model``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gpipe.commands.args import ArgumentParser, description, positive, refuse

__all__ = ["main"]

_SIZE = 32000  # the most pieces when --size is left out
_SAMPLE = 1_000_000  # the most sentence pairs drawn when --sample is left out (as gpipe train)


def _parser() -> ArgumentParser:
    v = ArgumentParser(prog="gpipe vocab", description=description(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    v.add_argument("--data", required=True, help="a directory of pair files: xx-yy.tsv, or xx-yy.xx + xx-yy.yy")
    v.add_argument(
        "--size",
        type=int,
        help=f"pieces in the vocabulary, refused if the text cannot make as many (default: as many as it supports, "
        f"up to {_SIZE})",
    )
    v.add_argument("--out", help="model prefix: writes PREFIX.model and PREFIX.vocab (default: DATA/vocab)")
    v.add_argument(
        "--temperature", type=float, default=5.0, help="sample pairs with p ∝ (D/ΣD)^(1/T) (default: 5, the paper's)"
    )
    v.add_argument(
        "--sample",
        type=int,
        help="sentence pairs drawn to train on (default: as many as the data holds, up to 1e6, as gpipe train draws)",
    )
    v.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    v.add_argument(
        "--extend",
        metavar="BASE.model",
        help="instead of training: BASE (the vocabulary of a run to fine-tune on DATA with gpipe train --init RUN "
        "--vocab PREFIX.model) with the tags of DATA's target languages it lacks appended, every id of BASE kept",
    )
    return v


def _unwritable(prefix: str) -> str | None:
    """Why the files of model prefix ``prefix`` cannot be written, found before any work (None: they can)."""
    try:
        above = next((p for p in Path(prefix).parents if p.exists()), None)
    except OSError as exc:
        return f"--out {prefix!r} cannot be reached: {exc.strerror or exc}"
    if above is not None and not above.is_dir():
        return f"--out {prefix!r} is inside {str(above)!r}, which is a file; name a prefix in a folder"
    folder = next((f"{prefix}{end}" for end in (".model", ".vocab") if Path(f"{prefix}{end}").is_dir()), None)
    if folder is not None:
        return f"--out {prefix!r} would write the file {folder!r}, which is a folder; name another prefix"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe vocab``; a bad flag raises :class:`UsageError` (one line from :mod:`gpipe.cli`)."""
    args = _parser().parse_args(argv)
    positive(args, *(name for name in ("size", "sample", "temperature") if getattr(args, name) is not None))
    out = args.out or str(Path(args.data) / "vocab")
    if (why := _unwritable(out)) is not None:
        return refuse(why)
    from gpipe.data import vocab as vocabulary

    if args.extend:
        return _extend(args, out)
    size = args.size or _SIZE
    try:
        pairs = vocabulary.read_pairs(args.data)
        shares = vocabulary.pair_probabilities(pairs, args.temperature)
        total = sum(len(p) for p in pairs.values())
        sample = args.sample or min(_SAMPLE, total)
        model = vocabulary.train_vocab(pairs, out, size=size, exact=args.size is not None,
                                       temperature=args.temperature, sample=sample, seed=args.seed)  # fmt: skip
    except vocabulary.VocabSizeError as exc:
        return refuse(f"{exc}; or leave --size out for as many as the text supports")
    except (ValueError, ImportError) as exc:
        return refuse(exc)
    except OSError as exc:  # a folder that cannot be made, no permission, a full disk
        return refuse(f"cannot write --out {out!r}: {exc.strerror or exc}")
    print(f"{len(pairs)} language pairs, {total} sentence pairs; {sample} drawn with temperature {args.temperature:g}:")
    for name, p in pairs.items():
        print(f"  {name:<12} {len(p):>9} pairs  {len(p) / total:7.2%} of the data  {shares[name]:7.2%} of the sample")
    pieces = vocabulary.Vocab(model).size
    if pieces < size:
        print(f"note: the sampled text supports only {pieces} pieces (--size left out: up to {size}); the "
              f"vocabulary has {pieces}", file=sys.stderr)  # fmt: skip
    print(f"wrote {model} ({pieces} pieces)")
    return 0


def _extend(args: argparse.Namespace, out: str) -> int:
    """``--extend BASE``: BASE with the tags of the data's new target languages appended."""
    from gpipe.data import vocab as vocabulary
    from gpipe.data.files import find_pairs

    if args.size is not None or args.sample is not None:
        return refuse("--extend keeps BASE's pieces and adds tags: leave --size and --sample out")
    try:
        languages = sorted({p.tgt for p in find_pairs(args.data).values()})  # (none: refused, naming the files)
        base = vocabulary.Vocab(args.extend)
        model = vocabulary.extend_vocab(base.path, languages, out)
    except ValueError as exc:
        return refuse(exc)
    except OSError as exc:
        return refuse(f"cannot write --out {out!r}: {exc.strerror or exc}")
    new = sorted(set(languages) - set(base.languages))
    added = f"the tags of {', '.join(new)} appended (ids {base.size} to {base.size + len(new) - 1})" if new else (
        "nothing appended: it has a tag for every target language of the data")  # fmt: skip
    print(f"wrote {model}: {base.path}'s {base.size} pieces, {added}")
    return 0
