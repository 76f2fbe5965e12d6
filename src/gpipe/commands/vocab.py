"""``gpipe vocab --data DIR --size N``: one SentencePiece vocabulary for every language pair in DIR,
trained on text sampled with temperature T=5 (see :mod:`gpipe.data.vocab`), and each pair's share of
the data and of the sample."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpipe.commands.args import ArgumentParser, positive, refuse

__all__ = ["main"]


def _parser() -> ArgumentParser:
    v = ArgumentParser(prog="gpipe vocab")
    v.add_argument("--data", required=True, help="a directory of pair files: xx-yy.tsv, or xx-yy.xx + xx-yy.yy")
    v.add_argument("--size", type=int, default=32000, help="pieces in the vocabulary (default: 32000)")
    v.add_argument("--out", help="model prefix: writes PREFIX.model and PREFIX.vocab (default: DATA/vocab)")
    v.add_argument(
        "--temperature", type=float, default=5.0, help="sample pairs with p ∝ (D/ΣD)^(1/T) (default: 5, the paper's)"
    )
    v.add_argument("--sample", type=int, default=1_000_000, help="sentence pairs drawn to train on (default: 1e6)")
    v.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe vocab``; a bad flag raises :class:`UsageError` (one line from :mod:`gpipe.cli`)."""
    args = _parser().parse_args(argv)
    positive(args, "size", "sample", "temperature")
    from gpipe.data import vocab as vocabulary

    try:
        pairs = vocabulary.read_pairs(args.data)
        shares = vocabulary.pair_probabilities(pairs, args.temperature)
        out = args.out or str(Path(args.data) / "vocab")
        model = vocabulary.train_vocab(
            pairs, out, size=args.size, temperature=args.temperature, sample=args.sample, seed=args.seed
        )
    except (ValueError, ImportError) as exc:
        return refuse(exc)
    total = sum(len(p) for p in pairs.values())
    print(f"{len(pairs)} language pairs, {total} sentence pairs; sampled with temperature {args.temperature:g}:")
    for name, p in pairs.items():
        print(f"  {name:<12} {len(p):>9} pairs  {len(p) / total:7.2%} of the data  {shares[name]:7.2%} of the sample")
    print(f"wrote {model} ({vocabulary.Vocab(model).size} pieces)")
    return 0
