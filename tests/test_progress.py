"""Progress reports: tqdm's bar on a terminal, a plain line every few seconds in a log."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from tqdm import tqdm

from gpipe.train import TrainConfig, train
from gpipe.train.progress import LineProgress, is_terminal, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_a_plain_line_every_few_seconds_not_one_per_step() -> None:
    log, clock = io.StringIO(), Clock()
    bar = LineProgress(2000, desc="gpipe train", unit="step", file=log, interval=5.0, clock=clock)
    for step in range(1, 2001):  # 2000 fast steps of 1/128 s (exact in binary): 15.6 s
        clock.now = step / 128
        bar.set_postfix(loss=f"{1000 / step:.1f}")
        bar.update(1)
    bar.close()
    bar.close()  # a second close writes nothing
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    # after the first step, then 5 s after the line before (steps 641 and 1281, 1921), and on close
    assert len(lines) == 5, lines
    assert lines[0] == "gpipe train: 1/2000 steps (0%); 0:00 elapsed, 128 step/s, 0:16 left; loss=1000.0"
    assert lines[1].startswith("gpipe train: 641/2000 steps (32%); 0:05 elapsed, 128 step/s, 0:11 left; ")
    assert lines[-1] == "gpipe train: 2000/2000 steps (100%); 0:16 elapsed, 128 step/s; loss=0.5"


def test_a_resumed_run_counts_from_its_first_step_and_close_repeats_nothing() -> None:
    log, clock = io.StringIO(), Clock()
    bar = LineProgress(100, initial=40, unit="step", file=log, interval=5.0, clock=clock)
    for _ in range(60):
        clock.now += 1.0
        bar.update()
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines[0] == "41/100 steps (41%); 0:01 elapsed, 1 step/s, 0:59 left"  # the rate of this run's steps
    assert lines[-1] == "100/100 steps (100%); 1:00 elapsed, 1 step/s"
    assert len(lines) == 13  # at 1 s, then every 5 s: 6, 11, ..., 56, and 60 on close
    written = log.getvalue()
    bar.close()
    assert log.getvalue() == written


def test_tqdm_on_a_terminal_lines_elsewhere() -> None:
    terminal = Terminal()
    bar = progress(10, desc="gpipe train", unit="step", file=terminal)
    assert isinstance(bar, tqdm)
    for _ in range(10):
        bar.update(1)
    bar.close()
    assert "\r" in terminal.getvalue()  # the bar redrawn in place
    assert isinstance(progress(10, file=io.StringIO()), LineProgress)
    closed = io.StringIO()
    closed.close()
    assert not is_terminal(closed) and not is_terminal(object()) and is_terminal(Terminal())


def test_gpipe_train_writes_lines_to_a_redirected_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = train(TrainConfig(out=str(tmp_path), steps=3, eval_every=3, progress=True))
    err = capsys.readouterr().err  # captured: not a terminal
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("gpipe train: ")]
    assert 1 <= len(lines) <= 3, err  # after the first step, on close, and at most one between
    assert lines[-1].startswith("gpipe train: 3/3 steps (100%); ") and "loss=" in lines[-1]
    # the rate by its unit's name; the latest evaluation: its loss and, for translation, the mean BLEU
    assert re.search(r"; loss=[0-9.]+, tokens/s=[0-9]+, bubble=", lines[-1]), lines[-1]
    assert lines[-1].endswith(f", eval_loss={result['eval_loss']:.3f}, bleu={result['bleu']:.1f}"), lines[-1]


def test_the_bar_of_amoebanet_shows_images_per_second_and_the_accuracy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = dict(layers=1, filters=4, image_size=8, batch=16, steps=2, eval_every=2, eval_batches=1)
    result = train(TrainConfig(out=str(tmp_path), model="amoebanet", progress=True, **settings))  # type: ignore[arg-type]
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("gpipe train: 2/2 steps (100%); "), line
    assert re.search(r"; loss=[0-9.]+, images/s=[0-9]+, bubble=", line), line
    assert line.endswith(f", eval_loss={result['eval_loss']:.3f}, accuracy={result['eval_accuracy']:.3f}"), line
