"""Checkpoints under failure: a save replaces a step's folder as a whole, killed saves leave nothing
behind for long, a full disk and corrupt or mismatched checkpoints say what and where."""

from __future__ import annotations

import errno
import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gpipe.saving.folders
from gpipe import Pipeline, load_checkpoint, save_checkpoint
from gpipe.saving import latest, layer_state, write_atomically
from tests import dist_cases
from tests.dist_harness import POOL, ROOT, Pool


def mlp(seed: int, widths: tuple[int, ...] = (6,) * 9) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(widths)])


def pipe_of(model: nn.Sequential, balance: list[int]) -> Pipeline:
    return Pipeline(model, balance, chunks=2, loss_fn=F.mse_loss, devices=["cpu"] * len(balance))


def snapshot(pipe: Pipeline) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in layer_state(pipe).items()}


def assert_holds(pipe: Pipeline, expected: dict[str, torch.Tensor]) -> None:
    state = layer_state(pipe)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), f"layer state {key} differs from the expected save"


def temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp" in p.name or p.name.endswith(".old"))


# 1. A save replaces the whole step folder.


DCP_FILES = [".metadata", "__0_0.distcp", "manifest.json"]  # a checkpoint saved by one process


@pytest.mark.parametrize(("first", "second"), [([4, 4], [2, 2, 2, 2]), ([2, 2, 2, 2], [4, 4]), ([3, 5], [5, 3])])
def test_a_save_over_a_step_of_another_layout_leaves_nothing_of_it(
    tmp_path: Path, first: list[int], second: list[int]
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    save_checkpoint(pipe_of(mlp(0), first), tmp_path, 5)
    step = tmp_path / "step-00000005"
    (step / "__3_0.distcp").write_bytes(b"rank 3's entries, of a save by 4 ranks")
    (step / "layers-00000-00003.pt").write_bytes(b"a file of the earlier format")
    newer = pipe_of(mlp(1), second)
    expected = snapshot(newer)
    save_checkpoint(newer, tmp_path, 5)

    assert sorted(p.name for p in step.iterdir()) == DCP_FILES
    assert sorted(FileSystemReader(step).read_metadata().state_dict_metadata) == sorted(f"model.{k}" for k in expected)
    assert json.loads((step / "manifest.json").read_text())["num_layers"] == 8
    assert temporaries(tmp_path) == []
    for balance in ([8], first, second):
        fresh = pipe_of(mlp(2), balance)
        assert load_checkpoint(fresh, tmp_path) == 5
        assert_holds(fresh, expected)


# Cases of the session's pool (tests/dist_harness.py: a few launches in all): four ranks save step 5,
# then (a later launch) two ranks save another step 5 over it; one rank's disk is full.
FOUR = POOL.add(4, "reliability four", "train_and_save_at", directory="{pool}/reliability-ckpt", steps=1, step=5)
TWO = POOL.add(
    2, "reliability two", "train_and_save_at", after=FOUR, directory="{pool}/reliability-ckpt", steps=3, step=5
)
FULL = POOL.add(2, "reliability full disk", "save_with_full_disk_on", directory="{pool}/reliability-full", rank=1)


def test_four_ranks_then_two_ranks_into_the_same_step(pool: Pool) -> None:
    ckpt = pool.path("reliability-ckpt")
    two = pool(TWO)  # (after FOUR's launch)
    saved_by_four = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "manifest.json"]
    assert all(r["before"] == saved_by_four for r in two)  # what the four ranks saved, as the two found it
    assert sorted(p.name for p in (ckpt / "step-00000005").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
    ], "nothing of the save by four ranks is left"
    assert temporaries(ckpt) == []
    expected = {k: v for rank in two for k, v in rank["state"].items()}
    pipe = dist_cases.build("1f1b", 1, 4)
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    assert load_checkpoint(pipe, ckpt) == 5
    assert_holds(pipe, expected)


def test_files_of_another_writer_are_carried_over_or_replaced_by_extra(tmp_path: Path) -> None:
    pipe = pipe_of(mlp(0), [4, 4])
    step = tmp_path / "step-00000003"
    step.mkdir(parents=True)
    (step / "optimizer-rank0.pt").write_text("written by gpipe train just before the save")
    save_checkpoint(pipe, tmp_path, 3)
    assert (step / "optimizer-rank0.pt").read_text() == "written by gpipe train just before the save"
    save_checkpoint(pipe, tmp_path, 3, extra={"optimizer-rank1.pt": lambda p: p.write_text("new")})
    assert sorted(p.name for p in step.iterdir()) == sorted([*DCP_FILES, "optimizer-rank1.pt"])
    for name in ("../escape", "__0_0.distcp", ".metadata", "manifest.json"):
        with pytest.raises(ValueError, match="plain file name"):
            save_checkpoint(pipe, tmp_path, 3, extra={name: lambda p: None})


