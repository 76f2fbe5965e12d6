"""The choice of the next tokens after a decoding step: greedy, beam search, sampling — as
transformers 5.23's ``generate`` makes it, so that a loop over cached layers (or a pipeline's last
stage) gives ``generate``'s tokens.

A policy is made for a group of prompts and runs where the logits are::

    policy = Beam(prompts, num_beams=4, max_new_tokens=8, eos_token_id=2, pad_token_id=0)
    step = {"input_ids": prompts[policy.start_rows], "attention_mask": mask[policy.start_rows]}
    while True:
        logits = run(step)                            # (rows, length, vocab): the step's logits
        tokens, rows, done = policy.choose(logits)
        if done:
            break
        cache.reorder(rows)                           # the rows that go on, in their new order
        step = tokens[:, None]
    policy.sequences                                  # what generate returns: prompts and new tokens

- :attr:`start_rows`: the prompts' rows the first step runs (beam search starts ``num_beams`` copies
  of each prompt, as ``generate`` expands its inputs before the prefill).
- :meth:`choose` takes the step's logits (the last position's count), and returns the next token of
  every row that goes on, which row of the step each continues (for ``Cache.reorder``: beam search
  repeats some hypotheses and drops others, finished sequences may leave), and whether the group is
  done (then no step follows).
- :attr:`sequences`: ``generate``'s output: the prompts, then the new tokens, finished sequences
  padded with ``pad_token_id`` (``generate``'s ``eos_token_id[0]`` where there is no pad).

Finished rows: ``generate`` keeps them in the batch (greedy search and sampling feed them
``pad_token_id``, beam search runs a done prompt's beams on) and throws their next tokens away, and
so do the policies by default (``drop_finished=False``): every step then runs on the batch
``generate`` runs, and the logits are ``generate``'s bitwise. With
``drop_finished=True`` they leave the group (``Beam``: the rows of a prompt whose search is over),
which saves their computation; the other rows' logits may then differ from ``generate``'s in the
last bits (a matmul over fewer rows rounds differently), so a token may differ where two candidates
tie within that rounding. :class:`Sample` draws a random number for every row of the group, finished
or gone or not, so that a seeded run draws what ``generate`` draws (``torch.multinomial`` takes one
exponential variate per entry of the probabilities, whatever they are). Logits are taken in
float32, as ``generate`` does. The defaults are ``generate``'s (a model's ``generation_config`` may
set others: pass them).

``pad_token_id`` may be chosen: unlike :mod:`gpipe.decode` (PAD's log-probability -inf, as fairseq:
its decoder would mask a PAD in the prefix it runs again), no policy masks it. Here it is only the
fill of finished rows: a step's new tokens go in with an attention mask of ones, as ``generate``
feeds them, so a chosen pad is attended like any token, and ``generate`` does not mask it (the
policies give its tokens). It is mostly None (GPT-2, Llama 3: eos fills) or one of the eos ids
(Qwen2.5's instruct models), where masking it would forbid ending.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["Beam", "Greedy", "Policy", "Sample"]


class Policy(Protocol):
    """What a decoding loop needs of a policy (see the module docstring)."""

    start_rows: Tensor

    def choose(self, logits: Tensor) -> tuple[Tensor, Tensor, bool]: ...

    @property
    def sequences(self) -> Tensor: ...


def _eos(eos_token_id: int | Sequence[int] | None, device: torch.device) -> Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def _last(logits: Tensor, device: torch.device) -> Tensor:
    """The last position's logits, ``(rows, vocab)``, in float32 on the policy's device."""
    if logits.dim() == 3:
        logits = logits[:, -1]
    if logits.dim() != 2:
        raise ValueError(
            f"choose takes a step's logits, (rows, length, vocab) or (rows, vocab) (got {tuple(logits.shape)})"
        )
    return logits.to(copy=True, dtype=torch.float32, device=device)


def _check(prompts: Tensor, max_new_tokens: int) -> None:
    if not isinstance(prompts, Tensor) or prompts.dim() != 2 or prompts.dtype != torch.long:
        shape = tuple(prompts.shape) if isinstance(prompts, Tensor) else type(prompts).__name__
        raise ValueError(f"prompts are token ids, a long tensor (rows, length), left-padded (got {shape})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int (max_new_tokens: {max_new_tokens!r})")


class Greedy:
    """The most likely token, row by row (``generate(do_sample=False, num_beams=1)``); a row is
    finished at ``eos_token_id`` (one id or several), all at ``max_new_tokens``."""

    def __init__(
        self,
        prompts: Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        drop_finished: bool = False,
    ) -> None:
        _check(prompts, max_new_tokens)
        self.device = prompts.device
        self.eos = _eos(eos_token_id, self.device)
        self.pad = pad_token_id if pad_token_id is not None else int(self.eos[0]) if self.eos is not None else 0
        self.max_length = prompts.shape[1] + max_new_tokens
        self.drop_finished = drop_finished
        self.start_rows = torch.arange(prompts.shape[0], device=self.device)
        self.rows = self.start_rows  # the prompt of each row of the next step
        self.unfinished = torch.ones(prompts.shape[0], dtype=torch.bool, device=self.device)
        self._sequences = prompts.clone()

    @property
    def sequences(self) -> Tensor:
        return self._sequences

    def choose(self, logits: Tensor) -> tuple[Tensor, Tensor, bool]:
        scores = _last(logits, self.device)
        if scores.shape[0] != self.rows.numel():
            raise ValueError(f"choose got the logits of {scores.shape[0]} rows; {self.rows.numel()} go on")
        going = self.unfinished[self.rows]
        tokens = torch.where(going, self._pick(scores), self.pad)  # a finished row's is the pad
        column = torch.full((self._sequences.shape[0],), self.pad, dtype=torch.long, device=self.device)
        column[self.rows] = tokens
        self._sequences = torch.cat([self._sequences, column[:, None]], dim=1)
        if self.eos is not None:
            going &= ~torch.isin(tokens, self.eos)
        if self._sequences.shape[1] >= self.max_length:
            going[:] = False
        self.unfinished[self.rows] = going
        if not bool(going.any()):
            return tokens[:0], going.nonzero().squeeze(1), True
        keep = going.nonzero().squeeze(1) if self.drop_finished else torch.arange(going.numel(), device=self.device)
        self.rows = self.rows[keep]
        return tokens[keep], keep, False

    def _pick(self, scores: Tensor) -> Tensor:
        return scores.argmax(dim=-1)  # (pad_token_id not masked: see the module docstring)


class Sample(Greedy):
    """A token drawn from the softmax of the logits after ``generate``'s warpers, in its order:
    ``temperature``, ``top_k`` (generate's default 50; 0 or None: off), ``top_p`` (1.0: off).
    Draws from ``generator``, or the global generator as ``generate`` does (the same
    ``torch.manual_seed`` gives the same tokens) — or, with ``row_seeds`` (one per prompt), each
    prompt from a generator of its own, so that its tokens do not depend on which prompts share its
    group (how a pipeline splits them)."""

    def __init__(
        self,
        prompts: Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        temperature: float = 1.0,
        top_k: int | None = 50,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        drop_finished: bool = False,
        row_seeds: Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            prompts, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
            drop_finished=drop_finished,
        )  # fmt: skip
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (temperature: {temperature!r})")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"top_k must be a non-negative int or None (top_k: {top_k!r})")
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (top_p: {top_p!r})")
        self.temperature, self.top_k, self.top_p, self.generator = temperature, top_k, top_p, generator
        self.row_generators: list[torch.Generator] | None = None
        if row_seeds is not None:
            if len(row_seeds) != prompts.shape[0]:
                raise ValueError(f"row_seeds has {len(row_seeds)} seeds for {prompts.shape[0]} prompts")
            self.row_generators = [torch.Generator(self.device).manual_seed(int(s)) for s in row_seeds]

    def _pick(self, scores: Tensor) -> Tensor:
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k:
            k = min(self.top_k, scores.shape[-1])
            scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1:], -float("inf"))
        if self.top_p < 1.0:
            ranked, order = torch.sort(scores, descending=False)
            outside = ranked.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            outside[..., -1:] = False  # the most likely token stays
            scores = scores.masked_fill(outside.scatter(1, order, outside), -float("inf"))
        probs = scores.softmax(dim=-1)
        if self.row_generators is not None:  # each prompt's own stream: one draw per step while it runs
            gens = self.row_generators
            picks = [torch.multinomial(probs[i], 1, generator=gens[int(r)]) for i, r in enumerate(self.rows.tolist())]
            return torch.cat(picks)
        # A draw for every row of the group, gone ones too (uniform there): generate's draws.
        probabilities = torch.ones(self._sequences.shape[0], scores.shape[-1], device=self.device)
        probabilities[self.rows] = probs
        drawn = torch.multinomial(probabilities, num_samples=1, generator=self.generator).squeeze(1)
        return drawn[self.rows]


def _gather(t: Tensor, index: Tensor) -> Tensor:
    """``t[b, index[b, j]]`` along dim 1, for ``t`` of 2 or 3 dimensions."""
    while index.dim() < t.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(t, index, dim=1)


class Beam:
    """Beam search as ``generate(do_sample=False, num_beams=N)`` runs it: per prompt the ``N``
    best hypotheses by summed log-probability; a hypothesis ending in ``eos_token_id`` (or at
    ``max_new_tokens``) is finished and scored by that sum over ``generated length **
    length_penalty``; the ``N`` best finished ones are kept. A prompt is done when no running
    hypothesis can beat its worst finished one (``early_stopping=False``: judged at the current
    length; ``"never"``: at the longest), or when ``N`` are finished (``early_stopping=True``). The
    search keeps ``generate``'s tensors and arithmetic; with ``drop_finished``, a done prompt's rows
    leave. ``sequences``: the ``num_return_sequences`` best finished hypotheses of each prompt, in
    order."""

    def __init__(
        self,
        prompts: Tensor,
        *,
        num_beams: int,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_return_sequences: int = 1,
        drop_finished: bool = False,
    ) -> None:
        _check(prompts, max_new_tokens)
        if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 2:
            raise ValueError(f"num_beams must be an int of 2 or more; Greedy is one beam (num_beams: {num_beams!r})")
        if not 1 <= num_return_sequences <= num_beams:
            raise ValueError(
                f"num_return_sequences must be between 1 and num_beams {num_beams} "
                f"(num_return_sequences: {num_return_sequences!r})"
            )
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping is True, False or 'never' (early_stopping: {early_stopping!r})")
        device = self.device = prompts.device
        self.beams, self.length_penalty, self.early_stopping = num_beams, float(length_penalty), early_stopping
        self.returned, self.drop_finished = num_return_sequences, drop_finished
        self.eos = _eos(eos_token_id, device)
        batch, self.prompt_length = prompts.shape
        self.max_length = self.prompt_length + max_new_tokens
        self.length = self.prompt_length
        # generate's fill for the unused places: pad_token_id (eos where it is unset or 0), -1 without eos
        fill = -1 if self.eos is None else pad_token_id if pad_token_id else int(self.eos[0])
        self.keep = max(2, 1 + (self.eos.numel() if self.eos is not None else 0)) * num_beams
        self.top = torch.arange(self.keep, device=device) < num_beams
        self.start_rows = torch.arange(batch, device=device).repeat_interleave(num_beams)
        self.active = torch.arange(batch, device=device)  # the prompts still searching
        shape = (batch, num_beams)
        self.running = torch.full((*shape, self.max_length), fill, dtype=torch.long, device=device)
        self.running[:, :, : self.prompt_length] = prompts[:, None, :]
        self.finished = self.running.clone()  # the best finished hypotheses
        self.running_scores = torch.zeros(shape, device=device)
        self.running_scores[:, 1:] = -1e9  # only the first beam's continuations count at first
        self.finished_scores = torch.full(shape, -1e9, device=device)
        self.running_sources = torch.full((*shape, max_new_tokens), -1, dtype=torch.int32, device=device)
        self.finished_sources = self.running_sources.clone()
        self.is_finished = torch.zeros(shape, dtype=torch.bool, device=device)
        self.improvable = torch.ones((batch, 1), dtype=torch.bool, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)  # prompts whose search is over

    @property
    def sequences(self) -> Tensor:
        rows = self.finished.shape[0] * self.returned
        sequences = self.finished[:, : self.returned].reshape(rows, -1)
        generated = int((self.finished_sources[:, : self.returned].reshape(rows, -1) + 1).bool().sum(dim=1).max())
        return sequences[:, : self.prompt_length + generated]

    def choose(self, logits: Tensor) -> tuple[Tensor, Tensor, bool]:
        active, n, length = self.active, self.beams, self.length
        scores = _last(logits, self.device)
        if scores.shape[0] != active.numel() * n:
            raise ValueError(f"choose got the logits of {scores.shape[0]} rows; {active.numel() * n} go on")
        vocab = scores.shape[-1]
        # (pad_token_id not masked, as generate does not: see the module docstring)
        log_probs = torch.log_softmax(scores, dim=-1).view(-1, n, vocab) + self.running_scores[active][:, :, None]
        # the best continuations of all the prompt's beams, twice as many as go on (some may finish)
        top_scores, top_index = torch.topk(log_probs.reshape(-1, n * vocab), k=self.keep)
        source, token = top_index // vocab, top_index % vocab
        candidates = _gather(self.running[active], source)
        candidates[:, :, length] = token
        sources = _gather(self.running_sources[active], source)
        sources[:, :, length - self.prompt_length] = (source + active[:, None] * n).to(torch.int32)
        hits = torch.full_like(token, length + 1 >= self.max_length, dtype=torch.bool)
        if self.eos is not None:
            hits |= torch.isin(token, self.eos)
        # the running beams of the next step: the best candidates that did not finish
        going_scores = top_scores + hits.to(torch.float32) * -1.0e9
        going = torch.topk(going_scores, k=n)[1]
        self.running[active] = _gather(candidates, going)
        self.running_scores[active] = _gather(going_scores, going)
        self.running_sources[active] = _gather(sources, going)
        self._finish(active, candidates, top_scores, sources, hits)
        self.length = length = length + 1
        self.improvable[active] = self._improvable(active)
        done = ~self.improvable[active, 0]
        if self.early_stopping is True:
            done |= self.is_finished[active].all(dim=1)
        self.done[active] = done
        if bool(hits.all()) or bool(self.done.all()):  # no continuation at all (max_new_tokens), or all done
            self.active = active[:0]
            return token[:0, 0], token[:0, 0], True
        staying = ~done if self.drop_finished else torch.ones_like(done)
        rows = (torch.arange(active.numel(), device=self.device)[:, None] * n + _gather(source, going))[staying]
        self.active = active[staying]
        tokens = self.running[self.active][:, :, length - 1]
        return tokens.reshape(-1), rows.reshape(-1), False

    def _finish(self, active: Tensor, candidates: Tensor, scores: Tensor, sources: Tensor, hits: Tensor) -> None:
        """Keep the best finished hypotheses: the finished among the top ``num_beams`` candidates,
        length-penalized, where they beat the kept ones (and the prompt can still improve)."""
        just = hits & self.top[None, :]
        scores = scores / ((self.length + 1 - self.prompt_length) ** self.length_penalty)
        full = self.is_finished[active].all(dim=-1, keepdim=True) & (self.early_stopping is True)
        scores = scores + full.to(torch.float32) * -1.0e9
        scores = scores + (~self.improvable[active]).to(torch.float32) * -1.0e9
        scores = scores + (~just) * -1.0e9
        merged = torch.cat((self.finished_scores[active], scores), dim=1)
        best = torch.topk(merged, k=self.beams)[1]
        self.finished[active] = _gather(torch.cat((self.finished[active], candidates), dim=1), best)
        self.finished_scores[active] = _gather(merged, best)
        self.finished_sources[active] = _gather(torch.cat((self.finished_sources[active], sources), dim=1), best)
        self.is_finished[active] = _gather(torch.cat((self.is_finished[active], just), dim=1), best)

    def _improvable(self, active: Tensor) -> Tensor:
        """Whether a running hypothesis may still beat the worst finished one, per prompt:
        generate's heuristic, the best running score at the current length (at the longest for
        ``early_stopping="never"`` with a positive length penalty)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            longest = self.max_length - self.prompt_length
        else:
            longest = self.length - self.prompt_length
        best = self.running_scores[active][:, :1] / (longest**self.length_penalty)
        finished_scores = self.finished_scores[active]
        worst = torch.where(self.is_finished[active], finished_scores.min(dim=1, keepdim=True)[0], -1.0e9)
        improvable: Tensor = self.improvable[active] & (best > worst).any(dim=-1, keepdim=True)
        return improvable
