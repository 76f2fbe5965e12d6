"""`gpipe train`: learning, partition invariance, exact resume, configuration and errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe.cli import main
from gpipe.data import SyntheticTranslation
from gpipe.train import TrainConfig, parse, train


def losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def quick(out: Path, **kwargs: Any) -> TrainConfig:
    return TrainConfig(out=str(out), progress=False, **kwargs)


def test_learns_to_translate_every_pair_and_is_the_same_for_one_and_two_stages(tmp_path: Path) -> None:
    two = train(quick(tmp_path / "k2", steps=200, partitions=2, eval_every=100))
    one = train(quick(tmp_path / "k1", steps=100, partitions=1, eval_every=100))  # (the first half, as K=2's)
    untrained = train(quick(tmp_path / "k0", steps=1, lr=1e-12, eval_every=1))  # (one update of 1e-12)
    assert losses(tmp_path / "k1") == losses(tmp_path / "k2")[:100]  # bitwise: the same floats
    assert two["eval_loss"] < two["baseline"] - 0.5, (two["eval_loss"], two["baseline"])
    halfway = [json.loads(line) for line in (tmp_path / "k2" / "metrics.jsonl").read_text().splitlines()][99]
    same = [k for k in halfway if k not in ("tokens_per_s", "bubble", "elapsed_s")]
    assert "bleu/xs-yd" in same and {k: one[k] for k in same} == {k: halfway[k] for k in same}
    pairs = ["xs-ya", "xs-yb", "xs-yc", "xs-yd"]  # 20000, 4000, 800 and 150 sentence pairs
    for pair in pairs:
        assert two[f"bleu/{pair}"] > 30, (pair, two)
        assert two[f"bleu/{pair}"] > untrained[f"bleu/{pair}"] + 5, (pair, two, untrained)
    assert two["bleu/high"] == (two["bleu/xs-ya"] + two["bleu/xs-yb"]) / 2
    assert two["bleu/low"] == (two["bleu/xs-yc"] + two["bleu/xs-yd"]) / 2
    assert (tmp_path / "k2" / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_v_schedule_trains_two_stages_per_worker_and_is_the_same_for_one_and_two_workers(tmp_path: Path) -> None:
    two = train(quick(tmp_path / "k2", steps=12, partitions=2, schedule="zb-v", eval_every=12))
    one = train(quick(tmp_path / "k1", steps=12, partitions=1, schedule="zb-v", eval_every=12))
    assert losses(tmp_path / "k1") == losses(tmp_path / "k2")
    assert two["eval_loss"] == one["eval_loss"]
    quick(tmp_path / "k9", partitions=3, schedule="dualpipev", layers=2).check()  # 6 stages, 7 layers: fine
    with pytest.raises(ValueError, match=r"--partitions 4 x 2 stages each \(dualpipev\) exceeds"):
        quick(tmp_path / "k9", partitions=4, schedule="dualpipev", layers=2).check()


@pytest.fixture(scope="module")
def run_and_half(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 24 steps ('full') and the same run stopped at its checkpoint of step 12 ('part'), at
    the default K=2: what each resume below starts from (a copy of 'part') and must give."""
    root = tmp_path_factory.mktemp("resume")
    train(quick(root / "full", steps=24, checkpoint_every=12, eval_every=12))
    train(quick(root / "part", steps=12, checkpoint_every=12, eval_every=12))
    return root


def test_resume_continues_exactly(run_and_half: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(run_and_half / "part", tmp_path / "part")
    train(quick(tmp_path / "part", steps=24, checkpoint_every=12, eval_every=12, resume=True))
    assert losses(tmp_path / "part") == losses(run_and_half / "full")
    assert [s for s, _ in losses(tmp_path / "part")] == list(range(1, 25))


@pytest.mark.parametrize("partitions", [1, 4])
def test_resume_at_another_partition_count_continues_exactly(
    run_and_half: Path, tmp_path: Path, partitions: int
) -> None:
    # the optimizer's state is keyed by global parameter name: a K=2 checkpoint resumes at K=1 and K=4
    import shutil

    shutil.copytree(run_and_half / "part", tmp_path / "part")
    train(quick(tmp_path / "part", steps=24, checkpoint_every=12, eval_every=12, resume=True, partitions=partitions))
    assert losses(tmp_path / "part") == losses(run_and_half / "full")


def test_background_checkpoints_hold_what_a_foreground_save_holds(tmp_path: Path) -> None:
    train(quick(tmp_path / "sync", steps=12, checkpoint_every=4, eval_every=12))
    train(quick(tmp_path / "async", steps=12, checkpoint_every=4, eval_every=12, async_checkpoint=True))
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    for run in ("sync", "async"):  # resume both from step 8's checkpoint
        (tmp_path / run / "checkpoints" / "latest").write_text("step-00000008")
        train(quick(tmp_path / run, steps=12, checkpoint_every=4, eval_every=12, resume=True))
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    names = sorted(p.name for p in (tmp_path / "async" / "checkpoints" / "step-00000008").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "sync" / "checkpoints" / "step-00000008").iterdir())
    assert {"run.json", "scheduler.json", "manifest.json", ".metadata"} <= set(names)


