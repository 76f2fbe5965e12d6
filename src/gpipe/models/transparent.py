"""Transparent attention (Bapna et al., 2018): each decoder layer of the encoder-decoder attends over
its own learned combination of the source embedding and every encoder layer's output, instead of the
last encoder layer's output alone, so that the gradient reaches every encoder layer directly and deep
encoders train. :func:`gpipe.models.transformer` builds it with ``transparent=True``.

With N encoder layers (outputs ``h_1 .. h_N``, ``h_0`` the source embedding) and D decoder layers,
decoder layer j (1-based) attends over ``memory_j = norm(sum_i softmax(w_j)_i h_i)``: ``w`` a (D, N + 1)
parameter, every entry starting at 1 / (N + 1) as in Lingvo's ``WeightedSumLayer`` (uniform weights),
``norm`` the final layer norm that closes the encoder in the plain model (which is the case of ``w_j``
all on ``h_N``). Lingvo's dropout on the weights is left out.

**Across stages.** gpipe cuts the model at any layer boundary, and a parameter must stay in one layer,
so the combination is built from what the layers hand on. Two ways do that:

- (A) a running sum per decoder layer: each encoder layer holds its own D logits and adds
  ``exp(w_ji) h_i`` to D sums (and ``exp(w_ji)`` to D normalizers) that travel with the activations;
  every boundary inside the encoder carries ``h_i`` and the D sums, whatever i is (Lingvo's GPipe
  variant carries a running sum from stage to stage).
- (B) the encoder's outputs carried to the end of the encoder: after encoder layer i a boundary carries
  ``h_0 .. h_i``, i + 1 tensors; the target embedding, which closes the encoder, holds ``w`` and mixes
  them into the D memories.

After the encoder both carry the memories the decoder layers still need: decoder layer j takes
``memory_j`` and hands on the D - j after it. Across the boundary after encoder layer i (0: the source
embedding), (B) sends i + 1 tensors of the source's shape and (A) D + 1 (and D numbers); after the last
encoder layer (A) drops ``h_N`` and sends D, (B) N + 1; across decoder boundaries the two send alike. So
with N = D, (B) sends less across every encoder boundary but that last one (one tensor more there),
and **it is what this module builds**. (Carrying the N + 1 outputs on through the decoder, each decoder
layer mixing its own, would send N + 1 tensors across every decoder boundary instead of D - j.)
Measured by ``benchmarks/transparent.py`` (``benchmarks/results/transparent/report.md``): the bytes a
training step sends across the cuts (forward values and the gradients that come back; cuts by
``balance_by_flops``; 32 sentences of 64 tokens a side, dim 1024, fp32; counted from the tensors the
layers hand on, which equal a count through the pipeline's transport at a small size): T(12) on 4
stages, (B) 0.375 GiB, (A) 0.438 GiB, the plain model 0.078 GiB; T(24) on 8 stages, (B) 1.53 GiB, (A)
1.95 GiB, plain 0.17 GiB. Most of it is transparent attention's own price, either way: the D memories
that cross the decoder's cuts.

The layers wrap the plain model's (the tuples of :mod:`gpipe.models.transformer`, one more entry)::

    (src, tgt) ─ SourceEmbedding ─> (h_0, src_pad, tgt) ─ N x TransparentEncoderLayer ─>
    ─> (h_N, src_pad, tgt, (h_0 .. h_N-1)) ─ TransparentTargetEmbedding ─> ((memory_1 .. memory_D), src_pad, y,
    tgt_pad) ─ D x TransparentDecoderLayer (each takes the first memory) ─> ((), src_pad, y, tgt_pad) ─ Output

Decoding with caches works as for the plain model: a step after the first carries ``None`` for the
source side, which every layer here passes on; each decoder layer keeps the keys and values of its own
memory from the first step. :func:`transparent_weights` reads the softmax weights (``gpipe train
--transparent`` logs them at each evaluation), on every rank of a pipeline under torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from gpipe.distributed.devices import comm_device
from gpipe.distributed.failure import collective
from gpipe.pipeline import Pipeline

__all__ = [
    "TransparentDecoderLayer",
    "TransparentEncoderLayer",
    "TransparentTargetEmbedding",
    "source_names",
    "transparent_attention",
    "transparent_weights",
]

Tuple = tuple[Any, ...]


def _plan_of(layer: nn.Module, tp: int) -> dict[str, ParallelStyle]:
    """The wrapped layer's tensor-parallel plan, its names under ``layer.``."""
    own = getattr(layer, "tensor_parallel_plan", None)
    plan: dict[str, ParallelStyle] = own(tp) if callable(own) else {}
    return {f"layer.{name}": style for name, style in plan.items()}