# 2. What killed saves leave behind.


def test_the_next_save_removes_what_killed_saves_left(tmp_path: Path) -> None:
    pipe = pipe_of(mlp(0), [4, 4])
    save_checkpoint(pipe, tmp_path, 1)
    staging = tmp_path / ".step-00000002.tmp"  # a save killed while the ranks wrote their files
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".latest.tmp-4242").write_text("step-000")
    (tmp_path / "step-00000001" / ".manifest.json.tmp-4242").write_bytes(b"half")
    (tmp_path / "step-00000001" / ".optimizer-rank0.pt.tmp-77").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / ".hidden").write_text("not ours")
    assert len(temporaries(tmp_path)) == 4

    assert load_checkpoint(pipe, tmp_path) == 1  # loading changes nothing: a save may be under way
    assert len(temporaries(tmp_path)) == 4
    save_checkpoint(pipe, tmp_path, 3)
    assert temporaries(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".hidden",
        "latest",
        "notes.txt",
        "step-00000001",
        "step-00000003",
    ]


KILLED_SAVE = r"""
import os, re, sys, time, torch, torch.nn.functional as F
from torch import nn
import gpipe.saving.folders
from gpipe import Pipeline, save_checkpoint
directory, mark, stage, step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.manual_seed(1)
model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(8)])
pipe = Pipeline(model, [4, 4], chunks=2, loss_fn=F.mse_loss, devices=["cpu", "cpu"])
real_save, real_rename, real_replace = torch.save, os.rename, os.replace
def stop():
    open(mark, "w").close()
    time.sleep(600)  # killed here
tensors = 0
def half_written(obj, f):
    global tensors
    tensors += isinstance(obj, torch.Tensor)
    if stage == "write" and tensors == 9:  # halfway through DCP's write of 16 tensors
        f.write(b"PK half a file")
        stop()
    real_save(obj, f)
def rename(a, b):
    if stage == "swap" and re.fullmatch(r"\.step-\d+\.tmp", os.path.basename(a)):  # the new folder, renamed in
        stop()
    real_rename(a, b)
def replace(a, b):
    if stage == "exchanged" and str(b).endswith("latest"):
        stop()
    real_replace(a, b)
torch.save, os.rename, os.replace = half_written, rename, replace
if stage == "swap":
    gpipe.saving.folders._exchange = lambda a, b: False  # the fallback: the old folder is renamed aside first
save_checkpoint(pipe, directory, step)
"""


@pytest.mark.parametrize(
    ("stage", "step"), [("write", 1), ("write", 2), ("swap", 1), ("swap", 2), ("exchanged", 1), ("exchanged", 2)]
)
def test_a_killed_save_keeps_the_previous_checkpoint_and_is_cleaned_up(tmp_path: Path, stage: str, step: int) -> None:
    """A save of step 1 or 2 over a checkpoint of step 1, killed while it writes the layers, between
    the two renames of the fallback swap, or after the atomic exchange but before ``latest``."""
    pipe = pipe_of(mlp(0), [4, 4])
    save_checkpoint(pipe, tmp_path, 1)
    expected = snapshot(pipe)
    if stage == "exchanged" and step == 1:  # the new folder is complete and in place
        expected = snapshot(pipe_of(mlp(1), [4, 4]))
    mark = tmp_path.parent / f"{tmp_path.name}.mark"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_SAVE), str(tmp_path), str(mark), stage, str(step)], env=env
    )
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), f"the save never reached its {stage} stage (exit code {proc.poll()})"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    assert (tmp_path / "latest").read_text() == "step-00000001"
    in_window = stage == "swap" and step == 1  # step-00000001 is aside, the new one not yet in place
    assert latest(tmp_path) == tmp_path / (".step-00000001.old" if in_window else "step-00000001")
    fresh = pipe_of(mlp(2), [2, 6])
    assert load_checkpoint(fresh, tmp_path) == 1
    assert_holds(fresh, expected)
    assert temporaries(tmp_path) != []

    save_checkpoint(pipe_of(mlp(3), [8]), tmp_path, 3)
    assert temporaries(tmp_path) == []
    kept = ["latest", "step-00000001", "step-00000003"]
    if (stage, step) == ("exchanged", 2):  # complete, though `latest` never named it
        kept.append("step-00000002")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    assert load_checkpoint(fresh, tmp_path / "step-00000001") == 1
    assert_holds(fresh, expected)


