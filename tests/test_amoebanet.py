"""AmoebaNet-D as layers: shapes, the paper's sizes, pipelined gradients, FLOP-based balance."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from gpipe.balance import balance_by_flops, layer_flops, solve
from gpipe.microbatch import scatter
from gpipe.models import amoebanet_d, parameter_count
from gpipe.models.amoebanet import Cell
from tests.helpers import assert_close_norm, intra_op_threads


def tiny(**kwargs: object) -> nn.Sequential:
    torch.manual_seed(0)
    return amoebanet_d(3, 8, classes=5, stem_cells=0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("stem_cells", "side"), [(0, 16), (2, 32), (2, 33), (1, 15)])
def test_shapes_and_layers(stem_cells: int, side: int) -> None:
    torch.manual_seed(0)
    model = amoebanet_d(4, 8, classes=7, stem_cells=stem_cells)
    assert len(model) == 4 + 4 + stem_cells  # stem, stem cells, 4 normal, 2 reductions, classifier
    assert model(torch.randn(2, 3, side, side)).shape == (2, 7)
    reductions = [m.reduction for m in model if isinstance(m, Cell)]
    assert reductions == [True] * stem_cells + [False, False, True, False, True, False]  # stacks 2, 1, 1


def test_cells_double_the_filters_and_halve_the_resolution() -> None:
    model = tiny()
    x = torch.randn(2, 3, 16, 16)
    sizes = []
    for layer in model[:-1]:
        x = layer(x)
        sizes.append(tuple(x[1].shape[1:]))
    assert sizes == [(8, 8, 8), (24, 8, 8), (48, 4, 4), (48, 4, 4), (96, 2, 2), (96, 2, 2)]


def test_reference_cells_concatenate_four_states_in_normal_cells_and_a_bottleneck_3x3() -> None:
    """The TPU reference implementation's cells: a normal cell's output also holds its (width-C) input,
    4C channels (reduction cells stay 3C), and the reduction's 3x3 convolution is a C/4 bottleneck."""
    model = tiny(reference_cells=True)
    x = torch.randn(2, 3, 16, 16)
    sizes = []
    for layer in model[:-1]:
        x = layer(x)
        sizes.append(tuple(x[1].shape[1:]))
    assert sizes == [(8, 8, 8), (32, 8, 8), (48, 4, 4), (64, 4, 4), (96, 2, 2), (128, 2, 2)]
    reduction = next(m for m in model if isinstance(m, Cell) and m.reduction)
    convs = [m for m in reduction.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [(4, 4)]  # C=16: the 3x3 at C/4
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 5)


@pytest.mark.parametrize(
    ("config", "paper"),
    [((18, 208), 82e6), ((18, 416), 318e6), ((18, 544), 542e6), ((36, 544), 1.05e9), ((72, 512), 1.8e9)],
)
def test_named_configurations_on_the_meta_device(config: tuple[int, int], paper: float) -> None:
    """Within 10% of the paper's Table 1 (docs/models.md explains the gap)."""
    with torch.device("meta"):
        model = amoebanet_d(*config)
    assert 0.9 <= parameter_count(model) / paper <= 1.0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"layers >= 1.*filters: 2"):
        amoebanet_d(3, 2)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_equals_plain_per_micro_batch(schedule: str) -> None:
    """Batch norm normalizes each micro-batch by its own statistics, so the plain reference runs the
    same micro-batches one by one and accumulates their gradients.

    Both sides run on one intra-op thread, so the convolutions are the same kernels on the same
    shapes and round alike on any CPU. (With another thread count on one side, batch norm over
    micro-batches of two amplifies the convolutions' different rounding: up to 2.5e-4 of a
    gradient's norm on a Zen 3, beyond an elementwise rtol of 1e-3 near zero.) What remains is the
    order in which the micro-batches' gradients are summed (the schedule's backward order, the
    loop's forward order): bitwise equal where they agree, and within 4e-7 of the norm where they
    differ, whatever the seed or ISA (AVX-512, AVX2, SSE4), so a bound of 1e-5 leaves a wide
    margin; a wrong factor or a lost micro-batch is off by more than 1e-2."""
    model = tiny()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))
    plain = copy.deepcopy(model)
    total = torch.zeros(())
    with intra_op_threads(1):
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            loss = loss_fn(plain(xs), ys) * len(xs) / len(x)
            loss.backward()
            total += loss.detach()
    pipe = Pipeline(model, [2, 2, 3], chunks=4, schedule=schedule, loss_fn=loss_fn, devices=["cpu"] * 3,
                    deferred_batch_norm=True, cpu_threads=1)  # fmt: skip
    torch.testing.assert_close(pipe.step(x, y), total)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert_close_norm(p.grad, q.grad, rtol=1e-5, msg=name)


def test_gradients_bitwise_equal_for_one_two_and_four_stages() -> None:
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))
    results = []
    for balance in ([7], [3, 4], [2, 2, 1, 2]):
        pipe = Pipeline(tiny(), balance, chunks=4, loss_fn=loss_fn, devices=["cpu"] * len(balance),
                        deferred_batch_norm=True, cpu_threads=1)  # fmt: skip
        loss = pipe.step(x, y)
        results.append((loss, [p.grad for p in pipe.parameters()], [b.clone() for b in pipe.buffers()]))
    for loss, grads, buffers in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(buffers, results[0][2], strict=True))


def test_layer_flops_counts_matrix_products_from_shapes_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 30))
    sample = torch.randn(8, 10)
    # forward 2·B·in·out; backward: the input's gradient and the weight's, 2·B·in·out each
    assert layer_flops(model, sample) == [2 * 8 * 10 * 20 * 3, 0.0, 2 * 8 * 20 * 30 * 3]
    assert layer_flops(model, sample, backward=False) == [2 * 8 * 10 * 20, 0.0, 2 * 8 * 20 * 30]
    assert layer_flops(model, sample, chunks=4)[2] == 2 * 2 * 20 * 30 * 3


def test_balance_by_flops_splits_an_amoebanet_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = amoebanet_d(18, 256)
    sample = torch.empty(8, 3, 224, 224)
    flops = layer_flops(model, sample)
    assert balance_by_flops(4, model, sample) == solve(flops, 4)
    assert flops[0] < flops[3] < flops[9]  # the stem < a cell at 56x56 < a reduction cell
    assert not any(p.is_meta is False for p in model.parameters())


def test_micro_batches_of_images() -> None:
    assert [b.value.shape[0] for b in scatter(torch.randn(10, 3, 4, 4), 4)] == [3, 3, 3, 1]
