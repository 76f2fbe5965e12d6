"""``gpipe prepare``'s work: a folder of language pairs tokenized once into memory-mapped arrays
(:mod:`gpipe.data.prepared` reads them), in worker processes, streaming the files: no pair is ever
held in memory whole.

1. *Count*: each pair's files are read once, line by line: records counted, bad lines refused with
   their file and line (or skipped and counted), and every :data:`CHUNK`-th record's byte offsets
   marked: where an encoding task may start.
2. *Hold out*: each pair's held-out sentences, as :class:`~gpipe.data.ParallelCorpus` takes them
   (its files in ``DIR/eval/``, else a seeded ``min(held_out, D // 10)``).
3. *Vocabulary*: ``vocab``, or a SentencePiece model trained on a bounded, seeded sample of
   ``min(sample, sentence pairs)`` draws at ``temperature`` — the very text
   :func:`~gpipe.data.vocab.train_vocab` samples, read from the files by index.
4. *Encode*: the chunks, in ``workers`` processes: each writes its tokens and lengths aside.
5. *Assemble*: each pair's sentences, sorted stably by length, into ``NAME.tok`` (the pieces, source
   then target, no EOS), ``NAME.off`` (int64 offsets, one more than sentences) and ``NAME.len``
   (uint32 source lengths): 2 bytes a token (4 past 65,536 pieces) and 12 bytes a sentence pair.

Everything is written into a folder beside ``out`` and renamed into place at the end: an interrupted
run leaves ``out`` as it was (and an older prepared folder there is replaced only with ``overwrite``)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from gpipe.data.base import EOS
from gpipe.data.corpus import held_out_rows, pair_tag
from gpipe.data.files import Counts, PairFiles, Position, check_eval, find_pairs, record_batches, records
from gpipe.data.integrity import record_checksums
from gpipe.data.prepared import FORMAT, MANIFEST, VERSION, file_digest, source_fingerprint
from gpipe.data.vocab import Vocab, VocabSizeError, sample_draws, tag_piece, train_text_vocab

__all__ = ["CHUNK", "DEFAULT_VOCAB_SIZE", "prepare", "train_vocabulary", "write_prepared"]

CHUNK = 50_000  # sentence pairs of one encoding task
DEFAULT_VOCAB_SIZE = 8000  # the most pieces of a vocabulary trained with vocab_size 0
_BATCH = 2048  # lines SentencePiece encodes at once


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Pair:
    index: int
    files: PairFiles
    counts: Counts
    marks: list[Position]
    held: list[int]  # held-out records (sorted); empty when DIR/eval/ has the pair


def _count(files: PairFiles, skip_bad: bool) -> tuple[Counts, list[Position]]:
    counts, marks = Counts(), list[Position]()
    for _ in records(files, skip_bad=skip_bad, counts=counts, positions=CHUNK, marks=marks):
        pass
    return counts, marks


def _texts(files: PairFiles, wanted: list[int], skip_bad: bool) -> dict[int, tuple[str, str]]:
    """The records ``wanted`` (sorted indices) of a pair, read in one pass that stops after the last."""
    found: dict[int, tuple[str, str]] = {}
    want = iter(wanted)
    nxt = next(want, None)
    for index, source, target in records(files, skip_bad=skip_bad):
        if nxt is None:
            break
        if index == nxt:
            found[index] = (source, target)
            nxt = next(want, None)
    return found


_VOCABS: dict[str, Vocab] = {}  # a worker's vocabulary, loaded once


def _encode(vocab_path: str, texts: list[str]) -> list[list[int]]:
    vocab = _VOCABS.get(vocab_path)
    if vocab is None:
        vocab = _VOCABS[vocab_path] = Vocab(vocab_path)
    return vocab.encode_lines(texts)


def _encode_chunk(
    files: PairFiles, start: Position, stop: Position | None, held: list[int], vocab_path: str, dtype: str,
    skip_bad: bool, prefix: str,
) -> dict[str, Any]:  # fmt: skip
    """Encode the records from ``start`` to ``stop``: the training ones into ``prefix.tok`` (source then
    target pieces of each) and ``prefix.len`` (uint32 source and target lengths); the held-out ones
    returned. Also per key (the longer side with EOS) the count of sentences and of tokens."""
    chosen = set(held)
    lengths: list[tuple[int, int]] = []
    held_rows: dict[int, tuple[list[int], list[int], str]] = {}
    keys: Counter[int] = Counter()
    key_tokens: Counter[int] = Counter()
    with open(f"{prefix}.tok", "wb") as tokens:
        for batch in record_batches(files, start, stop, skip_bad=skip_bad, size=_BATCH):
            ids = _encode(vocab_path, [side for _, source, target in batch for side in (source, target)])
            for n, (index, _, target) in enumerate(batch):
                source_ids, target_ids = ids[2 * n], ids[2 * n + 1]
                if index in chosen:
                    held_rows[index] = (source_ids, target_ids, target)
                    continue
                key = max(len(source_ids), len(target_ids)) + 1
                keys[key] += 1
                key_tokens[key] += len(source_ids) + len(target_ids)
                lengths.append((len(source_ids), len(target_ids)))
                tokens.write(np.asarray([*source_ids, *target_ids], dtype=dtype).tobytes())
    np.asarray(lengths, dtype=np.uint32).reshape(-1, 2).tofile(f"{prefix}.len")
    return {"keys": dict(keys), "key_tokens": dict(key_tokens), "held": held_rows}


def _assemble(pair: str, chunks: list[str], results: list[dict[str, Any]], folder: Path, dtype: str) -> dict[str, Any]:
    """Write pair ``pair``'s sentences, sorted stably by key, from the chunks' files (in order)."""
    keys: Counter[int] = Counter()
    key_tokens: Counter[int] = Counter()
    for r in results:
        keys.update({int(k): v for k, v in r["keys"].items()})
        key_tokens.update({int(k): v for k, v in r["key_tokens"].items()})
    top = max(keys, default=1)
    histogram = np.zeros(top + 1, dtype=np.int64)
    token_counts = np.zeros(top + 1, dtype=np.int64)
    for k, v in keys.items():
        histogram[k] = v
        token_counts[k] = key_tokens[k]
    sentences, total = int(histogram.sum()), int(token_counts.sum())
    record_cursor = np.concatenate([[0], np.cumsum(histogram)[:-1]])
    token_cursor = np.concatenate([[0], np.cumsum(token_counts)[:-1]])
    tok = np.memmap(folder / f"{pair}.tok", dtype=dtype, mode="w+", shape=(max(total, 1),))
    off = np.memmap(folder / f"{pair}.off", dtype=np.int64, mode="w+", shape=(sentences + 1,))
    src = np.memmap(folder / f"{pair}.len", dtype=np.uint32, mode="w+", shape=(max(sentences, 1),))
    for prefix in chunks:
        lengths = np.fromfile(f"{prefix}.len", dtype=np.uint32).reshape(-1, 2).astype(np.int64)
        if not len(lengths):
            continue
        ids = np.fromfile(f"{prefix}.tok", dtype=dtype)
        size = lengths.sum(1)
        key = lengths.max(1) + 1
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        first = np.searchsorted(sorted_key, sorted_key, side="left")  # where each record's key group starts
        rank = np.arange(len(order)) - first
        position = np.empty_like(order)
        position[order] = record_cursor[sorted_key] + rank
        sorted_size = size[order]
        within = np.cumsum(sorted_size) - sorted_size  # tokens before it in the chunk's sorted order
        within -= within[first]  # ... and in its key group
        start = np.empty_like(order)
        start[order] = token_cursor[sorted_key] + within
        np.add.at(record_cursor, key, 1)
        np.add.at(token_cursor, key, size)
        off[position] = start
        src[position] = lengths[:, 0]
        begins = np.cumsum(size) - size
        tok[np.repeat(start, size) + (np.arange(len(ids)) - np.repeat(begins, size))] = ids
        for suffix in (".tok", ".len"):
            os.unlink(prefix + suffix)
    off[sentences] = total
    for array in (tok, off, src):
        array.flush()
    if total == 0:  # (a placeholder element: a file of no bytes cannot be mapped)
        (folder / f"{pair}.tok").write_bytes(np.zeros(1, dtype=dtype).tobytes())
    return {"sentences": sentences, "tokens": total, "lengths": histogram.tolist()}


def _pool(workers: int) -> concurrent.futures.Executor:
    if workers <= 1:
        return _InProcess()
    # fork: the workers need only numpy and SentencePiece, and start at once, from any script (spawn would
    # import the caller's __main__ again)
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))


class _InProcess(concurrent.futures.Executor):
    """One worker: the tasks run in this process, at submit."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to .result(), as a process pool does
            future.set_exception(exc)
        return future


