"""Every bad input is refused before any work starts, with a clear error naming the value: in the
CLI one line ``error: ...`` and exit status 2, in the API a ``ValueError`` or ``TypeError``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gpipe import GPipe, Pipeline, make_schedule, simulate
from gpipe.cli import main
from gpipe.schedule import render_timeline
from gpipe.train import ConfigError, TrainConfig, parse
from gpipe.train import loop as train_loop

CONFIGS = {
    "progress-string.toml": 'progress = "no"\n',
    "resume-string.toml": 'resume = "false"\n',
    "steps-string.toml": 'steps = "ten"\n',
    "steps-float.toml": "steps = 2.5\n",
    "steps-bool.toml": "steps = true\n",
    "model-int.toml": "model = 3\n",
    "lr-zero.toml": "lr = 0\n",
    "unknown.toml": "stepz = 3\n",
    "table.toml": "[run]\nsteps = 2\n",
    "broken.toml": "steps = = 2\n",
    "list.json": "[1, 2]",
    "string.json": '"steps"',
}

# (argv after the command, a piece of the message: the bad value, and where useful the fix)
TRAIN = [
    (["--lr", "0"], "--lr must be a positive finite number (got 0.0)"),
    (["--lr", "-0.01"], "(got -0.01)"),
    (["--lr", "nan"], "(got nan)"),
    (["--lr", "abc"], "invalid float value: 'abc'"),
    (["--clip-norm", "-1"], "--clip-norm must be a finite number >= 0 (0: no clipping) (got -1.0)"),
    (["--logit-clip", "-1"], "--logit-clip must be a finite number >= 0"),
    (["--eval-every", "-1"], "--eval-every must be 0 (never) or positive (got -1)"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be positive (got 0)"),
    (["--eval-batches", "0"], "--eval-batches must be positive (got 0)"),
    (["--label-smoothing", "1.5"], "--label-smoothing must be in [0, 1) (got 1.5)"),
    (["--label-smoothing", "-0.1"], "(got -0.1)"),
    (["--dropout", "1"], "--dropout must be in [0, 1) (got 1.0)"),
    (["--temperature", "0"], "--temperature must be a positive finite number (got 0.0)"),
    (["--steps", "0"], "--steps must be positive (got 0)"),
    (["--steps", "ten"], "invalid int value: 'ten'"),
    (["--steps", "2.5"], "invalid int value: '2.5'"),
    (["--batch", "-1"], "--batch must be positive (got -1)"),
    (["--warmup", "0"], "--warmup must be positive (got 0)"),
    (["--layers", "-1"], "(got -1)"),
    (["--classes", "1"], "--classes must be at least 2 (got 1)"),
    (["--dim", "64", "--heads", "3"], "heads: 3"),
    (["--model", "amoebanet", "--image-size", "2"], "--image-size must be at least 4 (got 2)"),
    (["--model", "lstm"], "unknown model 'lstm'"),
    (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    (["--tensor-parallel", "2"], "nn.MultiheadAttention's fused projection cannot be: give --head-dim 16"),
    (["--model", "amoebanet", "--tensor-parallel", "2"], "AmoebaNet-D has no tensor-parallel plan"),
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--data", "{tmp}/nowhere.tsv"], "'{tmp}/nowhere.tsv': there is no such file"),
    (["--out", "{tmp}/afile"], "--out '{tmp}/afile' is a file"),
    (["--out", "{tmp}/afile/run"], "inside '{tmp}/afile', which is a file"),
    (["--resume"], "--resume: no checkpoint in '{tmp}/run/checkpoints'"),
    (["--config", "{tmp}/missing.toml"], "cannot read the config file '{tmp}/missing.toml'"),
    (["--config", "{tmp}/progress-string.toml"], "progress in '{tmp}/progress-string.toml' must be true or false"),
    (["--config", "{tmp}/resume-string.toml"], "resume in '{tmp}/resume-string.toml' must be true or false (got 'fa"),
    (["--config", "{tmp}/steps-string.toml"], "steps in '{tmp}/steps-string.toml' must be an integer (got 'ten'"),
    (["--config", "{tmp}/steps-float.toml"], "must be an integer (got 2.5"),
    (["--config", "{tmp}/steps-bool.toml"], "must be an integer (got True"),
    (["--config", "{tmp}/model-int.toml"], "model in '{tmp}/model-int.toml' must be a string (got 3"),
    (["--config", "{tmp}/lr-zero.toml"], "--lr must be a positive finite number (got 0.0)"),
    (["--config", "{tmp}/unknown.toml"], "unknown setting 'stepz' in the config file '{tmp}/unknown.toml'; did"),
    (["--config", "{tmp}/unknown.toml"], "did you mean 'steps'?"),
    (["--config", "{tmp}/table.toml"], "unknown setting 'run'"),
    (["--config", "{tmp}/broken.toml"], "cannot read the config file '{tmp}/broken.toml'"),
    (["--config", "{tmp}/list.json"], "the config file '{tmp}/list.json' holds a list"),
    (["--config", "{tmp}/string.json"], "holds a str"),
]  # fmt: skip

OTHERS = [
    (["schedule", "--out", "{tmp}/missing/timeline.png"], "the folder '{tmp}/missing' of"),
    (["schedule", "--out", "{tmp}/timeline.jpgx"], "has extension .jpgx; end the name with one of"),
    (["schedule", "--out", "{tmp}/timeline"], "has no extension; end the name with one of"),
    (["schedule", "--out", "{tmp}/afile/timeline.png"], "the folder '{tmp}/afile' of"),
    (["schedule", "--chunks", "0"], "--chunks must be positive (got 0)"),
    (["schedule", "--virtual", "0"], "--virtual must be positive (got 0)"),
    (["schedule", "--schedule", "zigzag"], "invalid choice: 'zigzag'"),
    (["schedule", "--costs", "F=nan"], "cost of F must be positive and finite (got nan)"),
    (["schedule", "--costs", "X=1"], "(got 'X=1')"),
    (["demo", "--corpus", "{tmp}/c", "--out", "{tmp}/run", "--lr", "0"], "--lr must be a positive finite number"),
    (["demo", "--corpus", "{tmp}/c", "--out", "{tmp}/run", "--lr", "nan"], "(got nan)"),
    (["demo", "--corpus", "{tmp}/afile", "--out", "{tmp}/run"], "--corpus '{tmp}/afile' is a file; name a folder"),
    (["demo", "--corpus", "{tmp}/c", "--out", "{tmp}/afile"], "--out '{tmp}/afile' is a file"),
    (["demo", "--corpus", "{tmp}/c", "--vocab", "{tmp}/afile"], "trains on its own corpus (--corpus) and vocabulary"),
    (["demo", "--corpus", "{tmp}/c", "--out", "{tmp}/run", "--steps", "zero"], "invalid int value: 'zero'"),
    (["bench", "--repeats", "0"], "repeats must be positive (repeats: 0)"),
    (["bench", "--only", "speed"], "unknown section(s) speed"),
    (["bench", "--only", ","], "no section to run"),
    (["bench", "--out", "{tmp}/afile"], "the report's folder '{tmp}/afile' is a file"),
    (["bogus"], "invalid choice: 'bogus'"),
]


@pytest.fixture
def tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the config files and a plain file ``afile``; training itself is forbidden."""
    for name, text in CONFIGS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "afile").write_text("not a folder")

    def no_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a bad input must be refused before any work starts")

    monkeypatch.setattr(train_loop, "_train", no_work)
    monkeypatch.setattr("gpipe.bench.run", no_work)
    monkeypatch.setattr("gpipe.demo.demo", no_work)
    return tmp_path