def test_ctrl_c_writes_a_final_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = SyntheticTranslation.batch

    def interrupt_at_step_7(self: Any, size: int, step: int, split: str = "train") -> Any:
        if step == 7 and split == "train":
            raise KeyboardInterrupt
        return real(self, size, step, split=split)

    monkeypatch.setattr(SyntheticTranslation, "batch", interrupt_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        train(quick(tmp_path, steps=50))
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000006"
    monkeypatch.undo()
    train(quick(tmp_path, steps=8, resume=True))
    assert [s for s, _ in losses(tmp_path)] == list(range(1, 9))


def test_config_file_and_flags(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('partitions = 3\nschedule = "zb-h1"\nsteps = 7\n')
    cfg = parse(["--config", str(config), "--steps", "9", "--no-progress"])
    assert (cfg.partitions, cfg.schedule, cfg.steps, cfg.progress) == (3, "zb-h1", 9, False)


def test_real_data_from_a_tab_separated_file(tmp_path: Path) -> None:
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"a{i} b{i} c\tx{i} y{i}\n" for i in range(20)))
    result = train(quick(tmp_path / "out", data=str(data), steps=5, batch=8, eval_every=5))
    assert result["step"] == 5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "lstm"], "unknown model 'lstm'"),
        (["--partitions", "9", "--layers", "2"], "--partitions 9 exceeds the model's 7 layers"),
        (["--data", "/nonexistent/pairs.tsv"], "cannot read the data file '/nonexistent/pairs.tsv'"),
        (["--schedule", "zigzag"], "unknown schedule 'zigzag'"),
        (["--resume"], "--resume: no checkpoint"),
    ],
)
def test_bad_flags_and_data(tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--out", str(tmp_path / "x"), "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def _scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_metrics(tmp_path: Path) -> None:
    train(quick(tmp_path / "run", steps=6, eval_every=3))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scalars = _scalars(tmp_path / "run")
    pairs = [f"{kind}/xs-y{p}" for kind in ("bleu", "eval_loss") for p in "abcd"]
    assert {
        "loss",
        "lr",
        "bubble",
        "eval_loss",
        "tokens_per_s",
        "bleu",
        "bleu/high",
        "bleu/low",
        *pairs,
    } <= scalars.keys()
    for tag in ("loss", "lr", "tokens_per_s", "eval_loss", "bleu", "bleu/low", *pairs):
        expected = [(r["step"], r[tag]) for r in rows if tag in r]
        assert [s for s, _ in scalars[tag]] == [s for s, _ in expected], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    assert [s for s, _ in scalars["eval_loss"]] == [3, 6]


def test_tensorboard_after_resume_holds_each_step_once(tmp_path: Path) -> None:
    import shutil

    train(quick(tmp_path / "run", steps=6, checkpoint_every=2, eval_every=2))
    # As if the run had died after step 6's events but before its checkpoint: the newest is step 4's.
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000006")
    (checkpoints / "latest").write_text("step-00000004")
    train(quick(tmp_path / "run", steps=6, checkpoint_every=2, eval_every=2, resume=True))
    steps = [s for s, _ in _scalars(tmp_path / "run")["loss"]]
    assert steps == sorted(set(steps)) == list(range(1, 7))
    assert [(s, round(v, 5)) for s, v in _scalars(tmp_path / "run")["loss"]] == [
        (s, round(v, 5)) for s, v in losses(tmp_path / "run")
    ]


def test_tensorboard_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train(quick(tmp_path / "off", steps=2, eval_every=2, tensorboard="off"))
    assert not (tmp_path / "off" / "tensorboard").exists()
    monkeypatch.setattr("gpipe.train.config.has_tensorboard", lambda: False)
    monkeypatch.setattr("gpipe.train.metrics.has_tensorboard", lambda: False)
    train(quick(tmp_path / "auto", steps=2, eval_every=2))  # auto without the package: no event files
    assert not (tmp_path / "auto" / "tensorboard").exists()
    with pytest.raises(ValueError, match="--tensorboard on needs the tensorboard package"):
        quick(tmp_path / "on", tensorboard="on").check()
    with pytest.raises(ValueError, match="unknown --tensorboard 'yes'; choose one of auto, on, off"):
        quick(tmp_path / "on", tensorboard="yes").check()


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_earlier_checkpoint_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk fills up at the second checkpoint: one line and exit 2, not a NoSpaceError traceback;
    the first checkpoint is intact and --resume goes on from it (issue 24, item 6)."""
    import errno
    import os

    argv = ["train", "--out", str(tmp_path), "--no-progress", "--steps", "4", "--checkpoint-every", "2",
            "--eval-every", "4", "--tensorboard", "off"]  # fmt: skip
    real_save, calls = torch.save, {"n": 0}

    def full_after_the_first_checkpoint(obj: object, f: object) -> None:
        calls["n"] += 1
        if calls["n"] > 1 and (tmp_path / "checkpoints" / "step-00000002").exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", full_after_the_first_checkpoint)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: no space left on device"), err
    assert "the earlier checkpoints are intact" in err
    monkeypatch.setattr(torch, "save", real_save)
    assert main([*argv, "--resume"]) == 0
    assert [s for s, _ in losses(tmp_path)] == [1, 2, 3, 4]


def test_help_is_plain_text_with_every_setting_in_a_group(capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import fields

    with pytest.raises(SystemExit):
        parse(["-h"])
    text = capsys.readouterr().out
    assert not any(markup in text for markup in (":mod:", ":class:", ":func:", "``")), text
    sections = text.split("\n\n")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert sum(f"\n  {flag} " in f"\n{s}" or f"\n  {flag}," in f"\n{s}" for s in sections) == 1, flag
    assert "\nmodel:\n" in text and "\npipeline:\n" in text and "\noutput:\n" in text
