"""Greedy and beam-search decoding for an encoder-decoder model (:func:`gpipe.models.transformer`).

``model`` is any callable taking the tuple ``(source, target_in)`` of token ids, (B, S) and (B, T),
and returning logits (B, T, vocab): the plain ``nn.Sequential`` or a :class:`gpipe.Pipeline` in
evaluation mode. There is no key/value cache: every step runs the whole prefix through the model
again, which is what a pipeline of stages can do (a stage keeps no state between calls). It costs
O(L^2) decoder work for L tokens, and each step is one forward of the pipeline, micro-batched as
usual.

Under torch.distributed a ``Pipeline`` returns logits only on the rank of its last stage; there the
next tokens are chosen and broadcast to the other ranks of the pipeline, so every rank calls
:func:`greedy` / :func:`beam_search` alike and gets the same result. (Not with data parallelism.)

Outputs are (B, L) token ids without the start token, each sentence ending with ``eos`` (unless it
ran into ``max_len``) and padded with ``pad`` after it; L is the longest sentence's length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe.data import EOS, PAD
from gpipe.pipeline import Pipeline

__all__ = ["beam_search", "greedy"]

Model = Callable[[tuple[Tensor, Tensor]], Any]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} ({name}: {value!r})")
    return value


def _check_inputs(model: Model, source: Tensor, start: Tensor, max_len: int, eos: int, pad: int) -> None:
    if not callable(model):
        raise TypeError(f"model must be callable as model((source, target_in)) -> logits (model: {model!r})")
    if isinstance(model, nn.Module) and model.training:
        raise ValueError("decode a model in evaluation mode: call model.eval() first (dropout would change each step)")
    _check_int("max_len", max_len, 1)
    _check_int("eos", eos, 0)
    _check_int("pad", pad, 0)
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


class _Steps:
    """Runs the model on a prefix and shares what the last stage's rank decides with every rank."""

    def __init__(self, model: Model, device: torch.device) -> None:
        self.model, self.device = model, device
        self.group: Any = None
        self.src: int | None = None  # the last stage's global rank, under torch.distributed
        self.comm_device = torch.device("cpu")
        if isinstance(model, Pipeline) and model.distributed:
            if model.data_parallel > 1:
                raise NotImplementedError(
                    f"decoding a Pipeline with data_parallel={model.data_parallel} is not supported: "
                    "build one without data parallelism to decode"
                )
            placement = model.engine.placement
            self.src = placement.rank_of(placement.num_stages - 1)
            self.group = getattr(model.engine.comm, "pp_group", None)
            if dist.get_backend(self.group) == "nccl":
                assert placement.rank is not None
                self.comm_device = placement.devices[placement.rank]

    @property
    def distributed(self) -> bool:
        return self.src is not None

    def last_log_probs(self, source: Tensor, prefix: Tensor) -> Tensor | None:
        """(N, V) float log-probabilities of the token after ``prefix`` (None on a rank without
        the last stage)."""
        with torch.no_grad():
            logits = self.model((source, prefix))
        if logits is None:
            if self.distributed:
                return None
            raise ValueError("the model returned None instead of logits")
        if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[:2] != prefix.shape:
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(
                f"the model must return logits (N, T, vocab) for a target_in of {tuple(prefix.shape)} (got: {shape})"
            )
        return F.log_softmax(logits[:, -1].to(self.device, torch.float32), dim=-1)

    def share(self, value: Tensor | None, shape: tuple[int, ...]) -> Tensor:
        """``value`` (a long tensor of ``shape``, known on the last stage's rank) on every rank."""
        if not self.distributed:
            assert value is not None
            return value
        buf = torch.empty(shape, dtype=torch.long, device=self.comm_device)
        if value is not None:
            buf.copy_(value)
        dist.broadcast(buf, src=self.src, group=self.group)
        return buf.to(self.device)


