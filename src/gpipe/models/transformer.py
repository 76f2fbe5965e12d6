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

``norm="none"`` takes the layer norms out (each an ``nn.Identity`` under its name);
``init_scheme="fixup"`` (with it) trains the model without them: :mod:`gpipe.models.fixup`.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from gpipe.cache import LayerCache, layer_cache
from gpipe.health import mark_blocks
from gpipe.models import sharing
from gpipe.models.attention import Attention, attend, attend_cached, attention
from gpipe.models.fixup import FixupBranch, FixupLinear, check_settings, fixup_scale, without_norms
from gpipe.models.moe import MoEFeedForward
from gpipe.models.transparent import transparent_attention
from gpipe.recipe import clip_logits

__all__ = ["Attention", "attend", "parameter_count", "transformer", "transformer_lm"]

Tuple = tuple[Any, ...]


class FeedForward(nn.Module):
    """Linear-ReLU-Linear, both weights scaled by ``init_scale``; with ``fixup``, the outer layer zero
    instead (:mod:`gpipe.models.fixup`)."""

    def __init__(self, dim: int, hidden: int, dropout: float, init_scale: float, fixup: bool = False) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)
        self.init_scale, self.fixup = init_scale, fixup
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inner.reset_parameters()
        self.outer.reset_parameters()
        with torch.no_grad():
            self.inner.weight.mul_(self.init_scale)
            if self.fixup:
                self.outer.weight.zero_()
                self.outer.bias.zero_()
            else:
                self.outer.weight.mul_(self.init_scale)

    def forward(self, x: Tensor, pad: Tensor | None = None, biases: Tensor | None = None) -> Tensor:
        """(``pad``: as a mixture of experts is called; ``biases``: Fixup's two scalars, before the
        ReLU and before the outer layer.)"""
        if biases is None:
            out: Tensor = self.outer(self.dropout(torch.relu(self.inner(x))))
            return out
        out = self.outer(self.dropout(torch.relu(self.inner(x) + biases[0])) + biases[1])
        return out


def _attention(attn: nn.Module, branch: FixupBranch | None, h: Tensor, memory: Tensor | None, **kwargs: Any) -> Tensor:
    """``attn`` of ``h`` over ``memory`` (None: self-attention), with a Fixup ``branch`` its first scalar
    bias added to the inputs, its second to the attended values, its output multiplied by its scalar."""
    if branch is None:
        keys = h if memory is None else memory
        return attend(attn, h, keys, keys, **kwargs)
    h = h + branch.biases[0]
    keys = h if memory is None else memory + branch.biases[0]
    return attend(attn, h, keys, keys, before_out=branch.biases[1], **kwargs) * branch.scale


def _feed_forward(ff: nn.Module, branch: FixupBranch | None, h: Tensor, pad: Tensor | None) -> Tensor:
    """``ff`` of ``h``, with a Fixup ``branch`` its first scalar bias added to the input, the others
    inside a dense block (a mixture of experts has none), the output multiplied by its scalar."""
    if branch is None:
        out: Tensor = ff(h, pad)
        return out
    h = h + branch.biases[0]
    out = ff(h, pad, branch.biases[1:]) if isinstance(ff, FeedForward) else ff(h, pad)
    return out * branch.scale


def _branches(fixup: float | None, *biases: int) -> list[FixupBranch | None]:
    """Fixup's scalars for a layer's branches (each with its count of ``biases``; 0: no such branch);
    None each without Fixup."""
    return [FixupBranch(n) if fixup is not None and n else None for n in biases]


