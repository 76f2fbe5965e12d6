"""``gpipe prepare --data FILE.jsonl --tokenizer DIR``: instruction or chat records (:mod:`gpipe.data.records`)
tokenized once into memory-mapped arrays that :class:`PreparedRecords` trains from, in the format
of :mod:`gpipe.data.prepare` (a manifest with every file's checksum, written aside and renamed).

The records are read in batches of lines, encoded and fitted to ``--max-length`` (a record's prompt
cut from the start, never an answer: :mod:`gpipe.data.instruct`) by ``workers`` processes, each with
the prepared folder's copy of the tokenizer and its chat template; a bad record is refused as
``file:line: ...``, or left out and counted with ``skip_bad``. The held-out part is the folder's
``eval/`` records, or the seeded tenth :class:`~gpipe.data.instruct.InstructionData` holds out of
the same file. Each split is written as ``SPLIT.tok`` (the tokens), ``SPLIT.ans`` (a byte a token:
1 where it is an answer's) and ``SPLIT.off`` (int64 offsets), with the unigram counts of the
training targets (``unigram.npy``: the answers'; ``unigram_all.npy``: every token's, for
``--train-on-prompt``). The documents are held in memory one batch at a time while encoding, and
8 bytes each while they are placed; training holds none."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpipe.data.base import entropy
from gpipe.data.chat import Encoder
from gpipe.data.instruct import IGNORE, Documents, encode_records, held_out, pack_rows
from gpipe.data.integrity import Blocks, PreparedError, check_open
from gpipe.data.prepare import _results, _say, write_prepared
from gpipe.data.prepared import FORMAT, VERSION, file_digest, read_manifest
from gpipe.data.records import lines, parse_lines, split_paths

__all__ = ["IGNORE", "PreparedRecords", "pack_rows", "prepare_records"]

_BATCH = 1024
_ENCODERS: dict[str, Encoder] = {}  # a worker's encoder, loaded once


def _encoder(folder: str) -> Encoder:
    from gpipe.data.tokenizer import of_checkpoint

    found = _ENCODERS.get(folder)
    if found is None:
        found = _ENCODERS[folder] = Encoder(of_checkpoint(Path(folder)))  # type: ignore[arg-type]
    return found


def _batches(paths: list[Path]) -> Iterator[list[tuple[str, str]]]:
    """The non-blank lines of ``paths`` (:func:`~gpipe.data.records.lines`) in batches of :data:`_BATCH`."""
    batch: list[tuple[str, str]] = []
    for numbered in lines(paths):
        batch.append(numbered)
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _encode_batch(folder: str, numbered: list[tuple[str, str]], length: int, skip_bad: bool, dtype: str,
                  prefix: str) -> dict[str, Any]:  # fmt: skip
    """Encode the records of ``numbered`` lines into ``prefix.tok``, ``prefix.ans`` and ``prefix.len``."""
    records, skipped = parse_lines(numbered, skip_bad=skip_bad)
    kept, cut = encode_records(records, _encoder(folder), length, skip_bad, skipped)
    np.asarray([t for e in kept for t in e.tokens], dtype=dtype).tofile(f"{prefix}.tok")
    np.asarray([a for e in kept for a in e.answer], dtype=np.uint8).tofile(f"{prefix}.ans")
    np.asarray([len(e.tokens) for e in kept], dtype=np.uint32).tofile(f"{prefix}.len")
    return {"records": len(kept), "cut": cut, "skipped": dict(skipped)}


def prepare_records(
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str],
    chat_template: str | os.PathLike[str] | None = None,
    max_length: int = 256,
    seed: int = 0,
    workers: int = 1,
    skip_bad: bool = False,
    overwrite: bool = False,
    say: Callable[[str], None] = _say,
) -> Path:
    """Prepare the records of ``data`` (a ``.jsonl`` file or a folder of them) into folder ``out``
    with ``tokenizer`` (a ``tokenizer.json`` or its folder, or a SentencePiece ``.model``); returns
    ``out``. A ``ValueError`` names a bad record or setting; ``out`` is left as it was."""
    from gpipe.data import tokenizer as tokenizers

    if workers < 1 or max_length < 2:
        raise ValueError(f"prepare_records needs workers >= 1 and max_length >= 2 (workers: {workers}, max_length: "
                         f"{max_length})")  # fmt: skip
    loaded = tokenizers.load(tokenizer, chat_template=chat_template)
    train_paths, eval_paths = split_paths(data)

    def build(pool: concurrent.futures.Executor, scratch: Path) -> dict[str, Any]:
        for name, source in tokenizers.checkpoint_files(loaded).items():
            shutil.copyfile(source, scratch / name)
        dtype = "uint16" if loaded.size <= 2**16 else "uint32"
        say(f"encoding the records of {data} with {loaded.size} tokens")
        parts: dict[str, list[str]] = {"train": [], "eval": []}
        pending: list[concurrent.futures.Future[Any]] = []
        done: list[dict[str, Any]] = []
        for split, paths in (("train", train_paths), ("eval", eval_paths)):
            for batch in _batches(paths):
                prefix = str(scratch / "chunks" / f"{split}.{len(done) + len(pending)}")
                parts[split].append(prefix)
                pending.append(pool.submit(_encode_batch, str(scratch), batch, max_length, skip_bad, dtype, prefix))
                if len(pending) > 2 * workers:  # (a bounded number of batches in memory)
                    done.append(pending.pop(0).result())
        done += _results(pending)
        skipped: Counter[str] = Counter()
        for result in done:
            skipped.update(result["skipped"])
        entry = _assemble(parts, scratch, dtype, seed, loaded.size)
        say(f"  {entry['train']} training and {entry['eval']} held-out records, {entry['tokens']} tokens")
        kept = sorted(p.name for p in scratch.iterdir() if p.is_file() and p.suffix in (".json", ".model", ".jinja"))
        main = "tokenizer.json" if "tokenizer.json" in kept else "vocab.model"
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": "records",
            "dtype": dtype,
            "tokenizer": {
                "files": kept,
                "size": loaded.size,
                "bos": loaded.bos,
                "eos": loaded.eos,
                "sha256": file_digest(scratch / main),
            },
            "records": entry["train"] + entry["eval"],
            **entry,
            "cut": sum(r["cut"] for r in done),
            "bad_records": dict(skipped),
            "settings": {
                "max_length": max_length,
                "seed": seed,
                "skip_bad": skip_bad,
                "tokenizer": str(tokenizer),
                "chat_template": str(chat_template or ""),
            },
        }

    return write_prepared(Path(out), build, workers=workers, overwrite=overwrite)


def _assemble(parts: dict[str, list[str]], folder: Path, dtype: str, seed: int, vocab: int) -> dict[str, Any]:
    """The encoded batches into the splits' arrays: the eval files' records, else the seeded tenth
    of the training files' (as :func:`~gpipe.data.instruct.held_out` picks it). Each batch is read
    once and its documents written where they go."""
    chunks = parts["train"] + parts["eval"]
    sizes = [np.fromfile(f"{p}.len", dtype=np.uint32).astype(np.int64) for p in chunks]
    lengths = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
    count = {"train": sum(len(x) for x in sizes[: len(parts["train"])])}
    split = np.zeros(len(lengths), dtype=np.int8)  # 0: train, 1: eval
    place = np.zeros(len(lengths), dtype=np.int64)  # its index in its split
    if parts["eval"]:
        split[count["train"] :] = 1
        place[: count["train"]] = np.arange(count["train"])
        place[count["train"] :] = np.arange(len(lengths) - count["train"])
    else:
        if count["train"] < 2:
            raise ValueError(f"{count['train']} usable record(s); at least 2 are needed (train and eval)")
        held, train = held_out(count["train"], seed)
        split[held], place[held], place[train] = 1, np.arange(len(held)), np.arange(len(train))
    names = ("train", "eval")
    offsets, tokens, answers = {}, {}, {}
    entry: dict[str, Any] = {"tokens": int(lengths.sum()), "longest": int(lengths.max(initial=0))}
    for s, name in enumerate(names):
        spans = np.zeros(int((split == s).sum()), dtype=np.int64)
        spans[place[split == s]] = lengths[split == s]
        offsets[s] = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
        offsets[s].tofile(folder / f"{name}.off")
        total = max(int(offsets[s][-1]), 1)
        tokens[s] = np.memmap(folder / f"{name}.tok", dtype=dtype, mode="w+", shape=(total,))
        answers[s] = np.memmap(folder / f"{name}.ans", dtype=np.uint8, mode="w+", shape=(total,))
        entry[name] = len(spans)
    unigram = {"answers": np.zeros(vocab, dtype=np.int64), "all": np.zeros(vocab, dtype=np.int64)}
    first = 0
    for prefix, size in zip(chunks, sizes):
        ids, ans = np.fromfile(f"{prefix}.tok", dtype=dtype), np.fromfile(f"{prefix}.ans", dtype=np.uint8)
        starts = np.concatenate([[0], np.cumsum(size)])
        for j in range(len(size)):
            g = first + j
            s, k = int(split[g]), int(place[g])
            a, b, at = int(starts[j]), int(starts[j + 1]), int(offsets[s][k])
            tokens[s][at : at + b - a] = ids[a:b]
            answers[s][at : at + b - a] = ans[a:b]
            if s == 0:  # (the training targets: every token but a document's first)
                unigram["all"] += np.bincount(ids[a + 1 : b].astype(np.int64), minlength=vocab)[:vocab]
                counted = ids[a + 1 : b][ans[a + 1 : b].astype(bool)].astype(np.int64)
                unigram["answers"] += np.bincount(counted, minlength=vocab)[:vocab]
        first += len(size)
        for suffix in (".tok", ".ans", ".len"):
            os.unlink(prefix + suffix)
    for s in range(2):
        tokens[s].flush()
        answers[s].flush()
    np.save(folder / "unigram.npy", unigram["answers"])
    np.save(folder / "unigram_all.npy", unigram["all"])
    return entry


class PreparedRecords(Documents):
    """Records prepared by ``gpipe prepare --data FILE.jsonl``, with the batches of
    :class:`~gpipe.data.instruct.InstructionData` (rows one example each, or packed), its arrays
    memory-mapped: memory does not grow with the records. ``length`` (``--max-length``) must hold
    the longest prepared record."""

    def __init__(
        self, path: str | os.PathLike[str], *, length: int = 256, seed: int = 0, pack: bool = False,
        train_on_prompt: bool = False,
    ) -> None:  # fmt: skip
        self.path = Path(path)
        self.manifest = manifest = read_manifest(self.path)
        if manifest.get("kind") != "records":
            raise PreparedError(f"{str(self.path)!r} holds {manifest.get('kind')!r} data, not instruction records "
                                "(gpipe prepare --data FILE.jsonl makes them)")  # fmt: skip
        if (problem := check_open(self.path, manifest)) is not None:
            raise PreparedError(problem)
        longest = int(manifest["longest"]) - 1
        if length < longest:
            raise PreparedError(
                f"{str(self.path)!r} holds records of up to {longest + 1} tokens (prepared with --max-length "
                f"{manifest['settings']['max_length']}): give --max-length {longest} or more, or prepare the records "
                f"again with --max-length {length}"
            )
        self.seed, self.pack, self.train_on_prompt = seed, pack, train_on_prompt
        self.dtype = np.dtype(manifest["dtype"])
        self.max_length = int(manifest["settings"]["max_length"])  # (what the records were fitted to)
        self.length = length if pack else longest
        self.bos, self.eos = manifest["tokenizer"]["bos"], manifest["tokenizer"]["eos"]
        self.pad = next(i for i in (self.eos, 0) if i is not None)
        self.cut, self.records = int(manifest["cut"]), int(manifest["records"])  # (when prepared)
        self.skipped = Counter(manifest["bad_records"])
        self._maps: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._blocks: dict[str, Blocks] = {}
        self._tokenizer: Any = None
        self.rows = {split: self._rows(split) for split in ("train", "eval")}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}, "_tokenizer": None}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from gpipe.data.tokenizer import of_checkpoint

            self._tokenizer = of_checkpoint(self.path)
            if self._tokenizer is None:
                raise PreparedError(f"{str(self.path)!r} holds no tokenizer files: prepare the records again")
        return self._tokenizer

    def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if split not in self._maps:
            try:
                self._maps[split] = (
                    np.memmap(self.path / f"{split}.tok", dtype=self.dtype, mode="r"),
                    np.memmap(self.path / f"{split}.ans", dtype=np.uint8, mode="r"),
                    np.memmap(self.path / f"{split}.off", dtype=np.int64, mode="r"),
                )
            except (OSError, ValueError) as exc:
                raise PreparedError(f"cannot map the {split} records of {str(self.path)!r}: {exc}") from None
        return self._maps[split]

    def document(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, _, offsets = self.arrays(split)
        if split not in self._blocks:
            self._blocks[split] = Blocks(self.path, split, len(tokens), None, int(self.manifest["longest"]))
        self._blocks[split].check(offsets, None, index)
        return super().document(split, index)

    def baseline(self) -> float:
        """The unigram entropy (nats) of the training targets the loss counts, counted when prepared."""
        counts = np.load(self.path / ("unigram_all.npy" if self.train_on_prompt else "unigram.npy"))
        return entropy(Counter({i: int(c) for i, c in enumerate(counts.tolist()) if c}))
