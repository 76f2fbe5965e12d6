"""``gpipe prepare --data TEXT``: a text file, one document a line (``gpipe train --model hf``'s text),
tokenized once into memory-mapped arrays that :class:`~gpipe.data.prepared.PreparedText` reads with
:class:`~gpipe.data.text.TextLines`' batches, in the format of :mod:`gpipe.data.prepare`.

The file is streamed: counted (bad lines refused with their number, or skipped and counted), its
tokenizer given (``tokenizer``: a ``tokenizer.json`` or a SentencePiece ``.model``, copied in) or a
SentencePiece vocabulary trained on a seeded sample of at most ``sample`` lines (the lines
``gpipe train`` would train it on), then encoded in chunks by ``workers`` processes: each document
``BOS pieces EOS`` (the tokenizer's own). The documents are written in the order of ``TextLines``'
seeded permutation: its held-out tenth into ``eval.tok`` / ``eval.off``, the others into ``train.tok``
/ ``train.off``, with the training targets' unigram counts in ``unigram.npy``. Placing them needs
8 bytes a document while preparing; training needs none."""

from __future__ import annotations

import concurrent.futures
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpipe.data.base import PAD
from gpipe.data.files import PairFiles as _Files
from gpipe.data.files import Position, record_batches
from gpipe.data.prepare import _count, _results, _say, _texts, train_vocabulary, write_prepared
from gpipe.data.prepared import FORMAT, VERSION, file_digest
from gpipe.rng import derive_seed

__all__ = ["prepare_text"]

_BATCH = 2048
_TOKENIZERS: dict[str, Any] = {}  # a worker's tokenizer, loaded once


def _tokenizer(folder: str) -> Any:
    from gpipe.data.tokenizer import of_checkpoint

    found = _TOKENIZERS.get(folder)
    if found is None:
        found = _TOKENIZERS[folder] = of_checkpoint(Path(folder))
    return found


def _encode_chunk(files: _Files, start: Position, stop: Position | None, folder: str, dtype: str, skip_bad: bool,
                  prefix: str) -> dict[str, Any]:  # fmt: skip
    """Encode the documents from ``start`` to ``stop`` into ``prefix.tok`` (``BOS pieces EOS`` each) and
    ``prefix.len`` (uint32 lengths)."""
    tokenizer = _tokenizer(folder)
    first = [] if tokenizer.bos is None else [tokenizer.bos]
    last = [] if tokenizer.eos is None else [tokenizer.eos]
    lengths: list[int] = []
    with open(f"{prefix}.tok", "wb") as out:
        for batch in record_batches(files, start, stop, skip_bad=skip_bad, size=_BATCH):
            for (index, line, _), ids in zip(batch, tokenizer.encode_lines([line for _, line, _ in batch])):
                if PAD in ids:
                    raise ValueError(
                        f"the tokenizer reads document {index + 1} of {str(files.files[0])!r} (its non-blank line "
                        f"{index + 1}: {line[:60]!r}) with id {PAD}, which is gpipe's padding, left out of the loss; "
                        f"give a tokenizer whose id {PAD} is a special token the text does not produce, such as a pad "
                        "token"
                    )
                document = [*first, *ids, *last]
                lengths.append(len(document))
                out.write(np.asarray(document, dtype=dtype).tobytes())
    np.asarray(lengths, dtype=np.uint32).tofile(f"{prefix}.len")
    return {"documents": len(lengths)}