def greedy(model: Model, source: Tensor, start: Tensor, *, max_len: int, eos: int = EOS, pad: int = PAD) -> Tensor:
    """Greedy decoding: at each step the most likely next token (the lowest id of equals).

    Each of the at most ``max_len`` steps runs the whole prefix through ``model`` (no key/value
    cache). Returns (B, L) token ids, L <= ``max_len``, without the start token: each sentence's
    tokens up to its ``eos``, then ``pad``.
    """
    _check_inputs(model, source, start, max_len, eos, pad)
    device = source.device
    steps = _Steps(model, device)
    batch = source.size(0)
    prefix = start.to(device, torch.long).unsqueeze(1)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for _ in range(max_len):
        log_probs = steps.last_log_probs(source, prefix)
        chosen = log_probs.argmax(dim=-1) if log_probs is not None else None
        token = steps.share(chosen, (batch,))
        token = torch.where(finished, torch.full_like(token, pad), token)
        prefix = torch.cat([prefix, token.unsqueeze(1)], dim=1)
        finished |= token == eos
        if bool(finished.all()):
            break
    return prefix[:, 1:]


def _penalty(length: int, alpha: float) -> float:
    """GNMT's length penalty ((5 + length) / 6) ** alpha."""
    return float(((5.0 + length) / 6.0) ** alpha)


