"""Loss weighting by tokens: with padding, a step's gradient is the mini-batch's token-mean loss's."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from gpipe.recipe import count_tokens, label_smoothing_loss
from tests.helpers import assert_all_close, grads

PAD = 0


def lm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 16))


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 6 tokens; the first ones padded heavily, the last ones not at all — so that
    micro-batches hold very different numbers of real tokens."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 16, (8, 6), generator=g)
    target = torch.randint(1, 16, (8, 6), generator=g)
    for row, length in enumerate([1, 1, 2, 2, 6, 6, 6, 6]):
        target[row, length:] = PAD
    return tokens, target


def token_mean(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1), ignore_index=PAD)


def token_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1), ignore_index=PAD, reduction="sum")


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_token_weighted_loss_equals_plain_token_mean(chunks: int, schedule: str) -> None:
    model = lm()
    tokens, target = padded_batch()
    plain = copy.deepcopy(model)
    expected_loss = token_mean(plain(tokens), target)
    expected_loss.backward()
    pipe = Pipeline(copy.deepcopy(model), [2, 2], chunks=chunks, loss_fn=token_sum, loss_count=count_tokens(PAD),
                    schedule=schedule, devices=["cpu", "cpu"])  # fmt: skip
    loss = pipe.step(tokens, target)
    torch.testing.assert_close(loss, expected_loss.detach())
    assert_all_close(grads(pipe), grads(plain), rtol=1e-5, atol=1e-7)
    if chunks > 1:  # not vacuous: weighting micro-batches by samples gives another gradient
        by_samples = Pipeline(copy.deepcopy(model), [2, 2], chunks=chunks, loss_fn=token_mean, schedule=schedule,
                              devices=["cpu", "cpu"])  # fmt: skip
        by_samples.step(tokens, target)
        gap = max((a - b).abs().max().item() for a, b in zip(grads(by_samples), grads(plain)))
        assert gap > 1e-3


def test_label_smoothing_sum_with_count_tokens() -> None:
    """gpipe train's token loss: label smoothing, summed, counted without the padding."""
    model = lm()
    tokens, target = padded_batch()
    plain = copy.deepcopy(model)
    label_smoothing_loss(plain(tokens), target, 0.1, ignore_index=PAD).backward()
    loss_fn = functools.partial(label_smoothing_loss, smoothing=0.1, ignore_index=PAD, reduction="sum")
    pipe = Pipeline(copy.deepcopy(model), [2, 2], chunks=4, loss_fn=loss_fn, loss_count=count_tokens(PAD),
                    devices=["cpu", "cpu"])  # fmt: skip
    pipe.step(tokens, target)
    assert_all_close(grads(pipe), grads(plain), rtol=1e-5, atol=1e-7)


def test_nothing_counted_gives_zero_loss_and_gradient() -> None:
    tokens, target = padded_batch()
    pipe = Pipeline(lm(), [2, 2], chunks=2, loss_fn=token_sum, loss_count=count_tokens(PAD), devices=["cpu", "cpu"])
    loss = pipe.step(tokens, torch.full_like(target, PAD))
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads(pipe))


def test_bad_loss_count() -> None:
    tokens, target = padded_batch()
    with pytest.raises(TypeError, match="loss_count must be callable"):
        Pipeline(lm(), [2, 2], chunks=2, loss_fn=token_sum, loss_count=3, devices=["cpu", "cpu"])  # type: ignore[arg-type]
    pipe = Pipeline(lm(), [2, 2], chunks=2, loss_fn=token_sum, loss_count=lambda t: -1, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"loss_count must return a number >= 0 \(loss_count\(target\): -1\)"):
        pipe.step(tokens, target)
    pipe = Pipeline(lm(), [2, 2], chunks=2, loss_fn=token_sum, loss_count=lambda t: t != PAD, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"a tensor of shape \(8, 6\)"):
        pipe.step(tokens, target)