def _split_plan(layer: nn.Module, attentions: tuple[str, ...], tp: int) -> dict[str, ParallelStyle]:
    """Megatron's split of a layer over ``tp`` ranks (``tensor_parallel_plan``, read by
    ``gpipe.distributed.tensor_parallel``): the feed-forward's inner projection by output features,
    its outer by input features; each attention's query, key and value projections by heads, its
    output projection by input features. The dropout between a split pair then draws per rank. A
    mixture of experts is not split: every rank of the group runs it whole on the same rows, drawing
    the same numbers (its experts may be split over replicas instead: ``expert_parallel``)."""
    plan: dict[str, ParallelStyle] = {}
    if not isinstance(layer.get_submodule("ff"), MoEFeedForward):
        plan.update({"ff.inner": ColwiseParallel(), "ff.outer": RowwiseParallel()})
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
        fixup: float | None = None,
    ) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = attention(dim, heads, dropout, head_dim, attention_dropout, fixup)
        self.ff: nn.Module = FeedForward(dim, hidden, dropout, ff_scale, fixup is not None)
        self.dropout = nn.Dropout(dropout)
        self.fixup_attn, self.fixup_ff = _branches(fixup, 2, 3)

    def tensor_parallel_plan(self, tp: int) -> dict[str, ParallelStyle]:
        return _split_plan(self, ("attn",), tp)

    def forward(self, inputs: Tuple) -> Tuple:
        x, src_pad, tgt = inputs
        if x is None:  # a decoding step after the first: nothing to encode
            return inputs
        x = x + self.dropout(_attention(self.attn, self.fixup_attn, self.norm1(x), None, pad=src_pad))
        x = x + self.dropout(_feed_forward(self.ff, self.fixup_ff, self.norm2(x), src_pad))
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
        fixup: float | None = None,
    ) -> None:
        super().__init__()
        self.norm1, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = attention(dim, heads, dropout, head_dim, attention_dropout, fixup)
        self.cross = cross
        if cross:
            self.norm2 = nn.LayerNorm(dim)
            self.cross_attn = attention(dim, heads, dropout, head_dim, attention_dropout, fixup)
        self.ff: nn.Module = FeedForward(dim, hidden, dropout, ff_scale, fixup is not None)
        self.dropout = nn.Dropout(dropout)
        self.fixup_self_attn, self.fixup_cross_attn, self.fixup_ff = _branches(fixup, 2, 2 if cross else 0, 3)
        self.pad_at_end: bool | None = None  # the targets' padding (attend's pad_at_end; transformer's target_padding)

    def tensor_parallel_plan(self, tp: int) -> dict[str, ParallelStyle]:
        return _split_plan(self, ("self_attn", "cross_attn") if self.cross else ("self_attn",), tp)

    def _block(self, y: Tensor, tgt_pad: Tensor | None, memory: Tensor | None, src_pad: Tensor | None) -> Tensor:
        cache = layer_cache(self)
        if cache is not None:
            return self._cached(cache, y, tgt_pad, memory, src_pad)
        h = self.norm1(y)
        attended = _attention(self.self_attn, self.fixup_self_attn, h, None, pad=tgt_pad, causal=True,
                              pad_at_end=self.pad_at_end)  # fmt: skip
        y = y + self.dropout(attended)
        if self.cross:
            assert memory is not None, "the decoder layer of an encoder-decoder needs the encoder's output"
            y = y + self.dropout(_attention(self.cross_attn, self.fixup_cross_attn, self.norm2(y), memory, pad=src_pad))
        out: Tensor = y + self.dropout(_feed_forward(self.ff, self.fixup_ff, self.norm3(y), tgt_pad))
        return out

    def _cached(
        self, cache: LayerCache, y: Tensor, tgt_pad: Tensor | None, memory: Tensor | None, src_pad: Tensor | None
    ) -> Tensor:
        """The block on the new positions ``y``, attending to the kept keys and values too (the
        encoder's output's, kept from the first step, for the cross-attention)."""
        h = self.norm1(y)
        y = y + self._cached_attention(self.self_attn, self.fixup_self_attn, cache, "self.", h, h, tgt_pad, True)
        if self.cross:
            h = self.norm2(y)
            y = y + self._cached_attention(self.cross_attn, self.fixup_cross_attn, cache, "cross.", h, memory,
                                           src_pad, False)  # fmt: skip
        out: Tensor = y + _feed_forward(self.ff, self.fixup_ff, self.norm3(y), tgt_pad)
        return out

    @staticmethod
    def _cached_attention(
        attn: nn.Module,
        branch: FixupBranch | None,
        cache: LayerCache,
        prefix: str,
        query: Tensor,
        new: Tensor | None,
        pad: Tensor | None,
        causal: bool,
    ) -> Tensor:
        """As :func:`_attention` does, over the cache (``new``: the keys' new inputs, ``query`` for
        self-attention, None when the memory's keys and values are kept)."""
        if getattr(attn, "training", False):
            raise ValueError("decoding with caches needs the model in evaluation mode: call model.eval() first")
        if branch is None:
            return attend_cached(attn, cache, prefix, query, new, pad, causal)
        shifted = query + branch.biases[0]
        new = shifted if new is query else None if new is None else new + branch.biases[0]
        return attend_cached(attn, cache, prefix, shifted, new, pad, causal, branch.biases[1]) * branch.scale

    def forward(self, inputs: Any) -> Any:
        if isinstance(inputs, Tensor):  # the decoder-only model: (B, T, D)
            return self._block(inputs, None, None, None)
        memory, src_pad, y, tgt_pad = inputs
        return memory, src_pad, self._block(y, tgt_pad, memory, src_pad), tgt_pad


