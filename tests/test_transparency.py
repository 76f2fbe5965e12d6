"""Pipelined training equals plain training: outputs and every parameter gradient."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gpipe import GPipe
from tests.helpers import assert_all_close, assert_all_close_norm, intra_op_threads, pipe, step


def conv_stack(dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(16):
        layers.append(nn.Conv2d(1, 1, 3, padding=1))
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def global_norm(gs: list[Tensor]) -> Tensor:
    return torch.sqrt(sum((g.double() ** 2).sum() for g in gs))  # type: ignore[arg-type]


# The plain run sums over the batch of 16 at once, the pipeline over micro-batches of 2, so the
# convolutions round differently: a bias's gradient (one number, a sum over 1024 positions of terms
# that partly cancel, through up to 15 convolutions) differed by up to 7.8e-6 of itself over seeds
# 0-7 and AVX-512, AVX2 or SSE4 kernels (plain on 2 or 4 threads: less), beyond an elementwise rtol
# of 1e-6. Norm-relative 1e-4 per tensor leaves a margin of 13; a lost micro-batch is off by 1/8.
# Both sides run on one thread, so the error does not depend on the machine's core count.
CONV_STACK_RTOL = 1e-4


def test_paper_consistency_conv_stack() -> None:
    """The paper's test: 16 3x3 convolutions, [16, 1, 8, 8], 8 micro-batches, loss = mean of the output."""
    torch.manual_seed(0)
    model = conv_stack()
    x = torch.randn(16, 1, 8, 8)
    with intra_op_threads(1):
        _, plain = step(model, x)
    norms = {}
    for k in (1, 2, 4):
        _, g = step(pipe(model, k, chunks=8, cpu_threads=1), x)
        assert_all_close_norm(g, plain, rtol=CONV_STACK_RTOL)
        norms[k] = global_norm(g)
    assert torch.equal(norms[1], norms[2]) and torch.equal(norms[1], norms[4]), norms  # same kernels: bitwise
    # the global norm (float64 over all gradients) differed from plain's by up to 1.2e-6 of itself
    assert torch.allclose(norms[1], global_norm(plain), rtol=1e-5, atol=0), (norms[1], global_norm(plain))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_consistency_every_checkpoint_mode(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = conv_stack()
    x = torch.randn(16, 1, 8, 8)
    with intra_op_threads(1):
        _, plain = step(model, x)
    for k in (1, 2, 4):
        _out, g = step(pipe(model, k, chunks=8, checkpoint=checkpoint, cpu_threads=1), x)
        assert_all_close_norm(g, plain, rtol=CONV_STACK_RTOL)


def test_mlp_outputs_and_gradients() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))
    x = torch.randn(24, 12, requires_grad=True)
    out_plain, plain = step(model, x)
    grad_x = x.grad.clone()  # type: ignore[union-attr]
    for k in (1, 2, 3):
        x.grad = None
        out, g = step(pipe(model, k, chunks=6), x)
        torch.testing.assert_close(out, out_plain)
        assert_all_close(g, plain)
        torch.testing.assert_close(x.grad, grad_x)


def test_transformer_blocks() -> None:
    torch.manual_seed(2)
    blocks = [
        nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        for _ in range(4)
    ]
    model = nn.Sequential(*blocks)
    x = torch.randn(8, 10, 32)
    out_plain, plain = step(model, x)
    for k in (2, 4):
        out, g = step(pipe(model, k, chunks=4), x)
        torch.testing.assert_close(out, out_plain, rtol=1e-5, atol=1e-5)
        assert_all_close(g, plain, rtol=1e-4, atol=1e-5)


class Mix(nn.Module):
    """A layer on a tuple (features, context, tag, token ids): mixes context into the features."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, inputs: tuple[Tensor, Tensor, str, Tensor]) -> tuple[Tensor, Tensor, str, Tensor]:
        x, ctx, tag, ids = inputs
        assert tag == "keep" and ids.dtype == torch.int64
        return torch.tanh(self.a(x) + self.b(ctx)) * (ids.unsqueeze(1) + 1), ctx * 0.5, tag, ids


def test_tuple_inputs_with_non_tensors() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(Mix(), Mix(), Mix(), Mix())
    x = torch.randn(12, 8)
    ctx = torch.randn(12, 8, requires_grad=True)
    ids = torch.arange(12) % 3
    out_plain, plain = step(model, (x, ctx, "keep", ids))
    grad_ctx = ctx.grad.clone()  # type: ignore[union-attr]
    ctx.grad = None
    out, g = step(pipe(model, 2, chunks=3), (x, ctx, "keep", ids))
    assert out[2] == "keep" and torch.equal(out[3], ids)
    torch.testing.assert_close(out[0], out_plain[0])
    torch.testing.assert_close(out[1], out_plain[1])
    assert_all_close(g, plain)
    torch.testing.assert_close(ctx.grad, grad_ctx)


def test_uneven_batch() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))
    x = torch.randn(10, 6)
    out_plain, plain = step(model, x)
    out, g = step(pipe(model, 2, chunks=4), x)
    assert out.shape == (10, 3)
    torch.testing.assert_close(out, out_plain)
    assert_all_close(g, plain)


def test_gradient_accumulates_over_two_forwards() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    model.zero_grad()
    (model(x1).sum() + model(x2).pow(2).sum()).backward()
    plain = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    gp = pipe(model, 2, chunks=4)
    (gp(x1).sum() + gp(x2).pow(2).sum()).backward()
    assert_all_close([p.grad for p in gp.parameters()], plain)  # type: ignore[misc]


def test_eval_and_no_grad_forward() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    gp = pipe(model, 2, chunks=4)
    with torch.no_grad():
        out = gp(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x))
    gp.eval()
    out = gp(x)
    out.sum().backward()  # eval mode still trains, just without re-materialization
    assert all(p.grad is not None for p in gp.parameters())


def test_frozen_model_output_needs_no_grad() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).requires_grad_(False)
    out = pipe(model, 2, chunks=2)(torch.randn(4, 4))
    assert not out.requires_grad


def test_backward_twice_is_a_clear_error() -> None:
    gp = pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), 2, chunks=2)
    out = gp(torch.randn(4, 4)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


def test_is_drop_in_for_state_dict_of_partitions() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    gp = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    assert list(gp.state_dict()) == [
        "partitions.0.0.weight",
        "partitions.0.0.bias",
        "partitions.1.2.weight",
        "partitions.1.2.bias",
    ]
