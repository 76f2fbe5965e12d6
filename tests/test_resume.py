"""`gpipe train --resume` keeps the run's own settings (flags override, and are named), refuses what cannot
change mid-run, says when a run is finished; `--out` over an earlier run is refused unless `--overwrite`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpipe.cli import main
from gpipe.train import TrainConfig, parse, train

QUICK = ["--batch", "16", "--checkpoint-every", "3", "--eval-every", "3", "--eval-batches", "1", "--no-progress"]


def rows(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def gpipe_train(*argv: str) -> int:
    return main(["train", *argv, *QUICK])


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 6 steps at a learning rate other than the default."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert gpipe_train("--out", str(out), "--steps", "6", "--lr", "0.005", "--warmup", "4", "--seed", "3") == 0
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))
    return tmp_path / "run"


def test_resume_takes_the_runs_settings_and_names_the_flags_that_override_them(
    six_steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_of(six_steps, tmp_path)
    cfg = parse(["--out", str(out), "--resume", "--steps", "9"])
    assert (cfg.lr, cfg.warmup, cfg.seed, cfg.steps, cfg.batch) == (0.005, 4, 3, 9, 16)
    capsys.readouterr()
    assert gpipe_train("--out", str(out), "--resume", "--steps", "9") == 0
    err = capsys.readouterr().err
    assert "resuming" in err and "checkpoint of step 6" in err and "--steps 6 -> 9" in err, err
    assert "--lr" not in err  # the run's own
    # The same as a run of 9 steps from the start, with the run's learning rate (not the default's).
    whole = tmp_path / "whole"
    assert gpipe_train("--out", str(whole), "--steps", "9", "--lr", "0.005", "--warmup", "4", "--seed", "3") == 0
    assert [(r["step"], r["loss"], r["lr"]) for r in rows(out)] == [
        (r["step"], r["loss"], r["lr"]) for r in rows(whole)
    ]


def test_a_finished_run_says_so_and_trains_nothing(
    six_steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_of(six_steps, tmp_path)
    before = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert gpipe_train("--out", str(out), "--resume") == 0
    err = capsys.readouterr().err
    assert "is finished" in err and "step 6" in err and "--steps above 6" in err, err
    assert (out / "metrics.jsonl").read_bytes() == before
    last = train(TrainConfig(out=str(out), resume=True, steps=6, progress=False, batch=16, lr=0.005, warmup=4, seed=3))
    assert last["step"] == 6 and last == rows(out)[-1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "3"], "--steps 3 is before the checkpoint's step 6"),
        (["--dim", "32", "--heads", "4"], "--dim 32 differs from the run's 64, and the model's size cannot change"),
        (["--optimizer", "rmsprop"], "--optimizer 'rmsprop' differs from the run's 'adam'"),
        (["--overwrite"], "--resume continues the run in OUT, --overwrite deletes it"),
    ],
)
def test_resume_refuses_what_cannot_change_mid_run(
    six_steps: Path, tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_of(six_steps, tmp_path)
    before = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert gpipe_train("--out", str(out), "--resume", *flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert (out / "metrics.jsonl").read_bytes() == before


def test_resume_on_other_data_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pairs = "".join(f"a{i} b{i}\tc{i} d{i}\n" for i in range(40))
    (tmp_path / "one.tsv").write_text(pairs)
    (tmp_path / "two.tsv").write_text(pairs.replace("a", "e"))
    out = tmp_path / "run"
    assert gpipe_train("--out", str(out), "--data", str(tmp_path / "one.tsv"), "--steps", "3") == 0
    capsys.readouterr()
    assert gpipe_train("--out", str(out), "--resume", "--data", str(tmp_path / "two.tsv"), "--steps", "4") == 2
    err = capsys.readouterr().err
    assert "--data" in err and "two.tsv" in err and "one.tsv" in err and "the data cannot change" in err, err
    # The same file, however spelled, is the run's data.
    spelled = str(tmp_path / "." / "one.tsv")
    assert gpipe_train("--out", str(out), "--resume", "--data", spelled, "--steps", "4") == 0
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]


def test_out_of_an_earlier_run_is_refused_unless_overwrite(
    six_steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_of(six_steps, tmp_path)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert gpipe_train("--out", str(out), "--steps", "3") == 2
    err = capsys.readouterr().err
    assert "holds an earlier run (checkpoints up to step 6, metrics.jsonl" in err and "--overwrite" in err, err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert gpipe_train("--out", str(out), "--steps", "3", "--overwrite") == 0
    assert "deleted the earlier run" in capsys.readouterr().err
    assert [r["step"] for r in rows(out)] == [1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000003"]
    if (out / "tensorboard").exists():  # one run's event files, not two drawn over each other
        assert len(list((out / "tensorboard").rglob("events.*"))) == 1
    # A vocabulary or nothing at all in OUT is no earlier run.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "vocab.model").write_bytes(b"")
    TrainConfig(out=str(fresh)).check()
