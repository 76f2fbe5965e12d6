"""Evaluation of a pipeline on held-out data: the loss, and for translation BLEU per language pair.

:func:`evaluate` is what ``gpipe train`` runs every ``--eval-every`` steps:

- any data set: the mean loss over ``batches`` held-out batches (and the accuracy, for images);
- a :class:`~gpipe.data.TranslationDataset` (several language pairs, each with held-out sentences):
  per pair, the token-mean loss of its held-out sentences and the BLEU (sacrebleu's corpus BLEU,
  its default 13a tokenization) of their translations, decoded through the pipeline's stages —
  greedy, or beam search with ``beam`` > 1 (:mod:`gpipe.decode`). Averages: ``eval_loss`` and
  ``bleu`` over all pairs (each pair counts once, as in the paper's plots), ``bleu/high`` and
  ``bleu/low`` over the high- and low-resource halves (:func:`resource_groups`).

- with ``cross_entropy`` (a causal LM's loss without label smoothing): ``eval_perplexity``, the
  exponential of its token mean over the same held-out batches;
- a causal LM's data (:class:`Prompted`) through a pipeline that generates (built from
  :func:`gpipe.generation.traced.cached_layers`): ``sample``, a held-out prompt and its greedy
  continuation of at most :data:`SAMPLE_TOKENS` tokens, as text (``prompt → continuation``): one
  short generation, a few pipeline steps.

Metric names are those of ``OUT/metrics.jsonl`` and TensorBoard: ``eval_loss``,
``eval_loss/<pair>``, ``bleu``, ``bleu/<pair>``, ``bleu/high``, ``bleu/low``, ``eval_perplexity``,
``sample`` (text).

Under torch.distributed every rank of the pipeline calls it alike and gets the same numbers: the
last stage's rank computes the losses and chooses the tokens, and shares them. With data parallelism
(``Pipeline(data_parallel=d)``) each replica computes the losses of its share of every held-out batch
and the sums are added up over the replicas, so the numbers are those of one replica of the whole
batch (up to float rounding); BLEU and the sample are left out (:func:`decoding_left_out`), as
decoding does not run on replicas of a pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.data import PAD, Dataset, HeldOut, TranslationDataset, ignore_index
from gpipe.decode import Chunk, decode_batches
from gpipe.microbatch import scatter
from gpipe.pipeline import Pipeline
from gpipe.schedule import min_groups

__all__ = [
    "SAMPLE_TOKENS",
    "Prompted",
    "bleu",
    "decoding_left_out",
    "evaluate",
    "resource_groups",
    "sample",
    "translate_held_out",
    "translation_chunk",
]

Loss = Callable[..., Tensor]

SAMPLE_TOKENS = 10
"""The most new tokens of an evaluation's sample generation."""


@runtime_checkable
class Prompted(Protocol):
    """A causal LM's data set, as an evaluation's sample needs it: a held-out prompt, and ids as text."""

    def sample_prompt(self) -> list[int]: ...

    def text(self, ids: Sequence[int]) -> str: ...


def resource_groups(sizes: Mapping[str, int]) -> dict[str, str]:
    """Each pair's group: ``'high'`` for the larger half of the pairs by training sentences (the
    middle one of an odd count too), ``'low'`` for the rest; ties go by name. One pair is high."""
    ranked = sorted(sizes, key=lambda name: (-sizes[name], name))
    high = math.ceil(len(ranked) / 2)
    return {name: "high" if i < high else "low" for i, name in enumerate(ranked)}


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (0 to 100) of ``hypotheses`` against one reference each, by sacrebleu."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def translation_chunk(source: Tensor, start: Tensor, *, max_len: int) -> Chunk:
    """Sentences to translate together, with their length limit: at most twice the longest source's
    tokens + 10, and at most ``max_len``, so that a sentence that never says EOS costs a bounded
    number of steps."""
    return Chunk(source, start, min(max_len, 2 * int((source != PAD).sum(1).max()) + 10))


def translate_held_out(
    model: Any,
    held: HeldOut,
    detokenize: Callable[[list[int]], str],
    *,
    batch: int,
    max_len: int,
    beam: int = 1,
    length_penalty: float = 0.6,
) -> list[str]:
    """The translations of ``held``'s sentences as text, ``batch`` at a time, limited as
    :func:`translation_chunk` says (a stream of batches: :func:`gpipe.decode.decode_batches`)."""
    chunks = [
        translation_chunk(held.source[first : first + batch], held.start[first : first + batch], max_len=max_len)
        for first in range(0, len(held), batch)
    ]
    texts: list[str] = []
    for ids in decode_batches(model, chunks, beam=beam, length_penalty=length_penalty):
        texts += [detokenize(row) for row in ids.tolist()]
    return texts