class Output(nn.Module):
    """Final norm and projection to the vocabulary, logits clipped to ±``logit_clip``."""

    def __init__(self, dim: int, vocab: int, logit_clip: float | None, fixup: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        # (Fixup: the classification layer starts at zero)
        self.proj = FixupLinear(dim, vocab, bias=False, gain=0.0) if fixup else nn.Linear(dim, vocab, bias=False)
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
    experts: int = 0,
    expert_top_k: int = 2,
    capacity_factor: float = 1.25,
    moe_every: int = 2,
    moe_loss_weight: float = 0.01,
    norm: str = "layer",
    init_scheme: str = "default",
    share_layers: int = 1,
) -> nn.Sequential:
    """T(L, H, A): ``layers`` encoder and ``layers`` decoder layers, feed-forward size ``hidden``,
    ``heads`` attention heads (each ``head_dim`` wide; default dim/heads). Input: a tuple (source
    tokens, target tokens), both (B, T); output: logits (B, T_target, vocab). ``attention_dropout``:
    on the attention probabilities (default: ``dropout``); 0 lets a CPU keep no (T, T) matrix.
    ``transparent``: each decoder layer attends over its own learned mix of the source embedding and
    every encoder layer's output (:mod:`gpipe.models.transparent`). ``target_padding``: ``'end'``, after
    the real tokens (gpipe's batches: no host read per attention call); ``'any'``, told by the values.
    ``experts``: the feed-forward block of every ``moe_every``-th encoder and decoder layer is a
    mixture of that many experts (:class:`gpipe.models.moe.MoEFeedForward`: ``expert_top_k`` per
    token, ``capacity_factor``, the load-balancing loss weighted ``moe_loss_weight``); 0: none.
    ``norm``: ``'layer'`` or ``'none'`` (no layer norm); ``init_scheme``: ``'default'`` or, with
    ``norm='none'``, ``'fixup'`` (:mod:`gpipe.models.fixup`: L = 5 x ``layers`` residual branches).
    ``share_layers``: every N consecutive encoder layers, and decoder layers, hold one set of weights
    (:mod:`gpipe.models.sharing`; N divides ``layers``, dense layers only); 1: none."""
    if target_padding not in ("any", "end"):
        raise ValueError(f"target_padding is 'any' or 'end' (target_padding: {target_padding!r})")
    fixup = _fixup(norm, init_scheme, ff_init_scale, 5 * layers)  # (2 branches per encoder layer, 3 per decoder)
    scale = fixup or (ff_init_scale if ff_init_scale is not None else 1.0 / (2 * layers))
    model = nn.Sequential(
        SourceEmbedding(vocab, dim, max_len, dropout, pad),
        *[EncoderLayer(dim, hidden, heads, dropout, scale, head_dim, attention_dropout, fixup) for _ in range(layers)],
        TargetEmbedding(vocab, dim, max_len, dropout, pad),
        *[DecoderLayer(dim, hidden, heads, dropout, scale, True, head_dim, attention_dropout, fixup)
          for _ in range(layers)],
        Output(dim, vocab, logit_clip, fixup is not None),
    )  # fmt: skip
    for layer in (m for m in model if isinstance(m, DecoderLayer) and target_padding == "end"):
        layer.pad_at_end = True
    if share_layers > 1:
        if experts:
            raise ValueError(f"share_layers={share_layers} with experts={experts} is not supported: leave one out")
        for kind in (EncoderLayer, DecoderLayer):
            sharing.share_layers([m for m in model if isinstance(m, kind)], share_layers)
    if experts:
        moe = {"experts": experts, "top_k": expert_top_k, "capacity_factor": capacity_factor,
               "loss_weight": moe_loss_weight, "dropout": dropout}  # fmt: skip
        _mixtures(model, moe_every, moe, scale, fixup is not None)
    if norm == "none":
        without_norms(model, nn.LayerNorm)
    model = transparent_attention(model, layers, layers) if transparent else model
    return mark_blocks(model, 1, layers)  # (Bapna et al.'s gradient-norm ratio: the first and last encoder layers)


