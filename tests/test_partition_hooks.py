"""Forward hooks on partitions fire as on a plain call; a failure stops the other partitions at once."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import gpipe
from gpipe import GPipe, Pipeline

CHUNKS = 4


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())


class Recorder:
    """Records every firing of a pre-hook and a hook on ``part``: (recomputing, input, output)."""

    def __init__(self, part: nn.Module) -> None:
        self.inputs: list[tuple[bool, Tensor]] = []
        self.outputs: list[tuple[bool, Tensor, Tensor]] = []
        part.register_forward_pre_hook(self.pre)
        part.register_forward_hook(self.post)

    def pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.inputs.append((gpipe.is_recomputing(), args[0].detach().clone()))

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        self.outputs.append((gpipe.is_recomputing(), args[0].detach().clone(), output.detach().clone()))


def plain(parts: list[nn.Module], x: Tensor) -> list[list[tuple[Tensor, Tensor]]]:
    """Per partition, (input, output) of plain calls on each micro-batch of ``x``."""
    seen: list[list[tuple[Tensor, Tensor]]] = [[] for _ in parts]
    with torch.no_grad():
        for chunk in x.chunk(CHUNKS):
            value = chunk
            for k, part in enumerate(parts):
                out = part(value)
                seen[k].append((value, out))
                value = out
    return seen


def check(recorder: Recorder, expected: list[tuple[Tensor, Tensor]], recomputed: bool) -> None:
    """Fired once per micro-batch forward, in order, with the plain call's tensors; and, if
    ``recomputed``, once more per micro-batch in backward (in any order) with the same tensors."""
    first = [r for r in recorder.inputs if not r[0]]
    again = [r for r in recorder.inputs if r[0]]
    assert len(first) == len(expected) and len(again) == (len(expected) if recomputed else 0)
    for (_, given), (value, _) in zip(first, expected):
        torch.testing.assert_close(given, value)
    firsts = [r for r in recorder.outputs if not r[0]]
    agains = [r for r in recorder.outputs if r[0]]
    assert len(firsts) == len(expected) and len(agains) == len(again)
    for (_, given, out), (value, expected_out) in zip(firsts, expected):
        torch.testing.assert_close(given, value)
        torch.testing.assert_close(out, expected_out)
    for _, given, out in agains:
        assert sum(torch.equal(given, v) and torch.allclose(out, o) for v, o in expected) == 1
    assert sorted(id(v) for _, given, _ in agains for v, _ in expected if torch.equal(given, v)) == sorted(
        id(v) for v, _ in expected[: len(agains)]
    )  # each micro-batch once


# GPipe.


@pytest.mark.parametrize("checkpoint", ["always", "never", "except_last"])
def test_gpipe_hooks_fire_once_per_microbatch(checkpoint: str) -> None:
    gp = GPipe(model(), [2, 2], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint=checkpoint)
    parts = list(gp.partitions)
    recorders = [Recorder(parts[0]), Recorder(parts[-1])]
    x = torch.randn(8, 4)
    expected = plain([copy.deepcopy(p) for p in parts], x)  # deep copies: no hooks fire here
    gp(x).sum().backward()
    # As torchgpipe: a re-materialized micro-batch calls the partition again in backward.
    for recorder, seen in zip(recorders, [expected[0], expected[-1]]):
        inputs = [r for r in recorder.inputs if r[0]]
        assert len(inputs) == {"always": CHUNKS, "never": 0, "except_last": CHUNKS - 1}[checkpoint]
        if checkpoint != "except_last":
            check(recorder, seen, recomputed=checkpoint == "always")


@pytest.mark.parametrize("mode", ["eval", "no_grad"])
def test_gpipe_hooks_fire_once_without_backward(mode: str) -> None:
    gp = GPipe(model(), [2, 2], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint="always")
    parts = list(gp.partitions)
    recorders = [Recorder(parts[0]), Recorder(parts[-1])]
    x = torch.randn(8, 4)
    expected = plain([copy.deepcopy(p) for p in parts], x)
    if mode == "eval":
        gp.eval()
        gp(x)
    else:
        with torch.no_grad():
            gp(x)
    check(recorders[0], expected[0], recomputed=False)
    check(recorders[1], expected[-1], recomputed=False)
    assert all(out.grad_fn is None for _, _, out in recorders[1].outputs)


def modify(parts: list[nn.Module], kwargs: bool) -> None:
    """A pre-hook doubling the first partition's input, a hook adding one to the last one's output
    (and a hook on the first one's output squaring it)."""
    if kwargs:
        parts[0].register_forward_pre_hook(lambda m, args, kw: ((args[0] * 2,), kw), with_kwargs=True)
        parts[-1].register_forward_hook(lambda m, args, kw, out: out + 1, with_kwargs=True)
    else:
        parts[0].register_forward_pre_hook(lambda m, args: args[0] * 2)
        parts[-1].register_forward_hook(lambda m, args, out: out + 1)
    parts[0].register_forward_hook(lambda m, args, out: out**2)


@pytest.mark.parametrize("kwargs", [False, True])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_gpipe_modifying_hooks_act_as_on_a_plain_call(checkpoint: str, kwargs: bool) -> None:
    gp = GPipe(model(), [2, 2], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint=checkpoint)
    parts = list(gp.partitions)
    modify(parts, kwargs)
    x = torch.randn(8, 4, requires_grad=True)
    out = gp(x)
    out.pow(2).sum().backward()
    got = [p.grad.clone() for p in gp.parameters()]  # type: ignore[union-attr]
    x_grad = x.grad
    gp.zero_grad()
    x.grad = None
    expected = parts[1](parts[0](x))  # the partitions called plainly: nn.Module runs the hooks
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected)
    for a, p in zip(got, gp.parameters()):
        torch.testing.assert_close(a, p.grad)
    torch.testing.assert_close(x_grad, x.grad)