@torch.no_grad()
def evaluate(
    pipe: Pipeline,
    data: Dataset,
    loss_fn: Loss,
    *,
    batch: int,
    batches: int = 4,
    beam: int = 1,
    length_penalty: float = 0.6,
    cross_entropy: Loss | None = None,
) -> dict[str, float | str]:
    """The held-out metrics of ``pipe`` on ``data`` (see the module's docstring). ``loss_fn(logits,
    target, reduction=...)``: the training loss; ``batch``: sentences or images per forward;
    ``cross_entropy``: a causal LM's loss without label smoothing, alike (``eval_perplexity``)."""
    pipe.eval()
    decodes = decoding_left_out(pipe, data) is None
    try:
        if isinstance(data, TranslationDataset):
            return {
                **_translation(
                    pipe, data, loss_fn, batch=batch, beam=beam, length_penalty=length_penalty, decodes=decodes
                )
            }
        result: dict[str, float | str] = {
            **_batches(pipe, data, loss_fn, batch=batch, batches=batches, cross_entropy=cross_entropy)
        }
        if isinstance(data, Prompted) and pipe.generation is not None and decodes:
            result["sample"] = sample(pipe, data)
        return result
    finally:
        pipe.train()


def decoding_left_out(pipe: Pipeline, data: Dataset) -> str | None:
    """What :func:`evaluate` leaves out of ``pipe``'s evaluations on ``data`` (``'BLEU'``, ``'sample
    generation'``), or None: with data parallelism it does not decode, as ``gpipe.decode`` and
    ``Pipeline.generate`` refuse replicas of a pipeline."""
    if pipe.data_parallel == 1 and pipe.tensor_parallel == 1:
        return None
    if isinstance(data, TranslationDataset):
        return "BLEU"
    if isinstance(data, Prompted) and pipe.generation is not None:
        return "sample generation"
    return None


def _share(pipe: Pipeline, value: Tensor) -> Tensor:
    """This replica's rows of ``value``: what ``pipe(inputs)`` returns the outputs of (all of them
    without data parallelism), split as the pipeline splits a batch among its replicas."""
    if pipe.data_parallel == 1:
        return value
    rows: Tensor = scatter(value, pipe.data_parallel)[pipe.dp_rank].value
    return rows


def _shareable(pipe: Pipeline, inputs: Any, target: Tensor, ignore: int) -> tuple[Any, Tensor]:
    """``inputs`` and ``target`` (rows of a held-out batch) with rows added, copies of the first
    whose targets are all ``ignore`` (they count for nothing), where the replicas would otherwise not
    get one share each (fewer rows than replicas, or 5 rows over 4 replicas: 3 shares)."""
    d, rows = pipe.data_parallel, target.size(0)
    if len(scatter(target, d)) == d:
        return inputs, target
    extra = math.ceil(rows / d) * d - rows

    def grow(t: Tensor) -> Tensor:
        return torch.cat([t, t[:1].expand(extra, *t.shape[1:])])

    if isinstance(inputs, dict):  # (packed rows: their ids and positions)
        grown: Any = {k: grow(t) for k, t in inputs.items()}
    else:
        grown = tuple(grow(t) for t in inputs) if isinstance(inputs, tuple) else grow(inputs)
    return grown, torch.cat([target, target.new_full((extra, *target.shape[1:]), ignore)])


