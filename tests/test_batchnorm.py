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


# torchgpipe's standalone use: ``chunks`` micro-batches fed by hand make a mini-batch.


@pytest.mark.parametrize("momentum", [0.1, None])
def test_standalone_commits_after_chunks_microbatches(momentum: float | None) -> None:
    torch.manual_seed(3)
    plain = nn.BatchNorm2d(3, momentum=momentum)
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks=4)
    assert isinstance(deferred, DeferredBatchNorm) and deferred.chunks == 4
    for step in range(2):
        x = torch.randn(16, 3, 5, 5) * 3 + 2
        before = [deferred.running_mean.clone(), deferred.running_var.clone()]
        for i, chunk in enumerate(x.chunk(4)):
            torch.testing.assert_close(deferred(chunk), copy.deepcopy(plain)(chunk))  # own statistics
            if i < 3:  # not before the last micro-batch
                assert torch.equal(deferred.running_mean, before[0]) and torch.equal(deferred.running_var, before[1])
                assert int(deferred.num_batches_tracked) == step
        plain(x)
        torch.testing.assert_close(deferred.running_mean, plain.running_mean)
        torch.testing.assert_close(deferred.running_var, plain.running_var)
        assert int(deferred.num_batches_tracked) == int(plain.num_batches_tracked) == step + 1


def test_standalone_ignores_recomputation_and_eval() -> None:
    from gpipe.checkpoint import recomputing

    bn = DeferredBatchNorm(3, chunks=2)
    x = torch.randn(8, 3)
    bn(x)
    with recomputing():
        bn(x)  # a recomputation in backward: not a micro-batch
    bn.eval()
    bn(x)
    assert bn.tracked == 1 and int(bn.num_batches_tracked) == 0
    bn.train()
    bn(x)
    assert bn.tracked == 0 and int(bn.num_batches_tracked) == 1


def test_convert_nested_module() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.norm = nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.conv(x))

    untracked = nn.BatchNorm1d(3, track_running_stats=False)
    model = nn.Sequential(Block(), nn.Sequential(nn.BatchNorm2d(3), nn.ReLU()), nn.Flatten(2), untracked)
    norm = model[0].norm
    assert DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2) is model  # converted in place
    converted = model[0].norm
    assert isinstance(converted, DeferredBatchNorm) and isinstance(model[1][0], DeferredBatchNorm)
    assert converted.chunks == model[1][0].chunks == 2
    assert converted.weight is norm.weight and converted.running_mean is norm.running_mean  # shared
    assert model[3] is untracked  # no running statistics: nothing to defer
    # A DeferredBatchNorm with the same chunks is kept, one with other chunks replaced (as torchgpipe).
    assert DeferredBatchNorm.convert_deferred_batch_norm(converted, chunks=2) is converted
    again = DeferredBatchNorm.convert_deferred_batch_norm(converted, chunks=3)
    assert again is not converted and again.chunks == 3 and again.weight is converted.weight
    with pytest.raises(ValueError, match=r"chunks: 0"):
        DeferredBatchNorm(3, chunks=0)


def test_pipeline_commits_per_step_whatever_chunks_the_layer_has() -> None:
    """A model converted by hand for other chunks, and a short last batch (3 micro-batches of the 4
    asked for): the pipeline still folds each step's micro-batches once, as plain BatchNorm on the
    whole mini-batch."""
    torch.manual_seed(4)
    plain = bn_model()
    model = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks=1)
    gp = GPipe(model, [2, 3], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)
    for batch in (16, 3):
        x = torch.randn(batch, 3, 6, 6)
        plain(x)
        gp(x).mean().backward()
    (a,) = [m for m in plain.modules() if isinstance(m, nn.BatchNorm2d)]
    (b,) = [m for m in gp.modules() if isinstance(m, DeferredBatchNorm)]
    torch.testing.assert_close(b.running_mean, a.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.running_var, a.running_var, rtol=1e-5, atol=1e-6)
    assert int(b.num_batches_tracked) == 2


def test_loads_a_torchgpipe_state_dict() -> None:
    """torchgpipe keeps its accumulators ``sum`` and ``sum_squares`` in the state dict."""
    bn = DeferredBatchNorm(3)
    state = {**bn.state_dict(), "sum": torch.zeros(3), "sum_squares": torch.zeros(3)}
    state["running_mean"] = torch.ones(3)
    bn.load_state_dict(state)  # strict
    assert torch.equal(bn.running_mean, torch.ones(3))
