"""The talk's training aids on the demo corpus: learned learning rates (``--lr-hypergradient``), Fixup
without normalization (``--init-scheme fixup --norm none``) and layers shared across depth
(``--share-layers``).

Reproduce (from the repository root; two trainings at a time, one thread each)::

    .venv/bin/python benchmarks/aids.py --out benchmarks/results/aids                  # every part
    .venv/bin/python benchmarks/aids.py --out benchmarks/results/aids --parts rates    # one part

Every run is ``gpipe train`` on the demo's corpus (``gpipe corpus``: four synthetic language pairs,
two high- and two low-resource, sampled at T = 5; a shared SentencePiece vocabulary of 270 pieces),
on two stages, with BLEU per pair at each evaluation, for each of ``--seeds`` (the seed draws the
weights, the batches and the dropout). Reported: the training loss at equal steps (the mean of the
seeds), the held-out loss and BLEU (over the pairs and per pair) at the last step, the parameters,
and the curves (``PART.png``).

- ``rates``: the demo's T(2, 256, 4) at the demo's rate (0.01), at the sweep's best
  (``benchmarks/results/sweep/best.toml``), and at the demo's rate learned by hypergradient descent, per
  layer and global; the learned per-layer rates drawn (``rates_per_layer.png``).
- ``fixup``: a deep T(``--deep``) with layer norm (the default), without normalization and the default
  initialization, and without normalization with Fixup, at the demo's rate (0.01) and at 0.002.
- ``share``: T(4) unshared, T(4) with every 2 layers sharing one set of weights (the parameters of
  T(2)'s layers) and with all 4 sharing, and T(2): BLEU per million parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from gpipe.demo import VOCAB_SIZE
from gpipe.train.guard import EXIT_NONFINITE

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["--vocab-size", str(VOCAB_SIZE), "--steps", "200", "--eval-every", "50", "--no-progress",
            "--tensorboard", "off", "--threads", "1", "--checkpoint-every", "1000"]  # fmt: skip
SWEEP_BEST = ROOT / "benchmarks" / "results" / "sweep" / "best.toml"


def parts(deep: int) -> dict[str, dict[str, list[str]]]:
    """Each part's runs: a name and its flags."""
    best = tomllib.loads(SWEEP_BEST.read_text())["lr"]
    return {
        "rates": {
            "default lr 0.01": [],
            f"sweep's best lr {best:.4g}": ["--lr", str(best)],
            "learned per layer (beta 0.02)": ["--lr-hypergradient", "0.02"],
            "learned global (beta 0.02)": ["--lr-hypergradient", "0.02", "--lr-hypergradient-scope", "global"],
        },
        "fixup": {
            f"T({deep}) {name}, lr {lr}": ["--layers", str(deep), "--lr", str(lr), *flags]
            for lr in (0.01, 0.002)
            for name, flags in (
                ("layer norm", []),
                ("no norm", ["--norm", "none"]),
                ("no norm, Fixup", ["--norm", "none", "--init-scheme", "fixup"]),
            )
        },
        "share": {
            "T(4)": ["--layers", "4"],
            "T(4), shared by 2": ["--layers", "4", "--share-layers", "2"],
            "T(4), shared by 4": ["--layers", "4", "--share-layers", "4"],
            "T(2)": ["--layers", "2"],
        },
    }


