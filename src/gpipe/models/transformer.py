"""The paper's Transformer T(L, H, A) as a sequence of layers, ready to be partitioned.

- :func:`transformer` — encoder-decoder: L encoder and L decoder layers, feed-forward size H, A heads,
  model dimension ``dim`` (1024 in the paper). Its layers pass a tuple along; the encoder's output
  travels with the decoder's activations through the decoder stages::

      (src, tgt) tokens ─ SourceEmbedding ─> (x, src_pad, tgt) ─ L x EncoderLayer ─>
      ─ TargetEmbedding ─> (memory, src_pad, y, tgt_pad) ─ L x DecoderLayer ─ Output ─> logits (B, T, V)

  With ``transparent=True`` each decoder layer attends over its own learned mix of the source embedding
  and every encoder layer's output instead (:mod:`gpipe.models.transparent`: the layers wrapped).

- :func:`transformer_lm` — decoder-only language model: ``Embedding ─ L x Block ─ Output``.

Attention holds its weights in ``nn.MultiheadAttention`` (heads of dim/A) unless ``head_dim`` is
given: then every head is ``head_dim`` wide whatever the model dimension (the paper's 32-head models
fit heads of 64 in a 1024-wide model). Either way it is computed by :func:`attend`, one call of
``F.scaled_dot_product_attention`` that keeps no (T, T) matrix: causal self-attention passes
``is_causal`` and padding a (B, 1, 1, T) mask, so that PyTorch takes its fused kernels (flash on CPU,
flash or memory-efficient on CUDA), which keep per head only the output and a log-sum-exp per query
where the textbook computation keeps the scores and probabilities of every pair of positions. Two
cases still need the (T, T) pairs: attention dropout on CPU (``attention_dropout``, by default
``dropout``: PyTorch's CPU kernels for it are the unfused ones; CUDA's flash kernel draws the dropout
itself), and a target whose padding is not all at its end (a causal mask combined with the padding,
built only then: padding at the end cannot reach a real position through causal attention).

Decoding keeps caches in the layers (:mod:`gpipe.cache`): with a cache current, the encoder runs
once (a step after the first carries no source: ``None``, which the encoder layers pass on), each
decoder layer keeps its self-attention's keys and values and its cross-attention's keys and values of
the encoder's output, and the target embedding counts the positions seen, so that a step computes
only the new tokens' positions. Without a cache every layer computes the whole sequence, as in
training.

Under ``torch.autocast`` (``gpipe train --precision bf16``) the residual stream is in autocast's
dtype from the embedding on: the values kept for backward and those sent between stages are bf16
where the layers compute in it; the weights stay as they are (fp32 masters).

The paper's two trainability tricks for deep models are built in: every feed-forward layer's
initial weights are scaled down by the number of layers (``ff_init_scale``, default 1/L), and the
output logits are clipped to ±``logit_clip`` (None: no clipping).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from gpipe.cache import LayerCache, layer_cache
from gpipe.health import mark_blocks
from gpipe.models.transparent import transparent_attention
from gpipe.recipe import clip_logits

__all__ = ["Attention", "attend", "parameter_count", "transformer", "transformer_lm"]

Tuple = tuple[Any, ...]


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float, init_scale: float) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)
        self.init_scale = init_scale
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inner.reset_parameters()
        self.outer.reset_parameters()
        with torch.no_grad():
            self.inner.weight.mul_(self.init_scale)
            self.outer.weight.mul_(self.init_scale)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.outer(self.dropout(torch.relu(self.inner(x))))
        return out


class Attention(nn.Module):
    """Multi-head attention with heads of ``head_dim`` (not necessarily dim/heads), called like
    ``nn.MultiheadAttention`` with ``batch_first=True``: masks are True where attention is not
    allowed; returns (output, None). Computed by :func:`attend` (``is_causal``: causal
    self-attention without a mask)."""

    def __init__(self, dim: int, heads: int, head_dim: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, head_dim, dropout
        self.q, self.k, self.v = (nn.Linear(dim, heads * head_dim) for _ in range(3))
        self.out_proj = nn.Linear(heads * head_dim, dim)

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
) -> Tensor:
    """``attn`` (:class:`Attention` or a ``batch_first`` ``nn.MultiheadAttention``, whose weights it
    uses) of ``query`` (B, T, D) over ``key`` and ``value`` (B, S, D), without a (T, S) matrix where
    the kernels allow: ``pad`` (B, S) True for the keys not to attend to, ``causal``: query t attends to
    keys up to t (self-attention), ``mask`` (T, S) or (B, 1, T, S) True where not allowed (a (T, S)
    matrix given is a (T, S) matrix used). Dropout on the attention probabilities: ``attn``'s, in
    training mode. ``pad_at_end`` (causal with ``pad``): True, every row's padding comes after its real
    tokens; False, not so; None, told by ``pad``'s values (a host read: a device synchronization)."""
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
    result: Tensor = out(attended.transpose(1, 2).flatten(2))
    return result


