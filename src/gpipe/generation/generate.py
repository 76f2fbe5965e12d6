"""``Pipeline.generate``: a causal language model's continuations of prompts, through the stages.

The layers are those of :func:`gpipe.generation.traced.cached_layers` (a Hugging Face causal LM
traced so that its blocks keep their keys and values in the stages). The prompts are split into
``groups`` groups in flight (default: one per stage, so that every stage works on some group's step
while the others work on theirs; :mod:`gpipe.runtime.decoding`); each group's tokens are chosen by
a policy of :mod:`gpipe.generation.policies` where the last stage runs — greedy, beam search or
sampling, as transformers' ``generate`` chooses them — and its sequences are shared with every rank
at the end.

Sampling: with ``seed``, every prompt draws from a random stream of its own (seeded by ``seed`` and
the prompt's index), so that the tokens are the same whatever the number of stages and groups;
without, the draws come from torch's global generator over each group's rows, as ``generate`` draws
them (with one group: ``generate``'s tokens after the same ``torch.manual_seed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.generation.policies import Beam, Greedy, Policy, Sample
from gpipe.runtime.decoding import DecodeTrace, Feed, Next

__all__ = ["Generation", "Settings", "generate"]


@dataclass(frozen=True)
class Generation:
    """What a traced causal LM says about generating (kept on its layers by ``cached_layers``)."""

    model: str
    vocab_size: int
    max_positions: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None


@dataclass(frozen=True, kw_only=True)
class Settings:
    """``Pipeline.generate``'s choice of tokens (see :func:`generate`)."""

    max_new_tokens: int
    num_beams: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1


def _check(model: Generation, ids: Tensor, mask: Tensor, s: Settings) -> None:
    if isinstance(s.max_new_tokens, bool) or not isinstance(s.max_new_tokens, int) or s.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1 (max_new_tokens: {s.max_new_tokens!r})")
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"input_ids must be a (batch, length) tensor of token ids, left-padded (input_ids: {shape})")
    if ids.numel() == 0 or not bool(mask.any(dim=1).all()):
        empty = [i for i, row in enumerate(mask.tolist()) if not any(row)] if ids.numel() else "all"
        raise ValueError(f"every prompt needs at least one token (empty prompts: {empty})")
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}")
    if int(ids.max()) >= model.vocab_size or int(ids.min()) < 0:
        raise ValueError(
            f"input_ids hold ids outside the vocabulary of {model.vocab_size} (ids {int(ids.min())}..{int(ids.max())})"
        )
    longest = ids.size(1) + s.max_new_tokens
    if model.max_positions is not None and longest > model.max_positions:
        raise ValueError(
            f"prompts of {ids.size(1)} tokens and max_new_tokens {s.max_new_tokens} make {longest} positions; "
            f"{model.model} has {model.max_positions}: shorten the prompts or generate fewer tokens"
        )
    if isinstance(s.num_beams, bool) or not isinstance(s.num_beams, int) or s.num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1 (num_beams: {s.num_beams!r})")
    if s.num_beams > model.vocab_size:
        raise ValueError(f"num_beams {s.num_beams} exceeds the vocabulary of {model.vocab_size} tokens")
    if not (isinstance(s.temperature, int | float) and s.temperature > 0):
        raise ValueError(f"temperature must be > 0 (temperature: {s.temperature!r})")
    if not (isinstance(s.top_p, int | float) and 0 < s.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (top_p: {s.top_p!r}); 1 keeps every token")
    if s.top_k is not None and (isinstance(s.top_k, bool) or not isinstance(s.top_k, int) or s.top_k < 0):
        raise ValueError(f"top_k must be a non-negative int or None (top_k: {s.top_k!r}); 0 or None keeps every token")
    if s.do_sample and s.num_beams > 1:
        raise ValueError("beam sampling (do_sample with num_beams > 1) is not supported: choose one of them")
    if s.seed is not None and (isinstance(s.seed, bool) or not isinstance(s.seed, int)):
        raise ValueError(f"seed must be an integer or None (seed: {s.seed!r})")
    if s.num_return_sequences != 1 and s.num_beams == 1:
        raise ValueError("num_return_sequences > 1 needs beam search (num_beams >= num_return_sequences)")


class _Feed:
    """Groups of prompts through the stages; each group's policy where the last stage runs."""

    def __init__(self, ids: Tensor, mask: Tensor, groups: int, make: Callable[[Tensor, int], Policy]) -> None:
        # (groups beyond the prompts stay empty: a placement may need more groups in flight than prompts)
        self.rows = list(torch.arange(ids.size(0)).tensor_split(groups))
        self.ids, self.mask, self.make = ids, mask, make
        self.policies: dict[int, Policy] = {}
        self.sequences: list[Tensor | None] = [None] * len(self.rows)

    @property
    def groups(self) -> int:
        return len(self.rows)

    def _policy(self, group: int) -> Policy:
        found = self.policies.get(group)
        if found is None:
            rows = self.rows[group]
            found = self.policies[group] = self.make(self.ids[rows], int(rows[0]))
        return found

    def start(self, group: int) -> dict[str, Tensor] | None:
        if self.rows[group].numel() == 0:
            return None
        rows = self.rows[group][self._policy(group).start_rows.cpu()]
        return {"input_ids": self.ids[rows], "attention_mask": self.mask[rows]}

    def next(self, group: int, output: Any) -> Next:
        if not isinstance(output, Tensor) or output.dim() != 3:
            shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            raise ValueError(f"the last layer must return logits (rows, length, vocab) (got: {shape})")
        policy = self._policy(group)
        tokens, rows, done = policy.choose(output)
        if done:
            self.sequences[group] = policy.sequences
            return Next()
        same = rows.numel() == output.size(0) and bool((rows == torch.arange(rows.numel(), device=rows.device)).all())
        return Next(tokens.unsqueeze(1), rows=None if same else rows)


def _policy_maker(s: Settings, eos: Any, pad: int | None) -> Callable[[Tensor, int], Policy]:
    def make(prompts: Tensor, first: int) -> Policy:
        common: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "eos_token_id": eos, "pad_token_id": pad}
        if s.num_beams > 1:
            return Beam(
                prompts, num_beams=s.num_beams, length_penalty=s.length_penalty, early_stopping=s.early_stopping,
                num_return_sequences=s.num_return_sequences, **common,
            )  # fmt: skip
        if s.do_sample:
            seeds = None if s.seed is None else [s.seed * 1_000_003 + first + i for i in range(prompts.size(0))]
            return Sample(prompts, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, row_seeds=seeds, **common)
        return Greedy(prompts, **common)

    return make