def train(corpus: Path, out: Path, flags: list[str], seed: int) -> dict[str, Any]:
    """One ``gpipe train`` run: its metrics rows, wall time and the parameter count it printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gpipe", "train", "--data", str(corpus), *SETTINGS, *flags, "--seed", str(seed),
               "--out", str(out), "--overwrite"]  # fmt: skip
    began = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, EXIT_NONFINITE):  # (a run that diverges stops at its non-finite step: a result)
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    diverged = done.stderr.strip().splitlines()[-1] if done.returncode else None
    return {"rows": rows, "seconds": time.perf_counter() - began, "parameters": parameters(out), "diverged": diverged}


def parameters(out: Path) -> int:
    """The model's parameters (a shared tensor once), from the newest checkpoint's settings."""
    from gpipe.models import parameter_count
    from gpipe.runfile import read_run
    from gpipe.saving import latest
    from gpipe.train import TrainConfig
    from gpipe.train.setup import translation_model

    found = latest(out / "checkpoints")
    assert found is not None, out
    run = read_run(found)
    known = set(TrainConfig.__dataclass_fields__)
    cfg = TrainConfig(**{k: v for k, v in run["config"].items() if k in known})
    with torch.device("meta"):
        return parameter_count(translation_model(cfg, run["vocab"], run["length"]))


def summary(runs: dict[int, dict[str, Any]], steps: int) -> dict[str, Any] | None:
    """A configuration's figures, the mean over its seeds (None: a seed's run diverged)."""
    if any(r.get("diverged") or len(r["rows"]) < steps for r in runs.values()):
        return None
    last = [r["rows"][-1] for r in runs.values()]
    pairs = sorted(k for k in last[0] if k.startswith("bleu/") and k.count("-"))
    mean = statistics.fmean
    at = {step: mean(r["rows"][step - 1]["loss"] for r in runs.values()) for step in (steps // 4, steps // 2, steps)}
    return {
        "loss": at,
        "eval_loss": mean(row["eval_loss"] for row in last),
        "bleu": mean(row["bleu"] for row in last),
        "bleu_seeds": [row["bleu"] for row in last],
        "pairs": {p.removeprefix("bleu/"): mean(row[p] for row in last) for p in pairs},
        "parameters": next(iter(runs.values()))["parameters"],
        "seconds": mean(r["seconds"] for r in runs.values()),
    }


def table(results: dict[str, dict[int, dict[str, Any]]], steps: int) -> list[str]:
    figures = {name: summary(runs, steps) for name, runs in results.items()}
    done = [f for f in figures.values() if f is not None]
    pairs = list(done[0]["pairs"]) if done else []
    lines = [
        f"| run | parameters | {' | '.join(f'loss @{step}' for step in (steps // 4, steps // 2, steps))} | "
        "held-out loss | BLEU (seeds) | "
        + " | ".join(f"BLEU {p}" for p in pairs) + " | BLEU per M parameters | s per run |",
        "|---" * (9 + len(pairs)) + "|",
    ]  # fmt: skip
    for name, f in figures.items():
        if f is None:  # a seed diverged: where, and how
            said = "; ".join(
                f"seed {seed}: loss {r['rows'][-1]['loss']:.4g} at step {len(r['rows'])}, then stopped "
                f"({_stop(r['diverged'])})"
                if r.get("diverged")
                else f"seed {seed}: trained, loss {r['rows'][-1]['loss']:.4g} at step {len(r['rows'])}"
                for seed, r in results[name].items()
            )
            lines.append(f"| {name} | {said} |" + " |" * (7 + len(pairs)))
            continue
        seeds = ", ".join(f"{b:.1f}" for b in f["bleu_seeds"])
        lines.append(
            f"| {name} | {f['parameters']:,} | {' | '.join(f'{v:.3f}' for v in f['loss'].values())} | "
            f"{f['eval_loss']:.3f} | {f['bleu']:.2f} ({seeds}) | "
            + " | ".join(f"{f['pairs'][p]:.1f}" for p in pairs)
            + f" | {f['bleu'] / (f['parameters'] / 1e6):.1f} | {f['seconds']:.0f} |"
        )  # fmt: skip
    return lines


def _stop(said: str) -> str:
    """What stopped a run, from its last line (``error: step N: NaN in ...; --on-nonfinite ...``)."""
    return said.removeprefix("error: ").split(";")[0]


def plot(results: dict[str, dict[int, dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for n, (name, runs) in enumerate(results.items()):
        color = plt.get_cmap("tab10")(n)  # (a color per run, a line style per seed)
        for seed, run in runs.items():
            rows = [r for r in run["rows"] if r["loss"] is not None]
            style = "-" if seed == min(runs) else ":"
            left.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, color=color,
                      label=f"{name} (seed {seed})")  # fmt: skip
            evals = [r for r in run["rows"] if "bleu" in r]
            right.plot([r["step"] for r in evals], [r["bleu"] for r in evals], style, color=color, marker="o")
    left.set(xlabel="step", ylabel="training loss", title=title, yscale="log")
    right.set(xlabel="step", ylabel="BLEU (mean over the pairs)")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rates(run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = run["rows"]
    names = sorted(k for k in rows[-1] if k.startswith("lr/"))
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    for name in names:
        ax.plot(steps, [r[name] for r in rows], label=f"layer {int(name[3:])}")
    ax.plot(steps, [r["lr"] for r in rows], "k--", label="the schedule")
    ax.set(xlabel="step", ylabel="learning rate", title="learned per-layer rates (seed 0)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: dict[str, dict[int, dict[str, Any]]], part: str, out: Path, args: Any, seeds: list[int]) -> None:
    """A part's table (``PART.md``) and curves (``PART.png``; ``rates_per_layer.png``)."""
    plot(results, out / f"{part}.png", part)
    if part == "rates":
        plot_rates(results["learned per layer (beta 0.02)"][seeds[0]], out / "rates_per_layer.png")
    lines = [
        f"## {part}",
        "",
        f"`python benchmarks/aids.py --parts {part} --seeds {args.seeds} --deep {args.deep} --steps "
        f"{args.steps}` on {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
        f"`gpipe train {' '.join(SETTINGS)}` on the demo corpus, two stages; the means of the seeds, "
        "two runs at a time.",
        "",
        *table(results, args.steps),
        "",
    ]
    (out / f"{part}.md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/aids")
    parser.add_argument("--parts", default="rates,share,fixup")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--deep", type=int, default=24, help="the fixup part's L")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--work", help="where the runs go (default: a temporary folder, deleted)")
    parser.add_argument(
        "--report-only", action="store_true", help="write the parts' tables and curves again, from their JSON"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    SETTINGS[SETTINGS.index("--steps") + 1] = str(args.steps)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpipe-aids-"))
    try:
        corpus = work / "corpus"
        if not corpus.exists() and not args.report_only:
            subprocess.run([sys.executable, "-m", "gpipe", "corpus", "--out", str(corpus)], check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True)  # fmt: skip
        for part in args.parts.split(","):
            if args.report_only:
                saved = json.loads((out / f"{part}.json").read_text())
                results = {name: {int(seed): run for seed, run in runs_.items()} for name, runs_ in saved.items()}
                report(results, part, out, args, seeds)
                continue
            runs = parts(args.deep)[part]
            jobs = [(name, seed) for name in runs for seed in seeds]
            names = list(runs)
            folders = [work / part / f"run{names.index(name)}-seed{seed}" for name, seed in jobs]
            with ThreadPoolExecutor(2) as pool:  # two trainings at a time, one thread each
                done = pool.map(train, [corpus] * len(jobs), folders, [runs[n] for n, _ in jobs], [s for _, s in jobs])
                results: dict[str, dict[int, dict[str, Any]]] = {}
                for (name, seed), run in zip(jobs, done, strict=True):
                    results.setdefault(name, {})[seed] = run
            (out / f"{part}.json").write_text(json.dumps(
                {name: {str(s): {k: r[k] for k in ("rows", "parameters", "seconds", "diverged")}
                        for s, r in runs_.items()} for name, runs_ in results.items()}) + "\n")  # fmt: skip
            report(results, part, out, args, seeds)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
