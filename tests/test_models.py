"""The paper's Transformer as layers: shapes, the depth-scaled init, logit clipping, pipelining."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gpipe import Pipeline
from gpipe.models import parameter_count, transformer, transformer_lm
from gpipe.models.transformer import FeedForward


def small_lm(**kwargs: object) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return transformer_lm(4, 64, 4, dim=32, vocab=50, max_len=16, dropout=0.0, **kwargs)  # type: ignore[arg-type]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def test_shapes() -> None:
    torch.manual_seed(0)
    model = transformer(2, 64, 4, dim=32, vocab=50, max_len=16)
    src, tgt = torch.randint(1, 50, (3, 7)), torch.randint(1, 50, (3, 5))
    assert model((src, tgt)).shape == (3, 5, 50)
    assert len(model) == 2 + 1 + 2 + 1 + 0 + 1  # source embedding, 2 encoder, target embedding, 2 decoder, output
    assert small_lm()(src).shape == (3, 7, 50)


def test_feed_forward_init_scaled_by_depth() -> None:
    torch.manual_seed(0)
    shallow = FeedForward(64, 256, 0.0, 1.0)
    torch.manual_seed(0)
    deep = FeedForward(64, 256, 0.0, 1.0 / 32)
    torch.testing.assert_close(deep.inner.weight, shallow.inner.weight / 32)
    torch.testing.assert_close(deep.outer.weight, shallow.outer.weight / 32)
    lm = transformer_lm(8, 64, 4, dim=32, vocab=50)
    assert all(m.init_scale == 1 / 8 for m in lm.modules() if isinstance(m, FeedForward))


def test_logit_clipping() -> None:
    model = small_lm(logit_clip=0.05)
    logits = model(torch.randint(1, 50, (2, 6)))
    assert float(logits.detach().abs().max()) <= 0.05 + 1e-7


def test_causal() -> None:
    """A prediction at position t does not see tokens after t."""
    model = small_lm().eval()
    a = torch.randint(1, 50, (1, 8))
    b = a.clone()
    b[0, 5:] = (b[0, 5:] + 1) % 50
    torch.testing.assert_close(model(a)[0, :5], model(b)[0, :5])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_lm_equals_plain(schedule: str) -> None:
    model = small_lm()
    x, y = torch.randint(1, 50, (8, 10)), torch.randint(1, 50, (8, 10))
    plain = copy.deepcopy(model)
    loss = lm_loss(plain(x), y)
    loss.backward()
    pipe = Pipeline(model, [2, 2, 2], chunks=4, schedule=schedule, loss_fn=lm_loss, devices=["cpu"] * 3)
    torch.testing.assert_close(pipe.step(x, y), loss.detach())
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=1e-4, atol=1e-6)


def test_encoder_decoder_pipelined_equals_plain() -> None:
    torch.manual_seed(0)
    model = transformer(2, 64, 4, dim=32, vocab=50, max_len=16, dropout=0.0)
    src, tgt, out = torch.randint(1, 50, (8, 7)), torch.randint(1, 50, (8, 5)), torch.randint(1, 50, (8, 5))
    plain = copy.deepcopy(model)
    loss = lm_loss(plain((src, tgt)), out)
    loss.backward()
    pipe = Pipeline(model, [2, 2, 3], chunks=4, schedule="1f1b", loss_fn=lm_loss, devices=["cpu"] * 3)
    torch.testing.assert_close(pipe.step((src, tgt), out), loss.detach())
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("config", "millions"),
    [((6, 8192, 16), 474.7), ((24, 8192, 16), 1305.9), ((12, 16384, 32), 1154.7)],
)
def test_named_configurations_on_the_meta_device(config: tuple[int, int, int], millions: float) -> None:
    with torch.device("meta"):
        model = transformer(*config, vocab=64000)
    assert parameter_count(model) / 1e6 == pytest.approx(millions, abs=0.1)