def _results(futures: Iterable[concurrent.futures.Future[Any]]) -> list[Any]:
    return [f.result() for f in futures]


def prepare(
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    vocab: str | os.PathLike[str] | None = None,
    vocab_size: int = 0,
    temperature: float = 5.0,
    sample: int = 1_000_000,
    held_out: int = 100,
    seed: int = 0,
    workers: int = 1,
    skip_bad: bool = False,
    overwrite: bool = False,
    say: Callable[[str], None] = _say,
) -> Path:
    """Prepare the language pairs of folder ``data`` into folder ``out`` (see the module's docstring);
    returns ``out``. ``vocab``: a SentencePiece model to use, else one of ``vocab_size`` pieces (0: as
    many as the sample supports, up to 8000) is trained. A ``ValueError`` names a bad file, line or
    setting; ``out`` is left as it was."""
    if held_out < 1 or sample < 1 or workers < 1 or vocab_size < 0 or not temperature > 0:
        raise ValueError(
            f"prepare needs held_out, sample and workers >= 1, vocab_size >= 0 and temperature > 0 (held_out: "
            f"{held_out}, sample: {sample}, workers: {workers}, vocab_size: {vocab_size}, temperature: {temperature})"
        )
    root, target = Path(data), Path(out)
    if (root / MANIFEST).is_file():
        raise ValueError(f"{str(root)!r} is prepared data already: give it to gpipe train --data as it is")
    pairs = find_pairs(root)
    given = find_pairs(root / "eval") if (root / "eval").is_dir() else {}
    check_eval(root, given, pairs)
    if vocab is not None and not Path(vocab).is_file():
        raise ValueError(f"--vocab {str(vocab)!r}: no such file; give a SentencePiece .model, or leave --vocab out")
    if vocab is not None:
        try:
            Vocab(vocab)  # (read here, as given: the copy the workers read is named nowhere)
        except ValueError as exc:
            raise ValueError(f"--vocab {exc}; give a SentencePiece .model, or leave --vocab out") from None

    def build(pool: concurrent.futures.Executor, scratch: Path) -> dict[str, Any]:
        return _prepare(pool, root, pairs, given, scratch, vocab=vocab, vocab_size=vocab_size, temperature=temperature,
                        sample=sample, held_out=held_out, seed=seed, skip_bad=skip_bad, say=say)  # fmt: skip

    return write_prepared(target, build, workers=workers, overwrite=overwrite)


