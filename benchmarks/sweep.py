"""A learning-rate sweep of the demo's translation model (issue: sweeps): ``gpipe sweep`` against the
demo's default rate, best BLEU and wall time.

    .venv/bin/python benchmarks/sweep.py --out benchmarks/results/sweep     # ≈ 15 min here

The demo's run (``gpipe demo``: the built-in synthetic language pairs written as text files, a shared
SentencePiece vocabulary of 270 pieces, the default T(2, 256, 4) on two stages, 200 steps) twice:

- **the default**: ``gpipe train`` with the demo's settings, ``--lr 0.01``;
- **the sweep**: ``gpipe sweep`` over ``lr`` in [1e-3, 1e-1] (log scale), 8 trials, TPE, the median pruner
  after 3 complete trials and from step 100 on (``--prune-after 100``: at step 50 every rate's BLEU is
  under 1, which ranks nothing), by BLEU (the mean over the pairs) at each evaluation (every 50 steps).

Reported: each one's best BLEU and wall time (the commands, start to exit), the trials' states, and the
sweep's ``results.md`` (copied beside the report).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpipe.demo import VOCAB_SIZE
from gpipe.runs.folder import best_of, metrics_rows
from gpipe.sweep.report import toml_value

ROOT = Path(__file__).resolve().parents[1]
PRUNE_AFTER = 100  # BLEU at step 50 is under 1 for every rate: the pruner judges from step 100 on
SETTINGS = {"vocab-size": VOCAB_SIZE, "steps": 200, "eval-every": 50, "progress": False}  # the demo's; 4 evaluations


def _gpipe(*args: str) -> float:
    """Run ``gpipe ARGS``; its wall time in seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpipe", *args], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gpipe {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/sweep")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--work", help="where the runs go (default: a temporary folder, deleted)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpipe-sweep-"))
    try:
        corpus = work / "corpus"
        _gpipe("corpus", "--out", str(corpus))
        fixed = {"data": str(corpus), **SETTINGS}
        flags = [x for k, v in fixed.items() for x in ((f"--{k}", str(v)) if not isinstance(v, bool) else
                                                       (f"--{k}" if v else f"--no-{k}",))]  # fmt: skip
        default_time = _gpipe("train", *flags, "--out", str(work / "default"))
        default_bleu = best_of(metrics_rows(work / "default"), "bleu", "maximize")
        space = work / "lr.toml"
        space.write_text(
            "[fixed]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in fixed.items())
            + "\n[search]\nlr = { low = 1e-3, high = 1e-1, log = true }\n"
        )  # fmt: skip
        sweep_time = _gpipe(
            "sweep",
            str(space),
            "--trials",
            str(args.trials),
            "--out",
            str(work / "sweep"),
            "--prune-after",
            str(PRUNE_AFTER),
        )
        import optuna

        study = optuna.load_study(study_name="gpipe-sweep", storage=f"sqlite:///{work / 'sweep' / 'study.db'}")
        states = [t.state.name.lower() for t in study.trials]
        best = study.best_trial
        results = (work / "sweep" / "results.md").read_text()
        shutil.copy(work / "sweep" / "best.toml", out / "best.toml")
        lines = [
            "# A learning-rate sweep of the demo's translation model",
            "",
            f"`{' '.join(['python', *sys.argv])}` on {platform.machine()}, {os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, optuna {optuna.__version__}; demo settings: "
            + ", ".join(f"{k} {v}" for k, v in SETTINGS.items()) + ".",
            "",
            "| | lr | best BLEU | wall time |",
            "|---|---|---|---|",
            f"| the demo's default | 0.01 | {default_bleu:.2f} | {default_time:.0f} s |",
            f"| the sweep's best (trial {best.number} of {len(states)}) | {best.params['lr']:.4g} | {best.value:.2f} "
            f"| {sweep_time:.0f} s in all ({sweep_time / default_time:.1f}x the default run) |",
            "",
            f"Trials: {states.count('complete')} complete, {states.count('pruned')} pruned, "
            f"{states.count('fail')} failed.",
            "",
            "The sweep's `results.md`:",
            "",
            *["    " + line if line else "" for line in results.splitlines()],
        ]  # fmt: skip
        (out / "report.md").write_text("\n".join(lines) + "\n")
        (out / "results.md").write_text(results)
        print("\n".join(lines))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
