"""``gpipe corpus``, ``gpipe vocab`` and ``gpipe train``'s vocabulary on the README's walk-through: the
default sizes work on the built-in corpus, an explicit size it cannot fill is refused naming what
works, and an output path that cannot be written is one line, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpipe.cli import main
from gpipe.data.vocab import Vocab
from gpipe.demo import VOCAB_SIZE
from gpipe.train import ConfigError, parse
from gpipe.train.setup import make_data


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("small")
    assert main(["corpus", "--out", str(root), "--sizes", "300,60", "--held-out", "8"]) == 0
    return root


def refused(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("command", "out", "message"),
    [
        ("corpus", "file/x", "--out '{tmp}/file/x' is inside '{tmp}/file', which is a file; name a folder"),
        ("corpus", "file/x/y", "--out '{tmp}/file/x/y' is inside '{tmp}/file', which is a file; name a folder"),
        ("corpus", "file", "--out '{tmp}/file' is a file; name a folder"),
        ("vocab", "file/x", "--out '{tmp}/file/x' is inside '{tmp}/file', which is a file; name a prefix in a folder"),
        ("vocab", "folder", "--out '{tmp}/folder' would write the file '{tmp}/folder.model', which is a folder"),
    ],
)
def test_an_out_that_cannot_be_written_is_one_line(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, out: str, message: str
) -> None:
    (tmp_path / "file").write_text("a file\n")
    (tmp_path / "folder.model").mkdir()
    flags = ["--sizes", "20"] if command == "corpus" else ["--data", str(small), "--size", "100"]
    assert main([command, "--out", str(tmp_path / out), *flags]) == 2
    assert message.format(tmp=tmp_path) in refused(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder.model"]  # nothing written


def test_the_readme_walkthrough_works_with_the_default_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpipe corpus --out C``, ``gpipe vocab --data C`` and ``gpipe train --data C``: the built-in corpus
    supports a few hundred pieces, so the default sizes (up to 32000, up to 8000) make that many and say
    so; gpipe vocab's default sample is gpipe train's, so both make the same vocabulary."""
    corpus = tmp_path / "corpus"
    assert main(["corpus", "--out", str(corpus)]) == 0
    capsys.readouterr()
    assert main(["vocab", "--data", str(corpus), "--out", str(tmp_path / "vocab")]) == 0
    printed = capsys.readouterr()
    pieces = Vocab(tmp_path / "vocab.model").size
    assert 8 < pieces < 8000
    assert pieces == VOCAB_SIZE  # gpipe demo's vocabulary: every piece the corpus supports, no fewer
    assert f"wrote {tmp_path}/vocab.model ({pieces} pieces)" in printed.out
    assert printed.err == (
        f"note: the sampled text supports only {pieces} pieces (--size left out: up to 32000); the vocabulary "
        f"has {pieces}\n"
    )

    cfg = parse(["--data", str(corpus), "--out", str(tmp_path / "run")])
    assert cfg.vocab_size == 0
    make_data(cfg)
    err = capsys.readouterr().err
    assert f"note: the text supports only {pieces} pieces (--vocab-size left out: up to 8000)" in err
    assert (tmp_path / "run" / "vocab.vocab").read_text() == (tmp_path / "vocab.vocab").read_text()

    # an explicit size is exact: one the text cannot fill is refused, naming the largest that works
    too_many = ["vocab", "--data", str(corpus), "--out", str(tmp_path / "exact")]
    assert main([*too_many, "--size", str(pieces + 1)]) == 2
    err = refused(capsys)
    assert f"SentencePiece can make at most {pieces} pieces of it; lower the size to {pieces} or less" in err
    assert "leave --size out for as many as the text supports" in err
    assert main([*too_many, "--size", "8000"]) == 2  # (refused before training: far more than its words make)
    assert "vocabulary size 8000 is too large for the sampled text: its words make at most" in refused(capsys)
    assert not list(tmp_path.glob("exact*"))
    assert main([*too_many, "--size", str(pieces)]) == 0
    assert Vocab(tmp_path / "exact.model").size == pieces

    with pytest.raises(ConfigError, match=r"vocabulary size 8000 is too large.*leave --vocab-size out"):
        make_data(parse(["--data", str(corpus), "--out", str(tmp_path / "run8000"), "--vocab-size", "8000"]))
    assert not (tmp_path / "run8000" / "vocab.model").exists()


def test_a_negative_vocab_size_is_refused(small: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--vocab-size must be positive, or 0 for as many as the text supports"):
        parse(["--data", str(small), "--out", str(tmp_path / "run"), "--vocab-size", "-1"])