def _split_plan(layer: nn.Module, attentions: tuple[str, ...], tp: int) -> dict[str, ParallelStyle]:
    """Megatron's split of a layer over ``tp`` ranks (``tensor_parallel_plan``, read by
    ``gpipe.distributed.tensor_parallel``): the feed-forward's inner projection by output features,
    its outer by input features; each attention's query, key and value projections by heads, its
    output projection by input features. The dropout between a split pair then draws per rank."""
    plan: dict[str, ParallelStyle] = {"ff.inner": ColwiseParallel(), "ff.outer": RowwiseParallel()}
    for name in attentions:
        attn = layer.get_submodule(name)
        if not isinstance(attn, Attention):
            raise ValueError(
                f"{type(layer).__name__}.{name} is an nn.MultiheadAttention, whose fused projections tensor "
                "parallelism cannot split: build the Transformer with head_dim=dim // heads (the same sizes)"
            )
        if attn.heads % tp:
            raise ValueError(
                f"tensor_parallel={tp} does not divide the {attn.heads} heads of {type(layer).__name__}.{name}: "
                "give a tensor_parallel that divides the heads"
            )
        plan.update({f"{name}.{p}": ColwiseParallel() for p in ("q", "k", "v")})
        plan[f"{name}.out_proj"] = RowwiseParallel()
    return plan


def _attention(
    dim: int, heads: int, dropout: float, head_dim: int | None, attention_dropout: float | None
) -> nn.Module:
    p = dropout if attention_dropout is None else attention_dropout  # on the attention probabilities
    if head_dim is None:
        return nn.MultiheadAttention(dim, heads, dropout=p, batch_first=True)
    return Attention(dim, heads, head_dim, p)


class _Embedding(nn.Module):
    """Token embedding scaled by sqrt(dim) plus a learned position embedding."""

    def __init__(self, vocab: int, dim: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Token vectors of unit scale after the sqrt(dim) factor, like the position vectors.
        nn.init.normal_(self.tokens.weight, std=self.scale**-1)

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:  # (B, T) -> (B, T, D)
        positions = torch.arange(offset, offset + tokens.size(1), device=tokens.device)
        out: Tensor = self.tokens(tokens) * self.scale + self.positions(positions)
        kind = tokens.device.type
        # Under autocast, the residual stream in its dtype (as the layers' outputs are).
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
            out = out.to(torch.get_autocast_dtype(kind))
        return self.dropout(out)  # type: ignore[no-any-return]


def _attend_cached(
    attn: nn.Module, cache: LayerCache, prefix: str, query: Tensor, new: Tensor | None, pad: Tensor | None, causal: bool
) -> Tensor:
    """``attn`` of ``query`` (B, T, D) over the keys and values kept under ``prefix`` in ``cache``,
    extended by those of ``new`` (B, T', D) if given; ``pad`` (B, T') marks the new keys not to
    attend to, ``causal``: the new queries are the last positions of the keys (a query attends to
    the keys up to its own position)."""
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
    result: Tensor = out(attended.transpose(1, 2).flatten(2))
    return result


class SourceEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, max_len: int, dropout: float, pad: int) -> None:
        super().__init__()
        self.embed, self.pad = _Embedding(vocab, dim, max_len, dropout), pad

    def forward(self, inputs: Tuple) -> Tuple:
        src, tgt = inputs
        if src is None:  # a decoding step after the first: the source was encoded
            return None, None, tgt
        return self.embed(src), src == self.pad, tgt