def prepare_text(
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    vocab_size: int = 0,
    sample: int = 1_000_000,
    seed: int = 0,
    workers: int = 1,
    skip_bad: bool = False,
    overwrite: bool = False,
    say: Callable[[str], None] = _say,
) -> Path:
    """Prepare the text file ``data`` (a document a line) into folder ``out``; returns ``out``.
    ``tokenizer``: a ``tokenizer.json`` (or its folder) or a SentencePiece ``.model``; else a
    vocabulary of ``vocab_size`` pieces (0: as many as the text supports, up to 8000) is trained. A
    ``ValueError`` names a bad line or setting; ``out`` is left as it was."""
    if sample < 1 or workers < 1 or vocab_size < 0:
        raise ValueError(
            f"prepare_text needs sample and workers >= 1 and vocab_size >= 0 (sample: {sample}, workers: {workers}, "
            f"vocab_size: {vocab_size})"
        )
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a text file")
    loaded = None
    if tokenizer is not None:
        from gpipe.data import tokenizer as tokenizers

        loaded = tokenizers.load(tokenizer)

    def build(pool: concurrent.futures.Executor, scratch: Path) -> dict[str, Any]:
        files = _Files.document_file(path)
        say(f"counting the documents of {path}")
        counts, marks = _count(files, skip_bad)
        if counts.records < 2:
            raise ValueError(
                f"{str(path)!r} holds {counts.records} document(s); at least 2 are needed (train and eval)"
            )
        if loaded is not None:
            from gpipe.data import tokenizer as tokenizers

            for name, source in tokenizers.checkpoint_files(loaded).items():
                shutil.copyfile(source, scratch / name)
        else:
            _train_vocab(files, counts.records, scratch, size=vocab_size, sample=sample, seed=seed, skip_bad=skip_bad,
                         say=say)  # fmt: skip
        made = _tokenizer(str(scratch))
        _TOKENIZERS.pop(str(scratch))  # (the workers load their own)
        dtype = "uint16" if made.size <= 2**16 else "uint32"
        say(f"encoding {counts.records} documents with {made.size} tokens")
        prefixes, futures = [], []
        for k, start in enumerate(marks):
            stop = marks[k + 1] if k + 1 < len(marks) else None
            prefixes.append(str(scratch / "chunks" / f"text.{k}"))
            futures.append(pool.submit(_encode_chunk, files, start, stop, str(scratch), dtype, skip_bad, prefixes[-1]))
        _results(futures)
        entry = _assemble(prefixes, counts.records, scratch, dtype, seed, made.size)
        say(f"  {entry['train']} training and {entry['eval']} held-out documents, {entry['tokens']} tokens")
        files_kept = sorted(p.name for p in scratch.iterdir() if p.name in ("vocab.model", "tokenizer.json",
                                                                            "tokenizer_config.json"))  # fmt: skip
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": "text",
            "dtype": dtype,
            "tokenizer": {
                "files": files_kept,
                "size": made.size,
                "bos": made.bos,
                "eos": made.eos,
                "sha256": file_digest(scratch / files_kept[0]),
            },
            "documents": counts.records,
            **entry,
            "blank_lines": counts.blank,
            "bad_lines": dict(counts.bad),
            "settings": {
                "seed": seed,
                "sample": sample,
                "vocab_size": vocab_size,
                "skip_bad": skip_bad,
                "tokenizer": str(tokenizer) if tokenizer else "",
            },
        }

    return write_prepared(Path(out), build, workers=workers, overwrite=overwrite)


def _train_vocab(files: _Files, documents: int, scratch: Path, *, size: int, sample: int, seed: int, skip_bad: bool,
                 say: Callable[[str], None]) -> None:  # fmt: skip
    """A SentencePiece vocabulary trained on the lines ``gpipe train`` trains one on: all, or a seeded
    sample of ``sample`` of them, in the sample's order."""
    picks = list(range(documents)) if documents <= sample else random.Random(seed).sample(range(documents), sample)
    found = _texts(files, sorted(set(picks)), skip_bad)  # (one pass, up to the last line picked)
    train_vocabulary([found[i][0] for i in picks], scratch / "vocab.model", size=size, seed=seed, tags=[],
                     what=f"{len(picks)} lines", say=say)  # fmt: skip


def _assemble(prefixes: list[str], documents: int, folder: Path, dtype: str, seed: int, vocab: int) -> dict[str, Any]:
    """The documents into their splits, in the order of TextLines' permutation: its first tenth (at least
    one) held out."""
    lengths = np.concatenate([np.fromfile(f"{p}.len", dtype=np.uint32) for p in prefixes]).astype(np.int64)
    order = torch.randperm(documents, generator=torch.Generator().manual_seed(derive_seed(seed, 8, 0))).numpy()
    held = max(documents // 10, 1)
    place = np.empty(documents, dtype=np.int64)  # document i is the place[i]-th of the permutation
    place[order] = np.arange(documents)
    unigram = np.zeros(vocab, dtype=np.int64)
    split = {}
    for name, first, stop in (("eval", 0, held), ("train", held, documents)):
        sizes = lengths[order[first:stop]]
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        np.asarray(offsets, dtype=np.int64).tofile(folder / f"{name}.off")
        tokens = np.memmap(folder / f"{name}.tok", dtype=dtype, mode="w+", shape=(max(int(offsets[-1]), 1),))
        split[name] = (first, stop, offsets, tokens)
    begin = 0
    for prefix in prefixes:
        ids = np.fromfile(f"{prefix}.tok", dtype=dtype)
        size = lengths[begin : begin + len(np.fromfile(f"{prefix}.len", dtype=np.uint32))]
        places = place[begin : begin + len(size)]
        starts = np.cumsum(size) - size
        for name, (first, stop, offsets, tokens) in split.items():
            chosen = (places >= first) & (places < stop)
            if not chosen.any():
                continue
            count = size[chosen]
            source = np.repeat(starts[chosen], count) + (
                np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
            )
            target = np.repeat(offsets[places[chosen] - first], count) + (source - np.repeat(starts[chosen], count))
            tokens[target] = ids[source]
            if name == "train":  # the targets: every token but a document's first
                mask = np.ones(len(source), dtype=bool)
                mask[np.cumsum(count) - count] = False
                unigram += np.bincount(ids[source][mask].astype(np.int64), minlength=vocab)[:vocab]
        begin += len(size)
        for suffix in (".tok", ".len"):
            os.unlink(prefix + suffix)
    for _, _, _, tokens in split.values():
        tokens.flush()
    np.save(folder / "unigram.npy", unigram)
    histogram = np.bincount(lengths).tolist()
    return {"train": documents - held, "eval": held, "tokens": int(lengths.sum()), "longest": int(lengths.max()),
            "lengths": histogram}  # fmt: skip
