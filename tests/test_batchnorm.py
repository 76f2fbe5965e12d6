from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe import DeferredBatchNorm, GPipe
from tests.helpers import intra_op_threads


def bn_model(first_stage: bool = True) -> nn.Sequential:
    """One BatchNorm (so its input is the same in plain and pipelined runs), on stage 0 or stage 1."""
    conv1, conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
    if first_stage:
        return nn.Sequential(conv1, nn.BatchNorm2d(4), nn.ReLU(), conv2, nn.ReLU())
    return nn.Sequential(conv1, nn.ReLU(), conv2, nn.BatchNorm2d(4), nn.ReLU())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("first_stage", [True, False])
def test_running_stats_equal_plain_batch_norm_on_whole_minibatch(
    checkpoint: str, momentum: float | None, first_stage: bool
) -> None:
    torch.manual_seed(0)
    plain = bn_model(first_stage)
    for m in plain.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = momentum
    gp = GPipe(
        copy.deepcopy(plain), [2, 3], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True
    )
    for _ in range(3):  # three steps: the running averages compound
        x = torch.randn(16, 3, 6, 6) * 2 + 1
        plain(x).mean().backward()
        gp(x).mean().backward()
    plain_bns = [m for m in plain.modules() if isinstance(m, nn.BatchNorm2d)]
    gp_bns = [m for m in gp.modules() if isinstance(m, DeferredBatchNorm)]
    assert len(gp_bns) == 1
    for a, b in zip(plain_bns, gp_bns):
        torch.testing.assert_close(b.running_mean, a.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.running_var, a.running_var, rtol=1e-5, atol=1e-6)
        assert int(b.num_batches_tracked) == int(a.num_batches_tracked) == 3


def test_each_microbatch_normalized_with_its_own_statistics() -> None:
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5))
    gp = GPipe(copy.deepcopy(plain), [1, 1], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)
    x = torch.randn(16, 5)
    expected = torch.cat([copy.deepcopy(plain)(c) for c in x.chunk(4)])
    torch.testing.assert_close(gp(x), expected)


def test_eval_uses_running_statistics() -> None:
    torch.manual_seed(2)
    plain = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5))
    gp = GPipe(copy.deepcopy(plain), [1, 1], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)
    x = torch.randn(16, 5)
    plain(x)
    gp(x)
    plain.eval()
    gp.eval()
    y = torch.randn(8, 5)
    torch.testing.assert_close(gp(y), plain(y))


def test_without_deferred_batch_norm_modules_are_unchanged() -> None:
    gp = GPipe(bn_model(), [2, 3], devices=["cpu", "cpu"], chunks=2)
    assert not any(isinstance(m, DeferredBatchNorm) for m in gp.modules())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_plain_batch_norm_counts_each_microbatch_once_under_rematerialization(
    checkpoint: str, momentum: float | None
) -> None:
    """Without deferred batch norm, each micro-batch updates the running statistics once, as a plain
    run over the micro-batches one by one does: the recomputation in backward must not count again."""
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
    )  # fmt: skip
    gp = GPipe(copy.deepcopy(plain), [2, 4], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint, cpu_threads=1)
    with intra_op_threads(1):  # the same kernels on both sides: the statistics compare bitwise
        for _ in range(2):
            x = torch.randn(16, 3, 6, 6) * 2 + 1
            for chunk in x.chunk(4):
                plain(chunk)
            gp(x).mean().backward()
    plain_bns = [m for m in plain.modules() if isinstance(m, nn.BatchNorm2d)]
    gp_bns = [m for m in gp.modules() if isinstance(m, nn.BatchNorm2d)]
    for a, b in zip(gp_bns, plain_bns):
        assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 8
        assert torch.equal(a.running_mean, b.running_mean)
        assert torch.equal(a.running_var, b.running_var)
