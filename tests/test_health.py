"""Training health (gpipe.health): the global gradient norm, the norm of the loss's gradient by every
layer's output and Bapna et al.'s ratio between the first and last block — bitwise the same at any K,
under re-materialization and split backward, equal to an unpipelined reference, written by
``gpipe train --health-every N``, and nothing installed when off. (On 2 gloo ranks:
tests/test_torchrun.py's comparison of whole metrics lines.)"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpipe import Pipeline, Selective
from gpipe.health import Health, Recorder, blocks_of, global_grad_norm, grad_norms, mark_blocks
from gpipe.models import amoebanet_d, transformer, transformer_lm
from gpipe.train import TrainConfig, train
from gpipe.train.guard import SpikeTracker, StepGuard

ROWS, CHUNKS, WIDTH = 8, 4, 6


class Lift(nn.Module):
    """The input features into the model's two states, the same tensor twice (as AmoebaNet's stem)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.linear(x)
        return h, h


class Cell(nn.Module):
    """(previous, current) -> (current, new): the current state handed on unchanged (as a cell's)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, states: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        a, b = states
        return b, b + torch.tanh(self.linear(torch.cat([a, b], dim=1)))


class Head(nn.Module):
    def __init__(self, lift: Lift) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.linear.weight = lift.linear.weight  # (tied: one parameter, counted once)

    def forward(self, states: tuple[Tensor, Tensor]) -> Tensor:
        out: Tensor = self.linear(states[1])
        return out


def model() -> nn.Sequential:
    torch.manual_seed(0)
    lift = Lift()
    return mark_blocks(nn.Sequential(lift, *[Cell() for _ in range(6)], Head(lift)), 1, 6)


def batch() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)


def record(k: int, schedule: str = "gpipe", checkpoint: Any = "never", **kwargs: Any) -> Health:
    layers = model()
    balance = [len(layers) // k] * k
    pipe = Pipeline(layers, balance, chunks=CHUNKS, loss_fn=F.mse_loss, schedule=schedule, checkpoint=checkpoint,
                    devices=["cpu"] * k, cpu_threads=1, **kwargs)  # fmt: skip
    x, y = batch()
    with Recorder(pipe) as health:
        pipe.step(x, y)
    assert all(stage.watch is None for stage in pipe.engine.stages)  # (removed again)
    return health.result()


def same(a: Health, b: Health) -> None:
    """Bitwise: the same floats."""
    assert (a.grad_norm, a.ratio, a.output_grads, a.blocks) == (b.grad_norm, b.ratio, b.output_grads, b.blocks)


@pytest.fixture(scope="module")
def one() -> Health:
    return record(1)


@pytest.mark.parametrize(
    ("k", "schedule", "checkpoint"),
    [
        (2, "gpipe", "never"),
        (4, "gpipe", "never"),
        (4, "1f1b", "always"),  # re-materialized: seen in the recomputation's backward, once
        (2, "1f1b", Selective(layers={2, 3, 5})),  # some layers re-materialized, along the tape
        (4, "zb-h1", "never"),  # split backward: seen in I, not again in W
        (2, "zb-h1", "except_last"),
        (2, "zb-h1", Selective(layers={2, 3, 5})),
    ],
    ids=["K2", "K4", "K4-always", "K2-selective", "K4-zb-h1", "K2-zb-h1-recomputed", "K2-zb-h1-selective"],
)
def test_the_same_bits_at_any_k_schedule_and_rematerialization(
    one: Health, k: int, schedule: str, checkpoint: Any
) -> None:
    """Against K=1 of the same schedule without re-materialization (a schedule's order of the
    micro-batches' backward is the order the parameters' gradients add up in: another schedule
    rounds them its own way, but not the output gradients, summed exactly)."""
    found = record(k, schedule, checkpoint)
    same(found, record(1, schedule) if schedule != "gpipe" else one)
    assert found.output_grads == one.output_grads and found.ratio == one.ratio


def reference() -> tuple[float, dict[int, float]]:
    """The plain model by hand, micro-batch by micro-batch as the pipeline scales them: every layer's
    input a leaf of its own (each place of a tuple apart), backward one layer at a time."""
    layers = model()
    x, y = batch()
    squares: dict[int, float] = {}
    for xm, ym in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
        value: Any = xm
        taped: list[tuple[list[Tensor], Any]] = []
        for layer in [*layers, lambda out, ym=ym: F.mse_loss(out, ym) * len(ym) / ROWS]:
            leaves, spec = tree_flatten(value)
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in leaves]
            value = layer(tree_unflatten(leaves, spec))
            taped.append((leaves, value))
        taped[-1][1].backward()  # the loss
        for i in reversed(range(len(layers))):  # layer i's output gradient: the next function's input leaves'
            pairs = [(o, t.grad) for o, t in zip(tree_flatten(taped[i][1])[0], taped[i + 1][0]) if t.grad is not None]
            squares[i] = squares.get(i, 0.0) + sum(float(g.double().square().sum()) for _, g in pairs)
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    grad_norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in layers.parameters() if p.grad is not None))
    return grad_norm, {i: math.sqrt(s) for i, s in squares.items()}


def test_equal_to_the_plain_model_by_hand(one: Health) -> None:
    grad_norm, outputs = reference()
    assert one.grad_norm == pytest.approx(grad_norm, rel=1e-5)
    assert one.output_grads == pytest.approx(outputs, rel=1e-5)
    assert sorted(one.output_grads) == list(range(8))  # (every layer's output, the head's the loss's input)
    assert one.blocks == (1, 6) and one.ratio == one.output_grads[1] / one.output_grads[6]
    metrics = one.metrics()
    assert list(metrics) == ["grad_norm", "grad_norm_ratio", *(f"output_grad/{i:03d}" for i in range(8))]


def test_the_spike_guard_sees_the_health_norm_ties_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """--skip-spikes' norm is global_grad_norm, the recorded grad_norm, the plain model's (the tie across
    the cut once), with or without the per-parameter norms the loop has to clip."""
    pipe = Pipeline(model(), [4, 4], chunks=CHUNKS, loss_fn=F.mse_loss, devices=["cpu"] * 2, cpu_threads=1)
    with Recorder(pipe) as health:
        loss = float(pipe.step(*batch()))
    recorded = health.result().grad_norm
    assert global_grad_norm(pipe) == recorded == global_grad_norm(pipe, grad_norms(pipe.parameters()))
    assert recorded == pytest.approx(reference()[0], rel=1e-5)
    seen: list[float] = []
    monkeypatch.setattr(SpikeTracker, "outlier", lambda self, norm: seen.append(norm))
    StepGuard(TrainConfig(skip_spikes=True), pipe).check(1, loss, lambda: None)
    assert seen == [recorded]


def test_the_norms_the_caller_has_are_used_and_blocks_fall_back() -> None:
    layers = model()
    del layers.health_blocks
    pipe = Pipeline(layers, [4, 4], chunks=CHUNKS, loss_fn=F.mse_loss, devices=["cpu"] * 2, cpu_threads=1)
    with Recorder(pipe) as health:
        pipe.step(*batch())
    found = health.result(norms=[(p, 1.0) for p in pipe.parameters()])
    assert found.grad_norm == math.sqrt(len(list(pipe.parameters())) - 1)  # (the tied copy once)
    assert found.blocks == (0, 7)  # (no blocks said: the first and last layer with an output gradient)
    with pytest.raises(ValueError, match=r"0 <= first <= last < 8, the model's layers \(blocks: \(3, 9\)\)"):
        Recorder(pipe, blocks=(3, 9))
    with pytest.raises(TypeError, match=r"records a gpipe.Pipeline's step \(got Sequential\)"):
        Recorder(layers)  # type: ignore[arg-type]


def test_a_layer_changing_its_input_in_place_is_named() -> None:
    layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH))
    pipe = Pipeline(layers, [3], chunks=2, loss_fn=F.mse_loss, devices=["cpu"], checkpoint="never")
    changed = r"layer 1 \(ReLU\) changes its input in place, so the gradient of layer 0"
    with pytest.warns(UserWarning, match=changed), Recorder(pipe) as health:
        pipe.step(*batch())
    assert sorted(health.result().output_grads) == [1, 2]


def test_the_models_name_their_blocks() -> None:
    with torch.device("meta"):
        assert blocks_of(transformer(3, 16, 2, dim=8, vocab=10)) == (1, 3)  # the encoder's first and last layers
        assert blocks_of(transformer_lm(3, 16, 2, dim=8, vocab=10)) == (1, 3)
        cells = amoebanet_d(3, 8, classes=10)
        assert blocks_of(cells) == (1, len(cells) - 2)
    pipe = Pipeline(transformer(3, 16, 2, dim=8, vocab=10), [9], chunks=1, devices=["cpu"])
    assert blocks_of(pipe) == (1, 3)  # (kept by the pipeline from the Sequential)


def test_gpipe_train_writes_the_health_every_n_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quick = {"progress": False, "steps": 4, "eval_every": 4, "eval_batches": 1, "batch": 16}
    train(TrainConfig(out=str(tmp_path / "on"), health_every=2, **quick))
    rows = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    keys = ["grad_norm", "grad_norm_ratio", *(f"output_grad/{i:03d}" for i in range(7))]  # T(2, ...): 7 layers
    assert [all(k in r for k in keys) for r in rows] == [False, True, False, True]
    assert not any(k.startswith(("grad_norm", "output_grad")) for r in rows[::2] for k in r)
    assert all(r["grad_norm_ratio"] == r["output_grad/001"] / r["output_grad/002"] for r in rows[1::2])  # encoder
    assert (tmp_path / "on" / "grad_norm_ratio.png").read_bytes().startswith(b"\x89PNG")
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "on" / "tensorboard"))
        events.Reload()
        for key in keys:
            assert [(e.step, e.value) for e in events.Scalars(key)] == [
                (r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows[1::2]
            ]

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a Recorder was made with --health-every 0")

    monkeypatch.setattr("gpipe.train.loop.Recorder", refused)  # off: no recorder, so no watch and no hook
    train(TrainConfig(out=str(tmp_path / "off"), health_every=0, tensorboard="off", **quick))
    assert not (tmp_path / "off" / "grad_norm_ratio.png").exists()
