"""Selective re-materialization against full re-materialization and none (issue 27, item 3).

A training step of gpipe's Transformer LM (4 blocks, dim 256, feed-forward 1024, 4 heads of 64,
vocabulary 4096; T = 256 tokens, a batch of 8 sequences in M = 4 micro-batches) on K = 2 'cpu' stages
in one process, one intra-op thread per stage, schedule 1F1B, with residual dropout 0.1 (the model's
default) and without, none on the attention probabilities (``attention_dropout=0``: the fused attention
kernel, as docs/models.md recommends), under four settings of ``checkpoint=``:

- ``'always'``: every micro-batch keeps only its stage input; backward runs the stage's forward again;
- ``Selective(save_ops='matmuls')``: every layer keeps the outputs of its matrix products and attention
  (``addmm``, ``mm``, ``_scaled_dot_product_flash_attention_for_cpu``, ...) and recomputes the rest
  (layer norms, dropout, ReLU, additions, views) in backward;
- ``Selective(layers=DecoderLayer, save_ops='matmuls')``: the same in the blocks only; the embedding
  and the output layer keep their activations (the logits, a vocabulary-sized product, are not kept
  beside the loss's log-softmax);
- ``'never'``: everything kept.

Within each repetition the settings take turns (one pipeline each, built once, the same weights and
batch), so that drifts of the shared machine hit all of them alike; reported per setting the median
[min-max] step time, and per repetition the ratio of each setting's step to full re-materialization's
(median [min-max] of those ratios). Then one step of each with ``measure_memory=True``: the peak
activation bytes per worker (what autograd saves, the kept inputs and outputs, recomputations while
they live; gpipe.memory), outside the timed steps.

Target: the selective step <= 0.9x of full re-materialization's.

Why dropout matters on the CPU: drawing a dropout mask (``bernoulli_``) costs about as much as all
the block's matrix products; the per-operator policy keeps the products, and recomputes the masks (a
kept mask would be an activation as large as what it saves).

Reproduce:  .venv/bin/python benchmarks/selective_checkpoint.py [--repeats 9] [--dropout 0.1 0.0]
                [--json benchmarks/results/selective_checkpoint/results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from gpipe import Pipeline, Selective
from gpipe.models import transformer_lm
from gpipe.models.transformer import DecoderLayer

BLOCKS, DIM, HIDDEN, HEADS, VOCAB, T, BATCH, CHUNKS = 4, 256, 1024, 4, 4096, 256, 8, 4


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def pipeline(checkpoint: Any, dropout: float, **kwargs: Any) -> Pipeline:
    torch.manual_seed(0)
    model = transformer_lm(
        BLOCKS,
        HIDDEN,
        HEADS,
        dim=DIM,
        vocab=VOCAB,
        max_len=T,
        dropout=dropout,
        head_dim=DIM // HEADS,
        attention_dropout=0.0,
    )
    return Pipeline(model, [3, 3], chunks=CHUNKS, loss_fn=lm_loss, schedule="1f1b", checkpoint=checkpoint,
                    devices=["cpu", "cpu"], cpu_threads=1, **kwargs)  # fmt: skip


SETTINGS: dict[str, Any] = {
    "always": "always",
    "selective (matmuls)": Selective(save_ops="matmuls"),
    "matmuls, blocks only": Selective(layers=DecoderLayer, save_ops="matmuls"),
    "never": "never",
}


def timed_step(pipe: Pipeline, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    pipe.zero_grad(set_to_none=True)
    began = time.perf_counter()
    pipe.step(*batch)
    return time.perf_counter() - began


def summary(values: list[float], scale: float = 1000.0, digits: int = 0) -> str:
    med, lo, hi = statistics.median(values) * scale, min(values) * scale, max(values) * scale
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.1, 0.0])
    parser.add_argument("--json", default=None, help="also write the raw numbers to this file")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, VOCAB, (BATCH, T), generator=g), torch.randint(0, VOCAB, (BATCH, T), generator=g)
    print(f"Transformer LM: {BLOCKS} blocks, dim {DIM}, ff {HIDDEN}, {HEADS} heads, vocab {VOCAB}, T {T}, "
          f"batch {BATCH}, M={CHUNKS}, K=2 'cpu' stages (1 thread each), 1F1B; torch {torch.__version__}; "
          f"{args.repeats} repetitions after 2 warm-ups")  # fmt: skip
    results = {f"dropout {p}": measure(p, batch, args.repeats) for p in args.dropout}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


def measure(dropout: float, batch: tuple[torch.Tensor, torch.Tensor], repeats: int) -> dict[str, Any]:
    """The settings side by side at this dropout probability: print and return the numbers."""
    pipes = {name: pipeline(c, dropout) for name, c in SETTINGS.items()}
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for rep in range(repeats + 2):
        order = list(pipes) if rep % 2 == 0 else list(reversed(pipes))  # who goes first alternates
        for name in order:
            took = timed_step(pipes[name], batch)
            if rep >= 2:
                times[name].append(took)
    ratios = {name: [t / a for t, a in zip(times[name], times["always"], strict=True)] for name in times}
    peaks: dict[str, list[int]] = {}
    for name, c in SETTINGS.items():
        pipe = pipeline(c, dropout, measure_memory=True)
        pipe.step(*batch)
        assert pipe.last_trace is not None and pipe.last_trace.peak_activation_bytes is not None
        peaks[name] = list(pipe.last_trace.peak_activation_bytes)
    print(f"\ndropout {dropout}: step time ms, median [min-max]; ratio to 'always' per repetition, "
          "median [min-max]; peak activation MiB per worker (stage 0, stage 1)")  # fmt: skip
    for name in pipes:
        mib = ", ".join(f"{b / 2**20:.1f}" for b in peaks[name])
        print(f"  {name:<22} {summary(times[name]):>16}   {summary(ratios[name], 1, 2):>17}x   {mib}")
    return {"seconds": times, "ratio_to_always": ratios, "peak_bytes": peaks}


if __name__ == "__main__":
    main()
