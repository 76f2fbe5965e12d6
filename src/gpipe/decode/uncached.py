"""Decoding without caches: every step runs the whole prefix through the model again.

For a model whose layers keep no cache (any callable ``model((source, target_in)) -> logits``): it
costs O(L^2) decoder work for L tokens, each step one forward of the pipeline, micro-batched as
usual. Under torch.distributed the last stage's rank chooses the next tokens and broadcasts them to
the other ranks of the pipeline, so every rank calls alike and gets the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.data import EOS, PAD
from gpipe.decode.beams import Beams, log_probs
from gpipe.distributed.devices import comm_device
from gpipe.pipeline import Pipeline

__all__ = ["Model", "Steps", "beam_search", "greedy"]

Model = Callable[[tuple[Tensor, Tensor]], Any]


class Steps:
    """Runs the model on a prefix and shares what the last stage's rank decides with every rank."""

    def __init__(self, model: Model, device: torch.device, pad: int) -> None:
        self.model, self.device, self.pad = model, device, pad
        self.group: Any = None
        self.src: int | None = None  # the last stage's global rank, under torch.distributed
        self.comm_device = torch.device("cpu")
        if isinstance(model, Pipeline) and model.distributed:
            model.check_decodable()
            placement = model.engine.placement
            self.src = placement.rank_of(placement.num_stages - 1)
            self.group = getattr(model.engine.comm, "pp_group", None)
            self.comm_device = comm_device(model.engine.devices[0], self.group)

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
        return log_probs(logits[:, -1].to(self.device), self.pad)

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
    device = source.device
    steps = Steps(model, device, pad)
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
    device = source.device
    steps = Steps(model, device, pad)
    batch = source.size(0)
    sources = source.repeat_interleave(beam, dim=0)
    prefix = start.to(device, torch.long).repeat_interleave(beam).unsqueeze(1)
    beams: Beams | None = None
    for _ in range(max_len):
        log_probs = steps.last_log_probs(sources, prefix)
        update: Tensor | None = None
        if log_probs is not None:
            if beams is None:
                beams = Beams(batch, beam, max_len, float(length_penalty), eos, pad, device)
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
