from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpipe.cli import main
from gpipe.data import SyntheticTranslation
from gpipe.data.vocab import Vocab, read_pairs
from gpipe.demo import VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[1]


def test_demo_is_make_demo_the_translation_workflow(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``gpipe demo`` writes the built-in corpus and trains on it with the demo's vocabulary, replacing an
    earlier run; ``make demo`` runs it; a flag it does not know goes to gpipe train."""
    demo_target = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert demo_target is not None and demo_target[1].split() == ["$(BIN)/gpipe", "demo"]
    corpus, out = tmp_path / "corpus", tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')  # an earlier run's
    flags = ["--steps", "2", "--dim", "32", "--heads", "2", "--hidden", "64", "--no-progress"]
    assert main(["demo", "--corpus", str(corpus), "--out", str(out), *flags]) == 0
    text = capsys.readouterr().out
    sizes = SyntheticTranslation().pair_sizes
    assert {name: len(pairs.sources) for name, pairs in read_pairs(corpus).items()} == sizes  # gpipe corpus's
    assert f"wrote {2 * len(sizes)} files to {corpus}" in text
    assert Vocab(out / "vocab.model").size == VOCAB_SIZE
    for name, size in sizes.items():  # the BLEU table, a row per pair
        assert re.search(rf"^{name} +{size} ", text, re.M), text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "bleu" in rows[-1]


def test_demo_refuses_bad_flags_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "new" / "corpus"
    for argv, message in [
        (["--steps", "0"], "--steps must be positive (got 0)"),
        (["--data", "x.tsv"], "gpipe demo trains on its own corpus (--corpus) and vocabulary (--data given)"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ]:
        assert main(["demo", "--corpus", str(corpus), "--out", str(tmp_path / "run"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "new").exists()  # the folders made to check the flags are gone again
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("command", "example"),
    [
        ("corpus", "gpipe corpus --out corpus/ "),
        ("vocab", "gpipe vocab --data corpus/ --size 8000 --out shared "),
        ("schedule", "gpipe schedule --auto --stages 4 --chunks 8 --costs F=1,I=1,W=2,transfer=0.1"),
    ],
)
def test_help_describes_the_command_with_examples(
    command: str, example: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """-h: the module's docstring, its example lines kept as written, without reST markup."""
    with pytest.raises(SystemExit) as done:
        main([command, "-h"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert description.startswith(f"gpipe {command}"), text
    assert re.search(rf"^    {re.escape(example)}", text, re.M), text
    assert "``" not in text and ":mod:" not in text and ":func:" not in text


def test_schedule_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/timeline.png"
    assert main(["schedule", "--schedule", "1f1b", "--stages", "4", "--chunks", "8", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "bubble 0.2727" in text
    assert "peak in-flight activations per worker: 4, 3, 2, 1" in text
    with open(out, "rb") as f:
        assert f.read(4) == b"\x89PNG"


def test_schedule_command_interleaved_and_costs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "--schedule", "interleaved-1f1b", "--stages", "2", "--chunks", "4", "--virtual", "2"]) == 0
    assert "4 stages" in capsys.readouterr().out
    assert main(["schedule", "--schedule", "zb-h1", "--stages", "4", "--chunks", "8", "--costs", "F=1,I=1,W=1"]) == 0
    assert "idle per worker: 3, 3, 3, 3" in capsys.readouterr().out


def test_schedule_command_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "--schedule", "gpipe", "--virtual", "2"]) == 2
    assert "runs one stage per worker" in capsys.readouterr().err
    assert main(["schedule", "--costs", "F=-1"]) == 2
    assert "must be positive" in capsys.readouterr().err
