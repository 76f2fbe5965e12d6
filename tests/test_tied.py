"""Tied weights across stages: the copies stay identical, their gradient is the shared one's."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from tests import dist_cases
from tests.dist_harness import POOL, Pool


def plain(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = dist_cases.tied_lm(share=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, y = dist_cases.lm_data()
    first = {}
    for i in range(steps):
        optimizer.zero_grad()
        dist_cases.lm_loss(model(x), y).backward()
        if i == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
        optimizer.step()
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}


def by_layer(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {re.sub(r"^partitions\.\d+\.", "", n): v for n, v in values.items()}


def check(grads: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    plain_grads, plain_weights = plain(5)
    assert torch.equal(weights["0.weight"], weights["5.weight"]), "the copies must stay bitwise identical"
    torch.testing.assert_close(grads["0.weight"], plain_grads["0.weight"])  # embedding + projection
    torch.testing.assert_close(grads["5.weight"], plain_grads["0.weight"])
    for name, g in grads.items():
        if name != "5.weight":
            torch.testing.assert_close(g, plain_grads[name], msg=name)
    for name, w in weights.items():
        torch.testing.assert_close(w, plain_weights["0.weight" if name == "5.weight" else name], msg=name)


def test_tied_in_one_process() -> None:
    out = dist_cases.tied_training(5)
    check(by_layer(out["grads"]), by_layer(out["weights"]))


# a case of the session's pool (tests/dist_harness.py: a few launches in all)
ACROSS = POOL.add(2, "tied", "tied_training", steps=5)


def test_tied_across_two_processes(pool: Pool) -> None:
    ranks = pool(ACROSS)
    grads = by_layer({n: g for r in ranks for n, g in r["grads"].items()})
    weights = by_layer({n: w for r in ranks for n, w in r["weights"].items()})
    assert "0.weight" in by_layer(ranks[0]["weights"]) and "5.weight" in by_layer(ranks[1]["weights"])
    check(grads, weights)


@pytest.mark.parametrize(
    ("tied", "match"),
    [
        ([["0.weight"]], "at least two parameters"),
        ([["0.weight", "9.weight"]], r"'9\.weight' is not '<layer index>\.<parameter name>' of a model of 6 layers"),
        ([["0.weight", "2.weight"]], r"layer 2 has no parameter 'weight'"),
        ([["0.weight", "1.weight"]], "different shapes"),
    ],
)
def test_tie_errors(tied: list[list[str]], match: str) -> None:
    model = dist_cases.tied_lm(share=False)
    model[1] = nn.Linear(dist_cases.DIM, dist_cases.DIM + 1)
    with pytest.raises(ValueError, match=match):
        Pipeline(model, [3, 3], chunks=2, loss_fn=F.mse_loss, tied=tied, devices=["cpu", "cpu"])


@pytest.mark.parametrize("front_end", ["gpipe", "pipeline"])
def test_shared_parameter_is_tied_without_being_named_and_trains_as_plain(front_end: str) -> None:
    """The plain model's one embedding/output weight, on the first and last partition: tied by
    itself, and three Adam steps later every copy equals the plain model's weight."""
    import copy

    from gpipe import GPipe

    model = dist_cases.tied_lm(share=True)
    plain = copy.deepcopy(model)
    x, y = dist_cases.lm_data()
    if front_end == "gpipe":
        net: nn.Module = GPipe(model, [3, 3], devices=["cpu"] * 2, chunks=4)
    else:
        net = Pipeline(model, [3, 3], devices=["cpu"] * 2, chunks=4, loss_fn=dist_cases.lm_loss)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
    reference = torch.optim.Adam(plain.parameters(), lr=0.05)
    for _ in range(3):
        optimizer.zero_grad()
        reference.zero_grad()
        if isinstance(net, GPipe):
            dist_cases.lm_loss(net(x), y).backward()
        else:
            net.step(x, y)
        dist_cases.lm_loss(plain(x), y).backward()
        optimizer.step()
        reference.step()
    copies = [p for n, p in net.named_parameters() if re.search(r"(^|\.)(0|5)\.weight$", n)]
    assert len(copies) == 2 and copies[0] is not copies[1]
    assert torch.equal(copies[0], copies[1])
    torch.testing.assert_close(copies[0], plain[0].weight, rtol=1e-5, atol=1e-6)