class _Beams:
    """The search state of B sentences x ``beam`` hypotheses, on the rank that sees the logits."""

    def __init__(self, batch: int, beam: int, max_len: int, alpha: float, eos: int, pad: int, device: torch.device):
        self.beam, self.max_len, self.alpha, self.eos, self.pad = beam, max_len, alpha, eos, pad
        self.scores = torch.full((batch, beam), -math.inf, device=device)  # log-probabilities of the alive
        self.scores[:, 0] = 0.0  # one empty hypothesis to start from
        self.hyps = torch.empty(batch, beam, 0, dtype=torch.long, device=device)  # their tokens
        self.best = torch.full((batch,), -math.inf, device=device)  # best finished, length-penalized
        self.best_tokens = torch.full((batch, max_len), pad, dtype=torch.long, device=device)
        self.best_length = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.long, device=device)  # finished hypotheses so far
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)

    def _finish(self, candidates: Tensor, scores: Tensor, tokens: Tensor, length: int) -> None:
        """Keep the best of ``candidates`` (B, k) (log-probabilities ``scores``, token rows
        ``tokens`` (B, k, length)) where it beats the best finished so far."""
        normalized = torch.where(candidates, scores / _penalty(length, self.alpha), -math.inf)
        value, position = normalized.max(dim=1)
        better = candidates.any(dim=1) & (value > self.best)
        rows = tokens[torch.arange(tokens.size(0), device=tokens.device), position]  # (B, length)
        self.best = torch.where(better, value, self.best)
        self.best_tokens[better] = self.pad
        self.best_tokens[better, :length] = rows[better]
        self.best_length[better] = length
        self.finished += candidates.sum(dim=1)

    def advance(self, log_probs: Tensor) -> Tensor:
        """One step from (B * beam, V) log-probabilities; returns the alive hypotheses' new last
        tokens' source beams and tokens as (B * beam, 2): (index of the hypothesis extended, token)."""
        batch, beam = self.scores.shape
        vocab = log_probs.size(-1)
        step = self.hyps.size(2)  # tokens so far; this step makes hypotheses of step + 1
        total = self.scores.unsqueeze(2) + log_probs.view(batch, beam, vocab)
        k = min(2 * beam, beam * vocab)  # at most `beam` of them end in eos: `beam` go on
        top, index = total.view(batch, beam * vocab).sort(dim=1, descending=True, stable=True)
        top, index = top[:, :k], index[:, :k]
        origin, token = index // vocab, index % vocab
        ended = token == self.eos
        grown = torch.cat([self.hyps.gather(1, origin.unsqueeze(2).expand(-1, -1, step)), token.unsqueeze(2)], 2)

        # an eos among the best `beam` candidates finishes a hypothesis (so that beam=1 is greedy)
        rank = torch.arange(k, device=top.device).unsqueeze(0)
        ending = ended & (rank < beam) & torch.isfinite(top) & ~self.done.unsqueeze(1)
        self._finish(ending, top, grown, step + 1)

        # the best `beam` that do not end go on
        keep = torch.sort(ended.to(torch.int8), dim=1, stable=True).indices[:, :beam]
        scores = torch.where(ended.gather(1, keep), -math.inf, top.gather(1, keep))
        scores = torch.where(self.done.unsqueeze(1), -math.inf, scores)
        self.hyps = grown.gather(1, keep.unsqueeze(2).expand(-1, -1, step + 1))
        self.scores = scores
        origin, token = origin.gather(1, keep), token.gather(1, keep)

        if step + 1 == self.max_len:  # out of room: the alive end here, unfinished
            self._finish(torch.isfinite(scores), scores, self.hyps, step + 1)
            self.done[:] = True
        else:
            # no alive hypothesis can beat the best finished: its log-probability only falls, and
            # the penalty's divisor is at most that of max_len
            bound = scores.max(dim=1).values / _penalty(self.max_len, self.alpha)
            self.done |= (self.finished >= beam) | (self.best >= bound)
            self.scores = torch.where(self.done.unsqueeze(1), -math.inf, self.scores)
        offset = torch.arange(batch, device=top.device).unsqueeze(1) * beam
        return torch.stack([(origin + offset).flatten(), token.flatten()], dim=1)


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
) -> Tensor:
    """Beam search: per sentence the finished hypothesis of the best log-probability divided by
    GNMT's length penalty ((5 + length) / 6) ** ``length_penalty`` (length: the tokens after the
    start token, eos included; 0 ranks by log-probability alone).

    The B x ``beam`` hypotheses go through ``model`` as one batch per step (a pipeline splits them
    into its micro-batches), the whole prefix each time (no key/value cache). At each step the
    best ``beam`` continuations of every sentence stay alive; one ending in ``eos`` among them is
    finished and kept aside. A sentence is done when ``beam`` of its hypotheses have finished (so
    that ``beam=1`` is :func:`greedy`), when no alive hypothesis can beat its best finished one,
    or at ``max_len`` tokens, where the alive hypotheses count as finished. Returns (B, L) token
    ids without the start token, padded with ``pad`` after ``eos``.
    """
    _check_inputs(model, source, start, max_len, eos, pad)
    _check_int("beam", beam, 1)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, int | float) or not 0 <= length_penalty < 1e6:
        raise ValueError(f"length_penalty must be a number >= 0 (length_penalty: {length_penalty!r})")
    device = source.device
    steps = _Steps(model, device)
    batch = source.size(0)
    sources = source.repeat_interleave(beam, dim=0)
    prefix = start.to(device, torch.long).repeat_interleave(beam).unsqueeze(1)
    beams: _Beams | None = None
    for _ in range(max_len):
        log_probs = steps.last_log_probs(sources, prefix)
        update: Tensor | None = None
        if log_probs is not None:
            if beams is None:
                beams = _Beams(batch, beam, max_len, float(length_penalty), eos, pad, device)
            chosen = beams.advance(log_probs)
            update = torch.cat([chosen.flatten(), beams.done.all().to(torch.long).reshape(1)])
        shared = steps.share(update, (batch * beam * 2 + 1,))
        chosen = shared[:-1].view(batch * beam, 2)
        prefix = torch.cat([prefix[chosen[:, 0]], chosen[:, 1:]], dim=1)
        if bool(shared[-1]):
            break
    result: Tensor | None = None
    if beams is not None:
        result = torch.cat([beams.best_tokens, beams.best_length.unsqueeze(1)], dim=1)
    result = steps.share(result, (batch, max_len + 1))
    length = int(result[:, -1].max())
    return result[:, :length]