def _summed(pipe: Pipeline, value: Tensor | None, shape: tuple[int, ...]) -> Tensor:
    """Sums (float, of ``shape``) known where each replica's last stage runs (``None`` elsewhere),
    added up over the data-parallel replicas, on every rank (float64 with replicas)."""
    shared = pipe.from_last_stage(value, shape)  # this replica's, on each of its ranks
    if pipe.data_parallel == 1:
        return shared
    total = shared.double()
    dist.all_reduce(total)  # over all ranks: each replica's sums once per rank it has, as many for each
    return total / (dist.get_world_size() // pipe.data_parallel)


def _batches(
    pipe: Pipeline, data: Dataset, loss_fn: Loss, *, batch: int, batches: int, cross_entropy: Loss | None
) -> dict[str, float]:
    if pipe.data_parallel > 1:
        return _replicated_batches(pipe, data, loss_fn, batch=batch, batches=batches, cross_entropy=cross_entropy)
    images = data.unit == "images"
    losses, correct = [], []
    total, tokens = torch.zeros((), dtype=torch.float64), 0  # cross_entropy's sum and its tokens
    for i in range(batches):
        held = data.batch(batch, i, split="eval")
        logits = pipe(held.inputs)  # on the last stage's rank only, under torch.distributed
        if logits is not None:
            losses.append(loss_fn(logits, held.target))
            if images:
                correct.append((logits.argmax(-1) == held.target).float().mean())
            if cross_entropy is not None:
                total += cross_entropy(logits, held.target, reduction="sum").detach().double().cpu()
                tokens += int((held.target != ignore_index(data)).sum())
    result = {"eval_loss": float(pipe.from_last_stage(torch.stack(losses).mean() if losses else None))}
    if images:
        result["eval_accuracy"] = float(pipe.from_last_stage(torch.stack(correct).mean() if correct else None))
    if cross_entropy is not None:
        mean = pipe.from_last_stage((total / max(tokens, 1)).float() if losses else None)  # (float32 on all ranks)
        result["eval_perplexity"] = math.exp(float(mean))
    return result


def _replicated_batches(
    pipe: Pipeline, data: Dataset, loss_fn: Loss, *, batch: int, batches: int, cross_entropy: Loss | None
) -> dict[str, float]:
    """:func:`_batches`'s metrics with replicas: per batch, each replica's loss sum, items (tokens
    that are not padding, or images), correct images and cross-entropy sum, added up over the
    replicas; a batch's loss is then its item mean, as one replica of the whole batch computes it."""
    images = data.unit == "images"
    ignore = ignore_index(data)  # (the training loss's)
    rows: list[Tensor] = []
    for i in range(batches):
        held = data.batch(batch, i, split="eval")
        inputs, target = _shareable(pipe, held.inputs, held.target, ignore)
        logits = pipe(inputs)  # this replica's rows, on its last stage's rank
        if logits is not None:
            target = _share(pipe, target)
            counted = target != ignore
            zero = torch.zeros(())
            rows.append(torch.stack([
                loss_fn(logits, target, reduction="sum").detach().float().cpu(),
                counted.sum().float().cpu(),
                ((logits.argmax(-1) == target) & counted).sum().float().cpu() if images else zero,
                cross_entropy(logits, target, reduction="sum").detach().float().cpu() if cross_entropy else zero,
            ]))  # fmt: skip
    sums = _summed(pipe, torch.stack(rows) if rows else None, (batches, 4))
    items = sums[:, 1].clamp(min=1)
    result = {"eval_loss": float((sums[:, 0] / items).mean())}
    if images:
        result["eval_accuracy"] = float((sums[:, 2] / items).mean())
    if cross_entropy is not None:
        result["eval_perplexity"] = math.exp(float(sums[:, 3].sum() / items.sum()))
    return result


def sample(pipe: Pipeline, data: Prompted, *, max_new_tokens: int = SAMPLE_TOKENS) -> str:
    """``data``'s held-out prompt and the pipeline's greedy continuation (up to its end-of-sequence
    token, at most ``max_new_tokens`` and the model's positions), as ``"prompt → continuation"``.
    The pipeline is in evaluation mode and built from ``cached_layers``; every rank calls it alike."""
    generation = pipe.generation
    if generation is None:
        raise ValueError("the pipeline cannot generate: build it from gpipe.generation.traced.cached_layers(model)")
    prompt = data.sample_prompt()
    most = generation.max_positions
    new = max_new_tokens if most is None else min(max_new_tokens, most - len(prompt))
    if new < 1:
        return f"{data.text(prompt)} → (no positions left to generate)"
    # (as many copies of the prompt as groups a placement needs in flight: one, or more where workers
    # hold several stages, as on a V; every copy continues alike)
    copies = min_groups(pipe.engine.placement.worker_of)
    ids = pipe.generate(torch.tensor([prompt] * copies), max_new_tokens=new)[0, len(prompt) :].tolist()
    eos = generation.eos_token_id
    ends = {eos} if isinstance(eos, int) else set(eos or ())
    cut = next((i for i, token in enumerate(ids) if token in ends), len(ids))
    return f"{data.text(prompt)} → {data.text(ids[:cut])}"


def _translation(
    pipe: Pipeline,
    data: TranslationDataset,
    loss_fn: Loss,
    *,
    batch: int,
    beam: int,
    length_penalty: float,
    decodes: bool = True,
) -> dict[str, float]:
    sets = data.held_out()
    names = sorted(sets)
    sums: list[Tensor] = []  # per pair: the loss summed over its tokens, and the tokens, on the last stage's rank
    last = False
    for name in names:
        held = sets[name]
        total, tokens = torch.zeros(()), 0
        for first in range(0, len(held), batch):
            rows = slice(first, first + batch)
            inputs, target = _shareable(pipe, (held.source[rows], held.target_in[rows]), held.target_out[rows], PAD)
            logits = pipe(inputs)
            if logits is not None:  # (the last stage's rank)
                last = True
                target = _share(pipe, target)
                total += loss_fn(logits, target, reduction="sum").float()
                tokens += int((target != PAD).sum())
        sums.append(torch.stack([total, torch.tensor(float(tokens))]))
    shared = _summed(pipe, torch.stack(sums) if last else None, (len(names), 2))
    means = (shared[:, 0] / shared[:, 1].clamp(min=1)).float()  # (float32: one process's division, bitwise)
    result: dict[str, float] = {}
    groups = resource_groups(data.pair_sizes)
    scores: dict[str, float] = {}
    for i, name in enumerate(names):
        result[f"eval_loss/{name}"] = float(means[i])
        if not decodes:
            continue
        held = sets[name]
        hypotheses = translate_held_out(
            pipe, held, data.detokenize, batch=batch, max_len=data.length, beam=beam, length_penalty=length_penalty
        )
        scores[name] = result[f"bleu/{name}"] = bleu(hypotheses, list(held.references))
    result["eval_loss"] = sum(result[f"eval_loss/{n}"] for n in names) / len(names)
    if not scores:
        return result
    result["bleu"] = sum(scores.values()) / len(scores)
    for group in ("high", "low"):
        members = [scores[n] for n in names if groups.get(n) == group]
        if members:
            result[f"bleu/{group}"] = sum(members) / len(members)
    return result
