"""Bad input gets a clear error naming the offending values."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gpipe import GPipe, MovingPartitionError


def four() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"balance": None}, ValueError, "balance is required"),
        ({"balance": [2, 1]}, ValueError, r"module: 4, sum of balance: 3"),
        ({"balance": [4, 0]}, ValueError, r"positive \(balance: \[4, 0\]\)"),
        ({"balance": [2, -1, 3]}, ValueError, r"positive \(balance: \[2, -1, 3\]\)"),
        ({"balance": "22"}, TypeError, "sequence of ints"),
        ({"balance": [2.0, 2.0]}, TypeError, "must contain ints"),
        ({"balance": [2, 2], "chunks": 0}, ValueError, r"chunks: 0"),
        ({"balance": [2, 2], "chunks": -3}, ValueError, r"chunks: -3"),
        ({"balance": [2, 2], "checkpoint": "sometimes"}, ValueError, r"checkpoint: 'sometimes'"),
        ({"balance": [2, 2], "devices": ["cpu"]}, IndexError, r"devices: 1, partitions: 2"),
        ({"balance": [2, 2], "devices": ["cpu", "cpu"], "cpu_threads": 0}, ValueError, r"cpu_threads: 0"),
    ],
)
def test_constructor_rejects(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    kwargs.setdefault("devices", ["cpu", "cpu", "cpu"])
    with pytest.raises(error, match=match):
        GPipe(four(), **kwargs)


def test_module_must_be_sequential_or_traced_on_a_sample() -> None:
    with pytest.raises(ValueError, match=r"Linear is not an nn.Sequential: pass sample="):
        GPipe(nn.Linear(2, 2), [1])
    with pytest.raises(TypeError, match=r"nn.Sequential.*\(module: str\)"):
        GPipe("layers", [1])  # type: ignore[arg-type]


def test_same_module_in_two_partitions() -> None:
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"same module is in partitions 0 and 1 \(layer '0' and layer '2'\)"):
        GPipe(nn.Sequential(shared, nn.ReLU(), shared), [2, 1], devices=["cpu", "cpu"])


def test_same_module_twice_in_one_partition_is_allowed() -> None:
    shared = nn.Linear(2, 2)
    gp = GPipe(nn.Sequential(shared, shared, nn.ReLU()), [2, 1], devices=["cpu", "cpu"])
    assert len(gp) == 3


def test_same_parameter_in_two_partitions_is_tied() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    plain = copy.deepcopy(nn.Sequential(a, b))
    gp = GPipe(nn.Sequential(a, b), [1, 1], devices=["cpu", "cpu"])
    first, second = gp[0].weight, gp[1].weight
    assert first is not second  # a copy on each partition, with the shared gradient
    x = torch.randn(4, 2)
    gp(x).sum().backward()
    plain(x).sum().backward()
    assert torch.equal(first.grad, second.grad)
    torch.testing.assert_close(first.grad, plain[0].weight.grad)


@pytest.mark.parametrize(
    ("inputs", "error", "match"),
    [
        ([1, 2], TypeError, r"got list of \(int, int\)"),
        (None, TypeError, "got NoneType"),
        (("not", "tensors"), TypeError, "at least one tensor"),
        (torch.zeros(0, 2), ValueError, "empty batch"),
    ],
)
def test_forward_rejects(inputs: Any, error: type[Exception], match: str) -> None:
    gp = GPipe(four(), [2, 2], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(error, match=match):
        gp(inputs)


def test_layer_returning_a_list_gathers_a_list() -> None:
    """Any pytree may leave a layer (a list here), and comes back gathered in that structure."""

    class Listed(nn.Module):
        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return [x, x + 1]

    gp = GPipe(nn.Sequential(nn.Linear(2, 2), Listed()), [1, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 2)
    out = gp(x)
    assert isinstance(out, list) and len(out) == 2
    torch.testing.assert_close(out[1], out[0] + 1)
    torch.testing.assert_close(out[0], gp.partitions[0](x))


def test_moving_is_refused_but_dtype_casts_are_not() -> None:
    gp = GPipe(four(), [2, 2], devices=["cpu", "cpu"])
    for move in (lambda: gp.to("cpu"), lambda: gp.cpu(), lambda: gp.cuda(), lambda: gp.to(torch.zeros(1))):
        with pytest.raises(MovingPartitionError, match="devices="):
            move()
    gp.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in gp.parameters())
