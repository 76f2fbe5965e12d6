"""The state of a beam search, shared by the cached and the uncached decoding: per sentence the
alive hypotheses and the best finished one (GNMT's length penalty); and the log-probabilities both
decodings choose from (:func:`log_probs`: PAD never chosen)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

__all__ = ["Beams", "log_probs", "penalty"]


def log_probs(logits: Tensor, pad: int) -> Tensor:
    """The float32 log-softmax of ``logits`` (N, V), PAD's set to -inf after it, as fairseq does: no
    hypothesis ever holds PAD. (One that did would differ between the decodings: the uncached one
    runs the whole prefix again, where the decoder masks PAD as padding; the cached one keeps its keys.)"""
    out = F.log_softmax(logits.to(torch.float32), dim=-1)
    if 0 <= pad < out.size(-1):
        out[..., pad] = -math.inf
    return out


def penalty(length: int, alpha: float) -> float:
    """GNMT's length penalty ((5 + length) / 6) ** alpha."""
    return float(((5.0 + length) / 6.0) ** alpha)


class Beams:
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
        normalized = torch.where(candidates, scores / penalty(length, self.alpha), -math.inf)
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
        # the k best (a top-k, not a sort of all beam x vocab scores), equals in the order of their index
        top, index = total.view(batch, beam * vocab).topk(k, dim=1)
        order = index.argsort(dim=1, stable=True)
        top, index = top.gather(1, order), index.gather(1, order)
        order = top.argsort(dim=1, descending=True, stable=True)
        top, index = top.gather(1, order), index.gather(1, order)
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
            bound = scores.max(dim=1).values / penalty(self.max_len, self.alpha)
            self.done |= (self.finished >= beam) | (self.best >= bound)
            self.scores = torch.where(self.done.unsqueeze(1), -math.inf, self.scores)
        offset = torch.arange(batch, device=top.device).unsqueeze(1) * beam
        return torch.stack([(origin + offset).flatten(), token.flatten()], dim=1)