def _one_error_line(argv: list[str], message: str, tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    assert message.replace("{tmp}", str(tmp)) in err


@pytest.mark.parametrize(("argv", "message"), TRAIN, ids=[" ".join(a).replace("{tmp}/", "") for a, _ in TRAIN])
def test_train_refuses(argv: list[str], message: str, tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _one_error_line(["train", "--out", str(tmp / "run"), *argv], message, tmp, capsys)


@pytest.mark.parametrize(("argv", "message"), OTHERS, ids=[" ".join(a).replace("{tmp}/", "") for a, _ in OTHERS])
def test_other_commands_refuse(argv: list[str], message: str, tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _one_error_line(argv, message, tmp, capsys)


def test_a_bug_in_training_keeps_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(cfg: TrainConfig, restart: Any, on_eval: Any) -> Any:
        raise ValueError("a bug deep in training")

    monkeypatch.setattr(train_loop, "_train", bug)
    with pytest.raises(ValueError, match="a bug deep in training"):
        main(["train", "--out", str(tmp_path), "--no-progress"])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"steps": "ten"}, TypeError, "steps must be an integer (got 'ten'"),
        ({"steps": 2.5}, TypeError, "(got 2.5"),
        ({"progress": "no"}, TypeError, "progress must be true or false (got 'no'"),
        ({"lr": 0.0}, ValueError, "(got 0.0)"),
        ({"lr": float("inf")}, ValueError, "(got inf)"),
        ({"eval_every": -1}, ValueError, "--eval-every must be 0 (never) or positive (got -1)"),
        ({"label_smoothing": 1.5}, ValueError, "(got 1.5)"),
        ({"schedule": "zigzag"}, ValueError, "unknown schedule 'zigzag'"),
        ({"head_dim": -8}, ValueError, "--head-dim must be positive, or 0 for --dim / --heads (got -8)"),
        ({"dim": 60, "heads": 8}, ValueError, "--dim must be a multiple of --heads (dim: 60, heads: 8), or give"),
        ({"reference_cells": True}, ValueError, "--reference-cells builds the cells of --model amoebanet (model: 'tr"),
    ],
)
def test_config_check_refuses(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        TrainConfig(**kwargs).check()
    assert message in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_head_dim_frees_the_model_dimension_from_the_heads() -> None:
    TrainConfig(dim=60, heads=8, head_dim=16).check()  # (attention 128 wide in a 60-wide model)


def test_parse_converts_ints_of_float_settings(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text("lr = 1\nprogress = false\n")
    cfg = parse(["--config", str(tmp_path / "run.toml"), "--out", str(tmp_path)])
    assert (cfg.lr, cfg.progress) == (1.0, False)
    assert isinstance(cfg.lr, float)


def _model() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])


