"""Attention of the paper's Transformer: :class:`Attention` (heads of any width) and :func:`attend`,
which computes it for an ``nn.MultiheadAttention`` too, without a (T, T) matrix where the kernels
allow (see :mod:`gpipe.models.transformer`'s docstring); with a key/value cache, :func:`attend_cached`.

Part of the library: imports torch and :mod:`gpipe.cache`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe.cache import LayerCache
from gpipe.models.fixup import FixupLinear, FixupMultiheadAttention

__all__ = ["Attention", "attend", "attend_cached", "attention"]


class Attention(nn.Module):
    """Multi-head attention with heads of ``head_dim`` (not necessarily dim/heads), called like
    ``nn.MultiheadAttention`` with ``batch_first=True``: masks are True where attention is not
    allowed; returns (output, None). Computed by :func:`attend` (``is_causal``: causal
    self-attention without a mask)."""

    def __init__(self, dim: int, heads: int, head_dim: int, dropout: float, fixup: float | None = None) -> None:
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, head_dim, dropout
        if fixup is None:
            self.q, self.k, self.v = (nn.Linear(dim, heads * head_dim) for _ in range(3))
            self.out_proj = nn.Linear(heads * head_dim, dim)
        else:  # Fixup's initialization (gpipe.models.fixup): the projections scaled, the output's zero
            self.q, self.k, self.v = (FixupLinear(dim, heads * head_dim, gain=fixup) for _ in range(3))
            self.out_proj = FixupLinear(heads * head_dim, dim, gain=0.0)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> tuple[Tensor, None]:
        return attend(self, query, key, value, pad=key_padding_mask, causal=is_causal, mask=attn_mask), None


def _projections(attn: nn.Module) -> tuple[Any, Any, Any, Any, int]:
    """The query, key, value and output projections of ``attn`` as functions, and its heads' width."""
    if isinstance(attn, Attention):
        return attn.q, attn.k, attn.v, attn.out_proj, attn.head_dim
    if not isinstance(attn, nn.MultiheadAttention) or not attn.batch_first or attn.bias_k is not None:
        raise TypeError(f"attend takes gpipe's Attention or a batch_first nn.MultiheadAttention (got {attn})")
    w, b = attn.in_proj_weight.chunk(3), attn.in_proj_bias.chunk(3) if attn.in_proj_bias is not None else (None,) * 3
    q, k, v = (lambda x, w=w_, b=b_: F.linear(x, w, b) for w_, b_ in zip(w, b))
    return q, k, v, attn.out_proj, attn.head_dim


def _heads(x: Tensor, width: int) -> Tensor:  # (B, T, H*d) -> (B, H, T, d); under tensor parallelism H/tp
    return x.view(*x.shape[:-1], -1, width).transpose(1, 2)


def _padding_at_the_end(pad: Tensor) -> bool:
    """Whether every row of ``pad`` (B, T; True: padding) is real tokens, then only padding. Told by
    the values: on the meta device (cost estimates: no values) the usual case, padding at the end; while
    torch.compile traces, no (the causal mask with the padding is right for any padding)."""
    if pad.device.type == "meta":
        return True
    if torch.compiler.is_compiling():
        return False
    return not bool((pad[:, 1:] < pad[:, :-1]).any())


