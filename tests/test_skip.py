"""Skip connections across stages: U-Net-like models in one process and across processes."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import GPipe, Pipeline
from gpipe.skip import SkipError, pop, skippable, stash
from tests import dist_cases
from tests.dist_harness import POOL, Pool
from tests.helpers import assert_all_close, even, step


def plain(build: Callable[[], nn.Sequential] = dist_cases.unet) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build()
    x, y = dist_cases.unet_data()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}  # type: ignore[misc]


def by_layer(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {re.sub(r"^partitions\.\d+\.", "", n): g for n, g in grads.items()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_unet_in_one_process(schedule: str, stages: int, checkpoint: str) -> None:
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    model = dist_cases.unet()
    pipe = Pipeline(
        model,
        even(len(model), stages),
        chunks=4,
        schedule=schedule,
        loss_fn=F.mse_loss,
        checkpoint=checkpoint,
        virtual=virtual,
        devices=["cpu"] * (stages // virtual),
    )
    x, y = dist_cases.unet_data()
    loss_plain, grads_plain = plain()
    torch.testing.assert_close(pipe.step(x, y), loss_plain)
    grads = by_layer({n: p.grad for n, p in pipe.named_parameters()})  # type: ignore[misc]
    assert set(grads) == set(grads_plain)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_plain[name], msg=name)


@pytest.mark.parametrize("stages", [2, 4])
def test_unet_with_gpipe_front_end(stages: int) -> None:
    model = dist_cases.unet()
    x, _ = dist_cases.unet_data()
    out_plain, grads_plain = step(model, x)
    out, grads = step(GPipe(copy.deepcopy(model), even(8, stages), devices=["cpu"] * stages, chunks=4), x)
    torch.testing.assert_close(out, out_plain)
    assert_all_close(grads, grads_plain)


ACROSS = [(2, "gpipe", False), (2, "1f1b", False), (4, "gpipe", False), (4, "1f1b", False), (2, "1f1b", True)]


ACROSS_RUNS = {
    c: POOL.add(c[0], f"skip {c}", "unet_step", schedule=c[1], chunks=4, generators=c[2]) for c in ACROSS
}  # cases of the session's pool (tests/dist_harness.py: a few launches in all)


@pytest.mark.parametrize(("world", "schedule", "generators"), ACROSS)
def test_unet_across_processes(pool: Pool, world: int, schedule: str, generators: bool) -> None:
    """Plain-call skips, and (``generators``) torchgpipe's protocol with namespaces: numbered in
    creation order, every rank names them alike."""
    ranks = pool(ACROSS_RUNS[world, schedule, generators])
    loss_plain, grads_plain = plain(dist_cases.generator_unet if generators else dist_cases.unet)
    merged = by_layer({n: g for r in ranks for n, g in r["grads"].items()})
    assert set(merged) == set(grads_plain)
    for r in ranks:
        torch.testing.assert_close(r["loss"], loss_plain)
    for name, g in merged.items():
        torch.testing.assert_close(g, grads_plain[name], msg=name)


@skippable(stash=["a"])
class StashA(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash("a", x)
        return x


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + pop("a")


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([PopA(), StashA()], r"layer 0 \(PopA\) pops skip 'a', which no earlier layer stashes"),
        ([StashA(), nn.Identity()], r"layer 0 \(StashA\) stashes skip 'a', which no later layer pops"),
        ([StashA(), StashA(), PopA()], r"layer 1 \(StashA\) stashes skip 'a', already stashed by layer 0"),
    ],
)
def test_unmatched_skips_are_refused_at_construction(layers: list[nn.Module], match: str) -> None:
    with pytest.raises(SkipError, match=match):
        GPipe(nn.Sequential(*layers), [1] * len(layers), devices=["cpu"] * len(layers))


def test_undeclared_pop_at_run_time() -> None:
    class Sneaky(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + pop("b")

    gp = GPipe(nn.Sequential(nn.Identity(), Sneaky()), [1, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(SkipError, match="skip 'b' is popped but was not stashed"):
        gp(torch.zeros(4, 2))