def test_a_save_killed_between_the_two_renames_of_the_fallback_swap(tmp_path: Path) -> None:
    """Where the folders cannot be exchanged atomically, the old one is renamed aside first: a crash
    before the new one is renamed in leaves no step-N, and `latest` falls back to the aside."""
    pipe = pipe_of(mlp(0), [4, 4])
    save_checkpoint(pipe, tmp_path, 1)
    expected = snapshot(pipe)
    save_checkpoint(pipe_of(mlp(1), [2, 2, 2, 2]), tmp_path / "new", 1)
    os.rename(tmp_path / "step-00000001", tmp_path / ".step-00000001.old")
    os.rename(tmp_path / "new" / "step-00000001", tmp_path / ".step-00000001.tmp")  # complete, not swapped in

    assert latest(tmp_path) == tmp_path / ".step-00000001.old"
    fresh = pipe_of(mlp(2), [8])
    assert load_checkpoint(fresh, tmp_path) == 1
    assert_holds(fresh, expected)

    save_checkpoint(pipe_of(mlp(3), [8]), tmp_path, 2)  # puts the old folder back, drops the staging one
    assert temporaries(tmp_path) == []
    assert load_checkpoint(fresh, tmp_path / "step-00000001") == 1
    assert_holds(fresh, expected)


def test_the_fallback_swap_replaces_the_folder_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpipe.saving.folders, "_exchange", lambda a, b: False)
    save_checkpoint(pipe_of(mlp(0), [4, 4]), tmp_path, 1)
    newer = pipe_of(mlp(1), [2, 2, 2, 2])
    save_checkpoint(newer, tmp_path, 1)
    assert sorted(p.name for p in (tmp_path / "step-00000001").iterdir()) == DCP_FILES
    assert temporaries(tmp_path) == []
    fresh = pipe_of(mlp(2), [8])
    load_checkpoint(fresh, tmp_path)
    assert_holds(fresh, snapshot(newer))


# 3. A full disk.


def _full_on_call(n: int) -> object:
    """A torch.save whose ``n``-th call writes part of the file, then finds the disk full."""
    real_save = torch.save
    calls = {"n": 0}

    def save(obj: object, f: object) -> None:
        calls["n"] += 1
        if calls["n"] == n:
            buffer = io.BytesIO()
            real_save(obj, buffer)
            f.write(buffer.getvalue()[:100])  # type: ignore[attr-defined]
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f)  # type: ignore[arg-type]

    return save


@pytest.mark.parametrize("failing", [1, 2])
def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    pipe = pipe_of(mlp(0), [4, 4])
    save_checkpoint(pipe, tmp_path, 1)
    expected = snapshot(pipe)
    files = sorted(p.name for p in (tmp_path / "step-00000001").iterdir())
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    for step in (1, 2):  # over the previous step itself, and as a new one
        monkeypatch.setattr(torch, "save", _full_on_call(failing))
        full = r"no space left on device: \S*\.step-0000000[12]\.tmp/__0_0\.distcp could not be written"
        with pytest.raises(OSError, match=full) as raised:
            save_checkpoint(pipe, tmp_path, step)
        assert raised.value.errno == errno.ENOSPC
        assert isinstance(raised.value, gpipe.saving.NoSpaceError)
        assert (tmp_path / "latest").read_text() == "step-00000001"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"], "no partial files"
        assert sorted(p.name for p in (tmp_path / "step-00000001").iterdir()) == files
    monkeypatch.undo()
    fresh = pipe_of(mlp(2), [8])
    assert load_checkpoint(fresh, tmp_path) == 1
    assert_holds(fresh, expected)


