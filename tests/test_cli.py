from __future__ import annotations

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
