"""Memory, the paper's Table 1: activation memory per stage against the O(N + L/K·N/M) model, and
the largest Transformer that fits a per-stage memory budget, naive and pipelined.

The model of a stage's memory: 12 bytes per parameter (weights, gradients and RMSProp's one
accumulator, as the paper counts) plus activations —

- without re-materialization (naive training, or ``checkpoint='never'``): every layer keeps its
  activations for the whole mini-batch, Σ a_l(N);
- with re-materialization: the stage keeps its input for all M micro-batches, in(N), plus the
  activations of one micro-batch being re-computed, Σ a_l(N/M)  — the paper's O(N + L/K·N/M).

a_l(n) = f_l + n·s_l is measured: the bytes autograd saves in layer l's forward on one and on two
samples (``ActivationMeter``); f_l, what does not grow with the batch, is under autocast the
low-precision copies of the weights that the matmuls keep. The largest model is the largest number of
Transformer blocks (decoder-only, embedding on the first stage, output on the last) with every stage
under the budget. *Measured*: that model is built and a real ``Pipeline`` step records each stage's
peak activation bytes. *Projected*: the same model of memory for the paper's Transformer-L on 16 GB,
from a_l measured on one and two sentences of the real layer, with its activations in fp32 and in
bf16 (autocast; the weights, their gradients and the optimizer's state stay fp32: the 12 bytes per
parameter). Its sizes (model dim 2048, feed-forward 8192, 32 heads, vocabulary 32k, 1024 tokens,
batch 32, M), and the paper's layers and parameters of each Table 1 column, are those of the paper's
configurations ``configs/transformer-l-*.toml`` (:func:`paper_transformer_l`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpipe.balance import layer_memory
from gpipe.bench.common import Bench, Section, token_loss
from gpipe.models import transformer_lm
from gpipe.pipeline import Pipeline
from gpipe.train import paper

__all__ = ["MemoryModel", "PaperRows", "paper_transformer_l", "run"]

BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class PaperRows:
    """Table 1's Transformer-L from the paper's configurations: ``sizes`` (the model's dim, feed-forward,
    heads, vocabulary and sequence length, as its transformers config names them, with the batch and
    the pipelines' M) and, by column (``"pipeline-8"``), the paper's layers and parameter count."""

    sizes: dict[str, int]
    rows: dict[str, tuple[int, str]]


def paper_transformer_l() -> PaperRows:
    """The Table 1 rows of ``configs/`` (``--model hf`` files with a ``column``): one model, its depth
    per column; a file whose sizes differ from the others' is refused."""
    sizes: dict[str, int] = {}
    rows: dict[str, tuple[int, str]] = {}
    for name in paper.names():
        config = paper.read(name)
        if config.settings.get("model") != "hf" or not config.column:
            continue
        hf = config.hf_settings()
        these = {k: int(hf[k]) for k in ("n_embd", "n_inner", "n_head", "vocab_size", "n_positions")}
        these["batch"] = int(config.settings["batch"])
        if config.settings.get("checkpoint") != "never":  # (naive training runs the batch whole: M=1)
            these["chunks"] = int(config.settings["chunks"])
        if any(sizes.get(k, v) != v for k, v in these.items()):
            raise ValueError(f"the paper's configuration {name!r} sizes Transformer-L {these}, the others {sizes}")
        sizes |= these
        rows[config.column.lower()] = (int(hf["n_layer"]), config.parameters)
    return PaperRows(sizes, rows)


@dataclass(frozen=True)
class MemoryModel:
    """Per-layer parameters and activation bytes of a decoder-only Transformer: embedding, block,
    output; activation bytes per sample (``per_sample``) and per layer whatever the batch (``fixed``);
    ``boundary``: bytes of a block's input per sample."""

    params: tuple[int, int, int]
    per_sample: tuple[float, float, float]
    boundary: float
    token_bytes: float
    fixed: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @classmethod
    def measure(cls, build: Any, sample: torch.Tensor, precision: str = "fp32") -> MemoryModel:
        """From a one-block model (``build(1)``) run on the first one and two sequences of ``sample``,
        under bf16 autocast with ``precision='bf16'``."""
        model = build(1)
        seq = sample.size(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            one, two = (layer_memory(model, sample[:n], param_scale=0.0) for n in (1, 2))
        params = tuple(sum(p.numel() for p in layer.parameters()) for layer in model)
        dim = model[0].tokens.embedding_dim
        per_sample = tuple(b - a for a, b in zip(one, two))
        fixed = tuple(max(a - s, 0.0) for a, s in zip(one, per_sample))
        width = 2.0 if precision == "bf16" else 4.0
        return cls(params, per_sample, seq * dim * width, seq * 8.0, fixed)  # type: ignore[arg-type]

    def parameters(self, blocks: int) -> int:
        """The parameters of a model of ``blocks`` blocks."""
        return self.params[0] + blocks * self.params[1] + self.params[2]

    def stages(self, blocks: int, partitions: int) -> list[list[int]]:
        """The layer kinds (0 embedding, 1 block, 2 output) of each stage: blocks spread evenly."""
        base, extra = divmod(blocks, partitions)
        stages = [[1] * (base + (k < extra)) for k in range(partitions)]
        stages[0].insert(0, 0)
        stages[-1].append(2)
        return stages

    def stage_bytes(
        self, blocks: int, partitions: int, batch: int, chunks: int, remat: bool
    ) -> list[tuple[float, float]]:
        """(parameter bytes, activation bytes) of every stage."""
        out = []
        for k, kinds in enumerate(self.stages(blocks, partitions)):
            params = BYTES_PER_PARAM * sum(self.params[i] for i in kinds)
            fixed = sum(self.fixed[i] for i in kinds)
            if remat:
                kept = batch * (self.token_bytes if k == 0 else self.boundary)
                acts = fixed + kept + sum(self.per_sample[i] for i in kinds) * batch / chunks
            else:
                acts = fixed + sum(self.per_sample[i] for i in kinds) * batch
            out.append((float(params), acts))
        return out

    def largest(
        self, budget: float, partitions: int, batch: int, chunks: int, remat: bool, limit: int = 100_000
    ) -> int:
        """The most blocks whose every stage fits ``budget`` bytes (0: not even one per stage)."""

        def fits(blocks: int) -> bool:
            return all(p + a <= budget for p, a in self.stage_bytes(blocks, partitions, batch, chunks, remat))

        if not fits(partitions):
            return 0
        lo, hi = partitions, partitions
        while hi < limit and fits(hi * 2):
            hi *= 2
        hi = min(hi * 2, limit)
        while lo < hi:  # the largest that fits, in [lo, hi]
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo


CONFIGS = [("naive-1", 1, False), ("pipeline-1", 1, True), ("pipeline-2", 2, True), ("pipeline-4", 4, True),
           ("pipeline-8", 8, True)]  # fmt: skip


def _measured_peaks(build: Any, blocks: int, model: MemoryModel, partitions: int, sample: torch.Tensor, chunks: int,
                    remat: bool, devices: Sequence[torch.device] | None = None) -> list[float]:  # fmt: skip
    """Each stage's peak activation bytes in a real step of the model with ``blocks`` blocks, on ``devices``
    (default: the CPU)."""
    torch.manual_seed(0)
    lm: nn.Sequential = build(blocks)
    balance = [len(kinds) for kinds in model.stages(blocks, partitions)]
    placed = list(devices or [torch.device("cpu")] * partitions)
    pipe = Pipeline(lm, balance, chunks=chunks, loss_fn=token_loss, checkpoint="always" if remat else "never",
                    devices=placed, cpu_threads=1, measure_memory=True)  # fmt: skip
    pipe.step(sample, sample)
    assert pipe.last_trace is not None and pipe.last_trace.peak_activation_bytes is not None
    return [float(b) for b in pipe.last_trace.peak_activation_bytes]


def run(bench: Bench, out: Path) -> Section:
    mib = 2.0**20
    batch, seq, chunks = 32, 32, 8

    def small(blocks: int) -> nn.Sequential:
        return transformer_lm(blocks, 512, 4, dim=128, vocab=256, max_len=seq, dropout=0.1, attention_dropout=0.0)

    sample = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    model = MemoryModel.measure(small, sample[:4])
    budgets = [64 * mib] if bench.quick else [64 * mib, 256 * mib]
    lines = [
        "Per-stage memory = 12 bytes per parameter + activations. Small Transformer LM (dim 128, "
        f"feed-forward 512, 4 heads, vocabulary 256), batch N={batch} sequences of {seq} tokens, "
        f"M={chunks} micro-batches for the pipelines (re-materialization on), naive = one device, no "
        "re-materialization. For each budget: the largest number of blocks the model of memory allows, "
        "then that model built and stepped; *predicted* and *measured* are the largest stage's "
        "activation MiB, *total* the largest stage's measured total (parameters + activations) against "
        "the budget.",
        "",
        "| budget | config | blocks | parameters | activations predicted (MiB) | measured (MiB) | measured / "
        "predicted | total measured (MiB) | fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    data: dict[str, Any] = {"measured": []}
    for budget in budgets:
        for name, k, remat in CONFIGS:
            m = 1 if not remat else chunks
            blocks = model.largest(budget, k, batch, m, remat, limit=4096)
            predicted = model.stage_bytes(blocks, k, batch, m, remat)
            peaks = _measured_peaks(small, blocks, model, k, sample, m, remat, bench.place(k))
            totals = [p + a for (p, _), a in zip(predicted, peaks)]
            worst = max(range(k), key=lambda i: totals[i])
            params = model.parameters(blocks)
            ratio = peaks[worst] / predicted[worst][1]
            lines.append(
                f"| {budget / mib:.0f} MiB | {name} | {blocks} | {params / 1e6:.2f}M | {predicted[worst][1] / mib:.1f} "
                f"| {peaks[worst] / mib:.1f} | {ratio:.2f} | {totals[worst] / mib:.1f} "
                f"| {'yes' if totals[worst] <= budget else 'no'} |"
            )
            data["measured"].append({"budget_mib": budget / mib, "config": name, "blocks": blocks,
                                     "predicted": [a for _, a in predicted], "measured": peaks})  # fmt: skip
        naive = [r for r in data["measured"] if r["budget_mib"] == budget / mib]
        grow = naive[-1]["blocks"] / max(naive[0]["blocks"], 1)
        lines.append(f"| | pipeline-8 / naive-1 | x{grow:.0f} | | | | | | |")
    lines += ["", *_projection(bench, data, paper_transformer_l())]
    return Section("Memory (Table 1)", "\n".join(lines), [], data)


def _projection(bench: Bench, data: dict[str, Any], table: PaperRows) -> list[str]:
    """The paper's Transformer-L on 16 GB, from the real layer's activations on one and two sentences,
    in fp32 and in bf16."""
    size = table.sizes
    seq, batch, chunks, vocab = size["n_positions"], size["batch"], size["chunks"], size["vocab_size"]

    def big(blocks: int) -> nn.Sequential:
        return transformer_lm(blocks, size["n_inner"], size["n_head"], dim=size["n_embd"], vocab=vocab, max_len=seq,
                              dropout=0.1, attention_dropout=0.0)  # fmt: skip

    torch.manual_seed(0)
    sample = torch.randint(0, vocab, (2, seq))
    models = {precision: MemoryModel.measure(big, sample, precision) for precision in ("fp32", "bf16")}
    configs = [("naive-1", 1, False), ("pipeline-1", 1, True), ("pipeline-2", 2, True), ("pipeline-4", 4, True),
               ("pipeline-8", 8, True), ("pipeline-32", 32, True), ("pipeline-128", 128, True)]  # fmt: skip
    budget = 16 * 2.0**30
    fp32, bf16 = models["fp32"], models["bf16"]
    lines = [
        f"Projected: the paper's Transformer-L (configs/transformer-l-*.toml: dim {size['n_embd']}, feed-forward "
        f"{size['n_inner']}, {size['n_head']} heads, vocabulary {vocab}, {seq} tokens, batch {batch}; M={chunks} for "
        "the pipelines) on 16 GB per stage; residual dropout "
        "0.1, none on the attention probabilities (attention then keeps no 1024 x 1024 matrix: "
        "docs/models.md). Measured per sentence: a block keeps "
        f"{fp32.per_sample[1] / 2**20:.0f} MiB in fp32, {bf16.per_sample[1] / 2**20:.0f} MiB in bf16 (and "
        f"{bf16.fixed[1] / 2**20:.0f} MiB of bf16 weight copies whatever the batch); the output layer "
        f"{fp32.per_sample[2] / 2**20:.0f} / {bf16.per_sample[2] / 2**20:.0f} MiB; a block has "
        f"{fp32.params[1] / 1e6:.1f}M parameters (12 bytes each: fp32 weights, gradients, RMSProp's accumulator).",
        "",
        "| config | blocks, fp32 | parameters | blocks, bf16 | parameters | blocks (paper) | parameters (paper) |",
        "|---|---|---|---|---|---|---|",
    ]
    data["projected"], data["projected_bf16"] = {}, {}
    data["paper_blocks"] = {column: layers for column, (layers, _) in table.rows.items()}
    for name, k, remat in configs:
        cells = []
        for key, model in (("projected", fp32), ("projected_bf16", bf16)):
            blocks = model.largest(budget, k, batch, chunks if remat else 1, remat)
            data[key][name] = blocks
            cells.append(f"{blocks} | {model.parameters(blocks) / 1e9:.2f}B")
        layers, params = table.rows.get(name, ("—", "—"))
        lines.append(f"| {name} | {' | '.join(cells)} | {layers} | {params} |")
    return lines