class EncoderLayer(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden: int,
        heads: int,
        dropout: float,
        ff_scale: float,
        head_dim: int | None = None,
        attention_dropout: float | None = None,
    ) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _attention(dim, heads, dropout, head_dim, attention_dropout)
        self.ff = FeedForward(dim, hidden, dropout, ff_scale)
        self.dropout = nn.Dropout(dropout)

    def tensor_parallel_plan(self, tp: int) -> dict[str, ParallelStyle]:
        return _split_plan(self, ("attn",), tp)

    def forward(self, inputs: Tuple) -> Tuple:
        x, src_pad, tgt = inputs
        if x is None:  # a decoding step after the first: nothing to encode
            return inputs
        h = self.norm1(x)
        x = x + self.dropout(attend(self.attn, h, h, h, pad=src_pad))
        x = x + self.dropout(self.ff(self.norm2(x)))
        return x, src_pad, tgt


class TargetEmbedding(nn.Module):
    """Closes the encoder (final norm) and embeds the target tokens."""

    def __init__(self, vocab: int, dim: int, max_len: int, dropout: float, pad: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.embed, self.pad = _Embedding(vocab, dim, max_len, dropout), pad

    def forward(self, inputs: Tuple) -> Tuple:
        x, src_pad, tgt = inputs
        cache = layer_cache(self)
        offset = 0
        if cache is not None:  # decoding: the target's positions go on from those seen before
            offset = cache.values.get("length", 0)
            cache.values["length"] = offset + tgt.size(1)
        memory = self.norm(x) if x is not None else None
        return memory, src_pad, self.embed(tgt, offset), tgt == self.pad


class DecoderLayer(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden: int,
        heads: int,
        dropout: float,
        ff_scale: float,
        cross: bool,
        head_dim: int | None = None,
        attention_dropout: float | None = None,
    ) -> None:
        super().__init__()
        self.norm1, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = _attention(dim, heads, dropout, head_dim, attention_dropout)
        self.cross = cross
        if cross:
            self.norm2 = nn.LayerNorm(dim)
            self.cross_attn = _attention(dim, heads, dropout, head_dim, attention_dropout)
        self.ff = FeedForward(dim, hidden, dropout, ff_scale)
        self.dropout = nn.Dropout(dropout)
        self.pad_at_end: bool | None = None  # the targets' padding (attend's pad_at_end; transformer's target_padding)

    def tensor_parallel_plan(self, tp: int) -> dict[str, ParallelStyle]:
        return _split_plan(self, ("self_attn", "cross_attn") if self.cross else ("self_attn",), tp)

    def _block(self, y: Tensor, tgt_pad: Tensor | None, memory: Tensor | None, src_pad: Tensor | None) -> Tensor:
        cache = layer_cache(self)
        if cache is not None:
            return self._cached(cache, y, tgt_pad, memory, src_pad)
        h = self.norm1(y)
        y = y + self.dropout(attend(self.self_attn, h, h, h, pad=tgt_pad, causal=True, pad_at_end=self.pad_at_end))
        if self.cross:
            assert memory is not None, "the decoder layer of an encoder-decoder needs the encoder's output"
            h = self.norm2(y)
            y = y + self.dropout(attend(self.cross_attn, h, memory, memory, pad=src_pad))
        out: Tensor = y + self.dropout(self.ff(self.norm3(y)))
        return out

    def _cached(
        self, cache: LayerCache, y: Tensor, tgt_pad: Tensor | None, memory: Tensor | None, src_pad: Tensor | None
    ) -> Tensor:
        """The block on the new positions ``y``, attending to the kept keys and values too (the
        encoder's output's, kept from the first step, for the cross-attention)."""
        h = self.norm1(y)
        y = y + self._cached_attention(self.self_attn, cache, "self.", h, h, tgt_pad, causal=True)
        if self.cross:
            h = self.norm2(y)
            y = y + self._cached_attention(self.cross_attn, cache, "cross.", h, memory, src_pad, causal=False)
        out: Tensor = y + self.ff(self.norm3(y))
        return out

    @staticmethod
    def _cached_attention(
        attn: nn.Module,
        cache: LayerCache,
        prefix: str,
        query: Tensor,
        new: Tensor | None,
        pad: Tensor | None,
        causal: bool,
    ) -> Tensor:
        if getattr(attn, "training", False):
            raise ValueError("decoding with caches needs the model in evaluation mode: call model.eval() first")
        return _attend_cached(attn, cache, prefix, query, new, pad, causal)

    def forward(self, inputs: Any) -> Any:
        if isinstance(inputs, Tensor):  # the decoder-only model: (B, T, D)
            return self._block(inputs, None, None, None)
        memory, src_pad, y, tgt_pad = inputs
        return memory, src_pad, self._block(y, tgt_pad, memory, src_pad), tgt_pad


class Output(nn.Module):
    """Final norm and projection to the vocabulary, logits clipped to ±``logit_clip``."""

    def __init__(self, dim: int, vocab: int, logit_clip: float | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab, bias=False)
        self.logit_clip = logit_clip

    def forward(self, inputs: Any) -> Tensor:
        y = inputs if isinstance(inputs, Tensor) else inputs[2]
        logits: Tensor = self.proj(self.norm(y))
        return clip_logits(logits, self.logit_clip)  # (B, T, V)


class TokenEmbedding(_Embedding):
    """The decoder-only model's input layer."""

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:
        cache = layer_cache(self)
        if cache is not None:  # decoding: the positions go on from those seen before
            offset = cache.values.get("length", 0)
            cache.values["length"] = offset + tokens.size(1)
        return super().forward(tokens, offset)


def transformer(
    layers: int,
    hidden: int,
    heads: int,
    *,
    dim: int = 1024,
    vocab: int = 32000,
    max_len: int = 512,
    dropout: float = 0.1,
    logit_clip: float | None = None,
    ff_init_scale: float | None = None,
    pad: int = 0,
    head_dim: int | None = None,
    attention_dropout: float | None = None,
    transparent: bool = False,
    target_padding: str = "any",
) -> nn.Sequential:
    """T(L, H, A): ``layers`` encoder and ``layers`` decoder layers, feed-forward size ``hidden``,
    ``heads`` attention heads (each ``head_dim`` wide; default dim/heads). Input: a tuple (source
    tokens, target tokens), both (B, T); output: logits (B, T_target, vocab). ``attention_dropout``:
    on the attention probabilities (default: ``dropout``); 0 lets a CPU keep no (T, T) matrix.
    ``transparent``: each decoder layer attends over its own learned mix of the source embedding and
    every encoder layer's output (:mod:`gpipe.models.transparent`). ``target_padding``: ``'end'``, after
    the real tokens (gpipe's batches: no host read per attention call); ``'any'``, told by the values."""
    if target_padding not in ("any", "end"):
        raise ValueError(f"target_padding is 'any' or 'end' (target_padding: {target_padding!r})")
    scale = ff_init_scale if ff_init_scale is not None else 1.0 / (2 * layers)
    model = nn.Sequential(
        SourceEmbedding(vocab, dim, max_len, dropout, pad),
        *[EncoderLayer(dim, hidden, heads, dropout, scale, head_dim, attention_dropout) for _ in range(layers)],
        TargetEmbedding(vocab, dim, max_len, dropout, pad),
        *[DecoderLayer(dim, hidden, heads, dropout, scale, True, head_dim, attention_dropout) for _ in range(layers)],
        Output(dim, vocab, logit_clip),
    )
    for layer in (m for m in model if isinstance(m, DecoderLayer) and target_padding == "end"):
        layer.pad_at_end = True
    model = transparent_attention(model, layers, layers) if transparent else model
    return mark_blocks(model, 1, layers)  # (Bapna et al.'s gradient-norm ratio: the first and last encoder layers)


def transformer_lm(
    layers: int,
    hidden: int,
    heads: int,
    *,
    dim: int = 1024,
    vocab: int = 32000,
    max_len: int = 512,
    dropout: float = 0.1,
    logit_clip: float | None = None,
    ff_init_scale: float | None = None,
    head_dim: int | None = None,
    attention_dropout: float | None = None,
    transparent: bool = False,
) -> nn.Sequential:
    """A decoder-only language model of ``layers`` blocks: input tokens (B, T), output logits
    (B, T, vocab) predicting the next token. ``attention_dropout``: as :func:`transformer`'s."""
    if transparent:
        raise ValueError(
            "transparent=True mixes the encoder's layers for the decoder's cross-attention, and transformer_lm has "
            "no encoder: build an encoder-decoder, transformer(..., transparent=True), or leave transparent out"
        )
    scale = ff_init_scale if ff_init_scale is not None else 1.0 / layers
    model = nn.Sequential(
        TokenEmbedding(vocab, dim, max_len, dropout),
        *[DecoderLayer(dim, hidden, heads, dropout, scale, False, head_dim, attention_dropout) for _ in range(layers)],
        Output(dim, vocab, logit_clip),
    )
    return mark_blocks(model, 1, layers)  # (the gradient-norm ratio: the first and last blocks)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