def test_torchs_writer_failing_on_a_full_disk_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save to a path reports a failed write as '[enforce fail at inline_container.cc] unexpected
    pos', without errno: a real one, by writing through a link to /dev/full."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    path = tmp_path / "optimizer-rank0.pt"
    state = {"w": torch.zeros(10_000)}

    def through_dev_full(p: Path) -> None:
        p.symlink_to("/dev/full")
        torch.save(state, p)

    with pytest.raises(OSError, match=r"writing \S*optimizer-rank0\.pt failed midway .* bytes free; torch: .*pos"):
        write_atomically(path, through_dev_full)  # plenty of space here: not blamed on the disk
    monkeypatch.setattr(gpipe.saving.folders, "_free_bytes", lambda d: 4096)
    with pytest.raises(gpipe.saving.NoSpaceError, match=r"no space left on device: \S*optimizer-rank0\.pt") as raised:
        write_atomically(path, through_dev_full)
    assert raised.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_on_one_rank_stops_every_rank(pool: Pool) -> None:
    ckpt = pool.path("reliability-full")
    results = pool(FULL)
    for rank, result in enumerate(results):
        assert result["error"]["type"] == "NoSpaceError", result
        assert result["error"]["errno"] == errno.ENOSPC
        assert "no space left on device: " in result["error"]["message"]
        assert ".step-00000002.tmp/__1_0.distcp" in result["error"]["message"]
        assert ("(on rank 1)" in result["error"]["message"]) == (rank == 0)
        assert result["step"] == 1 and result["restored"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000001"]


# 4. A model of another shape.


def test_a_model_of_another_shape_names_the_layer_and_both_shapes(tmp_path: Path) -> None:
    save_checkpoint(pipe_of(mlp(0, (8, 16, 64, 32, 4)), [2, 2]), tmp_path, 1)
    wider = pipe_of(mlp(0, (8, 16, 128, 32, 4)), [1, 3])
    with pytest.raises(
        ValueError,
        match=r"checkpoint layer 1 \('1\.weight', Linear\) in '\S*step-00000001/__0_0\.distcp': "
        r"saved shape \(64, 16\), model's \(128, 16\)",
    ):
        load_checkpoint(wider, tmp_path)


def test_a_layer_of_another_kind_names_its_keys(tmp_path: Path) -> None:
    save_checkpoint(pipe_of(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1]), tmp_path, 1)
    other = pipe_of(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, elementwise_affine=False)), [1, 1])
    with pytest.raises(ValueError, match=r"holds \['1\.bias', '1\.weight'\], which the model's layer 1 \(LayerNorm\)"):
        load_checkpoint(other, tmp_path)
    other = pipe_of(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False)), [1, 1])
    with pytest.raises(ValueError, match=r"holds \['1\.bias'\], which the model's layer 1 \(Linear\) lacks"):
        load_checkpoint(other, tmp_path)


# 5. Corrupt checkpoints.


def _garbage(p: Path) -> None:
    p.write_bytes(os.urandom(3000))


def _truncated(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _empty(p: Path) -> None:
    p.write_bytes(b"")


UNREADABLE = r"unreadable \(truncated or corrupt\?\)"
TRUNCATED = r"truncated: {} of \d+ bytes"
# A file damaged, and what loading says: with the manifest's checksums (checked first), and without (a
# checkpoint saved before them: what DCP's reader makes of the file).
FILE_CASES: dict[str, tuple[str, Callable[[Path], object], str, str]] = {
    "garbage data": ("__0_0.distcp", _garbage, TRUNCATED.format(3000), UNREADABLE),
    "truncated data": ("__0_0.distcp", _truncated, TRUNCATED.format(r"\d+"), UNREADABLE),
    "empty data": ("__0_0.distcp", _empty, TRUNCATED.format(0), UNREADABLE),
    "deleted data": (
        "__0_0.distcp",
        Path.unlink,
        r"missing, though \S*step-00000001/manifest\.json lists it",
        r"missing, though \S*step-00000001/\.metadata lists it",
    ),
    "garbage index": (".metadata", _garbage, r"(truncated: 3000 of|3000 bytes, \d+ more than)", UNREADABLE),
    "truncated index": (".metadata", _truncated, TRUNCATED.format(r"\d+"), UNREADABLE),
    "empty index": (".metadata", _empty, TRUNCATED.format(0), UNREADABLE),
    "deleted index": (
        ".metadata",
        Path.unlink,
        *[r"missing, though \S*manifest\.json says the checkpoint is complete"] * 2,
    ),
}


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "before checksums"])
@pytest.mark.parametrize("case", FILE_CASES)
def test_a_corrupt_file_is_named(tmp_path: Path, case: str, checksums: bool) -> None:
    pipe = pipe_of(mlp(0), [4, 4])
    save_checkpoint(pipe, tmp_path, 1)
    manifest = tmp_path / "step-00000001" / "manifest.json"
    if not checksums:  # as saved before them
        manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "files"}))
    name, corrupt, message, before_checksums = FILE_CASES[case]
    path = tmp_path / "step-00000001" / name
    corrupt(path)
    for balance in ([4, 4], [8]):
        fresh = pipe_of(mlp(1), balance)
        before = snapshot(fresh)
        expected = message if checksums else before_checksums
        with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + expected):
            load_checkpoint(fresh, tmp_path)
        assert_holds(fresh, before)  # nothing changed