@pytest.mark.parametrize("balance", [np.array([2, 2]), [np.int64(1), np.int64(3)], torch.tensor([3, 1])])
def test_balance_of_numpy_integers_is_accepted(balance: Any) -> None:
    assert GPipe(_model(), balance, devices=["cpu", "cpu"]).balance == [int(b) for b in balance]
    pipe = Pipeline(_model(), balance, devices=["cpu", "cpu"], chunks=2, loss_fn=nn.functional.mse_loss)
    assert pipe.balance == [int(b) for b in balance]


@pytest.mark.parametrize("balance", [np.array([2.5, 1.5]), [2.0, 2.0]])
def test_balance_of_floats_is_refused(balance: Any) -> None:
    with pytest.raises(TypeError, match=r"balance must contain ints \(balance: \[2.5, 1.5\]|\[2.0, 2.0\]"):
        GPipe(_model(), balance, devices=["cpu", "cpu"])


def test_step_needs_a_target() -> None:
    pipe = Pipeline(_model(), [2, 2], devices=["cpu", "cpu"], chunks=2, loss_fn=nn.functional.mse_loss)
    with pytest.raises(TypeError, match=r"needs the target .*\(target: None\)"):
        pipe.step(torch.randn(4, 4), None)


@pytest.mark.parametrize(
    ("name", "message"), [("t.jpgx", "extension .jpgx"), ("t", "no extension"), ("missing/t.png", "does not exist")]
)
def test_render_timeline_refuses_bad_paths(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        render_timeline(simulate(make_schedule("gpipe", 2, 2)), tmp_path / name)
    assert str(tmp_path / name) in str(info.value)
    assert ".png" in str(info.value) or "create it" in str(info.value)
