from __future__ import annotations

import pytest
import torch

from gpipe.microbatch import Batch, gather, scatter


def test_scatter_tensor_even() -> None:
    x = torch.arange(8.0).view(8, 1)
    batches = scatter(x, 4)
    assert [b.value.shape[0] for b in batches] == [2, 2, 2, 2]
    assert all(b.spec is None for b in batches)
    assert torch.equal(gather(batches), x)


def test_scatter_uneven_and_too_small() -> None:
    assert [b.value.size(0) for b in scatter(torch.zeros(10, 3), 4)] == [3, 3, 3, 1]
    assert [b.value.size(0) for b in scatter(torch.zeros(6, 3), 4)] == [2, 2, 2]
    assert [b.value.size(0) for b in scatter(torch.zeros(2, 3), 8)] == [1, 1]


def test_scatter_tuple_passes_non_tensors_through() -> None:
    x, y = torch.randn(6, 2), torch.arange(6)
    batches = scatter((x, "tag", y, None), 3)
    assert len(batches) == 3
    for m, b in enumerate(batches):
        assert b.spec is not None
        assert b.values[1] == "tag" and b.values[3] is None
        assert torch.equal(b.values[0], x[2 * m : 2 * m + 2])
        assert torch.equal(b.values[2], y[2 * m : 2 * m + 2])
    out = gather(batches)
    assert isinstance(out, tuple) and out[1] == "tag"
    assert torch.equal(out[0], x) and torch.equal(out[2], y)


def test_gather_stacks_scalars() -> None:
    batches = [Batch((torch.tensor(float(m)),), None) for m in range(3)]
    assert torch.equal(gather(batches), torch.tensor([0.0, 1.0, 2.0]))


@pytest.mark.parametrize(
    ("inputs", "error", "match"),
    [
        ([1, 2], TypeError, r"got list of \(int, int\)"),
        (3, TypeError, "got int$"),
        (None, TypeError, "got NoneType$"),
        ({}, TypeError, r"got dict of \(nothing\)"),
        ((1, "a"), TypeError, "at least one tensor"),
        ({"a": "x"}, TypeError, r"at least one tensor .* got dict of \(str\)"),
        (torch.zeros(0, 3), ValueError, "empty batch"),
        ({"a": torch.zeros(0, 3), "n": 1}, ValueError, "empty batch"),
        (torch.tensor(1.0), ValueError, "0-dimensional"),
        ((torch.tensor(1.0), torch.tensor(2.0)), ValueError, "0-dimensional"),
        ((torch.zeros(4), torch.zeros(5)), ValueError, r"\[4, 5\] \(\[0\]: 4, \[1\]: 5\)"),
        ({"x": torch.zeros(4), "m": [torch.zeros(5)]}, ValueError, r"\['x'\]: 4, \['m'\]\[0\]: 5"),
    ],
)
def test_scatter_rejects(inputs: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        scatter(inputs, 2)


def test_scatter_rejects_bad_chunks() -> None:
    with pytest.raises(ValueError, match="chunks: 0"):
        scatter(torch.zeros(4), 0)
