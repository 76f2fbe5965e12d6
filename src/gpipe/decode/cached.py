"""Decoding with caches in the stages: the greedy and beam-search :class:`~gpipe.runtime.decoding.Feed`
of gpipe's Transformer, and running one over a ``Pipeline`` or a plain ``nn.Sequential``.

A decode takes *chunks* (a batch of sources, their start tokens and a length limit each) and keeps
``groups`` of them in flight; a group that finishes its chunk starts the next one (a stream of
batches keeps every stage busy to the end). The encoder runs once per sentence — for beam search
too: its hypotheses start as one row per sentence, and the first step's choice repeats the rows —
and every later step sends one new token per row through the stages. Sentences that are done leave
their group's rows (and the stages' caches) at once.

The choices are the uncached decoding's (:mod:`gpipe.decode.uncached`) step for step: the same
log-probabilities (:func:`~gpipe.decode.beams.log_probs`: the float32 log-softmax of the last
position's logits, PAD never chosen), the same argmax, the same :class:`~gpipe.decode.beams.Beams`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gpipe.decode.beams import Beams
from gpipe.decode.beams import log_probs as next_log_probs
from gpipe.distributed.devices import comm_device
from gpipe.generation.generate import share_from
from gpipe.models.transformer import DecoderLayer, EncoderLayer, Output, SourceEmbedding, TargetEmbedding
from gpipe.models.transparent import TransparentDecoderLayer, TransparentEncoderLayer, TransparentTargetEmbedding
from gpipe.pipeline import Pipeline
from gpipe.runtime.decoding import DecodeTrace, Next, decode
from gpipe.runtime.executor import Executor
from gpipe.runtime.placement import Placement
from gpipe.runtime.stage import Stage

__all__ = ["Chunk", "caches_supported", "run"]

_CACHED = (SourceEmbedding, EncoderLayer, TargetEmbedding, DecoderLayer, Output, TransparentEncoderLayer,
           TransparentTargetEmbedding, TransparentDecoderLayer)  # fmt: skip


@dataclass(frozen=True)
class Chunk:
    """Sentences decoded together: sources (b, S), start tokens (b,), at most ``max_len`` tokens."""

    source: Tensor
    start: Tensor
    max_len: int


def caches_supported(model: object) -> bool:
    """Whether every layer of ``model`` (this process's, for a pipeline) keeps a decoding cache."""
    if isinstance(model, Pipeline):
        layers = [layer for p in model.engine.partitions.values() for layer in p]
    elif isinstance(model, nn.Sequential):
        layers = list(model)
    else:
        return False
    return bool(layers) and all(isinstance(layer, _CACHED) for layer in layers)


class _Greedy:
    """One chunk's greedy state, where the last stage runs."""

    def __init__(self, chunk: Chunk, eos: int, pad: int, device: torch.device) -> None:
        b = chunk.source.size(0)
        self.max_len, self.eos = chunk.max_len, eos
        self.rows = torch.arange(b, device=device)  # the sentence of each row of the model's batch
        self.tokens = torch.full((b, chunk.max_len), pad, dtype=torch.long, device=device)
        self.step = 0

    def advance(self, log_probs: Tensor) -> Next | None:
        token = log_probs.argmax(dim=-1)
        self.tokens[self.rows, self.step] = token
        self.step += 1
        going = token != self.eos
        if self.step == self.max_len or not bool(going.any()):
            return None
        keep = going.nonzero().squeeze(1)
        self.rows = self.rows[keep]
        return Next((None, token[keep].unsqueeze(1)), rows=None if keep.numel() == going.numel() else keep)

    def result(self) -> Tensor:
        return self.tokens[:, : self.step]


class _Beam:
    """One chunk's beam search, where the last stage runs: the hypotheses of the sentences not
    done, ``beam`` rows each (one row per sentence before the first step)."""

    def __init__(self, chunk: Chunk, beam: int, alpha: float, eos: int, pad: int, device: torch.device) -> None:
        b = chunk.source.size(0)
        self.beam = beam
        self.beams = Beams(b, beam, chunk.max_len, alpha, eos, pad, device)
        # each hypothesis's row in the model's batch (-1: none; only hypothesis 0 of each sentence at first)
        self.rows = torch.full((b * beam,), -1, dtype=torch.long, device=device)
        self.rows[::beam] = torch.arange(b, device=device)

    def advance(self, log_probs: Tensor) -> Next | None:
        beam, present = self.beam, self.rows >= 0
        full = log_probs.new_zeros(self.rows.numel(), log_probs.size(-1))  # (the absent have -inf scores)
        full[present] = log_probs[self.rows[present]]
        chosen = self.beams.advance(full)
        going = (~self.beams.done).nonzero().squeeze(1)
        if going.numel() == 0:
            return None
        hyps = (going.unsqueeze(1) * beam + torch.arange(beam, device=going.device)).flatten()
        origin, token = chosen[hyps, 0], chosen[hyps, 1]
        keep = self.rows[origin]
        # An origin without a row is a hypothesis of score -inf (fewer candidates than beams): any
        # row of its sentence does, its continuations stay at -inf.
        keep = torch.where(keep < 0, self.rows[origin // beam * beam], keep)
        self.rows = torch.full_like(self.rows, -1)
        self.rows[hyps] = torch.arange(hyps.numel(), device=hyps.device)
        return Next((None, token.unsqueeze(1)), rows=keep)

    def result(self) -> Tensor:
        beams = self.beams
        return beams.best_tokens[:, : int(beams.best_length.max())]


class _Feed:
    """Chunks through ``groups`` groups in flight, greedy (``beam`` 1) or beam search."""

    def __init__(
        self,
        chunks: Sequence[Chunk],
        groups: int,
        beam: int,
        alpha: float,
        eos: int,
        pad: int,
        on_chunk: Callable[[int, Tensor], None] | None = None,
    ) -> None:
        self.chunks, self.beam, self.alpha, self.eos, self.pad = chunks, beam, alpha, eos, pad
        self.on_chunk = on_chunk
        self._groups = groups  # (groups beyond the chunks stay empty: a placement may need more in flight)
        self.chunk_of = list(range(groups))  # the chunk each group decodes (where the last stage runs)
        self.waiting = min(groups, len(chunks))  # the next chunk to start
        self.states: dict[int, _Greedy | _Beam] = {}
        self.results: list[Tensor | None] = [None] * len(chunks)

    @property
    def groups(self) -> int:
        return self._groups

    def _prompt(self, c: int) -> tuple[Tensor, Tensor]:
        return self.chunks[c].source, self.chunks[c].start.unsqueeze(1)

    def start(self, group: int) -> tuple[Tensor, Tensor] | None:
        return self._prompt(group) if group < len(self.chunks) else None

    def next(self, group: int, output: object) -> Next:
        if not isinstance(output, Tensor) or output.dim() != 3:
            shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            raise ValueError(f"the model must return logits (N, T, vocab) (got: {shape})")
        log_probs = next_log_probs(output[:, -1], self.pad)
        state = self.states.get(group)
        if state is None:
            chunk = self.chunks[self.chunk_of[group]]
            state = self.states[group] = (
                _Greedy(chunk, self.eos, self.pad, log_probs.device)
                if self.beam == 1
                else _Beam(chunk, self.beam, self.alpha, self.eos, self.pad, log_probs.device)
            )
        nxt = state.advance(log_probs)
        if nxt is not None:
            return nxt
        self.results[self.chunk_of[group]] = tokens = state.result()
        if self.on_chunk is not None:
            self.on_chunk(self.chunk_of[group], tokens)
        del self.states[group]
        if self.waiting == len(self.chunks):
            return Next()
        self.chunk_of[group], self.waiting = self.waiting, self.waiting + 1
        return Next(self._prompt(self.chunk_of[group]), restart=True)


def _one_stage(model: nn.Sequential) -> Executor:
    """A plain model as a pipeline of one stage in this process."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    placement = Placement((0,), (device,))
    return Executor([Stage(0, model, 0, device)], placement)


def run(
    model: Pipeline | nn.Sequential,
    chunks: Sequence[Chunk],
    *,
    groups: int,
    beam: int,
    length_penalty: float,
    eos: int,
    pad: int,
    on_chunk: Callable[[int, Tensor], None] | None = None,
) -> tuple[list[Tensor], DecodeTrace]:
    """Decode ``chunks`` with caches; every chunk's tokens (b, L) (on every rank of a pipeline).
    ``on_chunk(index, tokens)`` is called as each chunk is done, where the last stage runs."""
    feed = _Feed(chunks, groups, beam, length_penalty, eos, pad, on_chunk)
    trace = model.decode(feed) if isinstance(model, Pipeline) else decode(_one_stage(model), feed)
    results: list[Tensor | None] = list(feed.results)
    if isinstance(model, Pipeline) and model.distributed:
        placement = model.engine.placement
        group = getattr(model.engine.comm, "pp_group", None)
        device = comm_device(model.engine.devices[0], group)
        results = list(share_from(placement.rank_of(placement.num_stages - 1), group, device)(results))
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"the decode ended without the tokens of chunks {missing}")
    return [r for r in results if r is not None], trace
