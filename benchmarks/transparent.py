"""Transparent attention (``gpipe train --transparent``, :mod:`gpipe.models.transparent`): what it
costs to send between stages, against the other way to build it, and what it does to a deep model's
training.

Reproduce (from the repository root; about 8 min here: the bytes 40 s, then four trainings, two at a
time on the 2 cores)::

    .venv/bin/python benchmarks/transparent.py --out benchmarks/results/transparent
    .venv/bin/python benchmarks/transparent.py --quick      # small sizes, ~30 s, runs/transparent

1. ``bytes``: every tensor a training step sends between stages, forward values and the gradients
   that come back, for three models of the same layers: the plain Transformer, transparent attention
   as gpipe builds it ((B): the encoder's outputs carried to the target embedding, which mixes them),
   and the other way ((A): a running sum per decoder layer, each encoder layer adding its output with
   its own D weights to D sums that travel with the activations; the normalizers are D numbers; the
   last encoder layer hands on the sums alone). (A) is built here only, from the same layers
   (:func:`running_sum`), and checked to compute (B)'s output. The counts come from the tensors the
   layers hand on at each cut, computed on the meta device (any size; ``--dim`` 1024, a batch of
   ``--sentences`` x ``--length`` tokens a side, fp32), the cuts those of ``balance_by_flops`` for the
   plain model (the same cuts for all three), in 2K micro-batches; at a small size they are checked
   against a count of what the pipeline's transport moves in a real step. Schedules do not change the
   sum, nor do micro-batches (M of 1/M the batch) but for (A)'s D normalizers, sent once per
   micro-batch.

2. ``training``: T(``--layers``) of small width (dim 32, feed-forward 64, 2 heads) trained by
   ``gpipe train`` on the built-in synthetic translation data with and without ``--transparent``, the
   same seed, batches and settings, for ``--seeds`` 0 and 1, each in a process of its own (one thread;
   a seed's two at once); the training loss of every step, the held-out loss and BLEU at each
   evaluation, and the learned weights at the end, into ``loss.png``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

import gpipe
from gpipe.balance import balance_by_flops
from gpipe.microbatch import Batch
from gpipe.models import transformer
from gpipe.models.transparent import TransparentDecoderLayer, TransparentTargetEmbedding, source_names
from gpipe.runtime.executor import Mailbox, Transport
from gpipe.schedule.ir import Schedule

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
VOCAB = 32000


# -- (A): a running sum per decoder layer ------------------------------------------------------------


class _Running(nn.Module):
    """A layer of the encoder side of (A): the source embedding or an encoder layer, which adds its
    output ``h_i``, weighted ``exp(logits)`` (one per decoder layer), to the D sums and the weights to
    the D normalizers. The last encoder layer hands on the sums only."""

    def __init__(self, layer: nn.Module, decoders: int, sources: int, last: bool) -> None:
        super().__init__()
        self.layer, self.last = layer, last
        self.logits = nn.Parameter(torch.full((decoders,), 1.0 / sources))

    def forward(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        if len(inputs) == 2:  # the source embedding: (src, tgt)
            h, src_pad, tgt = self.layer(inputs)
            sums: Any = 0.0
            norms: Any = 0.0
        else:
            x, src_pad, tgt, sums, norms = inputs
            h, src_pad, tgt = self.layer((x, src_pad, tgt))
        e = self.logits.exp()
        sums, norms = e[:, None, None, None] * h + sums, e + norms  # (D, B, S, dim), (D,)
        return None if self.last else h, src_pad, tgt, sums, norms


class _RunningTarget(nn.Module):
    """(A)'s target embedding: the D memories from the sums (the final norm on them at once)."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self.target = target

    def forward(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        _, src_pad, tgt, sums, norms = inputs
        memories, src_pad, y, tgt_pad = self.target((sums / norms[:, None, None, None], src_pad, tgt))
        return memories.unbind(0), src_pad, y, tgt_pad


def running_sum(plain: nn.Sequential, layers: int) -> nn.Sequential:
    """(A) from the plain ``transformer(layers, ...)``'s layers (shared, not copied)."""
    parts = list(plain)
    n = layers
    return nn.Sequential(
        *[_Running(parts[i], layers, n + 1, last=i == n) for i in range(n + 1)],
        _RunningTarget(parts[n + 1]),
        *[TransparentDecoderLayer(layer) for layer in parts[n + 2 : -1]],
        parts[-1],
    )


def same_weights(a: nn.Sequential, b: nn.Sequential, layers: int) -> None:
    """(A)'s logits set from (B)'s: softmax(w_j)_i = exp(w_ji) / sum_i exp(w_ji)."""
    target = next(layer for layer in b if isinstance(layer, TransparentTargetEmbedding))
    with torch.no_grad():
        for i, layer in enumerate(list(a)[: layers + 1]):
            assert isinstance(layer, _Running)
            layer.logits.copy_(target.logits[:, i])


# -- the bytes of a step ----------------------------------------------------------------------------


def _nbytes(tensors: Iterator[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


def sent_from_layers(
    model: nn.Sequential, balance: list[int], sample: tuple[Tensor, Tensor], chunks: int
) -> dict[str, int]:
    """What crosses the cuts of ``balance`` in a step on ``sample`` in ``chunks`` micro-batches: the
    values the layers hand on at each cut (forward), and those of them that need a gradient, which
    comes back (backward)."""
    cuts = set(itertools.accumulate(balance[:-1]))
    forward = backward = 0
    for value in zip(sample[0].chunk(chunks), sample[1].chunk(chunks)):  # (as the pipeline splits it)
        for i, layer in enumerate(model):
            value = layer(value)
            if i + 1 in cuts:
                leaves = [t for t in tree_leaves(value) if isinstance(t, Tensor)]
                forward += _nbytes(iter(leaves))
                backward += _nbytes(t for t in leaves if t.requires_grad)
    return {"forward": forward, "backward": backward, "total": forward + backward}


class _CountingMailbox(Mailbox):
    def __init__(self, stages: int, counts: dict[str, int]) -> None:
        super().__init__()
        self.stages, self.counts = stages, counts

    def put(self, key: tuple[str, int, int], value: Any) -> None:
        kind, _, s = key
        if kind == "act" and 0 < s < self.stages:  # a stage's output, to the next stage
            self.counts["forward"] += _nbytes(iter(value.values if isinstance(value, Batch) else tree_leaves(value)))
        elif kind == "grad" and 0 <= s < self.stages - 1:  # a stage's input gradients, to the one before
            self.counts["backward"] += _nbytes(iter(tree_leaves(value)))
        super().put(key, value)


class _CountingTransport(Transport):
    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.counts = {"forward": 0, "backward": 0}

    def mailbox(self, schedule: Schedule) -> Mailbox:
        return _CountingMailbox(self.stages, self.counts)


def sent_through_transport(
    model: nn.Sequential, balance: list[int], inputs: tuple[Tensor, Tensor], target: Tensor, chunks: int
) -> dict[str, int]:
    """What the pipeline's transport moves between stages in one real step (one process)."""
    pipe = gpipe.Pipeline(
        copy.deepcopy(model), balance, chunks=chunks, devices=["cpu"] * len(balance),
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
    )  # fmt: skip
    transport = _CountingTransport(len(balance))
    pipe.engine.executor.transport = transport
    pipe.step(inputs, target)
    counts = transport.counts
    return {**counts, "total": counts["forward"] + counts["backward"]}


def models(layers: int, dim: int, vocab: int, max_len: int) -> dict[str, nn.Sequential]:
    """The plain model, (B) and (A), the same layers' weights."""
    hidden, heads = 4 * dim, max(dim // 64, 2)
    torch.manual_seed(0)
    plain = transformer(layers, hidden, heads, dim=dim, vocab=vocab, max_len=max_len, dropout=0.0)
    torch.manual_seed(0)
    mixed = transformer(layers, hidden, heads, dim=dim, vocab=vocab, max_len=max_len, dropout=0.0, transparent=True)
    torch.manual_seed(0)
    running = running_sum(
        transformer(layers, hidden, heads, dim=dim, vocab=vocab, max_len=max_len, dropout=0.0), layers
    )
    return {"plain": plain, "B: outputs to the target embedding": mixed, "A: running sums": running}


def check_small(layers: int = 4, stages: int = 4) -> dict[str, Any]:
    """At a small size: (A) computes (B)'s logits (weights not uniform), and the counts from the layers
    equal the transport's."""
    found = models(layers, 32, 50, 16)
    g = torch.Generator().manual_seed(0)
    target_layer = next(
        x for x in found["B: outputs to the target embedding"] if isinstance(x, TransparentTargetEmbedding)
    )
    with torch.no_grad():
        target_layer.logits.normal_(generator=g)
    same_weights(found["A: running sums"], found["B: outputs to the target embedding"], layers)
    inputs = (torch.randint(3, 50, (8, 12), generator=g), torch.randint(3, 50, (8, 10), generator=g))
    target = torch.randint(3, 50, (8, 10), generator=g)
    with torch.no_grad():
        a, b = found["A: running sums"](inputs), found["B: outputs to the target embedding"](inputs)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    balance = balance_by_flops(stages, found["plain"], inputs, chunks=2)
    rows = {}
    for name, model in found.items():
        from_layers = sent_from_layers(model, balance, inputs, chunks=2)
        through = sent_through_transport(model, balance, inputs, target, chunks=2)
        assert from_layers == through, (name, from_layers, through)
        rows[name] = through
    return {"layers": layers, "stages": stages, "chunks": 2, "balance": balance, "dim": 32, "rows": rows}


def measure_bytes(layers: int, stages: int, dim: int, sentences: int, length: int) -> dict[str, Any]:
    with torch.device("meta"):
        found = models(layers, dim, VOCAB, length)
        sample = (torch.randint(3, VOCAB, (sentences, length)), torch.randint(3, VOCAB, (sentences, length)))
    chunks = 2 * stages
    balance = balance_by_flops(stages, found["plain"], sample, chunks=chunks)
    rows = {name: sent_from_layers(model, balance, sample, chunks) for name, model in found.items()}
    return {"layers": layers, "stages": stages, "chunks": chunks, "balance": balance, "dim": dim, "rows": rows}


# -- training ----------------------------------------------------------------------------------------


def train_both(out: Path, layers: int, steps: int, eval_every: int, seeds: list[int]) -> dict[str, Any]:
    """``gpipe train`` with and without ``--transparent`` for each of ``seeds``, the two of a seed at
    once (one thread each)."""
    common = ["--layers", str(layers), "--dim", "32", "--hidden", "64", "--heads", "2", "--partitions", "1",
              "--chunks", "1", "--threads", "1", "--steps", str(steps), "--eval-every", str(eval_every),
              "--checkpoint-every", str(steps), "--no-progress", "--tensorboard", "off", "--overwrite"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    results: dict[str, Any] = {}
    for seed in seeds:
        commands = {
            f"plain/seed{seed}": [*common, "--seed", str(seed), "--out", str(out / f"plain-{seed}")],
            f"transparent/seed{seed}": [*common, "--seed", str(seed), "--transparent", "--out",
                                        str(out / f"transparent-{seed}")],
        }  # fmt: skip
        running = {
            name: subprocess.Popen(
                [sys.executable, "-m", "gpipe", "train", *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name, argv in commands.items()
        }
        for name, proc in running.items():
            text, _ = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"gpipe train ({name}) failed:\n{text}")
            folder = Path(commands[name][-1])
            rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
            results[name] = {"command": "gpipe train " + " ".join(commands[name]), **_small(rows)}
    results["seconds"] = time.perf_counter() - began
    return results


def _small(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's metrics as kept: the loss of every step (from step 1), and the evaluations' rows, the
    weights in the last one only."""
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    evals = [r for r in rows if "eval_loss" in r]
    return {
        "losses": [round(r["loss"], 5) for r in rows],
        "evals": [{k: v for k, v in r.items() if r is evals[-1] or not k.startswith("transparent/")} for r in evals],
    }


def weights_matrix(row: dict[str, Any], layers: int) -> list[list[float]]:
    names = source_names(layers + 1)
    return [[row[f"transparent/dec{j}/{s}"] for s in names] for j in range(1, layers + 1)]


COLORS = {"plain": "tab:blue", "transparent": "tab:orange"}


def plot(training: dict[str, Any], layers: int, seeds: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_eval, ax_w) = plt.subplots(1, 3, figsize=(17, 4.8))
    for name, color in COLORS.items():
        for seed, style in zip(seeds, ("-", "--", ":")):
            run = training[f"{name}/seed{seed}"]
            label = f"{name}, seed {seed}"
            losses = run["losses"]
            ax_loss.plot(range(1, len(losses) + 1), losses, style, color=color, alpha=0.8, lw=0.8, label=label)
            evals = run["evals"]
            ax_eval.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o" + style, color=color,
                         label=label)  # fmt: skip
            for r in evals:
                ax_eval.annotate(f"{r['bleu']:.0f}", (r["step"], r["eval_loss"]), color=color, fontsize=7,
                                 textcoords="offset points", xytext=(2, 4))  # fmt: skip
    ax_loss.set(xlabel="step", ylabel="training loss (label-smoothed)", title=f"T({layers}), dim 32, synthetic pairs")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_eval.set(xlabel="step", ylabel="held-out loss", title="held-out loss (labels: BLEU)")
    ax_eval.legend()
    last = training[f"transparent/seed{seeds[0]}"]["evals"][-1]
    image = ax_w.imshow(weights_matrix(last, layers), aspect="auto", cmap="viridis")
    ax_w.set(xlabel="source", ylabel="decoder layer", title=f"learned weights, seed {seeds[0]}, step {last['step']}")
    ax_w.set_xticks(range(layers + 1), source_names(layers + 1), rotation=90, fontsize=7)
    ax_w.set_yticks(range(layers), [str(j) for j in range(1, layers + 1)], fontsize=7)
    fig.colorbar(image, ax=ax_w)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- the report -------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GIB:.3f}"


def report(results: dict[str, Any]) -> str:
    took = f"; {results['seconds']:.0f} s in all" if "seconds" in results else ""
    lines = ["# Transparent attention (benchmarks/transparent.py)", "", results["machine"] + took, ""]
    if "bytes" in results:
        lines += [
            "## Bytes sent between stages per training step",
            "",
            "Every tensor a step sends across the cuts: the values the layers hand on (forward) and the "
            "gradients of those that need one (backward). Cuts: `balance_by_flops` of the plain model, the "
            f"same for all three; 2K micro-batches. Batch: {results['sentences']} sentences x {results['length']} "
            "tokens a side, fp32, feed-forward 4 x dim, vocabulary 32000. (A): a running sum per decoder layer; "
            "(B): the encoder's outputs carried to the target embedding (what gpipe builds).",
            "",
            "| model | stages | balance | design | forward GiB | backward GiB | total GiB | vs plain |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for case in results["bytes"]:
            plain = case["rows"]["plain"]["total"]
            for name, row in case["rows"].items():
                lines.append(
                    f"| T({case['layers']}), dim {case['dim']} | {case['stages']} | {case['balance']} | {name} | "
                    f"{_gib(row['forward'])} | {_gib(row['backward'])} | **{_gib(row['total'])}** | "
                    f"{row['total'] / plain:.1f}x |"
                )
        small = results["check"]
        lines += [
            "",
            f"Checked at a small size (T({small['layers']}), dim {small['dim']}, {small['stages']} stages, balance "
            f"{small['balance']}, 8 sentences): the counts from the layers equal what the pipeline's transport "
            "moved in a real step, for all three models ("
            + ", ".join(f"{name}: {row['total']} bytes" for name, row in small["rows"].items())
            + "); (A) computes (B)'s logits from the same weights.",
            "",
        ]
    if "training" in results:
        t, layers, seeds = results["training"], results["layers"], results["seeds"]
        lines += [
            f"## Training T({layers}) with and without --transparent",
            "",
            f"{layers} encoder and {layers} decoder layers, dim 32, on the built-in synthetic pairs; seeds "
            f"{', '.join(map(str, seeds))} (the initialization and the batches; the two runs of a seed share both), "
            f"each seed's two runs at once, one thread each; {t['seconds']:.0f} s in all. The commands (seed "
            f"{seeds[0]}):",
            "",
            "```",
            t[f"plain/seed{seeds[0]}"]["command"],
            t[f"transparent/seed{seeds[0]}"]["command"],
            "```",
            "",
            "![loss curves and learned weights](loss.png)",
            "",
            "Training loss of the step, held-out loss and BLEU (every pair's average) at each evaluation:",
            "",
            "| seed | step | plain loss | transparent loss | plain eval loss | transparent eval loss | plain BLEU | "
            "transparent BLEU |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for seed in seeds:
            plain, mixed = t[f"plain/seed{seed}"], t[f"transparent/seed{seed}"]
            for p, m in zip(plain["evals"], mixed["evals"]):
                step = p["step"]
                lines.append(
                    f"| {seed} | {step} | {plain['losses'][step - 1]:.4f} | {mixed['losses'][step - 1]:.4f} | "
                    f"{p['eval_loss']:.4f} | "
                    f"{m['eval_loss']:.4f} | {p['bleu']:.1f} | {m['bleu']:.1f} |"
                )
        lines += [
            "",
            "On these pairs a target word is a fixed permutation of the source word at its position, so the source "
            "embedding nearly holds the answer: transparent attention hands every decoder layer that shortcut past "
            "the deep encoder (and the gradient a short way back to the embeddings), and the learned weights favor "
            "the embedding and the first encoder layers. That is what the curves show; they are no measure of the "
            "paper's gains on real translation.",
        ]
        last = t[f"transparent/seed{seeds[0]}"]["evals"][-1]
        names = source_names(layers + 1)
        shown = sorted({1, *range(6, layers + 1, 6), layers})
        lines += [
            "",
            f"Learned weights of seed {seeds[0]} at step {last['step']}, decoder layers {shown} (all of them: the "
            "picture, and results.json): row, decoder layer; column, source (emb: the source embedding, enc<i>: "
            f"encoder layer i's output); they started at 1/{layers + 1} = {1 / (layers + 1):.3f}.",
            "",
            "| dec | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        matrix = weights_matrix(last, layers)
        for j in shown:
            lines.append(f"| {j} | " + " | ".join(f"{w:.3f}" for w in matrix[j - 1]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/transparent")
    parser.add_argument("--runs", default="runs/transparent-runs", help="where the two trainings write their runs")
    parser.add_argument("--quick", action="store_true", help="small sizes, a short training")
    parser.add_argument("--only", choices=("bytes", "training"))
    parser.add_argument("--layers", type=int, default=24, help="L of the trained T(L) (L encoder, L decoder layers)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seeds", default="0,1", help="the trainings' seeds, comma-separated")
    parser.add_argument("--dim", type=int, default=1024, help="the bytes' model dimension")
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.steps, args.eval_every, args.dim, args.seeds = 4, 40, 20, 256, "0"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}"
    )
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, Any] = {"machine": machine, "layers": args.layers, "seeds": seeds, "sentences": args.sentences,
                               "length": args.length}  # fmt: skip
    began = time.perf_counter()
    if args.only in (None, "bytes"):
        results["check"] = check_small()
        cases = [(12, 4), (24, 8)] if not args.quick else [(6, 4)]
        results["bytes"] = [measure_bytes(n, k, args.dim, args.sentences, args.length) for n, k in cases]
    if args.only in (None, "training"):
        results["training"] = train_both(Path(args.runs), args.layers, args.steps, args.eval_every, seeds)
        plot(results["training"], args.layers, seeds, out / "loss.png")
    results["seconds"] = time.perf_counter() - began
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
