"""Greedy and beam-search decoding for an encoder-decoder model (:func:`gpipe.models.transformer`).

``model`` is the plain ``nn.Sequential`` of the Transformer's layers or a :class:`gpipe.Pipeline` of
them, in evaluation mode — or any callable taking the tuple ``(source, target_in)`` of token ids,
(B, S) and (B, T), and returning logits (B, T, vocab).

With gpipe's Transformer the stages keep caches (:mod:`gpipe.decode.cached`, :mod:`gpipe.cache`):
the encoder runs once per sentence, each decoder layer keeps its keys and values, and a step sends
one new token per row through the stages. The sentences go through in ``groups`` groups (default:
one per stage of the pipeline), so that with K stages K groups are in flight and every stage works
at once (:mod:`gpipe.runtime.decoding`); a stream of batches (:func:`decode_batches`) keeps them
busy to the end. Any other model is decoded without caches (:mod:`gpipe.decode.uncached`): each step
runs the whole prefix again. Both choose the same tokens.

Under torch.distributed every rank of the pipeline calls alike and gets the same result: the last
stage's rank chooses the tokens. (Not with data parallelism.)

Outputs are (B, L) token ids without the start token, each sentence ending with ``eos`` (unless it
ran into ``max_len``) and padded with ``pad`` after it; L is the longest sentence's length. No
sentence ever holds ``pad`` before that (its log-probability is -inf: :func:`gpipe.decode.beams.log_probs`),
so ``eos`` and ``pad`` must differ.

Part of the applications (it decodes gpipe's Transformer): ``cached`` (the feeds of the stages'
decode loop), ``uncached``, ``beams`` (the beam search's state); imports the library and
:mod:`gpipe.models`, :mod:`gpipe.data`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from gpipe.data import EOS, PAD
from gpipe.decode import uncached
from gpipe.decode.cached import Chunk, caches_supported, run
from gpipe.decode.uncached import Model
from gpipe.pipeline import Pipeline
from gpipe.schedule.decode import min_groups

__all__ = ["Chunk", "beam_search", "decode_batches", "greedy"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} ({name}: {value!r})")
    return value


def _check_model(model: Model, cache: bool | None) -> Pipeline | nn.Sequential | None:
    """``model`` if it is to be decoded with caches, else None."""
    if not callable(model):
        raise TypeError(f"model must be callable as model((source, target_in)) -> logits (model: {model!r})")
    if isinstance(model, nn.Module) and model.training:
        raise ValueError("decode a model in evaluation mode: call model.eval() first (dropout would change each step)")
    if cache not in (None, True, False):
        raise ValueError(f"cache must be True, False or None (automatic) (cache: {cache!r})")
    supported = caches_supported(model)
    if cache and not supported:
        raise ValueError(
            f"cache=True needs a model of gpipe's Transformer layers (an nn.Sequential or a Pipeline of "
            f"gpipe.models.transformer's layers) (model: {type(model).__name__}); use cache=None or False"
        )
    if supported and isinstance(model, Pipeline):
        model.check_decodable()
    if (cache is None or cache) and supported:
        assert isinstance(model, Pipeline | nn.Sequential)
        return model
    return None


def _check_inputs(source: Tensor, start: Tensor, max_len: int, eos: int, pad: int) -> None:
    _check_int("max_len", max_len, 1)
    _check_int("eos", eos, 0)
    _check_int("pad", pad, 0)
    if eos == pad:  # (beams.log_probs: pad is never chosen, so no sentence could end)
        raise ValueError(
            f"eos and pad must differ (eos: {eos}, pad: {pad}): decoding never chooses pad, so no sentence "
            "would end; pass the model's padding id as pad, its end-of-sentence id as eos"
        )
    if not isinstance(source, Tensor) or source.dim() != 2 or source.dtype.is_floating_point:
        raise ValueError(
            f"source must be a (B, S) tensor of token ids (source: "
            f"{tuple(source.shape) if isinstance(source, Tensor) else type(source).__name__}"
            f"{', ' + str(source.dtype) if isinstance(source, Tensor) else ''})"
        )
    if source.size(0) == 0 or source.size(1) == 0:
        raise ValueError(f"source must hold at least one token of one sentence (source: {tuple(source.shape)})")
    if not isinstance(start, Tensor) or start.dim() != 1 or start.dtype.is_floating_point:
        raise ValueError(
            "start must be a (B,) tensor of token ids, the first decoder token of each sentence (start: "
            f"{tuple(start.shape) if isinstance(start, Tensor) else type(start).__name__})"
        )
    if start.size(0) != source.size(0):
        raise ValueError(
            f"start has {start.size(0)} tokens but source {source.size(0)} sentences "
            f"(start: {tuple(start.shape)}, source: {tuple(source.shape)})"
        )


def _check_beam(beam: int, length_penalty: float) -> None:
    _check_int("beam", beam, 1)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, int | float) or not 0 <= length_penalty < 1e6:
        raise ValueError(f"length_penalty must be a number >= 0 (length_penalty: {length_penalty!r})")


def _groups(model: Model, groups: int | None, sentences: int | None = None) -> int:
    """``groups``, or one per stage (fewer for fewer sentences, never fewer than the placement needs)."""
    if groups is not None:
        return _check_int("groups", groups, 1)
    if not isinstance(model, Pipeline):
        return 1
    placement = model.engine.placement
    stages = placement.num_stages if sentences is None else min(placement.num_stages, sentences)
    return max(stages, min_groups(placement.worker_of))


def _padded(parts: Sequence[Tensor], pad: int, device: torch.device) -> Tensor:
    """The rows of ``parts`` in one (B, L) tensor, padded with ``pad`` to the longest."""
    length = max(p.size(1) for p in parts)
    out = torch.full((sum(p.size(0) for p in parts), length), pad, dtype=torch.long, device=device)
    first = 0
    for p in parts:
        out[first : first + p.size(0), : p.size(1)] = p.to(device)
        first += p.size(0)
    return out


def _split(source: Tensor, start: Tensor, max_len: int, groups: int) -> list[Chunk]:
    return [Chunk(s, t, max_len) for s, t in zip(source.tensor_split(groups), start.tensor_split(groups)) if len(s)]


def greedy(
    model: Model,
    source: Tensor,
    start: Tensor,
    *,
    max_len: int,
    eos: int = EOS,
    pad: int = PAD,
    cache: bool | None = None,
    groups: int | None = None,
) -> Tensor:
    """Greedy decoding: at each step the most likely next token (the lowest id of equals).

    ``cache``: decode with the stages' caches (None: when the model's layers keep them, see the
    module's docstring). ``groups``: groups of sentences in flight (default: one per stage).
    Returns (B, L) token ids, L <= ``max_len``, without the start token: each sentence's tokens up
    to its ``eos``, then ``pad``.
    """
    cached = _check_model(model, cache)
    _check_inputs(source, start, max_len, eos, pad)
    if cached is None:
        return uncached.greedy(model, source, start, max_len=max_len, eos=eos, pad=pad)
    count = _groups(model, groups, source.size(0))
    chunks = _split(source, start, max_len, count)
    parts, _ = run(cached, chunks, groups=count, beam=1, length_penalty=0.0, eos=eos, pad=pad)
    return _padded(parts, pad, source.device)


def beam_search(
    model: Model,
    source: Tensor,
    start: Tensor,
    *,
    beam: int,
    max_len: int,
    length_penalty: float = 0.6,
    eos: int = EOS,
    pad: int = PAD,
    cache: bool | None = None,
    groups: int | None = None,
) -> Tensor:
    """Beam search: per sentence the finished hypothesis of the best log-probability divided by
    GNMT's length penalty ((5 + length) / 6) ** ``length_penalty`` (length: the tokens after the
    start token, eos included; 0 ranks by log-probability alone).

    At each step the best ``beam`` continuations of every sentence stay alive; one ending in
    ``eos`` among them is finished and kept aside. A sentence is done when ``beam`` of its
    hypotheses have finished (so that ``beam=1`` is :func:`greedy`), when no alive hypothesis can
    beat its best finished one, or at ``max_len`` tokens, where the alive hypotheses count as
    finished. ``cache`` and ``groups`` as for :func:`greedy`. Returns (B, L) token ids without the
    start token, padded with ``pad`` after ``eos``.
    """
    cached = _check_model(model, cache)
    _check_inputs(source, start, max_len, eos, pad)
    _check_beam(beam, length_penalty)
    if cached is None:
        return uncached.beam_search(
            model, source, start, beam=beam, max_len=max_len, length_penalty=length_penalty, eos=eos, pad=pad
        )
    count = _groups(model, groups, source.size(0))
    chunks = _split(source, start, max_len, count)
    parts, _ = run(cached, chunks, groups=count, beam=beam, length_penalty=float(length_penalty), eos=eos, pad=pad)
    return _padded(parts, pad, source.device)


def decode_batches(
    model: Model,
    batches: Sequence[Chunk],
    *,
    beam: int = 1,
    length_penalty: float = 0.6,
    eos: int = EOS,
    pad: int = PAD,
    cache: bool | None = None,
    groups: int | None = None,
    on_batch: Callable[[int, Tensor], None] | None = None,
) -> list[Tensor]:
    """Decode a stream of batches (each a :class:`Chunk`: sources, start tokens, its own length
    limit), greedy with ``beam`` 1, else beam search; each batch's (b, L) tokens. With caches,
    ``groups`` batches are in flight and a group that finishes takes the next batch, so that the
    stages stay busy to the end. ``on_batch(index, tokens)`` is called as each batch is done (for
    progress reports), in this process if it decides the tokens (under torch.distributed: the last
    stage's rank)."""
    cached = _check_model(model, cache)
    _check_beam(beam, length_penalty)
    for chunk in batches:
        _check_inputs(chunk.source, chunk.start, chunk.max_len, eos, pad)
    if not batches:
        return []
    if cached is None:
        if beam == 1:
            done = [uncached.greedy(model, c.source, c.start, max_len=c.max_len, eos=eos, pad=pad) for c in batches]
        else:
            done = [
                uncached.beam_search(
                    model,
                    c.source,
                    c.start,
                    beam=beam,
                    max_len=c.max_len,
                    length_penalty=length_penalty,
                    eos=eos,
                    pad=pad,
                )
                for c in batches
            ]
        if on_batch is not None:
            for i, tokens in enumerate(done):
                on_batch(i, tokens)
        return done
    parts, _ = run(
        cached,
        batches,
        groups=_groups(model, groups, len(batches)),
        beam=beam,
        length_penalty=float(length_penalty),
        eos=eos,
        pad=pad,
        on_chunk=on_batch,
    )
    return [p.to(c.source.device) for p, c in zip(parts, batches)]