class TransparentEncoderLayer(nn.Module):
    """An encoder layer that also hands on its input, after the encoder outputs before it:
    ``(h, src_pad, tgt[, earlier])`` -> ``(layer's h, src_pad, tgt, (*earlier, h))``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def tensor_parallel_plan(self, tp: int) -> dict[str, ParallelStyle]:
        return _plan_of(self.layer, tp)

    def forward(self, inputs: Tuple) -> Tuple:
        x, src_pad, tgt, *kept = inputs
        if x is None:  # a decoding step after the first: nothing to encode
            return None, src_pad, tgt, None
        out, src_pad, tgt = self.layer((x, src_pad, tgt))
        earlier = kept[0] if kept else ()
        return out, src_pad, tgt, (*earlier, x)


class TransparentTargetEmbedding(nn.Module):
    """The target embedding that closes the encoder by mixing its ``sources`` outputs into one memory
    per decoder layer (``decoders``): ``(h_N, src_pad, tgt, (h_0 .. h_N-1))`` -> ``((memory_1 ..
    memory_D), src_pad, y, tgt_pad)``. ``logits``: (D, N + 1), softmaxed over the sources."""

    def __init__(self, target: nn.Module, decoders: int, sources: int) -> None:
        super().__init__()
        self.target = target
        self.decoders, self.sources = decoders, sources
        self.logits = nn.Parameter(torch.empty(decoders, sources))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.logits.fill_(1.0 / self.sources)  # Lingvo's start: uniform weights

    def weights(self) -> Tensor:
        """The (D, N + 1) softmax weights: row j, decoder layer j + 1's over the sources."""
        logits = self.logits.full_tensor() if isinstance(self.logits, DTensor) else self.logits
        return torch.softmax(logits.float(), dim=-1)

    def forward(self, inputs: Tuple) -> Tuple:
        x, src_pad, tgt, *kept = inputs
        if x is None:  # a decoding step after the first: the decoder layers keep their memories
            _, src_pad, y, tgt_pad = self.target((None, src_pad, tgt))
            return None, src_pad, y, tgt_pad
        sources = (*(kept[0] if kept else ()), x)
        if len(sources) != self.sources:
            raise ValueError(
                f"the transparent target embedding mixes {self.sources} encoder outputs but was given {len(sources)}: "
                "build the model with transformer(..., transparent=True)"
            )
        stacked = torch.stack(sources)  # (N + 1, B, S, dim)
        mixed = torch.softmax(self.logits, dim=-1).to(stacked.dtype) @ stacked.flatten(1)
        # The final norm normalizes the last dimension: the D memories at once.
        memories, src_pad, y, tgt_pad = self.target((mixed.view(self.decoders, *x.shape), src_pad, tgt))
        return memories.unbind(0), src_pad, y, tgt_pad


