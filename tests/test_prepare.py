"""`gpipe prepare` and prepared data: the same sentences, held-out sets and batches as the in-memory
ParallelCorpus on the same files (so the same losses), token batches from length buckets, resume and
K-invariance on prepared data, bad lines refused with their line numbers or skipped and counted, an
interrupted prepare leaving the old folder, the format's size, and the batches made ahead."""

from __future__ import annotations

import itertools
import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gpipe.data.prepare as preparing
from gpipe.cli import main
from gpipe.data import ParallelCorpus
from gpipe.data.batches import bucket_bounds
from gpipe.data.loader import BatchError, StepLoader
from gpipe.data.prepare import prepare
from gpipe.data.prepared import PreparedCorpus, PreparedError, read_manifest
from gpipe.data.vocab import Vocab, train_vocab
from gpipe.train import TrainConfig, train
from gpipe.train.data import train_batch

WORDS = [f"{c}{v}{d}" for c in "bdfgklmnprst" for v in "aeiou" for d in "aeiou"]


def write_corpus(root: Path, sizes: dict[str, int], *, seed: int = 0, longest: int = 24) -> None:
    """Pairs of made-up words, 1 to ``longest`` a side (the target's length near the source's), with a
    blank line, Windows line ends in one file and two-file pairs in another."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for p, (name, n) in enumerate(sizes.items()):
        rows = []
        for _ in range(n):
            k = rng.randint(1, longest)
            source = " ".join(rng.choice(WORDS) for _ in range(k))
            target = " ".join(rng.choice(WORDS[::-1]) for _ in range(max(1, k + rng.randint(-2, 2))))
            rows.append((source, target))
        if p == 1:  # two files, aligned
            src, tgt = name.split("-")
            (root / f"{name}.{src}").write_text("".join(f"{s}\n" for s, _ in rows), encoding="utf-8")
            (root / f"{name}.{tgt}").write_text("".join(f"{t}\n" for _, t in rows), encoding="utf-8")
        else:
            end = "\r\n" if p == 0 else "\n"
            lines = [f"{s}\t{t}{end}" for s, t in rows]
            lines.insert(n // 2, "\n")  # (a blank line: skipped)
            (root / f"{name}.tsv").write_text("".join(lines), encoding="utf-8", newline="")


SIZES = {"en-de": 900, "en-fr": 300, "de-fr": 70}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "raw", SIZES)
    (root / "raw" / "eval").mkdir()
    (root / "raw" / "eval" / "de-fr.tsv").write_text("bab beb\tkik\nfof\tsus sas\n", encoding="utf-8")
    train_vocab(root / "raw", root / "vocab", size=400, exact=False, sample=1270)
    prepared = prepare(root / "raw", root / "prepared", vocab=root / "vocab.model", workers=2, say=lambda _: None)
    return {"raw": root / "raw", "vocab": root / "vocab.model", "prepared": prepared, "root": root}


def equal(a: Any, b: Any) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("source", "target_in", "target_out"))


@pytest.mark.parametrize("length", [64, 12])
def test_prepared_batches_are_the_in_memory_corpus_batches(corpus: dict[str, Path], length: int) -> None:
    memory = ParallelCorpus(corpus["raw"], Vocab(corpus["vocab"]), length=length, seed=0)
    prepared = PreparedCorpus(corpus["prepared"], length=length, seed=0)
    assert prepared.pair_sizes == memory.pair_sizes and prepared.skipped == memory.skipped
    assert bool(sum(memory.skipped.values())) == (length == 12)
    for name in memory.names:
        assert prepared.sets[name].references == memory.sets[name].references
        assert equal(prepared.sets[name], memory.sets[name])
    assert prepared.sets["de-fr"].references == ("kik", "sus sas")  # (DIR/eval's, not held out of training)
    for step in range(6):
        assert equal(prepared.batch(16, step), memory.batch(16, step))
        assert equal(prepared.batch(16, step, split="eval"), memory.batch(16, step, split="eval"))
        assert equal(prepared.token_batch(256, step), memory.token_batch(256, step))
    assert prepared.unigram_entropy() == memory.unigram_entropy()
    again = pickle.loads(pickle.dumps(prepared))  # (a DataLoader worker's copy maps the arrays again)
    assert equal(again.token_batch(256, 3), prepared.token_batch(256, 3))
    assert len(pickle.dumps(prepared)) < 200_000


def test_the_manifest_and_the_size_on_disk(corpus: dict[str, Path]) -> None:
    manifest = read_manifest(corpus["prepared"])
    memory = ParallelCorpus(corpus["raw"], Vocab(corpus["vocab"]), length=10_000, seed=0)
    assert manifest["sentences"] == sum(memory.pair_sizes.values())
    tokens = sum(len(s) + len(t) - 2 for pair in memory.train.values() for s, t in pair)  # (EOS not stored)
    assert manifest["tokens"] == tokens
    assert manifest["dtype"] == "uint16" and manifest["pairs"]["en-de"]["blank_lines"] == 1
    assert sum(manifest["lengths"]) == manifest["sentences"]
    assert manifest["pairs"]["de-fr"]["held_out_from"] == "eval"
    files = [p for p in corpus["prepared"].iterdir() if p.suffix in (".tok", ".off", ".len")]
    size = sum(p.stat().st_size for p in files)
    assert size <= 2 * manifest["tokens"] + 12 * manifest["sentences"] + 8 * len(manifest["pairs"])
    memory_sorted = [max(len(s), len(t)) for s, t in memory.train["en-fr"]]
    assert memory_sorted == sorted(memory_sorted)  # (kept by length: a bucket is a range of indices)


def test_token_batches_fill_their_bucket_and_keep_the_pairs_shares(corpus: dict[str, Path]) -> None:
    data = PreparedCorpus(corpus["prepared"], length=32, seed=1)
    bounds = bucket_bounds(32)
    assert bounds[0] == 2 and bounds[-1] == 32 and all(b / a <= 1.5 for a, b in itertools.pairwise(bounds))
    padding, rows = [], []
    for step in range(200):
        batch = data.token_batch(512, step)
        width = max(batch.source.size(1), batch.target_out.size(1))
        assert batch.source.size(0) * width <= 512 or batch.source.size(0) == 1
        padding.append(batch.padding)
        rows.append(batch.source.size(0))
    assert np.mean(padding) < 0.3  # (sentence batches of this corpus: about 0.5)
    sentences = [data.batch(32, step).padding for step in range(50)]
    assert np.mean(padding) < np.mean(sentences) - 0.15
    assert min(rows) < max(rows)  # (short buckets hold more sentences)


def test_prepare_refuses_bad_lines_with_their_numbers_or_skips_and_counts_them(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    good = "".join(f"a{i} b\tc{i} d\n" for i in range(30))
    cases = {
        "no tab": (b"x y\n", r"en-de\.tsv:31: expected exactly one tab", "tab"),
        "two tabs": (b"x\ty\tz\n", r"en-de\.tsv:31: .*found 2", "tab"),
        "bytes": (b"x \xff\ty\n", r"en-de\.tsv:31: not UTF-8 text", "utf8"),
        "empty side": (b"x\t  \n", r"en-de\.tsv:31: the target side is empty", "empty"),
    }
    for name, (line, error, kind) in cases.items():
        (raw / "en-de.tsv").write_bytes(good.encode() + line + good.encode())
        with pytest.raises(ValueError, match=error):  # (found by a worker process: the error travels back)
            prepare(raw, tmp_path / name, vocab_size=0, workers=2 if kind == "tab" else 1, say=lambda _: None)
        assert not (tmp_path / name).exists() and not list(tmp_path.glob(".*tmp*")), name
        out = prepare(raw, tmp_path / name, workers=1, skip_bad=True, say=lambda _: None)
        entry = read_manifest(out)["pairs"]["en-de"]
        assert entry["bad_lines"] == {kind: 1} and entry["sentences"] + entry["held_out"] == 60, name
    (raw / "en-de.tsv").write_text(good)
    (raw / "en-fr.en").write_text("a\nb\nc\n")
    (raw / "en-fr.fr").write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"en-fr\.fr' has 2 lines but .*en-fr\.en' has more"):
        prepare(raw, tmp_path / "split", workers=1, say=lambda _: None)


def test_the_command_and_its_refusals(
    corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    assert (
        main(["prepare", "--data", str(corpus["raw"]), "--out", str(out), "--workers", "1", "--vocab-size", "300"]) == 0
    )
    said = capsys.readouterr()
    assert f"wrote {out}: 3 language pairs" in said.out and "worker(s)" in said.out
    assert Vocab(out / "vocab.model").size == 300
    assert main(["prepare", "--data", str(corpus["raw"]), "--out", str(out)]) == 2
    assert "holds prepared data already; add --overwrite" in capsys.readouterr().err
    assert main(["prepare", "--data", str(out), "--out", str(tmp_path / "q")]) == 2
    assert "is prepared data already" in capsys.readouterr().err
    assert main(["prepare", "--data", str(corpus["raw"]), "--out", str(tmp_path / "q"), "--workers", "0"]) == 2
    assert "--workers must be positive" in capsys.readouterr().err
    (tmp_path / "notsp.model").write_text("not a model\n")
    vocab = str(tmp_path / "notsp.model")
    assert main(["prepare", "--data", str(corpus["raw"]), "--out", str(tmp_path / "q"), "--vocab", vocab]) == 2
    err = capsys.readouterr().err  # (the user's file, never the copy the workers read)
    assert err.startswith(f"error: --vocab {vocab!r} is not a SentencePiece model") and err.count("\n") == 1, err


def test_an_interrupted_prepare_leaves_the_old_folder(corpus: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    out = corpus["root"] / "again"
    prepare(corpus["raw"], out, vocab=corpus["vocab"], workers=1, say=lambda _: None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = 0
    assemble = preparing._assemble

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt  # (Ctrl-C while the second pair is written)
        return assemble(*args, **kwargs)

    monkeypatch.setattr(preparing, "_assemble", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus["raw"], out, vocab=corpus["vocab"], workers=1, overwrite=True, say=lambda _: None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".again")]


def quick(out: Path, data: Path, **kwargs: Any) -> TrainConfig:
    flags = {"steps": 4, "batch": 16, "eval_every": 2, "checkpoint_every": 2, "progress": False, "tensorboard": "off"}
    return TrainConfig(out=str(out), data=str(data), **{**flags, **kwargs})


def losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def test_training_on_prepared_data_is_training_on_the_folder(
    corpus: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same losses from the in-memory corpus, from --data PREPARED and from --data FOLDER (prepared
    into OUT/prepared once, reused by --resume); with --batch-tokens, the same for 1 and 2 stages and
    resumed, the metrics saying the tokens and padding of each step; the pairs longer than --max-length
    left out, said once with their count."""
    prepared = train(quick(tmp_path / "prepared", corpus["prepared"]))
    folder = train(quick(tmp_path / "folder", corpus["raw"], vocab=str(corpus["vocab"])))
    assert prepared["loss"] == folder["loss"] and losses(tmp_path / "prepared") == losses(tmp_path / "folder")
    assert read_manifest(tmp_path / "folder" / "prepared")["vocab"] == read_manifest(corpus["prepared"])["vocab"]
    import gpipe.train.loop as loop

    monkeypatch.setattr(loop, "make_data", lambda cfg: ParallelCorpus(cfg.data, Vocab(corpus["vocab"]), seed=cfg.seed))
    train(quick(tmp_path / "memory", corpus["raw"], vocab=str(corpus["vocab"])))
    monkeypatch.undo()
    assert not (tmp_path / "memory" / "prepared").exists()  # (the in-memory corpus was read)
    assert losses(tmp_path / "memory") == losses(tmp_path / "prepared")

    tokens = {"batch_tokens": 512, "max_length": 32}
    train(quick(tmp_path / "k2", corpus["prepared"], **tokens))
    train(quick(tmp_path / "k1", corpus["prepared"], partitions=1, **tokens))
    assert losses(tmp_path / "k1") == losses(tmp_path / "k2")
    train(quick(tmp_path / "half", corpus["prepared"], **tokens, steps=2))
    train(quick(tmp_path / "half", corpus["prepared"], **tokens, resume=True))
    assert losses(tmp_path / "half") == losses(tmp_path / "k2")
    rows = [json.loads(line) for line in (tmp_path / "k2" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["padding"] < 0.5 and 0 < r["tokens"] <= 512 for r in rows)
    data, cfg = PreparedCorpus(corpus["prepared"], length=32), quick(tmp_path, corpus["prepared"], **tokens)
    assert all(len(train_batch(data, cfg, 0, step).source) % 8 == 0 for step in range(20))
    with pytest.raises(ValueError, match="--batch-tokens 300 makes batches of multiples of 8 sentences, 8 of"):
        quick(tmp_path / "small", corpus["prepared"], batch_tokens=300, max_length=32, chunks=16).check()
    with pytest.raises(ValueError, match=r"--batch-tokens 3 is below 256 tokens, the smallest batch of the longest "
                                         r"sentences \(8 of --max-length 32 tokens"):  # fmt: skip
        quick(tmp_path / "small", corpus["prepared"], batch_tokens=3, max_length=32).check()
    with pytest.raises(ValueError, match="is prepared data, with its own vocabulary"):
        quick(tmp_path / "v", corpus["prepared"], vocab=str(corpus["vocab"])).check()
    capsys.readouterr()
    train(quick(tmp_path / "short", corpus["prepared"], steps=1, max_length=12))  # (12: some pairs are longer)
    short = PreparedCorpus(corpus["prepared"], length=12)
    count, total = sum(short.skipped.values()), sum(short.skipped.values()) + sum(short.pair_sizes.values())
    err = capsys.readouterr().err
    note = f"note: {count} of the {total} training sentence pairs have a side longer than --max-length 12 tokens"
    pairs = ", ".join(f"{name}: {n}" for name, n in short.skipped.items())
    assert count and err.count(note) == 1 and f"are left out of training ({pairs}); raise --max-length" in err, err


def test_the_loader_makes_the_batches_ahead_in_order(corpus: dict[str, Path]) -> None:
    data = PreparedCorpus(corpus["prepared"], length=32, seed=0)
    want = [data.token_batch(256, step) for step in range(3, 9)]
    for workers in (0, 2):
        with StepLoader(lambda step: data.token_batch(256, step), 3, 8, workers=workers) as loader:
            got = list(loader)
        assert [s for s, _ in got] == list(range(3, 9)) and all(equal(b, w) for (_, b), w in zip(got, want))

    def failing(step: int) -> int:
        if step == 5:
            raise ValueError("cannot read 'x.png'")  # (bad data: one line, naming the step)
        if step == 7:
            raise RuntimeError("a bug")  # (anything else keeps its type and traceback)
        return step

    for workers, start, error, message in ((0, 1, BatchError, "the batch of step 5: cannot read"),
                                           (2, 1, BatchError, "^the batch of step 5: cannot read 'x.png'$"),
                                           (0, 6, RuntimeError, "a bug")):  # fmt: skip
        loader = StepLoader(failing, start, 9, workers=workers)
        seen = []
        with pytest.raises(error, match=message):
            for step, _ in loader:
                seen.append(step)
        loader.close()
        assert seen == list(range(start, 5 if start == 1 else 7))


def _damaged(corpus: dict[str, Path], tmp_path: Path, name: str, damage: Any) -> Path:
    """A copy of the prepared corpus with ``damage(path)`` done to its file ``name``."""
    copy = tmp_path / "damaged"
    shutil.copytree(corpus["prepared"], copy)
    damage(copy / name)
    return copy


def _garbage(path: Path) -> None:
    """Random bytes of the same size, with the first and last offsets kept (the checks at open pass)."""
    data = np.memmap(path, dtype=np.int64, mode="r+")
    middle = np.random.default_rng(0).integers(0, int(data[-1]), len(data) - 2)
    data[1:-1] = middle
    data.flush()


def test_damaged_prepared_data_is_found_before_it_trains(
    corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .tok cut short: one line, exit 2, before training (at open). An .off of garbage of the same size:
    the first batch reading it stops the run in one line. gpipe prepare --verify finds both, and a .tok
    whose bytes changed (its checksum); it passes an intact folder and one prepared before checksums."""
    flags = ["train", "--steps", "2", "--batch", "16", "--no-progress", "--tensorboard", "off"]

    def cut(path: Path) -> None:
        with open(path, "r+b") as f:
            f.truncate(100)

    folder = _damaged(corpus, tmp_path / "cut", "en-fr.tok", cut)
    with pytest.raises(PreparedError, match=r"en-fr.tok: truncated: 100 of \d+ bytes; check the folder whole"):
        PreparedCorpus(folder)
    assert main([*flags, "--data", str(folder), "--out", str(tmp_path / "r1")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "en-fr.tok: truncated" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r1" / "metrics.jsonl").exists()  # (nothing trained)

    folder = _damaged(corpus, tmp_path / "garbage", "en-fr.off", _garbage)
    data = PreparedCorpus(folder)  # (the sizes and the offsets' ends are right)
    with pytest.raises(PreparedError, match=r"en-fr.off'(: the offsets| or .*en-fr.len': sentence pair)"):
        data.sentence(data.names.index("en-fr"), 0)
    assert main([*flags, "--data", str(folder), "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "en-fr.off'" in err and err.count("\n") == 1, err

    assert main(["prepare", "--verify", str(folder)]) == 1
    said = capsys.readouterr()
    assert "en-fr.off: corrupt: its sha256 differs from the manifest's" in said.err, said
    assert main(["prepare", "--verify", str(corpus["prepared"])]) == 0
    said = capsys.readouterr()
    assert "match their checksums" in said.out and "consistent with the manifest" in said.out, said

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[7] ^= 0xFF
        path.write_bytes(bytes(data))

    assert main(["prepare", "--verify", str(_damaged(corpus, tmp_path / "flip", "en-fr.tok", flip))]) == 1
    assert "en-fr.tok: corrupt" in capsys.readouterr().err
    old = _damaged(corpus, tmp_path / "old", "manifest.json", lambda p: p.write_text(json.dumps(
        {k: v for k, v in json.loads(p.read_text()).items() if k != "files"})))  # fmt: skip
    _garbage(old / "en-fr.off")
    assert main(["prepare", "--verify", str(old)]) == 1  # (no checksums: the structure finds it)
    said = capsys.readouterr()
    assert "lists no checksums" in said.out and "en-fr.off'" in said.err, said


def test_replicas_on_prepared_token_batches_train_as_one_and_resume_with_another_data_parallel(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """2 gloo ranks, --data-parallel 2, on prepared data in token batches: the losses of one process,
    and the run resumed with --data-parallel 1 sees the same mini-batches (the same losses)."""
    from tests.test_train_data_parallel import FLAGS, gpipe_train, rows, same_numbers

    flags = ["--data", str(corpus["prepared"]), "--batch-tokens", "512", "--max-length", "32", "--partitions", "1"]
    out = tmp_path / "d2"
    gpipe_train(2, *flags, "--data-parallel", "2", "--steps", "4", "--out", str(out))
    assert main(["train", *FLAGS, *flags, "--steps", "6", "--out", str(tmp_path / "d1")]) == 0
    want = [{k: v for k, v in r.items() if not k.startswith("bleu")} for r in rows(tmp_path / "d1")]
    same_numbers(rows(out), want[:4])
    assert [r["tokens"] for r in rows(out)] == [r["tokens"] for r in want[:4]]
    assert main(["train", *FLAGS, "--out", str(out), "--resume", "--steps", "6", "--data-parallel", "1"]) == 0
    same_numbers([{k: v for k, v in r.items() if not k.startswith("bleu")} for r in rows(out)], want)


def test_a_prepared_text_is_the_text_file_for_a_causal_lm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gpipe prepare on a text file: TextLines' documents, held-out tenth and batches from memory-mapped
    arrays; gpipe train --model hf on it gives the losses of the file read with the same tokenizer."""
    from gpipe.data.prepared import PreparedText
    from gpipe.data.text import TextLines

    rng = random.Random(3)
    lines = [" ".join(rng.choice(WORDS[:40]) for _ in range(rng.randint(1, 40))) for _ in range(400)]
    lines[7] = "  "  # (a blank line: not a document)
    (tmp_path / "text.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    argv = ["prepare", "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "p"), "--workers", "2"]
    assert main([*argv, "--seed", "5"]) == 0  # (the seed of the held-out tenth: TextLines' with --seed 5)
    assert "wrote " in capsys.readouterr().out
    prepared = PreparedText(tmp_path / "p", seed=5)
    memory = TextLines(tmp_path / "text.txt", Vocab(tmp_path / "p" / "vocab.model"), seed=5)
    assert prepared.length == memory.length and prepared.sizes == {"train": 360, "eval": 39}
    for step in range(4):
        for split in ("train", "eval"):
            a, b = prepared.batch(8, step, split=split), memory.batch(8, step, split=split)
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.target, b.target)
    assert prepared.sample_prompt() == memory.sample_prompt()
    assert prepared.baseline() == pytest.approx(memory.baseline(), rel=0.05)  # (counted on whole documents)

    flags = [
        "train",
        "--model",
        "hf",
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--batch",
        "8",
        "--no-progress",
        "--seed",
        "5",
    ]
    assert main([*flags, "--data", str(tmp_path / "p"), "--out", str(tmp_path / "a")]) == 0
    tokenizer = str(tmp_path / "p" / "vocab.model")
    assert (
        main([*flags, "--data", str(tmp_path / "text.txt"), "--tokenizer", tokenizer, "--out", str(tmp_path / "b")])
        == 0
    )
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert (tmp_path / "a" / "checkpoints" / "step-00000002" / "vocab.model").is_file()  # (for gpipe generate)

    (tmp_path / "bad.txt").write_bytes(b"one line\nanother \xfe one\n")
    assert main(["prepare", "--data", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "q")]) == 2
    assert "bad.txt:2: not UTF-8 text" in capsys.readouterr().err
    assert (
        main(["prepare", "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "q"), "--vocab", tokenizer]) == 2
    )
    assert "--vocab is the shared vocabulary of a folder" in capsys.readouterr().err


def test_a_replica_reads_its_share_alone(corpus: dict[str, Path], tmp_path: Path) -> None:
    """With data parallelism a replica reads only its rows of a batch, padded as the whole batch is,
    with the whole's size, token count and padding: the shares put together are the whole batch."""
    from gpipe.data import ImageFiles
    from gpipe.data.base import ReplicaBatch

    for data in (PreparedCorpus(corpus["prepared"], length=32), ParallelCorpus(corpus["raw"], Vocab(corpus["vocab"]))):
        for whole, parts in (
            (data.batch(16, 3), [data.batch(16, 3, share=(r, 4)) for r in range(4)]),
            (
                data.token_batch(512, 3, multiple=8),
                [data.token_batch(512, 3, multiple=8, share=(r, 2)) for r in range(2)],
            ),
        ):
            assert all(isinstance(p, ReplicaBatch) for p in parts)
            for field in ("source", "target_in", "target_out"):
                assert torch.equal(torch.cat([getattr(p.batch, field) for p in parts]), getattr(whole, field))
            assert {(p.share.size, p.share.count, p.count) for p in parts} == {
                (len(whole.source), whole.count, whole.count)
            }
            assert parts[0].padding == pytest.approx(whole.padding)
    from PIL import Image

    for c in range(2):
        (tmp_path / "images" / f"c{c}").mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (8, 8), (40 * i, 100 * c, 7)).save(tmp_path / "images" / f"c{c}" / f"{i}.png")
    images = ImageFiles(tmp_path / "images", size=8)
    parts = [images.batch(4, 2, share=(r, 2)) for r in range(2)]
    assert torch.equal(torch.cat([p.batch.images for p in parts]), images.batch(4, 2).images)
    assert [p.share.size for p in parts] == [4, 4] and parts[0].share.count is None


def test_a_pipeline_step_refuses_a_share_it_cannot_take() -> None:
    from torch import nn

    from gpipe import Pipeline
    from gpipe.microbatch import Share
    from gpipe.recipe import count_tokens

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    pipe = Pipeline(model, [1, 1], devices=["cpu", "cpu"], chunks=2, loss_fn=nn.functional.cross_entropy)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    whole = pipe.step(x, y)
    assert torch.equal(pipe.step(x, y, share=Share(6)), whole)  # (one replica: its share is the whole)
    with pytest.raises(ValueError, match=r"replica 0 of 1 takes 8 row\(s\) of a mini-batch of 8 .* given 6"):
        pipe.step(x, y, share=Share(8))

    def summed(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, t, reduction="sum")

    counted = Pipeline(model, [1, 1], devices=["cpu", "cpu"], chunks=2, loss_count=count_tokens(-1), loss_fn=summed)
    with pytest.raises(ValueError, match=r"give Share\(size=\.\.\., count="):
        counted.step(x, y, share=Share(6))
    assert torch.equal(counted.step(x, y, share=Share(6, 6)), counted.step(x, y))


def test_bad_data_found_mid_run_ends_the_run_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpipe.train.loop as loop

    made = loop.train_batch

    def unreadable(data: Any, cfg: TrainConfig, replica: int, step: int) -> Any:
        if step == 3:
            raise ValueError("cannot read the image 'c0/7.png': truncated")
        return made(data, cfg, replica, step)

    monkeypatch.setattr(loop, "train_batch", unreadable)
    argv = ["train", "--steps", "4", "--checkpoint-every", "2", "--no-progress", "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the batch of step 3: cannot read the image")
    assert "the checkpoint of step 2 is kept: fix the data, then --resume" in err
