"""One reader of a checkpoint's run.json (gpipe.runfile), one search for the checkpoint a path names
(gpipe.saving.find, behind --checkpoint and --init), and one list of the settings that say where and how a
run ran (never a column of gpipe runs, never a TensorBoard hyper-parameter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from gpipe import GPipe
from gpipe.runfile import WHERE_AND_HOW, RunFileError, read_run
from gpipe.runs import Run, columns
from gpipe.saving import CheckpointError, find, save
from gpipe.train.config import TrainConfig
from gpipe.train.initial import init_source
from gpipe.translate import find_checkpoint


def test_run_json_is_read_and_checked_in_one_place(tmp_path: Path) -> None:
    with pytest.raises(RunFileError, match=r"cannot read '.*run.json': No such file"):
        read_run(tmp_path)
    (tmp_path / "run.json").write_text("{nope")
    with pytest.raises(RunFileError, match=r"'.*run.json' is not JSON"):
        read_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"config": [1]}))
    with pytest.raises(RunFileError, match="holds no object of settings under 'config'"):
        read_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"config": {"model": "hf"}, "data": "TextLines"}))
    assert read_run(tmp_path) == {"config": {"model": "hf"}, "data": "TextLines"}


def test_a_run_its_checkpoints_folder_and_a_step_name_the_same_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2)), [1], devices=["cpu"])
    for step in (2, 4):
        save(pipe, run / "checkpoints", step)
    newest = run / "checkpoints" / "step-00000004"
    for given in (run, run / "checkpoints", newest):
        assert find(given) == find_checkpoint(given) == init_source(str(given))[1] == newest
    older = run / "checkpoints" / "step-00000002"
    assert find(older) == older and find(tmp_path / "nothing") is None and find(tmp_path) is None
    (run / "checkpoints" / "latest").write_text("not a step\n")
    with pytest.raises(CheckpointError, match="latest"):
        find(run)


def test_where_and_how_a_run_ran_is_no_column_of_gpipe_runs() -> None:
    assert set(WHERE_AND_HOW) <= {f for f in TrainConfig.__dataclass_fields__}
    a = Run(path=Path("a"), settings={"lr": 1.0, "devices": "cpu", "timeout": 60.0, "out": "a"})
    b = Run(path=Path("b"), settings={"lr": 2.0, "devices": "cuda", "timeout": 30.0, "out": "b"})
    assert columns([a, b]) == ["lr"]


def test_a_run_is_running_while_a_live_process_of_gpipe_on_this_host_holds_its_lock(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import time

    from gpipe.evaluator.watch import next_checkpoint
    from gpipe.runfile import LOCK, lock_line, running

    assert running(tmp_path) is False  # (never started: no lock)
    (tmp_path / LOCK).write_text("")
    assert running(tmp_path) is None  # (a run starting: its PID not written yet)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "gpipe"])
    try:
        while b"gpipe" not in Path(f"/proc/{sleeper.pid}/cmdline").read_bytes():  # (until it runs)
            time.sleep(0.01)
        (tmp_path / LOCK).write_text(f"{sleeper.pid} {socket.gethostname()}\n")
        assert running(tmp_path) is True
        (tmp_path / LOCK).write_text(f"{sleeper.pid} another-host\n")
        assert running(tmp_path) is None  # (cannot be told from here)
    finally:
        sleeper.kill()
        sleeper.wait()
    (tmp_path / LOCK).write_text(f"{sleeper.pid} {socket.gethostname()}\n")
    assert running(tmp_path) is False and lock_line().split()[1] == socket.gethostname()
    chosen = next_checkpoint(tmp_path, set(), every=False, failed=set(), live=False)
    assert chosen.action == "stop" and not chosen.ok and "left no checkpoint" in chosen.message
