"""The mixture of experts (``gpipe train --experts``, :mod:`gpipe.models.moe`), in one process: what a
step costs against the dense model of equal active parameters per token, and what the experts do to
training on the built-in translation pairs (issue 49).

Reproduce (from the repository root; about 12 min here)::

    .venv/bin/python benchmarks/moe.py --out benchmarks/results/moe
    .venv/bin/python benchmarks/moe.py --quick        # small sizes, ~1 min, runs/moe

1. ``step``: a training step (``Pipeline.step``, K=2 'cpu' stages, M=4, one intra-op thread each)
   of T(``--layers``, H, 4) at model dimension ``--dim`` on random token pairs, every layer's
   feed-forward block a mixture of E experts of size H, top-2 (``moe_every=1``), against the dense
   model whose feed-forward blocks are 2H wide: the same parameters per token (the gate aside), so
   the same matrix work per token. Fresh pipelines take turns, ``--repeats`` rounds of 5 timed steps
   each after a warm-up; tokens/s and the step's time over the dense one's (median). Target: at most
   1.3x.

2. ``training``: ``gpipe train`` on the built-in synthetic pairs (four pairs, high and low resource),
   the default T(2, 256, 4) dense and with ``--experts`` 4 and 8 (every other layer, top-2), the same
   seed, batches and settings, ``--steps`` steps, for ``--seeds``; each in a process of its own (one
   thread; two at a time). The training loss of every step, the held-out loss, BLEU and the routing
   figures at each evaluation, into ``loss.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from gpipe import Pipeline
from gpipe.balance import balance_by_flops
from gpipe.models import transformer
from gpipe.models.moe import active_parameters

ROOT = Path(__file__).resolve().parent.parent


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0)


def step_costs(args: argparse.Namespace) -> dict[str, Any]:
    """Section 1: the MoE step against the dense step of equal active parameters."""
    torch.manual_seed(0)
    vocab, batch, length = 1000, args.batch, args.length
    g = torch.Generator().manual_seed(1)
    src = torch.randint(1, vocab, (batch, length), generator=g)
    tgt = torch.randint(1, vocab, (batch, length + 1), generator=g)
    inputs, target = (src, tgt[:, :-1]), tgt[:, 1:]
    hidden = args.hidden
    models = {"dense (feed-forward 2H)": transformer(args.layers, 2 * hidden, 4, dim=args.dim, vocab=vocab,
                                                     dropout=0.0, target_padding="end")}  # fmt: skip
    for e in args.experts:
        models[f"MoE E={e} (top-2 of H)"] = transformer(args.layers, hidden, 4, dim=args.dim, vocab=vocab, dropout=0.0,
                                                         target_padding="end", experts=e, moe_every=1)  # fmt: skip
    counts = {name: (sum(p.numel() for p in m.parameters()), active_parameters(m)) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            pipe = Pipeline(copy.deepcopy(model), balance_by_flops(2, model, inputs, chunks=4), chunks=4,
                            loss_fn=_loss, devices=["cpu", "cpu"], cpu_threads=1)  # fmt: skip
            pipe.step(inputs, target)  # warm-up
            for _ in range(5):
                pipe.zero_grad()
                began = time.perf_counter()
                pipe.step(inputs, target)
                times[name].append(time.perf_counter() - began)
    dense = statistics.median(times["dense (feed-forward 2H)"])
    tokens = batch * length * 2  # (source and target)
    found = {}
    for name, t in times.items():
        median = statistics.median(t)
        found[name] = {"parameters": counts[name][0], "active": counts[name][1], "step_s": median,
                       "tokens_per_s": tokens / median, "over_dense": median / dense, "steps": t}  # fmt: skip
    return found


def training(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Section 2: gpipe train, dense and with experts, on the built-in pairs (the runs in ``out``, a
    scratch folder: their metrics are kept in the results)."""
    runs: dict[str, list[str]] = {"dense": []}
    for e in args.experts:
        runs[f"E={e}"] = ["--experts", str(e)]
    jobs = [(name, seed, flags) for seed in args.seeds for name, flags in runs.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    results: dict[str, Any] = {}
    for i in range(0, len(jobs), 2):
        started = {}
        for name, seed, flags in jobs[i : i + 2]:
            folder = out / "runs" / f"{name}-seed{seed}"
            argv = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--seed", str(seed),
                    "--no-progress", "--tensorboard", "off", "--overwrite", "--out", str(folder), *flags]  # fmt: skip
            started[(name, seed)] = (folder, subprocess.Popen([sys.executable, "-m", "gpipe", "train", *argv],
                                                              env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                                              stderr=subprocess.STDOUT, text=True))  # fmt: skip
        for (name, seed), (folder, proc) in started.items():
            output = proc.communicate(timeout=3600)[0]
            if proc.returncode:
                raise RuntimeError(f"gpipe train {name} seed {seed} failed:\n{output[-3000:]}")
            rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
            results[f"{name}/seed{seed}"] = rows
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, bleu_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for key, rows in results.items():
        steps = [r["step"] for r in rows]
        loss_ax.plot(steps, [r["loss"] for r in rows], label=key, linewidth=0.8)
        evaluated = [r for r in rows if "bleu" in r]
        bleu_ax.plot([r["step"] for r in evaluated], [r["bleu"] for r in evaluated], marker="o", label=key)
    loss_ax.set(xlabel="step", ylabel="training loss", title="training loss")
    bleu_ax.set(xlabel="step", ylabel="BLEU (average over the pairs)", title="held-out BLEU")
    for ax in (loss_ax, bleu_ax):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(args: argparse.Namespace, step: dict[str, Any], trained: dict[str, Any], seconds: float) -> str:
    quick = " --quick" if args.quick else ""
    lines = [
        "# The mixture of experts in one process: its step against the dense one, and training",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/moe.py{quick} --out {args.out}` ({seconds / 60:.1f} min). Machine: "
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), Python {platform.python_version()}, "
        f"torch {torch.__version__}.",
        "",
        f"## A training step: T({args.layers}, H, 4), dim {args.dim}, H = {args.hidden}; K=2, M=4, batch "
        f"{args.batch} x {args.length} tokens a side",
        "",
        "Every layer's feed-forward block a mixture of E experts of size H, top-2, against the dense model "
        "whose blocks are 2H wide (the same matrix work per token). Median over "
        f"{args.repeats} rounds x 5 steps, the models taking turns.",
        "",
        "| model | parameters | per token | step (s) | tokens/s | step / dense |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in step.items():
        lines.append(f"| {name} | {r['parameters']:,} | {r['active']:,} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['over_dense']:.2f}x |")  # fmt: skip
    worst = max(r["over_dense"] for r in step.values())
    verdict = "met" if worst <= 1.3 else "missed"
    lines += ["", f"Target: the MoE step at most 1.3x the dense step: {verdict} (worst {worst:.3f}x).", ""]
    lines += [
        f"## Training: gpipe train, {args.steps} steps on the built-in pairs (T(2, 256, 4); experts every other "
        "layer, top-2)",
        "",
        "| run | loss (last 20 steps) | held-out loss | BLEU | moe_dropped | moe_busiest | moe_aux_loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, rows in trained.items():
        last = [r for r in rows if "eval_loss" in r][-1]
        tail = statistics.mean(r["loss"] for r in rows[-20:])
        moe = [f"{last[k]:.3f}" if k in last else "-" for k in ("moe_dropped", "moe_busiest", "moe_aux_loss")]
        lines.append(f"| {key} | {tail:.3f} | {last['eval_loss']:.3f} | {last.get('bleu', 0):.1f} | " + " | ".join(moe)
                     + " |")  # fmt: skip
    lines += ["", "![loss and BLEU](loss.png)", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/moe")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    args.layers, args.dim, args.hidden = (2, 64, 128) if args.quick else (2, 256, 512)
    args.batch, args.length, args.repeats = (8, 16, 1) if args.quick else (32, 64, 3)
    args.steps, args.eval_every = (20, 10) if args.quick else (400, 100)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    torch.set_num_threads(1)
    step = step_costs(args)
    scratch = Path(tempfile.mkdtemp(prefix="gpipe-moe-"))
    try:
        trained = training(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    plot(trained, out / "loss.png")
    (out / "results.json").write_text(json.dumps({"step": step, "training": trained}, indent=1) + "\n")
    text = report(args, step, trained, time.perf_counter() - began)
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