MANIFEST_CASES = {
    "not json": (b"{'step': 1", r"not a checkpoint manifest: not JSON"),
    "binary": (bytes(range(256)), r"not a checkpoint manifest: not JSON"),
    "a list": (b"[1, 2]", r"not a checkpoint manifest: expected a JSON object, got list"),
    "the earlier format": (
        b'{"step": 1, "num_layers": 8, "files": ["layers-00000-00003.pt", "layers-00004-00007.pt"]}',
        r"a checkpoint of gpipe's earlier format \(a torch\.save file per stage: \['layers-00000-00003\.pt', "
        r"'layers-00004-00007\.pt'\]\), which this version does not read",
    ),
    "no format": (b'{"step": 1, "num_layers": 8}', r"not a checkpoint manifest: lacks 'format'"),
    "no step": (b'{"format": "gpipe-dcp-1", "num_layers": 8}', r"not a checkpoint manifest: lacks 'step'"),
    "no num_layers": (b'{"format": "gpipe-dcp-1", "step": 1}', r"not a checkpoint manifest: lacks 'num_layers'"),
    "step a string": (
        b'{"format": "gpipe-dcp-1", "step": "1", "num_layers": 8}',
        r"'step' should be an integer, got '1'",
    ),
    "another format": (
        b'{"format": "gpipe-dcp-9", "step": 1, "num_layers": 8}',
        r"a checkpoint of format 'gpipe-dcp-9'; this version reads 'gpipe-dcp-1'",
    ),
    "optimizer a number": (
        b'{"format": "gpipe-dcp-1", "step": 1, "num_layers": 8, "optimizer": 3}',
        r"'optimizer' should be a class name or null, got 3",
    ),
}


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_a_corrupt_manifest_is_named(tmp_path: Path, case: str) -> None:
    pipe = pipe_of(mlp(0), [4, 4])
    save_checkpoint(pipe, tmp_path, 1)
    path = tmp_path / "step-00000001" / "manifest.json"
    content, message = MANIFEST_CASES[case]
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message):
        load_checkpoint(pipe, tmp_path)


def test_a_corrupt_latest_is_named(tmp_path: Path) -> None:
    pipe = pipe_of(mlp(0), [4, 4])
    save_checkpoint(pipe, tmp_path, 1)
    (tmp_path / "latest").write_text("../../somewhere")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "latest")) + r": names '\.\./\.\./somewhere'"):
        load_checkpoint(pipe, tmp_path)


def test_prune_keeps_the_newest_complete_checkpoints_and_the_latest(tmp_path: Path) -> None:
    """``gpipe.saving.prune``: the newest N complete step folders stay, so does the one ``latest``
    names, and an incomplete one (a save under way) is neither counted nor deleted."""
    from gpipe.saving import prune

    for step in (1, 2, 3, 4, 5):
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        if step != 5:  # step 5: no manifest yet, a save still writing it
            (folder / "manifest.json").write_text("{}")
    (tmp_path / "latest").write_text("step-00000002")  # (named by hand: kept whatever its age)
    assert prune(tmp_path, 1) == ["step-00000001", "step-00000003"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000004", "step-00000005"]
    with pytest.raises(ValueError, match="keep must be a positive number"):
        prune(tmp_path, 0)


def test_keep_n_leaves_the_newest_n_checkpoints_of_a_run(tmp_path: Path) -> None:
    from gpipe.cli import main

    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--steps", "4", "--checkpoint-every", "1", "--eval-every", "50", "--batch",
            "8", "--layers", "1", "--dim", "16", "--hidden", "32", "--no-progress", "--tensorboard", "off"]  # fmt: skip
    assert main([*argv, "--keep", "2"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000003", "step-00000004"]
    assert main([*argv, "--keep", "2", "--resume", "--steps", "6", "--async-checkpoint"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000005", "step-00000006"]
    assert main([*argv, "--keep", "-1", "--out", str(tmp_path / "other")]) == 2
