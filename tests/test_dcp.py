"""Checkpoints through torch.distributed.checkpoint: the optimizer's state by parameter name (a run
resumed at another number of stages takes the very update of the uninterrupted one), asynchronous
saves, a kill during one, and saves by several ranks."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import gpipe.saving
import gpipe.saving.keys
from gpipe import GPipe, Pipeline, load_checkpoint, save_checkpoint
from gpipe.models import transformer
from gpipe.saving import AsyncSave, CheckpointError, NoSpaceError, latest, layer_state
from tests import dist_cases
from tests.dist_harness import POOL, ROOT, Pool
from tests.helpers import even

VOCAB = 40


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return transformer(2, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0)  # 7 layers


def batch(i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    src, tgt = torch.randint(1, VOCAB, (8, 9), generator=g), torch.randint(1, VOCAB, (8, 7), generator=g)
    return (src, tgt[:, :-1]), tgt[:, 1:]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def pipeline(k: int, seed: int = 0) -> Pipeline:
    # init_seed: another seed, other initial weights: only the checkpoint makes a resumed run match
    return Pipeline(model(), even(7, k), chunks=4, loss_fn=lm_loss, devices=["cpu"] * k, cpu_threads=1, init_seed=seed)


def adam(module: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=lr, betas=(0.8, 0.95), weight_decay=0.01)


def train(pipe: Pipeline, optimizer: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    losses = []
    for i in steps:
        x, y = batch(i)
        optimizer.zero_grad()
        losses.append(pipe.step(x, y))
        optimizer.step()
    return losses


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in layer_state(model).items()}


def assert_equal_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{key} differs (max abs diff {(actual[key] - value).abs().max()})"


def by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors, keyed '<global parameter name>.<key>'."""
    names = {id(p): f"{i}.{n}" for i, layer in gpipe.saving.keys._layers(model) for n, p in layer.named_parameters()}
    return {
        f"{names[id(p)]}.{key}": value
        for p, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


@pytest.fixture(scope="module")
def saved_at_two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Adam over a Transformer at K=2, 2 steps, saved with its state; then the uninterrupted 3rd step."""
    directory = tmp_path_factory.mktemp("ckpt")
    pipe = pipeline(2)
    optimizer = adam(pipe)
    train(pipe, optimizer, range(2))
    assert save_checkpoint(pipe, directory, 2, optimizer=optimizer) == directory / "step-00000002"
    saved, state = snapshot(pipe), {k: v.clone() for k, v in by_name(pipe, optimizer).items()}
    (loss,) = train(pipe, optimizer, range(2, 3))
    return {"directory": directory, "saved": saved, "state": state, "loss": loss, "after": snapshot(pipe)}


@pytest.mark.parametrize("k", [1, 2, 4])
def test_adam_resumes_bitwise_at_any_number_of_stages(saved_at_two: dict[str, Any], k: int) -> None:
    pipe = pipeline(k, seed=7)
    optimizer = adam(pipe, lr=0.5)  # the checkpoint's hyper-parameters replace these
    assert not torch.equal(next(pipe.parameters()), next(iter(saved_at_two["saved"].values())))
    assert load_checkpoint(pipe, saved_at_two["directory"], optimizer=optimizer) == 2
    assert_equal_state(snapshot(pipe), saved_at_two["saved"])
    assert_equal_state(by_name(pipe, optimizer), saved_at_two["state"])
    assert all(g["lr"] == 1e-2 and g["betas"] == (0.8, 0.95) for g in optimizer.param_groups)
    (loss,) = train(pipe, optimizer, range(2, 3))
    assert torch.equal(loss, saved_at_two["loss"])
    assert_equal_state(snapshot(pipe), saved_at_two["after"])


def gpipe_step(gp: GPipe, optimizer: torch.optim.Optimizer, i: int) -> torch.Tensor:
    x, y = batch(i)
    optimizer.zero_grad()
    loss = lm_loss(gp(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_adam_resumes_bitwise_in_gpipe(saved_at_two: dict[str, Any], tmp_path: Path) -> None:
    """The single-process front end loads what a Pipeline saved; and a GPipe run saved at K=2
    resumes bitwise at K=1 and K=3 (its step, a loss over the whole batch, is its own)."""
    gp = GPipe(model(), [7], devices=["cpu"], chunks=4)
    optimizer = adam(gp, lr=0.5)
    assert load_checkpoint(gp, saved_at_two["directory"], optimizer=optimizer) == 2
    assert_equal_state(snapshot(gp), saved_at_two["saved"])
    assert_equal_state(by_name(gp, optimizer), saved_at_two["state"])

    gp = GPipe(model(), [3, 4], devices=["cpu", "cpu"], chunks=4, cpu_threads=1)
    optimizer = adam(gp)
    for i in range(2):
        gpipe_step(gp, optimizer, i)
    save_checkpoint(gp, tmp_path, 2, optimizer=optimizer)
    loss, after = gpipe_step(gp, optimizer, 2), snapshot(gp)
    for balance in ([7], [2, 2, 3]):
        torch.manual_seed(11)
        layers = transformer(2, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0)
        fresh = GPipe(layers, balance, devices=["cpu"] * len(balance), chunks=4, cpu_threads=1)
        resumed = adam(fresh, lr=0.5)
        assert load_checkpoint(fresh, tmp_path, optimizer=resumed) == 2
        assert torch.equal(gpipe_step(fresh, resumed, 2), loss)
        assert_equal_state(snapshot(fresh), after)


@pytest.mark.parametrize("make", [torch.optim.RMSprop, torch.optim.Adafactor, torch.optim.SGD])
def test_other_optimizers_resume_bitwise(tmp_path: Path, make: Callable[..., torch.optim.Optimizer]) -> None:
    options: dict[str, Any] = {"lr": 1e-2} | ({"momentum": 0.9} if make is not torch.optim.Adafactor else {})
    pipe = pipeline(2)
    optimizer = make(pipe.parameters(), **options)
    train(pipe, optimizer, range(2))
    save_checkpoint(pipe, tmp_path, 2, optimizer=optimizer)
    expected_state = {k: v.clone() for k, v in by_name(pipe, optimizer).items()}
    assert expected_state, "the optimizer has state to restore"
    (loss,) = train(pipe, optimizer, range(2, 3))
    after = snapshot(pipe)

    fresh = pipeline(3, seed=7)
    resumed = make(fresh.parameters(), **options)
    assert load_checkpoint(fresh, tmp_path, optimizer=resumed) == 2
    assert_equal_state(by_name(fresh, resumed), expected_state)
    assert torch.equal(train(fresh, resumed, range(2, 3))[0], loss)
    assert_equal_state(snapshot(fresh), after)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's, at our own dcp.load below
def test_the_folder_is_a_dcp_checkpoint_keyed_by_global_names(saved_at_two: dict[str, Any]) -> None:
    step = saved_at_two["directory"] / "step-00000002"
    assert sorted(p.name for p in step.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]
    manifest = json.loads((step / "manifest.json").read_text())
    assert sorted(manifest.pop("files")) == [".metadata", "__0_0.distcp"]  # (tests/test_saving_checksums.py)
    assert manifest == {
        "format": "gpipe-dcp-1",
        "step": 2,
        "num_layers": 7,
        "optimizer": "torch.optim.adam.Adam",
    }
    keys = set(FileSystemReader(step).read_metadata().state_dict_metadata)
    model_keys = {f"model.{k}" for k in saved_at_two["saved"]}
    assert {k for k in keys if k.startswith("model.")} == model_keys
    assert {int(k.split(".")[1]) for k in model_keys} == set(range(7))  # every layer, by its global index
    params = {k.removesuffix(".exp_avg") for k in saved_at_two["state"] if k.endswith(".exp_avg")}
    assert {k for k in keys if k.startswith("optimizer.param_groups.")} == {
        f"optimizer.param_groups.{p}" for p in params
    }
    assert {k for k in keys if k.startswith("optimizer.state.")} == {
        f"optimizer.state.{k}" for k in saved_at_two["state"]
    }
    # Another tool reads it with DCP alone: layer 0's weights, by their global name.
    name = next(k for k in saved_at_two["saved"] if k.startswith("0."))
    out = {f"model.{name}": torch.empty_like(saved_at_two["saved"][name])}
    import torch.distributed.checkpoint as dcp

    dcp.load(out, checkpoint_id=step, no_dist=True)
    assert torch.equal(out[f"model.{name}"], saved_at_two["saved"][name])


# Refusals.


def test_optimizer_state_that_is_not_there_or_of_another_optimizer(tmp_path: Path) -> None:
    pipe = pipeline(2)
    optimizer = adam(pipe)
    train(pipe, optimizer, range(1))
    save_checkpoint(pipe, tmp_path / "model-only", 1)
    save_checkpoint(pipe, tmp_path / "adam", 1, optimizer=optimizer)

    fresh = pipeline(1, seed=3)
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match=r"holds no optimizer state \(saved without optimizer=\)"):
        load_checkpoint(fresh, tmp_path / "model-only", optimizer=adam(fresh))
    with pytest.raises(CheckpointError, match=r"holds the state of a torch\.optim\.adam\.Adam, not of a .*SGD"):
        load_checkpoint(fresh, tmp_path / "adam", optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert_equal_state(snapshot(fresh), before)  # nothing changed
    assert load_checkpoint(fresh, tmp_path / "adam") == 1  # the model alone loads from either
    assert load_checkpoint(fresh, tmp_path / "model-only") == 1
    assert_equal_state(snapshot(fresh), snapshot(pipe))


def test_groups_whose_parameters_were_saved_with_other_hyper_parameters_are_refused(tmp_path: Path) -> None:
    pipe = pipeline(2)
    decay = [p for n, p in pipe.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in pipe.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    train(pipe, optimizer, range(2))
    save_checkpoint(pipe, tmp_path, 2, optimizer=optimizer)
    (loss,) = train(pipe, optimizer, range(2, 3))

    fresh = pipeline(4, seed=3)
    with pytest.raises(CheckpointError, match=r"param group 0 holds parameters saved with other hyper-parameters"):
        load_checkpoint(fresh, tmp_path, optimizer=torch.optim.AdamW(fresh.parameters()))
    # Grouped as when saved (the groups' order and sizes may differ: each parameter keeps its own).
    decay = [p for n, p in fresh.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in fresh.named_parameters() if not n.endswith("weight")]
    resumed = torch.optim.AdamW([{"params": no_decay}, {"params": decay}])
    assert load_checkpoint(fresh, tmp_path, optimizer=resumed) == 2
    assert [g["weight_decay"] for g in resumed.param_groups] == [0.0, 0.1]
    assert torch.equal(train(fresh, resumed, range(2, 3))[0], loss)


def test_an_optimizer_over_other_parameters_is_refused(tmp_path: Path) -> None:
    pipe = pipeline(2)
    stray = nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*pipe.parameters(), *stray.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"holds a parameter of shape \(2, 2\) that is none of the parameters"):
        save_checkpoint(pipe, tmp_path, 1, optimizer=optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing was written


def test_a_checkpoint_of_the_earlier_format_is_named(tmp_path: Path) -> None:
    step = tmp_path / "step-00000004"
    step.mkdir()
    torch.save({"0.weight": torch.zeros(2)}, step / "layers-00000-00006.pt")
    (step / "manifest.json").write_text('{"step": 4, "num_layers": 7, "files": ["layers-00000-00006.pt"]}')
    (tmp_path / "latest").write_text("step-00000004")
    with pytest.raises(CheckpointError, match=r"manifest\.json: a checkpoint of gpipe's earlier format"):
        load_checkpoint(pipeline(1), tmp_path)


def test_foreign_dcp_entries_are_named(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    pipe = pipeline(1)
    save_checkpoint(pipe, tmp_path, 1)
    step = tmp_path / "step-00000001"
    for p in step.glob("*distcp"):
        p.unlink()
    (step / ".metadata").unlink()
    dcp.save({"encoder.0.weight": torch.zeros(3)}, checkpoint_id=step, no_dist=True)
    with pytest.raises(CheckpointError, match=r"\.metadata: truncated: \d+ of \d+ bytes"):
        load_checkpoint(pipe, tmp_path)
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["files"]  # as a checkpoint saved before checksums
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"\.metadata: holds 'encoder\.0\.weight', not an entry of a gpipe"):
        load_checkpoint(pipe, tmp_path)


# Asynchronous saves.


@pytest.fixture
def gated_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """torch.save, as DCP's writer calls it in a background thread, waits for ``gate``; ``entered``
    is set once a write waits."""
    gate, entered = threading.Event(), threading.Event()
    real_save = torch.save

    def gated(obj: object, f: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            assert gate.wait(60), "the test never opened the gate"
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", gated)
    yield gate, entered
    gate.set()


def small(seed: int = 0) -> Pipeline:
    torch.manual_seed(seed)
    layers = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    return Pipeline(layers, [2, 2], chunks=2, loss_fn=F.mse_loss, devices=["cpu", "cpu"], cpu_threads=1)


def test_an_asynchronous_save_returns_before_the_write_and_commits_after_it(
    tmp_path: Path, gated_writes: tuple[threading.Event, threading.Event]
) -> None:
    gate, entered = gated_writes
    pipe = small()
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.1)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    save_checkpoint(pipe, tmp_path, 1, optimizer=optimizer)  # (in this thread: not gated)
    pipe.step(x, y)
    optimizer.step()
    expected, expected_state = snapshot(pipe), {k: v.clone() for k, v in by_name(pipe, optimizer).items()}

    handle = save_checkpoint(pipe, tmp_path, 2, optimizer=optimizer, asynchronous=True)
    assert isinstance(handle, AsyncSave) and handle.step == 2
    assert entered.wait(30), "the write starts in the background"
    assert not handle.done()
    assert latest(tmp_path) == tmp_path / "step-00000001"  # not before the write is complete
    assert not (tmp_path / "step-00000002").exists()
    with pytest.raises(TimeoutError, match="still being written"):
        handle.wait(timeout=0.1)
    optimizer.zero_grad()
    pipe.step(x, y)
    optimizer.step()  # training goes on, changing the weights and the state being written
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    gate.set()
    assert handle.wait(timeout=60) == tmp_path / "step-00000002"
    assert handle.done() and latest(tmp_path) == tmp_path / "step-00000002"
    assert "done" in repr(handle)

    fresh = small(seed=5)
    resumed = torch.optim.Adam(fresh.parameters(), lr=0.1)
    assert load_checkpoint(fresh, tmp_path, optimizer=resumed) == 2
    assert_equal_state(snapshot(fresh), expected)  # as they were at the call
    assert_equal_state(by_name(fresh, resumed), expected_state)

    # The next asynchronous save copies into the same buffers: each checkpoint holds its own values.
    now, now_state = snapshot(pipe), {k: v.clone() for k, v in by_name(pipe, optimizer).items()}
    assert (
        save_checkpoint(pipe, tmp_path, 3, optimizer=optimizer, asynchronous=True).wait(60)
        == tmp_path / "step-00000003"
    )
    for step, state, optimizer_state in ((2, expected, expected_state), (3, now, now_state)):
        assert load_checkpoint(fresh, tmp_path / f"step-{step:08d}", optimizer=resumed) == step
        assert_equal_state(snapshot(fresh), state)
        assert_equal_state(by_name(fresh, resumed), optimizer_state)


def test_a_save_waits_for_the_asynchronous_one_under_way(
    tmp_path: Path, gated_writes: tuple[threading.Event, threading.Event]
) -> None:
    gate, entered = gated_writes
    pipe = small()
    first = save_checkpoint(pipe, tmp_path, 1, asynchronous=True)
    assert entered.wait(30)
    second: list[Path] = []
    saver = threading.Thread(target=lambda: second.append(save_checkpoint(pipe, tmp_path, 2)))
    saver.start()
    saver.join(timeout=0.5)
    assert saver.is_alive() and not first.done(), "the second save waits"
    assert not (tmp_path / ".step-00000002.tmp").exists(), "and has not started"
    gate.set()
    saver.join(timeout=60)
    assert second == [tmp_path / "step-00000002"]
    assert first.done() and first.wait() == tmp_path / "step-00000001"
    assert latest(tmp_path) == tmp_path / "step-00000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000002"]


def test_a_failed_asynchronous_save_is_raised_by_wait_or_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = small()
    save_checkpoint(pipe, tmp_path, 1)
    real_save = torch.save

    def full_in_the_background(obj: object, f: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", full_in_the_background)
    handle = save_checkpoint(pipe, tmp_path, 2, asynchronous=True)
    with pytest.raises(NoSpaceError, match=r"no space left on device: \S*\.step-00000002\.tmp/__0_0\.distcp"):
        handle.wait(timeout=60)
    assert "failed" in repr(handle)
    unseen = save_checkpoint(pipe, tmp_path, 3, asynchronous=True)
    unseen._thread.join(60)  # fails too; no one waits for it
    monkeypatch.undo()
    with pytest.raises(NoSpaceError) as raised:
        save_checkpoint(pipe, tmp_path, 4)  # raises the unseen failure, and saves nothing
    assert "the asynchronous save of step 3" in "".join(getattr(raised.value, "__notes__", []))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    assert save_checkpoint(pipe, tmp_path, 4) == tmp_path / "step-00000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000004"]


KILLED_ASYNC_SAVE = r"""
import os, sys, threading, time, torch, torch.nn.functional as F
from torch import nn
from gpipe import Pipeline, save_checkpoint
from gpipe.saving import layer_state
directory, mark, expected = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(1)
pipe = Pipeline(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), [4, 4], chunks=2, loss_fn=F.mse_loss,
                devices=["cpu", "cpu"])
