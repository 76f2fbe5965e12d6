"""Prepared data: what ``gpipe prepare`` writes (:mod:`gpipe.data.prepare`) and
:class:`PreparedCorpus`, which trains from it with memory that does not grow with the corpus.

A prepared folder holds ``manifest.json`` (the pairs, their sentences, tokens and length histograms,
the vocabulary's hash, the settings and the source files' sizes), ``vocab.model`` (the shared
SentencePiece vocabulary), ``heldout.json`` (each pair's held-out sentences, as ids, and their
references), and per language pair ``NAME.tok`` (the pieces of every sentence pair, source then target,
without EOS; uint16, or uint32 past 65,536 pieces), ``NAME.off`` (int64: where each sentence pair
starts, and the end) and ``NAME.len`` (uint32: each source's length), its sentence pairs sorted stably
by length (:mod:`gpipe.data.batches`). The arrays are memory-mapped read-only: every process on a
machine shares the page cache's one copy, and a batch reads only its own sentences."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpipe.data.base import EOS, PAD, entropy
from gpipe.data.batches import DrawnPairs, Draws
from gpipe.data.corpus import detokenize, held_out_set
from gpipe.data.files import find_pairs
from gpipe.data.integrity import Blocks, PreparedError, check_open
from gpipe.data.text import SAMPLE_PROMPT, CausalBatch, decode_text
from gpipe.recipe import temperature_sampling
from gpipe.rng import derive_seed

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "PreparedCorpus",
    "PreparedError",
    "PreparedText",
    "file_digest",
    "is_prepared",
    "read_manifest",
    "source_fingerprint",
]

FORMAT, VERSION, MANIFEST = "gpipe-prepared", 1, "manifest.json"


def is_prepared(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder ``gpipe prepare`` wrote (it has a manifest)."""
    return (Path(path) / MANIFEST).is_file()


def file_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_fingerprint(root: Path) -> dict[str, list[int]]:
    """The pair files of folder ``root`` (and its ``eval/``) with their sizes and modification times
    (ns): a prepared cache of the folder is stale once they change."""
    found = {}
    for folder, where in ((root, ""), (root / "eval", "eval/")):
        if folder.is_dir():
            for pair in find_pairs(folder).values():
                for path in pair.files:
                    stat = path.stat()
                    found[where + path.name] = [stat.st_size, stat.st_mtime_ns]
    return found


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A prepared folder's manifest, checked for its format and version."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise PreparedError(f"cannot read {str(file)!r}: {exc}; prepare the data again (gpipe prepare)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PreparedError(f"{str(file)!r} is not a manifest of gpipe prepare")
    if manifest.get("version") != VERSION:
        raise PreparedError(
            f"{str(file)!r} is of format version {manifest.get('version')}, this gpipe reads {VERSION}: prepare the "
            "data again with this version (gpipe prepare)"
        )
    return manifest


