from __future__ import annotations

from pathlib import Path

import pytest

from gpipe.cli import main


def test_demo_prints_bubble_and_falling_loss(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "25", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "bubble 0.111" in out
    losses = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 25
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["demo", "--partitions", "50"], "exceeds the model's"), (["demo", "--chunks", "0"], "--chunks must be positive")],
)
def test_demo_rejects_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


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
