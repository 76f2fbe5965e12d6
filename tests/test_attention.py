"""Attention without (T, T) matrices: ``gpipe.models.transformer.attend`` against the textbook
computation (scores, mask, softmax, weighted values) for every head layout and masking case, and the
Transformer's layers keeping nothing quadratic in the sequence length for backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe.models import transformer, transformer_lm
from gpipe.models.transformer import Attention, attend

DIM, HEADS = 32, 4


def _layouts() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "multihead": nn.MultiheadAttention(DIM, HEADS, batch_first=True),
        "head_dim": Attention(DIM, HEADS, 8, dropout=0.0),
        "wide_heads": Attention(DIM, HEADS, 16, dropout=0.0),
    }


def _textbook(attn: nn.Module, query: Tensor, key: Tensor, pad: Tensor | None, causal: bool) -> Tensor:
    """Every (query, key) score, masked, softmax, weighted values: what attention was before."""
    if isinstance(attn, Attention):
        q, k, v, out, width = attn.q(query), attn.k(key), attn.v(key), attn.out_proj, attn.head_dim
    else:
        w, b = attn.in_proj_weight.chunk(3), attn.in_proj_bias.chunk(3)
        q, k, v = (F.linear(x, w_, b_) for x, w_, b_ in zip((query, key, key), w, b))
        out, width = attn.out_proj, DIM // HEADS

    def heads(x: Tensor) -> Tensor:
        return x.view(*x.shape[:-1], -1, width).transpose(1, 2)

    scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(width)  # (B, H, T, S)
    blocked = torch.zeros(scores.shape[-2:], dtype=torch.bool)
    if causal:
        blocked = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    if pad is not None:
        blocked = blocked | pad[:, None, None, :]
    # (finite: a query with every key blocked, padding before the first real token, stays finite)
    probs = scores.masked_fill(blocked, torch.finfo(scores.dtype).min).softmax(-1)
    result: Tensor = out((probs @ heads(v)).transpose(1, 2).flatten(2))
    return result


def _padding(batch: int, length: int, where: str) -> Tensor:
    pad = torch.zeros(batch, length, dtype=torch.bool)
    if where == "end":
        pad[1, length - 3 :] = True
        pad[2, length - 1 :] = True
    elif where == "start":  # left padding: a real query must not see the padding before it
        pad[1, :2] = True
    elif where == "inside":
        pad[0, 3] = True
    return pad


@pytest.mark.parametrize("layout", ["multihead", "head_dim", "wide_heads"])
@pytest.mark.parametrize(
    "case",
    ["self", "self-padded", "causal", "causal-padded-end", "causal-padded-start", "causal-padded-inside", "cross"],
)
def test_attend_equals_the_textbook_computation(layout: str, case: str) -> None:
    """Outputs and gradients (of the inputs and the weights) equal the computation that keeps every
    (query, key) probability, at the positions a loss reads (not the queries of padding)."""
    attn = _layouts()[layout]
    torch.manual_seed(1)
    t, s = 9, 6 if case == "cross" else 9
    query = torch.randn(3, t, DIM, requires_grad=True)
    key = torch.randn(3, s, DIM, requires_grad=True) if case == "cross" else query
    where = case.rsplit("-", 1)[-1] if "padded" in case else ("end" if case == "cross" else "")
    pad = _padding(3, s, where) if where else None
    causal = case.startswith("causal")
    real = torch.ones(3, t, 1) if pad is None or case == "cross" else (~pad)[..., None].float()

    def grads(out: Tensor) -> tuple[Tensor, ...]:
        loss = (out * real * torch.linspace(-1, 1, DIM)).sum()
        return torch.autograd.grad(loss, [query, *([key] if key is not query else []), *attn.parameters()])

    ours = attend(attn, query, key, key, pad=pad, causal=causal)
    expected = _textbook(attn, query, key, pad, causal)
    torch.testing.assert_close(ours * real, expected * real, rtol=1e-5, atol=1e-6)
    assert ours.isfinite().all()
    for g, e in zip(grads(ours), grads(expected)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_a_causal_mask_and_causal_together_are_refused() -> None:
    attn = _layouts()["head_dim"]
    x = torch.randn(2, 4, DIM)
    with pytest.raises(ValueError, match="give causal or a mask, not both"):
        attend(attn, x, x, x, causal=True, mask=torch.ones(4, 4, dtype=torch.bool).triu(1))


def _saved_shapes(model: nn.Module, inputs: object) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs).sum().backward()
    return shapes


@pytest.mark.parametrize("head_dim", [None, 8])
def test_the_language_model_keeps_nothing_quadratic_in_the_length(head_dim: int | None) -> None:
    """Causal self-attention in training saves no (T, T) tensor for backward: the fused kernel keeps
    the output and one log-sum-exp per query. With attention dropout (on a CPU) it would."""
    t = 48
    torch.manual_seed(0)
    lm = transformer_lm(2, 64, HEADS, dim=DIM, vocab=50, max_len=t, dropout=0.1, attention_dropout=0.0,
                        head_dim=head_dim)  # fmt: skip
    shapes = _saved_shapes(lm.train(), torch.randint(0, 50, (2, t)))
    assert shapes and not [s for s in shapes if s[-2:] == (t, t)]
    dropping = transformer_lm(2, 64, HEADS, dim=DIM, vocab=50, max_len=t, dropout=0.1, head_dim=head_dim)
    assert [s for s in _saved_shapes(dropping.train(), torch.randint(0, 50, (2, t))) if s[-2:] == (t, t)]


def test_the_translation_model_keeps_nothing_quadratic_with_padding_at_the_end() -> None:
    """Encoder self-attention and cross-attention with padded sources, causal self-attention with
    padded targets (padding at the end): no (T, T), (T, S) or (S, S) tensor saved."""
    s, t = 40, 24
    torch.manual_seed(0)
    model = transformer(1, 64, HEADS, dim=DIM, vocab=50, max_len=s, attention_dropout=0.0).train()
    src, tgt = torch.randint(1, 50, (3, s)), torch.randint(1, 50, (3, t))
    src[1, 30:] = 0
    tgt[2, 20:] = 0
    shapes = _saved_shapes(model, (src, tgt))
    assert not [x for x in shapes if x[-2:] in {(s, s), (t, t), (t, s)}]
    tgt[0, :2] = 0  # padding before real tokens: the causal mask with the padding is built, and kept
    assert [x for x in _saved_shapes(model, (src, tgt)) if x[-2:] == (t, t)]


def test_attention_dropout_defaults_to_dropout() -> None:
    model = transformer_lm(2, 64, HEADS, dim=DIM, vocab=50, dropout=0.2, head_dim=8)
    assert model[1].self_attn.dropout == 0.2 and model[1].dropout.p == 0.2
    model = transformer(1, 64, HEADS, dim=DIM, vocab=50, dropout=0.2, attention_dropout=0.0)
    assert model[1].attn.dropout == 0.0 and model[3].cross_attn.dropout == 0.0 and model[3].dropout.p == 0.2