class PreparedCorpus(DrawnPairs):
    """The language pairs of a prepared folder, with the batches of
    :class:`~gpipe.data.ParallelCorpus` on the same files (the same sentences, held out and drawn
    alike, so the same batches): training pairs with a side longer than ``length`` tokens are left
    out (a prefix of each pair's sorted sentences; :attr:`skipped` counts them), pairs are drawn with
    temperature T, and the held-out sentences are those ``gpipe prepare`` took out (cut to ``length``
    tokens). Memory: the manifest's counts and the held-out sentences, not the corpus.

    Pickles without its arrays (a DataLoader worker maps them again)."""

    def __init__(
        self, path: str | os.PathLike[str], *, length: int = 64, temperature: float = 5.0, seed: int = 0
    ) -> None:
        if length < 2:
            raise ValueError(f"PreparedCorpus needs length >= 2 (length: {length})")
        self.path = Path(path)
        self.manifest = manifest = read_manifest(self.path)
        if manifest.get("kind") != "pairs":
            raise PreparedError(f"{str(self.path)!r} holds {manifest.get('kind')!r} data, not language pairs")
        if (problem := check_open(self.path, manifest)) is not None:
            raise PreparedError(problem)
        self.length_cap, self.seed, self.dtype = length, seed, np.dtype(manifest["dtype"])
        vocab = self.path / manifest["vocab"]["file"]
        if not vocab.is_file():
            raise PreparedError(f"{str(vocab)!r} is missing: prepare the data again (gpipe prepare)")
        self.vocab_path = vocab
        self.names = sorted(manifest["pairs"])
        self.tags = {name: int(manifest["pairs"][name]["tag"]) for name in self.names}
        histograms, self.skipped = [], {}
        for name in self.names:
            lengths = manifest["pairs"][name]["lengths"]
            kept = lengths[: length + 1]
            self.skipped[name] = sum(lengths) - sum(kept)
            if not sum(kept):
                raise ValueError(
                    f"pair {name}: every training sentence pair has a side longer than {length} tokens; raise the "
                    "length (--max-length)"
                )
            histograms.append(kept)
        sizes = [sum(h) for h in histograms]
        self.draws = Draws(temperature_sampling(sizes, temperature), histograms, length)
        try:
            held = json.loads((self.path / "heldout.json").read_text())
        except (OSError, ValueError) as exc:
            raise PreparedError(f"cannot read {str(self.path / 'heldout.json')!r}: {exc}") from None
        self.sets = {
            name: held_out_set(
                name,
                [[*s, EOS] for s in held[name]["source"]],
                [[*t, EOS] for t in held[name]["target"]],
                held[name]["references"],
                self.tags[name],
                length,
            )
            for name in self.names
        }
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._vocab: Any = None
        self._blocks = [
            Blocks(self.path, name, int(manifest["pairs"][name]["tokens"]), manifest["pairs"][name]["lengths"])
            for name in self.names
        ]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None, "_vocab": None}

    def _pair_arrays(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._arrays is None:
            self._arrays = {}
        arrays = self._arrays.get(name)
        if arrays is None:
            base = self.path / name
            try:
                arrays = (
                    np.memmap(f"{base}.tok", dtype=self.dtype, mode="r"),
                    np.memmap(f"{base}.off", dtype=np.int64, mode="r"),
                    np.memmap(f"{base}.len", dtype=np.uint32, mode="r"),
                )
            except (OSError, ValueError) as exc:
                raise PreparedError(f"cannot map the arrays of pair {name} in {str(self.path)!r}: {exc}") from None
            self._arrays[name] = arrays
        return arrays

    def lengths(self, pair: int, index: int) -> tuple[int, int]:
        _, offsets, sources = self._pair_arrays(self.names[pair])
        self._blocks[pair].check(offsets, sources, index)  # (its block, the first time it is read)
        source = int(sources[index])
        return source + 1, int(offsets[index + 1]) - int(offsets[index]) - source + 1

    def sentence(self, pair: int, index: int) -> tuple[list[int], list[int]]:
        tokens, offsets, sources = self._pair_arrays(self.names[pair])
        self._blocks[pair].check(offsets, sources, index)
        start, end, split = int(offsets[index]), int(offsets[index + 1]), int(sources[index])
        ids = tokens[start:end].tolist()
        return [*ids[:split], EOS], [*ids[split:], EOS]

    @property
    def vocab_model(self) -> Any:
        """The shared SentencePiece vocabulary (:class:`~gpipe.data.vocab.Vocab`), loaded when first used."""
        if self._vocab is None:
            from gpipe.data.vocab import Vocab

            self._vocab = Vocab(self.vocab_path)
        return self._vocab

    @property
    def vocab(self) -> int:
        return int(self.manifest["vocab"]["size"])

    @property
    def length(self) -> int:
        """The most tokens of a side (EOS included)."""
        return self.length_cap

    def detokenize(self, ids: Sequence[int]) -> str:
        return detokenize(self.vocab_model, ids)


class PreparedText:
    """The documents of a text file prepared by ``gpipe prepare --data TEXT``, with
    :class:`~gpipe.data.text.TextLines`' batches of the same file and tokenizer (the same held-out
    tenth, the same rows drawn): ``BOS pieces EOS`` cut at ``length`` + 1 tokens (or the longest
    document's, if shorter), padded with id 0. The baseline is the unigram entropy of the training
    documents' targets, counted whole when prepared. Memory: none per document; the tokenizer (the
    prepared folder's copy) loads when first used."""

    unit = "tokens"
    baseline_name = "unigram entropy"

    def __init__(self, path: str | os.PathLike[str], *, length: int = 64, seed: int = 0) -> None:
        self.path = Path(path)
        self.manifest = manifest = read_manifest(self.path)
        if manifest.get("kind") != "text":
            raise PreparedError(
                f"{str(self.path)!r} holds {manifest.get('kind')!r} data, not the text of a causal LM (gpipe prepare "
                "--data TEXT_FILE makes it)"
            )
        if (problem := check_open(self.path, manifest)) is not None:
            raise PreparedError(problem)
        self.seed, self.dtype = seed, np.dtype(manifest["dtype"])
        self.length = min(length, int(manifest["longest"]) - 1)
        self.bos, self.eos = manifest["tokenizer"]["bos"], manifest["tokenizer"]["eos"]
        self.sizes = {"train": int(manifest["train"]), "eval": int(manifest["eval"])}
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
        self._tokenizer: Any = None
        self._blocks: dict[str, Blocks] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None, "_tokenizer": None}

    @property
    def vocab(self) -> int:
        return int(self.manifest["tokenizer"]["size"])

    @property
    def tokenizer(self) -> Any:
        """The tokenizer the text was read with (the prepared folder's copy of its files)."""
        if self._tokenizer is None:
            from gpipe.data.tokenizer import of_checkpoint

            self._tokenizer = of_checkpoint(self.path)
            if self._tokenizer is None:
                raise PreparedError(f"{str(self.path)!r} holds no tokenizer files: prepare the text again")
        return self._tokenizer

    def document(self, split: str, index: int) -> list[int]:
        """Document ``index`` of ``split``: ``BOS pieces EOS``, whole."""
        if self._arrays is None:
            self._arrays = {}
        if split not in self._arrays:
            try:
                self._arrays[split] = (
                    np.memmap(self.path / f"{split}.tok", dtype=self.dtype, mode="r"),
                    np.memmap(self.path / f"{split}.off", dtype=np.int64, mode="r"),
                )
            except (OSError, ValueError) as exc:
                raise PreparedError(f"cannot map the {split} documents of {str(self.path)!r}: {exc}") from None
        tokens, offsets = self._arrays[split]
        if split not in self._blocks:
            self._blocks[split] = Blocks(self.path, split, len(tokens), None, int(self.manifest["longest"]))
        self._blocks[split].check(offsets, None, index)
        ids: list[int] = tokens[int(offsets[index]) : int(offsets[index + 1])].tolist()
        return ids

    def _row(self, split: str, index: int) -> list[int]:
        ids = self.document(split, index)[: self.length + 1]
        return ids + [PAD] * (self.length + 1 - len(ids))

    def batch(self, size: int, step: int, *, split: str = "train") -> CausalBatch:
        if split not in self.sizes:
            raise ValueError(f"split must be one of {sorted(self.sizes)} (split: {split!r})")
        g = torch.Generator().manual_seed(derive_seed(self.seed, 0 if split == "train" else 1, step))
        picked = torch.randint(0, self.sizes[split], (size,), generator=g).tolist()
        rows = torch.tensor([self._row(split, i) for i in picked])
        return CausalBatch(rows[:, :-1], rows[:, 1:])

    def baseline(self) -> float:
        """The unigram entropy (nats) of the training documents' targets (all their tokens but the first)."""
        counts = np.load(self.path / "unigram.npy")
        return entropy(Counter({i: int(c) for i, c in enumerate(counts.tolist()) if c}))

    def sample_prompt(self) -> list[int]:
        """As :meth:`~gpipe.data.text.TextLines.sample_prompt`: the first held-out document's first half."""
        document = self._row("eval", 0)
        document = [i for i in document if i != PAD]
        if self.eos is not None and document and document[-1] == self.eos:
            document = document[:-1]
        return document[: max(1, min(SAMPLE_PROMPT, len(document) // 2))]

    def text(self, ids: Sequence[int]) -> str:
        return decode_text(self.tokenizer, ids)
