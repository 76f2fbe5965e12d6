"""torchgpipe's skip-connection API: ``yield stash(...)`` / ``x = yield pop(...)``, ``Namespace``
and ``isolate`` to use one pair of layer classes twice, ``verify_skippables`` — in plain
``nn.Sequential`` use and in both front ends under every schedule (across processes:
tests/test_skip.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gpipe
from gpipe.skip import Namespace, SkipError, pop, skippable, stash, verify_skippables
from tests import dist_cases
from tests.helpers import even
from tests.test_skip import by_layer

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def unet() -> nn.Sequential:
    return dist_cases.generator_unet()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    return dist_cases.unet_data()


def plain_grads() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model = unet()
    x, y = data()
    out = model(x)
    loss = F.mse_loss(out, y)
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_the_generator_unet_runs_plainly_and_reuses_its_classes() -> None:
    model = unet()
    assert sum(isinstance(m, dist_cases.GenDown) for m in model) == 2  # one class, two namespaces
    assert repr(model[0]).startswith("@skippable(GenDown(")
    out = model(data()[0])
    assert out.shape == data()[1].shape
    verify_skippables(model)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_equals_plain(k: int, schedule: str) -> None:
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    model = unet()
    pipe = gpipe.Pipeline(model, even(len(model), k * virtual), chunks=4, schedule=schedule, loss_fn=F.mse_loss,
                          virtual=virtual, devices=["cpu"] * k, checkpoint="always")  # fmt: skip
    x, y = data()
    _, loss_plain, grads_plain = plain_grads()
    torch.testing.assert_close(pipe.step(x, y), loss_plain)
    grads = by_layer({n: p.grad for n, p in pipe.named_parameters() if p.grad is not None})
    assert set(grads) == set(grads_plain)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_plain[name], msg=name)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_gpipe_front_end_equals_plain(k: int) -> None:
    model = unet()
    net = gpipe.GPipe(copy.deepcopy(model), even(len(model), k), devices=["cpu"] * k, chunks=4)
    x, y = data()
    out_plain, _, grads_plain = plain_grads()
    out = net(x)
    torch.testing.assert_close(out, out_plain)
    F.mse_loss(out, y).backward()
    grads = by_layer({n: p.grad for n, p in net.named_parameters() if p.grad is not None})
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_plain[name], msg=name)


@skippable(stash=["1to3"])
class Layer1(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("1to3", x)
        return x * 2


class Layer2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


@skippable(pop=["1to3"])
class Layer3(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("1to3")
        return x + skip


@skippable(stash=["x"], pop=["x"])
class StashPopSame(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("x", x)
        return (yield pop("x"))


@pytest.mark.parametrize(
    ("layers", "messages"),
    [
        ([Layer1, Layer2], ["no module declared '1to3' as poppable but stashed"]),
        ([Layer2, Layer3], ["'1' declared '1to3' as poppable but it was not stashed"]),
        ([Layer1, Layer2, Layer3, Layer3], ["'3' redeclared '1to3' as poppable but not isolated by namespace"]),
        ([Layer1, Layer1, Layer2, Layer3], ["'1' redeclared '1to3' as stashable but not isolated by namespace"]),
        ([StashPopSame], ["'0' declared 'x' both as stashable and as poppable"]),
    ],
)
def test_verify_skippables_names_every_mismatch(layers: list[type[nn.Module]], messages: list[str]) -> None:
    with pytest.raises(TypeError, match="one or more pairs of stash and pop do not match") as info:
        verify_skippables(nn.Sequential(*(layer() for layer in layers)))
    for message in messages:
        assert f"* {message}" in str(info.value)


def test_isolated_names_verify_and_run() -> None:
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(Layer1().isolate(ns1), Layer1().isolate(ns2), Layer2(), Layer3().isolate(ns2),
                          Layer3().isolate(ns1))  # fmt: skip
    verify_skippables(model)
    x = torch.randn(4, 3)
    expected = ((x * 2) * 2 + 1 + x * 2) + x  # each Layer3 adds its own namespace's stash
    torch.testing.assert_close(model(x), expected)
    net = gpipe.GPipe(copy.deepcopy(model), [2, 1, 2], devices=["cpu"] * 3, chunks=2)
    torch.testing.assert_close(net(x), expected)


def test_calls_are_checked_against_the_declarations() -> None:
    @skippable(stash=["a"])
    class Undeclared(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            yield stash("b", x)
            return x

    @skippable(stash=["a"])
    class Forgetful(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(RuntimeError, match="'b' has not been declared as stashable"):
        Undeclared()(torch.zeros(1))
    with pytest.raises(RuntimeError, match="'a' must be stashed but have not been"):
        Forgetful()(torch.zeros(1))
    with pytest.raises(SkipError, match="pops skip '1to3', which no earlier layer stashes"):
        gpipe.GPipe(nn.Sequential(Layer2(), Layer3()), [1, 1], devices=["cpu"] * 2)