def _fixup(norm: str, init_scheme: str, ff_init_scale: float | None, branches: int) -> float | None:
    """The settings checked; Fixup's factor for a model of ``branches`` residual branches, or None."""
    if not check_settings(norm, init_scheme, ("layer", "none")):
        return None
    if ff_init_scale is not None:
        raise ValueError(
            f"init_scheme='fixup' sets the feed-forward layers' initial scale itself (ff_init_scale: {ff_init_scale}): "
            "leave ff_init_scale out"
        )
    return fixup_scale(branches, 2)  # (m = 2 weight layers per branch)


def _mixtures(model: nn.Sequential, every: int, moe: dict[str, Any], scale: float, fixup: bool) -> None:
    """Every ``every``-th encoder layer's and decoder layer's feed-forward block made a mixture of
    experts of its sizes (``moe``: :class:`MoEFeedForward`'s settings; ``fixup``: Fixup's)."""
    if every < 1:
        raise ValueError(f"moe_every must be at least 1 (moe_every: {every}): 2 makes every other layer's a mixture")
    for kind in (EncoderLayer, DecoderLayer):
        for i, layer in enumerate((m for m in model if isinstance(m, kind)), start=1):
            if i % every == 0:
                inner = cast(nn.Linear, layer.ff.get_submodule("inner"))
                layer.ff = MoEFeedForward(inner.in_features, inner.out_features, init_scale=scale, fixup=fixup, **moe)
                if fixup:  # a mixture's branch: a scalar bias before it, none inside
                    layer.fixup_ff = FixupBranch(1)


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
    norm: str = "layer",
    init_scheme: str = "default",
) -> nn.Sequential:
    """A decoder-only language model of ``layers`` blocks: input tokens (B, T), output logits
    (B, T, vocab) predicting the next token. ``attention_dropout``, ``norm``, ``init_scheme``: as
    :func:`transformer`'s (Fixup's L = 2 x ``layers`` residual branches)."""
    if transparent:
        raise ValueError(
            "transparent=True mixes the encoder's layers for the decoder's cross-attention, and transformer_lm has "
            "no encoder: build an encoder-decoder, transformer(..., transparent=True), or leave transparent out"
        )
    fixup = _fixup(norm, init_scheme, ff_init_scale, 2 * layers)  # (2 branches per block)
    scale = fixup or (ff_init_scale if ff_init_scale is not None else 1.0 / layers)
    model = nn.Sequential(
        TokenEmbedding(vocab, dim, max_len, dropout),
        *[DecoderLayer(dim, hidden, heads, dropout, scale, False, head_dim, attention_dropout, fixup)
          for _ in range(layers)],
        Output(dim, vocab, logit_clip, fixup is not None),
    )  # fmt: skip
    if norm == "none":
        without_norms(model, nn.LayerNorm)
    return mark_blocks(model, 1, layers)  # (the gradient-norm ratio: the first and last blocks)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
