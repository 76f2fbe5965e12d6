"""Checkpoints keyed by global layer index: saved with K stages, loaded with another K."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gpipe.saving
from gpipe import GPipe, Pipeline, load_checkpoint, save_checkpoint
from tests import dist_cases
from tests.dist_harness import POOL, Pool

# Cases of the session's pool (tests/dist_harness.py: a few launches in all): the load in a later launch
# (other processes: nothing of the saving one's memory helps).
SAVE = POOL.add(2, "saving save on 2", "train_and_save", directory="{pool}/saving-ckpt", steps=3)
LOAD = POOL.add(4, "saving load on 4", "load_and_step", after=SAVE, directory="{pool}/saving-ckpt")


def test_saved_with_two_ranks_loads_into_four_ranks_and_one_process(pool: Pool) -> None:
    ckpt = pool.path("saving-ckpt")
    saved = pool(SAVE)
    assert sorted(p.name for p in (ckpt / "step-00000003").iterdir()) == [
        ".metadata",  # DCP's index
        "__0_0.distcp",  # each rank's entries
        "__1_0.distcp",
        "manifest.json",
    ]
    expected = saved[0]["next"]
    assert torch.equal(saved[1]["next"], expected)
    four = pool(LOAD)
    one = dist_cases.load_and_step(str(ckpt))
    assert one["step"] == 3 and all(r["step"] == 3 for r in four)
    for result in [*four, one]:
        assert torch.equal(result["next"], expected)


def test_single_process_front_ends_share_the_format(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = Pipeline(model, [2, 1], chunks=2, loss_fn=F.mse_loss, devices=["cpu", "cpu"])
    save_checkpoint(pipe, tmp_path, 7)
    torch.manual_seed(1)
    other = GPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), [1, 2], devices=["cpu", "cpu"])
    assert load_checkpoint(other, tmp_path) == 7
    x = torch.randn(3, 4)
    torch.testing.assert_close(other(x), pipe(x))


def test_a_crash_during_save_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = Pipeline(model, [1, 1], chunks=2, loss_fn=F.mse_loss, devices=["cpu", "cpu"])
    save_checkpoint(pipe, tmp_path, 1)
    before = {k: v.clone() for k, v in gpipe.saving.layer_state(pipe).items()}
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    calls = 0
    real_save = torch.save

    def crash_on_second_file(obj: object, f: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            real_save(obj, f)  # half-written: the file exists under its temporary name
            raise OSError("disk full")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", crash_on_second_file)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(pipe, tmp_path, 2)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert not list(tmp_path.rglob(".*tmp*")), "temporary files must not linger"
    assert load_checkpoint(pipe, tmp_path) == 1
    for k, v in gpipe.saving.layer_state(pipe).items():
        assert torch.equal(v, before[k]), k


def test_load_errors(tmp_path: Path) -> None:
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=2, loss_fn=F.mse_loss)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(pipe, tmp_path)
    save_checkpoint(pipe, tmp_path, 1)
    bigger = Pipeline(nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]), [2, 1], chunks=2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="holds 2 layers, the model has 3"):
        load_checkpoint(bigger, tmp_path)
    manifest = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())
    files = manifest.pop("files")  # every file written, as sha256sum sees it
    assert manifest == {"format": "gpipe-dcp-1", "step": 1, "num_layers": 2, "optimizer": None}
    written = {p.name: p.read_bytes() for p in (tmp_path / "step-00000001").iterdir() if p.name != "manifest.json"}
    assert files == {name: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for name, b in written.items()}
    assert sorted(files) == [".metadata", "__0_0.distcp"]
    with pytest.raises(TypeError, match=r"expected a gpipe\.Pipeline or gpipe\.GPipe"):
        save_checkpoint(nn.Linear(2, 2), tmp_path, 2)


@pytest.mark.parametrize("how", ["deleted", "incomplete", "no latest"])
def test_a_broken_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path: Path, how: str) -> None:
    """``latest`` naming a step folder that is gone or incomplete (or no ``latest`` at all) while
    complete checkpoints are there: load the newest of them and say so (issue 24, item 7)."""
    import shutil

    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), [1, 1], chunks=2, loss_fn=F.mse_loss,
                    devices=["cpu", "cpu"])  # fmt: skip
    for step in (2, 10, 11):
        save_checkpoint(pipe, tmp_path, step)
        if step == 10:
            expected = {k: v.clone() for k, v in gpipe.saving.layer_state(pipe).items()}
        with torch.no_grad():
            for p in pipe.parameters():
                p.add_(1.0)
    if how == "deleted":
        shutil.rmtree(tmp_path / "step-00000011")
    elif how == "incomplete":
        (tmp_path / "step-00000011" / "manifest.json").unlink()
    else:
        shutil.rmtree(tmp_path / "step-00000011")
        (tmp_path / "latest").unlink()
    with pytest.warns(RuntimeWarning, match="using step-00000010, the newest complete checkpoint"):
        assert gpipe.saving.latest(tmp_path) == tmp_path / "step-00000010"
    with pytest.warns(RuntimeWarning, match="step-00000010"):
        assert load_checkpoint(pipe, tmp_path) == 10
    for name, value in gpipe.saving.layer_state(pipe).items():
        assert torch.equal(value, expected[name]), name


def test_no_complete_checkpoint_is_still_none(tmp_path: Path) -> None:
    assert gpipe.saving.latest(tmp_path) is None
    (tmp_path / "step-00000003").mkdir()  # a folder without its manifest: not a checkpoint
    assert gpipe.saving.latest(tmp_path) is None