optimizer = torch.optim.Adam(pipe.parameters(), lr=0.1)
x, y = torch.randn(4, 64), torch.randn(4, 64)
def train():
    optimizer.zero_grad()
    pipe.step(x, y)
    optimizer.step()
train()
save_checkpoint(pipe, directory, 1, optimizer=optimizer)
torch.save(dict(layer_state(pipe)), expected)
train()
real_save = torch.save
written = 0
def slow(obj, f):
    global written
    if threading.current_thread() is not threading.main_thread():  # DCP's write, in the background
        written += 1
        if written == 20:  # halfway
            open(mark, "w").close()
            time.sleep(600)  # killed here
    real_save(obj, f)
torch.save = slow
handle = save_checkpoint(pipe, directory, 2, optimizer=optimizer, asynchronous=True)
train()  # training goes on meanwhile
handle.wait()
"""


def test_a_process_killed_during_an_asynchronous_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt, mark, expected = tmp_path / "ckpt", tmp_path / "mark", tmp_path / "expected.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_ASYNC_SAVE), str(ckpt), str(mark), str(expected)], env=env
    )
    try:
        deadline = time.monotonic() + 90
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), f"the asynchronous save never got halfway (exit code {proc.poll()})"
        staging = ckpt / ".step-00000002.tmp"
        assert staging.is_dir() and not (staging / "manifest.json").exists(), "killed mid-write"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    assert (ckpt / "latest").read_text() == "step-00000001"
    assert latest(ckpt) == ckpt / "step-00000001"
    torch.manual_seed(9)
    fresh = Pipeline(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), [8], chunks=2, loss_fn=F.mse_loss)
    optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    assert load_checkpoint(fresh, ckpt, optimizer=optimizer) == 1
    assert_equal_state(snapshot(fresh), torch.load(expected))
    assert all(float(s["step"]) == 1 for s in optimizer.state.values()) and len(optimizer.state) == 16
    assert (ckpt / ".step-00000002.tmp").exists()

    assert save_checkpoint(fresh, ckpt, 2, optimizer=optimizer) == ckpt / "step-00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    assert load_checkpoint(fresh, ckpt, optimizer=optimizer) == 2


# Several ranks (gloo): each writes its own stages' entries; one process loads them at any K.


# Two ranks save with Adam's state, in the foreground ('sync') and in the background ('async'), each
# into its own folder ('dcp-<how>/ckpt', a damaged copy in 'dcp-<how>/damaged'); two replicas of two
# stages save theirs: cases of the session's pool (tests/dist_harness.py: a few launches in all).
SAVED_BY_TWO = {
    how: POOL.add(
        2, f"dcp {how}", "train_and_save_with_optimizer", directory=f"{{pool}}/dcp-{how}/ckpt", steps=2,
        asynchronous=how == "async", damaged=f"{{pool}}/dcp-{how}/damaged",
    )
    for how in ("sync", "async")
}  # fmt: skip
REPLICAS = POOL.add(4, "dcp replicas", "train_and_save_with_optimizer", directory="{pool}/dcp-dp/ckpt", steps=2, dp=2)


@pytest.mark.parametrize("how", ["sync", "async"])
def test_saved_by_two_ranks_with_adam_resumes_in_one_process(pool: Pool, how: str) -> None:
    ranks = pool(SAVED_BY_TWO[how])
    tmp_path = pool.path(f"dcp-{how}")
    ckpt = tmp_path / "ckpt"
    step = ckpt / "step-00000002"
    assert sorted(p.name for p in step.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["optimizer"] == "torch.optim.adam.Adam"
    # Every rank's file, hashed by its rank as it wrote it, listed by rank 0 (DCP's index too).
    assert manifest["files"] == {
        p.name: {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "bytes": p.stat().st_size}
        for p in step.iterdir()
        if p.name != "manifest.json"
    }
    assert gpipe.saving.verify(step) == []
    # Rank 1's file damaged: rank 0 does not read it (nor check it), rank 1 names it; both pass it over.
    bad = tmp_path / "damaged" / step.name / "__1_0.distcp"
    said = f"{bad}: corrupt: its sha256 differs from the manifest's"
    assert [r["own"] for r in ranks] == [[], [said]]
    assert [r["agreed"] for r in ranks] == [said, said]
    assert gpipe.saving.verify(bad.parent) == [said]
    assert torch.equal(ranks[0]["next"], ranks[1]["next"])
    saved = {k: v for r in ranks for k, v in r["saved"].items()}
    after = {k: v for r in ranks for k, v in r["after"].items()}
    assert len(saved) == 16  # 8 Linear layers (and 8 Tanh)
    for workers in (1, 4):
        one = dist_cases.load_with_optimizer_and_step(str(ckpt), workers=workers)
        assert one["step"] == 2
        assert_equal_state(one["loaded"], saved)
        assert torch.equal(one["next"], ranks[0]["next"])
        assert_equal_state(one["after"], after)


def test_data_parallel_replicas_write_one_copy(pool: Pool) -> None:
    ranks = pool(REPLICAS)
    ckpt = pool.path("dcp-dp", "ckpt")
    step = ckpt / "step-00000002"
    data = sorted(p.name for p in step.glob("*.distcp"))
    assert len(data) == 2, f"one file per rank of the first replica: {data}"
    replica = [r for r in ranks if r["dp_rank"] == 0]
    assert len(replica) == 2
    saved = {k: v for r in replica for k, v in r["saved"].items()}
    for r in ranks:  # the other replica holds the same
        for k, v in r["saved"].items():
            assert torch.equal(v, saved[k]), k
    one = dist_cases.load_with_optimizer_and_step(str(ckpt), workers=2)
    assert_equal_state(one["loaded"], saved)
    torch.testing.assert_close(one["next"], ranks[0]["next"])
    metadata = FileSystemReader(step).read_metadata()
    assert len([k for k in metadata.state_dict_metadata if k.startswith("model.")]) == 16
    files = {info.relative_path for info in metadata.storage_data.values()}
    assert files == set(data)


# Back to the model the pipeline was cut from.


def test_load_module_maps_a_sequential_back_by_index(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    pipe = Pipeline(layers, [2, 1], chunks=2, loss_fn=F.mse_loss, devices=["cpu", "cpu"])
    pipe.step(torch.randn(4, 8), torch.randn(4, 4))
    save_checkpoint(pipe, tmp_path, 3)
    plain = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    assert gpipe.saving.load_module(plain, tmp_path) == 3
    assert_equal_state(plain.state_dict(), dict(layer_state(pipe)))
    with pytest.raises(CheckpointError, match="does not match the Sequential"):
        gpipe.saving.load_module(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), tmp_path)


def test_load_module_maps_a_hugging_face_model_back_to_its_own_names(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (4, 12))

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())

    pipe = Pipeline(transformers.GPT2LMHeadModel(config), [3, 2], chunks=2, loss_fn=loss, devices=["cpu", "cpu"],
                    sample=tokens)  # fmt: skip
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        pipe.step(tokens, tokens)
        optimizer.step()
    save_checkpoint(pipe, tmp_path, 2)
    torch.manual_seed(1)
    original = transformers.GPT2LMHeadModel(config).eval()
    assert gpipe.saving.load_module(original, tmp_path) == 2
    assert original.lm_head.weight is original.transformer.wte.weight  # still tied
    pipe.eval()
    with torch.no_grad():
        assert torch.equal(original(tokens).logits, pipe(tokens).logits)
