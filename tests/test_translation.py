"""The translation workflow: a folder of language pairs, the shared vocabulary, training with BLEU per
pair, and `gpipe translate` from a checkpoint."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from gpipe.cli import main
from gpipe.data import EOS, ParallelCorpus, SyntheticTranslation
from gpipe.data.vocab import Vocab, train_vocab
from gpipe.evaluation import bleu, resource_groups
from gpipe.recipe import temperature_sampling
from gpipe.train import TrainConfig, train
from gpipe.translate import Translator

SIZES = (1500, 300, 60)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    assert main(["corpus", "--out", str(root), "--sizes", ",".join(map(str, SIZES)), "--held-out", "16"]) == 0
    return root


@pytest.fixture(scope="module")
def vocab(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Vocab:
    return Vocab(train_vocab(corpus, tmp_path_factory.mktemp("vocab") / "v", size=200, sample=2000))


@pytest.fixture(scope="module")
def run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    out = tmp_path_factory.mktemp("run")
    result = train(
        TrainConfig(out=str(out), data=str(corpus), vocab_size=200, steps=150, eval_every=75, progress=False)
    )
    return out, result


def test_the_corpus_command_writes_every_pair_and_its_held_out_sentences(corpus: Path) -> None:
    for pair, size in zip(["xs-ya", "xs-yb", "xs-yc"], SIZES):
        lines = (corpus / f"{pair}.tsv").read_text(encoding="utf-8").splitlines()
        held = (corpus / "eval" / f"{pair}.tsv").read_text(encoding="utf-8").splitlines()
        assert (len(lines), len(held)) == (size, 16)
        assert not set(lines) & set(held)
        assert all(line.count("\t") == 1 and len(line.split("\t")[1].split()) == 8 for line in lines + held)


def test_batches_draw_the_pairs_with_temperature(corpus: Path, vocab: Vocab) -> None:
    data = ParallelCorpus(corpus, vocab, temperature=5.0)
    tags = {vocab.tag(lang): name for name, lang in (("xs-ya", "ya"), ("xs-yb", "yb"), ("xs-yc", "yc"))}
    drawn = Counter[str]()
    for step in range(60):
        drawn.update(tags[int(t)] for t in data.batch(64, step).target_in[:, 0])
    expected = temperature_sampling(SIZES, 5.0)
    total = sum(drawn.values())
    chi2 = sum((drawn[n] - p * total) ** 2 / (p * total) for n, p in zip(sorted(tags.values()), expected))
    assert chi2 < 13.8, (drawn, expected)  # chi-square, 2 degrees of freedom, p = 0.001
    # T=1 is the data's own distribution: the smallest pair is then drawn about 3% of the time
    flat = ParallelCorpus(corpus, vocab, temperature=1.0)
    smallest = sum(int((flat.batch(64, s).target_in[:, 0] == vocab.tag("yc")).sum()) for s in range(30))
    assert smallest / (30 * 64) < expected[2] / 2


def test_sentences_are_encoded_with_the_tag_and_eos(corpus: Path, vocab: Vocab) -> None:
    data = ParallelCorpus(corpus, vocab)
    source_text, target_text = (corpus / "xs-yc.tsv").read_text(encoding="utf-8").splitlines()[0].split("\t")
    held = data.held_out()["xs-yc"]
    assert len(held) == 16  # the eval/ file's, not taken from training
    assert data.pair_sizes == dict(zip(["xs-ya", "xs-yb", "xs-yc"], SIZES))
    batch = data.batch(8, 0)
    for source, target_in, target_out in zip(batch.source, batch.target_in, batch.target_out):
        n = int((target_out != 0).sum())
        assert int(target_out[n - 1]) == EOS and torch.equal(target_in[1:n], target_out[: n - 1])
        assert vocab.decode(target_out[: n - 1].tolist()) in {
            line.split("\t")[1] for pair in ("xs-ya", "xs-yb", "xs-yc")
            for line in (corpus / f"{pair}.tsv").read_text(encoding="utf-8").splitlines()
        }  # fmt: skip
        assert int(source[int((source != 0).sum()) - 1]) == EOS
    assert data.detokenize([*vocab.encode(target_text), EOS, 0, 0]) == target_text
    assert source_text  # (the source side is read too)


def word(i: int) -> str:
    """A word of letters every vocabulary here knows, one for each i < 125."""
    return "".join("bdfgk"[(i // 5**k) % 5] + "a" for k in range(3))


def test_held_out_sentences_come_out_of_training_without_an_eval_folder(tmp_path: Path, vocab: Vocab) -> None:
    lines = [f"ka ni {word(i)}\tza tu {word(i)}" for i in range(50)]
    (tmp_path / "xs-ya.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = ParallelCorpus(tmp_path, vocab, held_out=100)
    held = data.held_out()["xs-ya"]
    assert len(held) == 5 and data.pair_sizes == {"xs-ya": 45}  # a tenth of 50
    trained = {vocab.decode(t[:-1]) for _, t in data.train["xs-ya"]}
    assert not trained & set(held.references) and len(trained | set(held.references)) == 50


def test_long_pairs_are_left_out_of_training(tmp_path: Path, vocab: Vocab) -> None:
    lines = [f"{'ka ' * (40 if i % 5 == 0 else 2)}ni\tza tu" for i in range(40)]
    (tmp_path / "xs-yb.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = ParallelCorpus(tmp_path, vocab, length=16)
    assert data.skipped["xs-yb"] > 0 and data.pair_sizes["xs-yb"] + data.skipped["xs-yb"] == 36
    assert data.held_out()["xs-yb"].source.size(1) <= 16  # cut for the model


def test_a_pair_the_vocabulary_has_no_tag_for_is_refused(tmp_path: Path, vocab: Vocab) -> None:
    (tmp_path / "xs-de.tsv").write_text("a\tb\nc\td\n", encoding="utf-8")
    with pytest.raises(ValueError, match="has no tag <2de> for pair xs-de"):
        ParallelCorpus(tmp_path, vocab)


def test_resource_groups_and_bleu() -> None:
    assert resource_groups({"a-b": 10, "a-c": 1000, "a-d": 50}) == {"a-c": "high", "a-d": "high", "a-b": "low"}
    assert resource_groups({"a-b": 3}) == {"a-b": "high"}
    assert bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(100.0)
    assert bleu(["dog"], ["the cat sat on the mat"]) < 1


def test_training_on_a_folder_reports_bleu_per_pair(run: tuple[Path, dict[str, float]]) -> None:
    out, result = run
    assert (out / "vocab.model").is_file() and Vocab(out / "vocab.model").languages == ["ya", "yb", "yc"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "bleu" in r]
    assert [r["step"] for r in evals] == [75, 150]
    for pair in ("xs-ya", "xs-yb", "xs-yc"):
        assert 0 <= evals[-1][f"bleu/{pair}"] <= 100 + 1e-9 and math.isfinite(evals[-1][f"eval_loss/{pair}"])
    assert result["bleu/xs-ya"] > 30, result  # the high-resource pair is learnt
    assert result["bleu/high"] == (result["bleu/xs-ya"] + result["bleu/xs-yb"]) / 2
    assert result["bleu/low"] == result["bleu/xs-yc"]
    step = out / "checkpoints" / "step-00000150"
    description = json.loads((step / "run.json").read_text())
    assert description["pairs"] == dict(zip(["xs-ya", "xs-yb", "xs-yc"], SIZES)) and description["vocab"] == 200


def test_translate_from_a_checkpoint_at_any_partition_count(
    run: tuple[Path, dict[str, float]], corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = run
    held = [line.split("\t") for line in (corpus / "eval" / "xs-ya.tsv").read_text(encoding="utf-8").splitlines()]
    sources = tmp_path / "sources.txt"
    sources.write_text("\n".join(s for s, _ in held) + "\n\n<2yb> " + held[0][0] + "\n", encoding="utf-8")
    outputs = []
    for partitions in ("1", "2"):
        target = tmp_path / f"out-{partitions}.txt"
        argv = ["translate", "--checkpoint", str(out), "--input", str(sources), "--output", str(target), "--to", "ya"]
        assert main([*argv, "--beam", "1", "--partitions", partitions, "--batch", "4"]) == 0, capsys.readouterr().err
        outputs.append(target.read_text(encoding="utf-8").splitlines())
        # progress on standard error: every sentence counted, tokens/s, the caches' memory per stage
        err = capsys.readouterr().err.splitlines()
        count = len(held) + 1
        assert err[-2].startswith(f"translating: {count}/{count} sentences (100%)") and "tokens_per_s=" in err[-2]
        assert err[-1].startswith("translated with caches of at most stage 0:")
        assert err[-1].count("stage ") == int(partitions) and "MiB" in err[-1]
    assert outputs[0] == outputs[1]  # the same translations from one and two stages
    lines = outputs[0]
    assert len(lines) == len(held) + 2 and lines[len(held)] == ""  # a blank line stays blank
    assert bleu(lines[: len(held)], [t for _, t in held]) > 30
    # the <2yb> tag asks for the other language: words of yb's lexicon, not ya's
    ya_words = {w for _, t in held for w in t.split()}
    assert lines[-1] and not set(lines[-1].split()) <= ya_words
    # beam search through the Translator API: beam 1 is greedy
    translator = Translator(out)
    assert translator.translate([h[0] for h in held[:4]], to="ya", beam=1) == lines[:4]
    assert len(translator.translate([held[0][0]], to="ya", beam=3)) == 1


def test_translate_writes_its_output_whole_or_not_at_all(
    run: tuple[Path, dict[str, float]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The disk fills up while --output is written: one line, exit 2, and the file as it was (it was
    written in place: left at 0 bytes, with a raw OSError traceback) (issue 24, item 5)."""
    import errno
    import io
    import os

    sources, target = tmp_path / "in.txt", tmp_path / "out.txt"
    sources.write_text("vude dalo\n", encoding="utf-8")
    target.write_text("yesterday's translations\n", encoding="utf-8")

    class Full(io.StringIO):
        def writelines(self, lines: object) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_disk(path: str, mode: str = "r", **kwargs: Any) -> IO[str]:
        return Full() if "w" in mode else open(path, mode, **kwargs)

    monkeypatch.setattr("gpipe.translate.open", full_disk, raising=False)
    argv = ["translate", "--checkpoint", str(run[0]), "--input", str(sources), "--output", str(target), "--to", "ya"]
    assert main([*argv, "--beam", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot write --output" in err and "no space left" in err, err
    assert target.read_text(encoding="utf-8") == "yesterday's translations\n"
    assert {p.name for p in tmp_path.iterdir()} == {"in.txt", "out.txt"}  # no temporary file left behind


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--to", "fr"], "the model does not translate into 'fr'; it knows ya, yb, yc"),
        ([], "the model translates into ya, yb, yc: say which with --to"),
        (["--beam", "0", "--to", "ya"], "--beam must be positive"),
    ],
)
def test_translate_refuses_bad_requests(
    run: tuple[Path, dict[str, float]], tmp_path: Path, argv: list[str], message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    sources = tmp_path / "in.txt"
    sources.write_text("a sentence\n", encoding="utf-8")
    assert main(["translate", "--checkpoint", str(run[0]), "--input", str(sources), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_translate_needs_a_run_on_a_folder_of_pairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train(TrainConfig(out=str(tmp_path / "synthetic"), steps=1, eval_every=1, progress=False))
    assert main(["translate", "--checkpoint", str(tmp_path / "synthetic"), "--to", "ya"]) == 2
    assert "gpipe translate needs a run of gpipe train --data FOLDER" in capsys.readouterr().err
    assert main(["translate", "--checkpoint", str(tmp_path / "nothing")]) == 2
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "data", "files", "message"),
    [
        ("hf", "TextLines", ["vocab.model"], "is of a causal language model (gpipe train --model hf) trained on text, "
         "which continues text rather than translating it: continue prompts with gpipe generate --checkpoint {ckpt}"),
        ("hf", "PreparedText", ["tokenizer.json"], "trained on text, which continues text rather than translating "
         "it: continue prompts with gpipe generate --checkpoint {ckpt}"),
        ("hf", "CausalPairs", [], "is of a causal language model (gpipe train --model hf) trained on language pairs "
         "as token ids (the built-in corpus, or source<TAB>target lines), with no vocabulary to read sentences with"),
        ("transformer", "TextPairs", [], "is of a translation model trained on one file of source<TAB>target lines "
         "as words split at white space, with no vocabulary"),
        ("amoebanet", "ImageFiles", [], "is of an image classifier (gpipe train --model amoebanet); gpipe translate "
         "needs a run of gpipe train --data FOLDER"),
        ("transformer", "PreparedCorpus", [], "keeps no vocab.model, the run's vocabulary"),
    ],
)  # fmt: skip
def test_translate_says_what_a_run_it_cannot_read_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, data: str, files: list[str], message: str
) -> None:
    """A run of another kind is named for what it is (never by gpipe's class for its data), with the
    command that reads it where there is one: a text run's vocab.model is its tokenizer, not a
    vocabulary of language pairs."""
    checkpoint = tmp_path / "run"
    checkpoint.mkdir()
    (checkpoint / "run.json").write_text(json.dumps({"config": {"model": model}, "data": data}))
    (checkpoint / "manifest.json").write_text("{}")  # (what makes a checkpoint folder complete)
    for name in files:
        (checkpoint / name).write_text("")
    assert main(["translate", "--checkpoint", str(checkpoint), "--to", "ya"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message.format(ckpt=checkpoint) in err and f"on {data}" not in err, err


def test_the_synthetic_text_translates_word_by_word(corpus: Path) -> None:
    for pair in ("xs-ya", "xs-yc"):
        lines = (corpus / f"{pair}.tsv").read_text(encoding="utf-8").splitlines()
        lines += (corpus / "eval" / f"{pair}.tsv").read_text(encoding="utf-8").splitlines()
        mapping: dict[str, set[str]] = {}
        for line in lines:
            source, target = (side.split() for side in line.split("\t"))
            for s, t in zip(source, target, strict=True):
                mapping.setdefault(s, set()).add(t)
        assert all(len(t) == 1 for t in mapping.values())  # a word always translates alike
        assert len({next(iter(t)) for t in mapping.values()}) == len(mapping) == 48  # one to one
    held = SyntheticTranslation(sizes=(30, 20), held_out=4).held_out()
    assert set(held) == {"xs-ya", "xs-yb"} and all(len(h) == 4 for h in held.values())


def test_torchrun_trains_the_vocabulary_once_and_equals_one_process(corpus: Path, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.dist_harness import free_port

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    env.pop("WORLD_SIZE", None)
    flags = [f"--data={corpus}", "--vocab-size=200", "--steps=4", "--eval-every=4", "--no-progress"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "gpipe", "train", *flags, f"--out={tmp_path / 'ranks'}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.count("training a vocabulary") == 1  # by rank 0 alone
    train(TrainConfig(out=str(tmp_path / "one"), data=str(corpus), vocab_size=200, steps=4, eval_every=4,
                      progress=False))  # fmt: skip

    def rows(out: str) -> list[dict[str, float]]:
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "elapsed_s")} for line in lines]

    assert rows("ranks") == rows("one")  # bitwise: losses, eval losses and BLEU per pair
    assert "bleu/xs-yc" in rows("ranks")[-1]
    # gpipe eval of the checkpoint: in one process, and under torchrun (rank 0 writes), with the numbers the
    # run's own evaluation logged, from its prepared data (OUT/prepared), bitwise
    assert main(["eval", "--checkpoint", str(tmp_path / "ranks")]) == 0
    cmd[cmd.index("train") :] = ["eval", "--checkpoint", str(tmp_path / "one")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for out in ("ranks", "one"):
        lines = (tmp_path / out / "eval" / "metrics.jsonl").read_text().splitlines()
        (evaluated,) = map(json.loads, lines)
        assert evaluated == {k: v for k, v in rows(out)[-1].items() if k in evaluated}
        assert "bleu/xs-yc" in evaluated


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vocab-size", "100000"], "vocabulary size 100000 is too large for the sampled text"),
        (["--vocab", "{tmp}/none.model"], "--vocab '{tmp}/none.model': no such file"),
        (["--max-length", "1"], "--max-length must be at least 2"),
        (["--beam", "0"], "--beam must be positive"),
    ],
)
def test_bad_translation_flags_are_refused(
    corpus: Path, tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [f.format(tmp=tmp_path) for f in flags]
    argv = ["train", "--data", str(corpus), "--out", str(tmp_path / "out"), "--steps", "1", "--no-progress", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err
    assert not (tmp_path / "out" / "vocab.model").exists()


def test_vocab_and_folders_are_for_the_transformer(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "v.model"
    model.write_bytes(b"x")
    assert main(["train", "--vocab", str(model), "--out", str(tmp_path / "o"), "--steps", "1"]) == 2
    assert "is for --data FOLDER" in capsys.readouterr().err
    assert main(["train", "--model", "hf", "--data", str(corpus), "--out", str(tmp_path / "o"), "--steps", "1"]) == 2
    assert "a folder of language pairs trains the encoder-decoder transformer" in capsys.readouterr().err


def test_one_tab_separated_file_is_one_pair_with_held_out_sentences(tmp_path: Path) -> None:
    from gpipe.data import TextPairs

    data = tmp_path / "de-en.tsv"
    data.write_text("".join(f"a{i} b{i} c\tx{i} y{i}\n" for i in range(40)))
    pairs = TextPairs(data)
    held = pairs.held_out()["de-en"]
    assert len(held) == 4 and pairs.pair_sizes == {"de-en": 36}
    trained = {pairs.detokenize(t) for _, t in pairs.pairs}
    assert len(trained) == 36 and not trained & set(held.references)
    assert pairs.detokenize(held.target_out[0].tolist()) == held.references[0]
    result = train(TrainConfig(out=str(tmp_path / "out"), data=str(data), steps=2, batch=8, eval_every=2,
                               progress=False))  # fmt: skip
    assert 0 <= result["bleu/de-en"] <= 100 + 1e-9 and result["bleu"] == result["bleu/de-en"]