class TransparentDecoderLayer(nn.Module):
    """A decoder layer that attends over the first of the memories it is given and hands on the rest:
    ``((memory_j .. memory_D), src_pad, y, tgt_pad)`` -> ``((memory_j+1 .. memory_D), src_pad, y', tgt_pad)``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def tensor_parallel_plan(self, tp: int) -> dict[str, ParallelStyle]:
        return _plan_of(self.layer, tp)

    def forward(self, inputs: Tuple) -> Tuple:
        memories, src_pad, y, tgt_pad = inputs
        if memories is None:  # a decoding step after the first: the memory's keys and values are cached
            return None, src_pad, self.layer((None, src_pad, y, tgt_pad))[2], tgt_pad
        if not memories:
            raise ValueError(
                "a transparent decoder layer was given no memory: the model has more decoder layers than mixes"
            )
        return memories[1:], src_pad, self.layer((memories[0], src_pad, y, tgt_pad))[2], tgt_pad


def transparent_attention(model: nn.Sequential, encoders: int, decoders: int) -> nn.Sequential:
    """The encoder-decoder ``model`` (source embedding, ``encoders`` encoder layers, target embedding,
    ``decoders`` decoder layers, output: :func:`gpipe.models.transformer`'s) with transparent
    attention: its layers wrapped as the module's docstring shows (the same parameters, under
    ``layer.`` / ``target.``, plus the target embedding's ``logits``)."""
    if encoders < 1 or decoders < 1:
        raise ValueError(
            f"transparent attention mixes encoder layers' outputs for decoder layers: give at least one of each "
            f"(encoder layers: {encoders}, decoder layers: {decoders})"
        )
    if len(model) != encoders + decoders + 3:
        raise ValueError(
            f"an encoder-decoder of {encoders} + {decoders} layers has {encoders + decoders + 3} layers "
            f"(embeddings and output included), this one {len(model)}"
        )
    layers = list(model)
    target = encoders + 1
    return nn.Sequential(
        layers[0],
        *[TransparentEncoderLayer(layer) for layer in layers[1:target]],
        TransparentTargetEmbedding(layers[target], decoders, encoders + 1),
        *[TransparentDecoderLayer(layer) for layer in layers[target + 1 : -1]],
        layers[-1],
    )


def source_names(sources: int) -> list[str]:
    """The names of a mix's sources in the metrics: ``emb``, ``enc1`` .. ``enc<N>``."""
    return ["emb", *(f"enc{i}" for i in range(1, sources))]


def transparent_weights(model: Pipeline | nn.Sequential) -> dict[str, float]:
    """The softmax weights of a transparent model (a plain ``nn.Sequential`` or a :class:`Pipeline`) by
    name, ``transparent/dec<j>/<source>`` (j from 1; source ``emb`` or ``enc<i>``, i from 1), rounded
    to 4 digits. Under torch.distributed every rank of the pipeline calls it and gets them all: the
    rank that holds the target embedding shares them (two all-reduces over the pipeline's ranks)."""
    if isinstance(model, Pipeline):
        layers = [layer for p in model.engine.partitions.values() for layer in p]
    else:
        layers = list(model)
    found = [layer for layer in layers if isinstance(layer, TransparentTargetEmbedding)]
    weights = found[0].weights().detach() if found else None
    if isinstance(model, Pipeline) and model.distributed:
        weights = _shared(model, weights)
    if weights is None:
        raise ValueError(
            "transparent_weights: the model has no transparent attention (transformer(..., transparent=True))"
        )
    names = source_names(weights.size(1))
    return {
        f"transparent/dec{j + 1}/{names[i]}": round(float(w), 4)
        for j, row in enumerate(weights.tolist())
        for i, w in enumerate(row)
    }


def _shared(pipe: Pipeline, weights: Tensor | None) -> Tensor | None:
    """``weights``, known on the rank that holds them (``None`` elsewhere), on every rank of the
    pipeline: their shape, then their values, summed over the ranks (the others add zeros)."""
    group = getattr(pipe.engine.comm, "pp_group", None)
    device = comm_device(pipe.engine.devices[0], group)
    shape = torch.tensor(weights.shape if weights is not None else (0, 0), device=device)
    with collective("all-reduce of the transparent attention's weights' shape", group):
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
    rows, cols = (int(n) for n in shape.tolist())
    values = torch.zeros(rows, cols, device=device)
    if weights is not None:
        values.copy_(weights)
    with collective("all-reduce of the transparent attention's weights", group):
        dist.all_reduce(values, group=group)
    return values.cpu() if rows else None
