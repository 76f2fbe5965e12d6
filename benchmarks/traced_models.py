"""Traced models: what ``gpipe.to_sequential`` costs, once and per step, on Hugging Face models.

Reproduce (from the repository root; transformers is in the dev extra)::

    .venv/bin/python benchmarks/traced_models.py --out benchmarks/results/traced

For GPT-2 (12 blocks, dim 256), BERT (12 layers, dim 256, a padding mask, token types, a dict
input) and T5 (6 + 6 blocks, dim 256), each built from its config with random weights:

1. ``trace``: the seconds ``to_sequential`` takes (torch.export, then the cut), median of 3.
2. ``step``: one training step (forward + backward, no optimizer) of ``gpipe.Pipeline`` at K=1
   (``devices=['cpu']``, ``checkpoint='never'``, M micro-batches, ``cpu_threads=1``) of the traced
   layers, against the plain model run on the same M micro-batches (``(loss * n_m / N).backward()``
   each). The same work on both sides, in one intra-op thread (the process runs with
   ``torch.set_num_threads(1)``); the ratio Pipeline / plain is what the traced glue, the cut and
   the engine cost together. Variants take turns within every repetition (machine noise hits both);
   ratio per repetition, median [min-max].
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import gpipe
from gpipe.microbatch import scatter

VOCAB = 1000


def _ids(rows: int, cols: int, seed: int) -> Tensor:
    return torch.randint(1, VOCAB, (rows, cols), generator=torch.Generator().manual_seed(seed))


def cases(batch: int, seq: int) -> dict[str, tuple[Callable[[], nn.Module], Any, Tensor, Callable[..., Tensor]]]:
    import transformers

    def token_loss(out: Any, y: Tensor) -> Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    def class_loss(out: Any, y: Tensor) -> Tensor:
        return F.cross_entropy(out.logits, y)

    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[::2, seq // 2 :] = 0
    types = torch.zeros(batch, seq, dtype=torch.long)
    types[:, seq // 2 :] = 1

    def gpt2() -> nn.Module:
        config = transformers.GPT2Config(
            n_layer=12, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=seq, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(config)

    def bert() -> nn.Module:
        config = transformers.BertConfig(
            num_hidden_layers=12,
            hidden_size=256,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=VOCAB,
            max_position_embeddings=seq,
            num_labels=4,
        )
        return transformers.BertForSequenceClassification(config)

    def t5() -> nn.Module:
        config = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=256,
            d_kv=64,
            d_ff=1024,
            num_layers=6,
            num_decoder_layers=6,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        return transformers.T5ForConditionalGeneration(config)

    ids = _ids(batch, seq, 1)
    return {
        "gpt2": (gpt2, ids, _ids(batch, seq, 2), token_loss),
        "bert": (
            bert,
            {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types},
            torch.arange(batch) % 4,
            class_loss,
        ),
        "t5": (
            t5,
            {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": _ids(batch, seq // 2, 3)},
            _ids(batch, seq // 2, 4),
            token_loss,
        ),
    }


def _call(model: nn.Module, value: Any) -> Any:
    return model(**value, use_cache=False) if isinstance(value, dict) else model(value, use_cache=False)


def measure(
    name: str,
    build: Callable[[], nn.Module],
    inputs: Any,
    target: Tensor,
    loss: Callable[..., Tensor],
    chunks: int,
    repeats: int,
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build()
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
    traces = []
    for _ in range(3):
        start = time.perf_counter()
        layers = gpipe.to_sequential(copy.deepcopy(model), *args, **kwargs)
        traces.append(time.perf_counter() - start)
    plain = copy.deepcopy(model)
    pipe = gpipe.Pipeline(
        layers, [len(layers)], chunks=chunks, loss_fn=loss, devices=["cpu"], cpu_threads=1, checkpoint="never"
    )
    parts = [p.value for p in scatter(inputs, chunks)]
    targets = target.chunk(chunks)

    def plain_step() -> None:
        for part, y in zip(parts, targets):
            (loss(_call(plain, part), y) * (len(y) / len(target))).backward()
        plain.zero_grad(set_to_none=True)

    def pipe_step() -> None:
        pipe.step(inputs, target)
        pipe.zero_grad(set_to_none=True)

    steps = {"plain": plain_step, "pipeline": pipe_step}
    for step in steps.values():  # warm-up
        step()
        step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(repeats):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for key in order:
            start = time.perf_counter()
            steps[key]()
            times[key].append(time.perf_counter() - start)
    ratios = [p / q for p, q in zip(times["pipeline"], times["plain"])]
    return {
        "model": name,
        "layers": len(layers),
        "trace_s": statistics.median(traces),
        "chunks": chunks,
        "plain_s": times["plain"],
        "pipeline_s": times["pipeline"],
        "ratio": ratios,
    }


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | layers | trace (s) | M | plain step (s) | Pipeline K=1 step (s) | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = row["ratio"]
        lines.append(
            f"| {row['model']} | {row['layers']} | {row['trace_s']:.2f} | {row['chunks']} "
            f"| {statistics.median(row['plain_s']):.3f} | {statistics.median(row['pipeline_s']):.3f} "
            f"| {statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}] |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="runs/traced")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(name, *case, args.chunks, args.repeats) for name, case in cases(args.batch, args.seq).items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (
        f"Traced models (benchmarks/traced_models.py): batch {args.batch}, seq {args.seq}, "
        f"{args.repeats} repetitions, one intra-op thread; {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}\n\n"
    )
    (out / "report.md").write_text(header + render(rows) + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(header + render(rows))


if __name__ == "__main__":
    main()