def attend(
    attn: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    pad: Tensor | None = None,
    causal: bool = False,
    mask: Tensor | None = None,
    pad_at_end: bool | None = None,
    before_out: Tensor | None = None,
) -> Tensor:
    """``attn`` (:class:`Attention` or a ``batch_first`` ``nn.MultiheadAttention``, whose weights it
    uses) of ``query`` (B, T, D) over ``key`` and ``value`` (B, S, D), without a (T, S) matrix where
    the kernels allow: ``pad`` (B, S) True for the keys not to attend to, ``causal``: query t attends to
    keys up to t (self-attention), ``mask`` (T, S) or (B, 1, T, S) True where not allowed (a (T, S)
    matrix given is a (T, S) matrix used). Dropout on the attention probabilities: ``attn``'s, in
    training mode. ``pad_at_end`` (causal with ``pad``): True, every row's padding comes after its real
    tokens; False, not so; None, told by ``pad``'s values (a host read: a device synchronization).
    ``before_out``: added to the attended values before the output projection (Fixup's scalar bias)."""
    q, k, v, out, width = _projections(attn)
    if causal and mask is not None:
        raise ValueError("attend: give causal or a mask, not both (put the causal pairs in the mask)")
    if causal and pad is not None:
        if _padding_at_the_end(pad) if pad_at_end is None else pad_at_end:
            pad = None  # no real query reaches it under causal attention
        else:  # padding before real tokens: causal attention alone would let them see it
            mask = torch.ones(query.size(1), key.size(1), dtype=torch.bool, device=query.device).triu(1)
            causal = False
    allowed = None if pad is None else ~pad[:, None, None, :]
    if mask is not None:
        allowed = ~mask if allowed is None else allowed & ~mask
    if isinstance(attn, nn.MultiheadAttention) and query is key and key is value:
        # self-attention: one matmul for the three projections, as nn.MultiheadAttention does
        queries, keys, values = (
            _heads(t, width) for t in F.linear(query, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
        )
    else:
        queries, keys, values = _heads(q(query), width), _heads(k(key), width), _heads(v(value), width)
    dropout = cast(float, attn.dropout) if attn.training else 0.0
    attended = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=allowed, dropout_p=dropout, is_causal=causal
    )
    return _out(out, attended, before_out)


def _out(out: Any, attended: Tensor, before_out: Tensor | None) -> Tensor:
    """The output projection of the heads' attended values (B, H, T, d), ``before_out`` added first."""
    values = attended.transpose(1, 2).flatten(2)
    result: Tensor = out(values if before_out is None else values + before_out)
    return result


def attention(
    dim: int, heads: int, dropout: float, head_dim: int | None, attention_dropout: float | None,
    fixup: float | None = None,
) -> nn.Module:  # fmt: skip
    """``fixup``: Fixup's initialization, the query, key and value projections scaled by it, the
    output projection zero (:mod:`gpipe.models.fixup`); None: the usual one."""
    p = dropout if attention_dropout is None else attention_dropout  # on the attention probabilities
    if head_dim is None and fixup is not None:
        return FixupMultiheadAttention(dim, heads, dropout=p, batch_first=True, gain=fixup)
    if head_dim is None:
        return nn.MultiheadAttention(dim, heads, dropout=p, batch_first=True)
    return Attention(dim, heads, head_dim, p, fixup)


def attend_cached(
    attn: nn.Module,
    cache: LayerCache,
    prefix: str,
    query: Tensor,
    new: Tensor | None,
    pad: Tensor | None,
    causal: bool,
    before_out: Tensor | None = None,
) -> Tensor:
    """``attn`` of ``query`` (B, T, D) over the keys and values kept under ``prefix`` in ``cache``,
    extended by those of ``new`` (B, T', D) if given; ``pad`` (B, T') marks the new keys not to
    attend to, ``causal``: the new queries are the last positions of the keys (a query attends to
    the keys up to its own position). ``before_out``: as :func:`attend`'s."""
    q, k, v, out, width = _projections(attn)
    if new is not None:
        keys = cache.extend(prefix + "k", _heads(k(new), width), dim=2)
        values = cache.extend(prefix + "v", _heads(v(new), width), dim=2)
        masked = cache.extend(
            prefix + "pad", pad if pad is not None else new.new_zeros(new.shape[:2], dtype=torch.bool), 1
        )
        cache.values[prefix + "masked"] = cache.values.get(prefix + "masked", False) or bool(
            masked[:, -new.size(1) :].any()
        )
    else:
        keys, values, masked = cache.tensors[prefix + "k"], cache.tensors[prefix + "v"], cache.tensors[prefix + "pad"]
    length, total = query.size(1), keys.size(2)
    allowed: Tensor | None = None
    if cache.values[prefix + "masked"]:
        allowed = ~masked[:, None, None, :]
    first = causal and length > 1 and length == total and allowed is None  # a prompt, nothing kept before
    if causal and length > 1 and not first:
        later = torch.ones(length, total, dtype=torch.bool, device=query.device).triu(total - length + 1)
        allowed = ~later if allowed is None else allowed & ~later
    attended = F.scaled_dot_product_attention(_heads(q(query), width), keys, values, attn_mask=allowed, is_causal=first)
    return _out(out, attended, before_out)