def generate(
    decode: Callable[[Feed], DecodeTrace],
    model: Generation,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    settings: Settings,
    *,
    groups: int,
    share: Callable[[list[Tensor | None]], list[Tensor]],
) -> Tensor:
    """The prompts' sequences (prompt and new tokens, as ``generate`` returns them), decoded by
    ``decode`` in ``groups`` groups; ``share`` hands the groups' sequences (known where the last
    stage runs) to every rank."""
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    _check(model, input_ids, mask, settings)
    eos = settings.eos_token_id if settings.eos_token_id is not None else model.eos_token_id
    pad = settings.pad_token_id if settings.pad_token_id is not None else model.pad_token_id
    feed = _Feed(input_ids.long(), mask.long(), groups, _policy_maker(settings, eos, pad))
    decode(feed)
    parts = share(feed.sequences)
    fill = pad if pad is not None else (eos if isinstance(eos, int) else eos[0] if eos else 0)
    length = max(p.size(1) for p in parts)
    out = torch.full((sum(p.size(0) for p in parts), length), int(fill), dtype=torch.long, device=input_ids.device)
    first = 0
    for p in parts:
        out[first : first + p.size(0), : p.size(1)] = p.to(input_ids.device)
        first += p.size(0)
    return out


def share_from(src: int | None, group: Any, device: torch.device) -> Callable[[list[Tensor | None]], list[Tensor]]:
    """A ``share`` for :func:`generate`: in one process the sequences as they are; under
    torch.distributed broadcast from global rank ``src`` (the last stage's) over ``group``."""

    def share(parts: list[Tensor | None]) -> list[Tensor]:
        if src is None:
            return [p for p in parts if p is not None]
        shapes = torch.zeros(len(parts), 2, dtype=torch.long, device=device)
        if dist.get_rank() == src:
            shapes.copy_(torch.tensor([tuple(p.shape) if p is not None else (0, 0) for p in parts]))
        dist.broadcast(shapes, src=src, group=group)
        sizes = [int(a) * int(b) for a, b in shapes.tolist()]
        flat = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        if dist.get_rank() == src:
            flat.copy_(torch.cat([p.flatten().to(device) for p in parts if p is not None]))
        dist.broadcast(flat, src=src, group=group)
        return [x.view(int(a), int(b)) for x, (a, b) in zip(torch.split(flat, sizes), shapes.tolist())]

    return share