def write_prepared(
    target: Path,
    build: Callable[[concurrent.futures.Executor, Path], dict[str, Any]],
    *,
    workers: int,
    overwrite: bool,
) -> Path:
    """Make prepared folder ``target``: ``build(pool, scratch)`` writes its files into ``scratch`` (a
    folder beside ``target``, with a ``chunks/`` folder for its own use) with ``workers`` processes and
    returns the manifest, written last with every file's size and SHA-256 (``"files"``); then
    ``scratch`` is renamed ``target`` (an older prepared folder there is replaced only with
    ``overwrite``). Whatever stops it, ``target`` is left as it was."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        if not (target / MANIFEST).is_file():
            raise ValueError(f"--out {str(target)!r} exists and is not prepared data: give a new or empty folder")
        if not overwrite:
            raise ValueError(f"--out {str(target)!r} holds prepared data already; add --overwrite to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "chunks").mkdir(parents=True)
    began = time.perf_counter()
    try:
        with _pool(workers) as pool:
            manifest = build(pool, scratch)
        manifest["seconds"] = round(time.perf_counter() - began, 3)
        manifest["workers"] = workers
        shutil.rmtree(scratch / "chunks")
        record_checksums(scratch, manifest, sorted(p.name for p in scratch.iterdir() if p.is_file()))
        (scratch / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last: a folder without it is no data
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            target.rename(old)
            scratch.rename(target)
            shutil.rmtree(old)
        else:
            scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _prepare(
    pool: concurrent.futures.Executor, root: Path, pairs: dict[str, PairFiles], given: dict[str, PairFiles],
    scratch: Path, *, vocab: str | os.PathLike[str] | None, vocab_size: int, temperature: float, sample: int,
    held_out: int, seed: int, skip_bad: bool, say: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    names = sorted(pairs)
    say(f"counting the sentence pairs of {len(names)} language pair(s) in {root}")
    counted = _results([pool.submit(_count, pairs[n], skip_bad) for n in names])
    state: dict[str, _Pair] = {}
    for index, (name, (counts, marks)) in enumerate(zip(names, counted)):
        if not counts.records:
            raise ValueError(f"{', '.join(repr(str(p)) for p in pairs[name].files)}: no sentence pairs")
        held = [] if name in given else held_out_rows(name, counts.records, held_out, seed, index, root)
        state[name] = _Pair(index, pairs[name], counts, marks, held)
    vocab_file = scratch / "vocab.model"
    if vocab is not None:
        shutil.copyfile(vocab, vocab_file)
        if Path(vocab).with_suffix(".vocab").is_file():
            shutil.copyfile(Path(vocab).with_suffix(".vocab"), scratch / "vocab.vocab")
    else:
        _train_vocab(pool, state, vocab_file, size=vocab_size, temperature=temperature, sample=sample, seed=seed,
                     skip_bad=skip_bad, say=say)  # fmt: skip
    try:
        vocabulary = Vocab(vocab_file)
    except ValueError as exc:
        raise ValueError(f"{exc}; give a SentencePiece .model as --vocab") from None
    tags = {name: pair_tag(vocabulary, name, pairs[name].tgt, root) for name in names}
    dtype = "uint16" if vocabulary.size <= 2**16 else "uint32"
    say(f"encoding {sum(p.counts.records for p in state.values())} sentence pairs with {vocabulary.size} pieces")
    tasks: dict[str, list[tuple[str, concurrent.futures.Future[Any]]]] = {}
    for name in names:
        p = state[name]
        marks = p.marks
        for k, start in enumerate(marks):
            stop = marks[k + 1] if k + 1 < len(marks) else None
            prefix = str(scratch / "chunks" / f"{name}.{k}")
            held = [i for i in p.held if start.record <= i < (stop.record if stop else p.counts.records)]
            future = pool.submit(_encode_chunk, p.files, start, stop, held, str(vocab_file), dtype, skip_bad, prefix)
            tasks.setdefault(name, []).append((prefix, future))
    manifest_pairs: dict[str, Any] = {}
    held_sets: dict[str, Any] = {}
    for name in names:
        results = _results(f for _, f in tasks[name])
        entry = _assemble(name, [prefix for prefix, _ in tasks[name]], results, scratch, dtype)
        if name in given:
            rows = [(s, t) for _, s, t in records(given[name])]
            ids = vocabulary.encode_lines([text for row in rows for text in row])
            held_rows = [(ids[2 * n], ids[2 * n + 1], rows[n][1]) for n in range(len(rows))]
        else:
            found: dict[int, Any] = {}
            for r in results:
                found.update(r["held"])
            held_rows = [found[i] for i in state[name].held]
        held_sets[name] = {
            "source": [s for s, _, _ in held_rows],
            "target": [t for _, t, _ in held_rows],
            "references": [ref for _, _, ref in held_rows],
        }
        counts = state[name].counts
        manifest_pairs[name] = {
            "src": pairs[name].src,
            "tgt": pairs[name].tgt,
            "tag": tags[name],
            "files": [p.name for p in pairs[name].files],
            **entry,
            "held_out": len(held_rows),
            "held_out_from": "eval" if name in given else "training",
            "blank_lines": counts.blank,
            "bad_lines": dict(counts.bad),
        }
        skipped = f", {sum(counts.bad.values())} bad line(s) skipped" if counts.bad else ""
        say(f"  {name}: {entry['sentences']} sentence pairs, {entry['tokens']} tokens{skipped}")
    (scratch / "heldout.json").write_text(json.dumps(held_sets) + "\n")
    lengths = [0] * max(len(e["lengths"]) for e in manifest_pairs.values())
    for e in manifest_pairs.values():
        for k, v in enumerate(e["lengths"]):
            lengths[k] += v
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "pairs",
        "dtype": dtype,
        "eos": EOS,
        "vocab": {"file": "vocab.model", "size": vocabulary.size, "sha256": file_digest(vocab_file)},
        "sentences": sum(e["sentences"] for e in manifest_pairs.values()),
        "tokens": sum(e["tokens"] for e in manifest_pairs.values()),
        "lengths": lengths,
        "pairs": manifest_pairs,
        "settings": {
            "held_out": held_out,
            "seed": seed,
            "temperature": temperature,
            "sample": sample,
            "vocab_size": vocab_size,
            "vocab": str(vocab) if vocab else "",
            "skip_bad": skip_bad,
        },
        "source": source_fingerprint(root),
    }


def _train_vocab(
    pool: concurrent.futures.Executor, state: dict[str, _Pair], path: Path, *, size: int, temperature: float,
    sample: int, seed: int, skip_bad: bool, say: Callable[[str], None],
) -> None:  # fmt: skip
    """The shared vocabulary, trained on :func:`~gpipe.data.vocab.sample_text`'s draws
    (:func:`~gpipe.data.vocab.sample_draws`: pair by temperature, then a record uniformly, both sides), read
    from the files by index."""
    sizes = {name: p.counts.records for name, p in state.items()}
    draws = min(sample, sum(sizes.values()))
    picks = sample_draws(sizes, temperature, draws, seed)
    wanted: dict[str, set[int]] = {}
    for name, i in picks:
        wanted.setdefault(name, set()).add(i)
    names = sorted(wanted)
    found = dict(zip(names, _results(pool.submit(_texts, state[n].files, sorted(wanted[n]), skip_bad) for n in names)))
    text = [side for name, i in picks for side in found[name][i]]
    tags = sorted({tag_piece(p.files.tgt) for p in state.values()})
    train_vocabulary(text, path, size=size, seed=seed, tags=tags, what=f"{draws} sentence pairs (T={temperature:g})",
                     say=say)  # fmt: skip


def train_vocabulary(
    text: list[str],
    path: Path,
    *,
    size: int,
    seed: int,
    tags: list[str],
    what: str,
    say: Callable[[str], None] = _say,
    sample: int | None = None,
) -> None:
    """SentencePiece trained on ``text`` (all of it, or a seeded ``sample`` of its lines) into ``path`` (a
    ``.model``; its ``.vocab`` beside): ``size`` pieces, or with 0 as many as it supports up to
    :data:`DEFAULT_VOCAB_SIZE` (said when fewer)."""
    most = size or DEFAULT_VOCAB_SIZE
    say(f"training a vocabulary of {size if size else f'up to {most}'} pieces on {what}")
    try:
        made = train_text_vocab(text, path.with_suffix(""), size=most, exact=bool(size), sample=sample or len(text),
                                seed=seed, tags=tags)  # fmt: skip
    except VocabSizeError as exc:
        raise ValueError(f"{exc}; or leave --vocab-size out for as many as the text supports") from None
    pieces = Vocab(made).size
    if pieces < most:
        say(f"note: the text supports only {pieces} pieces (--vocab-size left out: up to {most}); the vocabulary has "
            f"{pieces}")  # fmt: skip