def test_pre_hook_giving_two_inputs_is_refused() -> None:
    gp = GPipe(model(), [2, 2], devices=["cpu", "cpu"], chunks=CHUNKS)
    gp.partitions[0].register_forward_pre_hook(lambda m, args: (args[0], args[0]))
    with pytest.raises(TypeError, match=r"partition 0 give it 2 positional arguments"):
        gp(torch.randn(8, 4))


def test_tuple_input_reaches_the_hooks_as_one_argument() -> None:
    class Add(nn.Module):
        def forward(self, ab: tuple[Tensor, Tensor]) -> Tensor:
            return ab[0] + ab[1]

    gp = GPipe(nn.Sequential(nn.Identity(), Add()), [1, 1], devices=["cpu", "cpu"], chunks=2)
    seen: list[int] = []
    gp.partitions[0].register_forward_pre_hook(lambda m, args: seen.append(len(args[0])))
    gp.partitions[1].register_forward_pre_hook(lambda m, args: ((args[0][0], args[0][1] * 0),))
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(gp((a, b)), a)
    assert seen == [2, 2]


def test_always_call_hook_fires_when_the_partition_raises() -> None:
    class Boom(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise ValueError("boom")

    gp = GPipe(nn.Sequential(nn.Linear(4, 4), Boom()), [1, 1], devices=["cpu", "cpu"], chunks=1)
    fired: list[Any] = []
    gp.partitions[1].register_forward_hook(lambda m, args, out: fired.append(out), always_call=True)
    gp.partitions[1].register_forward_hook(lambda m, args, out: fired.append("never"))
    with pytest.raises(ValueError, match="boom"):
        gp(torch.randn(2, 4))
    assert fired == [None]


def test_backward_hook_on_a_partition_is_refused() -> None:
    gp = GPipe(model(), [2, 2], devices=["cpu", "cpu"], chunks=CHUNKS)
    gp.partitions[1].register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError, match=r"partition 1 has a backward hook"):
        gp(torch.randn(8, 4))


def test_global_forward_hooks_see_the_partitions() -> None:
    gp = GPipe(model(), [2, 2], devices=["cpu", "cpu"], chunks=CHUNKS)
    parts = list(gp.partitions)
    seen: list[nn.Module] = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(m))
    try:
        gp(torch.randn(8, 4))
    finally:
        handle.remove()
    assert sum(m is parts[0] for m in seen) == CHUNKS and sum(m is parts[1] for m in seen) == CHUNKS


# Pipeline.


def pipeline(schedule: str, checkpoint: str) -> Pipeline:
    return Pipeline(
        model(),
        [2, 2],
        chunks=CHUNKS,
        loss_fn=F.mse_loss,
        schedule=schedule,
        checkpoint=checkpoint,
        devices=["cpu", "cpu"],
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_pipeline_hooks_fire_once_per_microbatch(schedule: str, checkpoint: str) -> None:
    pipe = pipeline(schedule, checkpoint)
    parts = [pipe.partitions["0"], pipe.partitions["1"]]
    recorders = [Recorder(parts[0]), Recorder(parts[1])]
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    expected = plain([copy.deepcopy(p) for p in parts], x)
    pipe.step(x, y)
    check(recorders[0], expected[0], recomputed=checkpoint == "always")
    check(recorders[1], expected[1], recomputed=checkpoint == "always")  # the output before the loss
    for r in recorders:
        r.inputs.clear()
        r.outputs.clear()
    pipe(x)  # evaluation: once per micro-batch
    check(recorders[0], expected[0], recomputed=False)
    check(recorders[1], expected[1], recomputed=False)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_pipeline_modifying_hooks_act_as_on_a_plain_call(schedule: str, checkpoint: str) -> None:
    pipe = pipeline(schedule, checkpoint)
    parts = [pipe.partitions["0"], pipe.partitions["1"]]
    modify(parts, kwargs=schedule == "1f1b")
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss = pipe.step(x, y)
    got = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    pipe.zero_grad()
    expected = F.mse_loss(parts[1](parts[0](x)), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for a, p in zip(got, pipe.parameters()):
        torch.testing.assert_close(a, p.grad)
    torch.testing.assert_close(pipe(x), parts[1](parts[0](x)).detach())


# A failure stops the other partitions.


class ExpectedError(Exception):
    pass


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        time.sleep(0.05)  # the failure downstream comes first
        return x * 1.0


class Raise(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ExpectedError("the last partition failed")


def failing(k: int) -> tuple[nn.Sequential, Counter]:
    counter = Counter()
    return nn.Sequential(counter, *[nn.Identity() for _ in range(k - 2)], Raise()), counter


@pytest.mark.parametrize("k", [2, 4])
def test_gpipe_failure_stops_the_first_partition(k: int) -> None:
    chunks = 8
    layers, counter = failing(k)
    gp = GPipe(layers, [1] * k, devices=["cpu"] * k, chunks=chunks)
    with pytest.raises(ExpectedError, match="the last partition failed"):
        gp(torch.randn(16, 4, requires_grad=True))
    assert counter.calls < chunks


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_failure_stops_the_first_partition(schedule: str, k: int) -> None:
    chunks = 8
    layers, counter = failing(k)
    pipe = Pipeline(layers, [1] * k, chunks=chunks, loss_fn=F.mse_loss, schedule=schedule, devices=["cpu"] * k)
    with pytest.raises(ExpectedError, match="the last partition failed"):
        pipe.step(torch.randn(16, 4), torch.randn(16, 4))
    assert counter.calls < chunks
