"""Checksums of a checkpoint's files (the manifest's ``"files"``): taken while the files are written,
checked by load (each process the files it reads) and by ``gpipe.saving.verify``; a checkpoint saved
before them loads as before; ``prune`` spares the folder it is given. (Under torch.distributed:
tests/test_dcp.py's two-rank saves and tests/test_train_data_parallel.py's runs; resuming past a
damaged checkpoint: tests/test_train_interrupt.py.)"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gpipe.saving.checksums
from gpipe import Pipeline, load_checkpoint, save_checkpoint
from gpipe.saving import CheckpointError, layer_state, prune, verify

NOTES = "notes.json"  # an extra file of the saves here


def pipeline(seed: int) -> Pipeline:
    """Two stages; the first layer's weight (600 x 600 floats) is one write long enough to be hashed
    beside the write, in another thread."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(600, 600), nn.Tanh(), nn.Linear(600, 6))
    return Pipeline(model, [2, 1], chunks=2, loss_fn=F.mse_loss, devices=["cpu", "cpu"])


def saved(root: Path, *, asynchronous: bool = False) -> Path:
    pipe = pipeline(0)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    optimizer.zero_grad()
    pipe.step(torch.randn(4, 600), torch.randn(4, 6))
    optimizer.step()
    extra = {NOTES: lambda p: p.write_text('{"note": 1}\n')}
    handle = save_checkpoint(pipe, root, 1, optimizer=optimizer, extra=extra, asynchronous=asynchronous)
    return handle if isinstance(handle, Path) else handle.wait()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_manifest_lists_every_file_written_as_sha256sum_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    read_back = []
    digest = gpipe.saving.checksums._digest
    monkeypatch.setattr(gpipe.saving.checksums, "_digest", lambda p, *a: read_back.append(p.name) or digest(p, *a))
    monkeypatch.setattr(gpipe.saving.saver, "_digest", gpipe.saving.checksums._digest)
    folder = saved(tmp_path, asynchronous=asynchronous)
    assert read_back == [NOTES], "the data file and DCP's index are hashed as they are written, not read back"
    files = json.loads((folder / "manifest.json").read_text())["files"]
    written = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "manifest.json"}
    assert sorted(written) == [".metadata", "__0_0.distcp", NOTES]
    assert files == {name: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for name, b in written.items()}
    assert files["__0_0.distcp"]["bytes"] > 600 * 600 * 4 * 3  # the weights and Adam's two moments
    assert verify(folder) == [] and verify(tmp_path) == []  # a step folder, or the newest of a checkpoints folder


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:1234])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _append(p: Path) -> None:
    p.write_bytes(p.read_bytes() + b"\0")


DAMAGE: dict[str, tuple[str, Callable[[Path], object], str]] = {
    "a truncated shard": ("__0_0.distcp", _truncate, r"truncated: 1234 of \d+ bytes"),
    "a flipped bit in a shard": ("__0_0.distcp", _flip, r"corrupt: its sha256 differs from the manifest's"),
    "a byte more in a shard": ("__0_0.distcp", _append, r"\d+ bytes, 1 more than the manifest's \d+"),
    "a flipped bit in the index": (".metadata", _flip, r"corrupt: its sha256 differs from the manifest's"),
    "a flipped bit in an extra file": (NOTES, _flip, r"corrupt: its sha256 differs from the manifest's"),
    "an extra file deleted": (NOTES, Path.unlink, r"missing, though \S+manifest\.json lists it"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_file_is_named_by_load_and_verify(tmp_path: Path, case: str) -> None:
    folder = saved(tmp_path)
    name, damage, message = DAMAGE[case]
    damage(folder / name)
    expected = re.escape(str(folder / name)) + ": " + message
    fresh = pipeline(1)
    before = {k: v.clone() for k, v in layer_state(fresh).items()}
    with pytest.raises(CheckpointError, match="^" + expected + "$"):
        load_checkpoint(fresh, tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in layer_state(fresh).items()), "nothing loaded"
    problems = verify(folder)
    assert len(problems) == 1 and re.fullmatch(expected, problems[0]), problems


def test_a_checkpoint_saved_before_checksums_loads_as_before(tmp_path: Path) -> None:
    folder = saved(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _flip(folder / NOTES)  # not checked: nothing says what it held
    fresh = pipeline(1)
    assert load_checkpoint(fresh, tmp_path) == 1
    for key, value in layer_state(pipeline(0)).items():
        assert value.shape == layer_state(fresh)[key].shape
    assert verify(folder) == []


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([1, 2], r"'files' should be an object of files, got \[1, 2\]"),
        ({"../x": {"sha256": "00", "bytes": 1}}, r"lists '\.\./x', not a file of the checkpoint's folder"),
        ({".metadata": {"bytes": 1}}, r"the entry of '\.metadata' should be \{<algorithm>: <hex digest>, 'bytes'"),
        ({".metadata": {"sha256": "00", "bytes": -1}}, r"the entry of '\.metadata' should be"),
    ],
)
def test_a_malformed_list_of_files_is_named(tmp_path: Path, files: object, message: str) -> None:
    folder = saved(tmp_path)
    path = folder / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "files": files}))
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ": " + message):
        load_checkpoint(pipeline(1), folder)
    assert len(verify(folder)) == 1


def test_a_checksum_of_an_algorithm_this_python_lacks_is_named(tmp_path: Path) -> None:
    folder = saved(tmp_path)
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][NOTES] = {"sha9000": "00", "bytes": manifest["files"][NOTES]["bytes"]}
    path.write_text(json.dumps(manifest))
    assert verify(folder) == [
        f"{folder / NOTES}: cannot be checked: its checksum is a 'sha9000', which this Python lacks"
    ]


def test_prune_spares_the_folder_it_is_given(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "manifest.json").write_text("{}")
    (tmp_path / "latest").write_text("step-00000004")
    assert prune(tmp_path, 1, spare=tmp_path / "step-00000002") == ["step-00000001", "step-00000003"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000004"]
