"""The evaluation job (issue: evaluation as its own job): what training gains when ``gpipe eval --watch``
evaluates its checkpoints beside it instead of ``--eval-every`` pausing it.

    .venv/bin/python benchmarks/eval_job.py --out benchmarks/results/eval_job     # ≈ 3 min here

The same run, ``gpipe train --steps S --checkpoint-every E --threads 1 --beam 4`` on the built-in
translation data (the default T(2, 256, 4) on two stages; BLEU per language pair with beam search), pinned
to CPU 0, three ways, alternating, each ``--repeats`` times:

- **in training**: ``--eval-every E``: every E steps the pipeline stops to compute the held-out losses and
  decode the held-out sentences;
- **without evaluation**: ``--eval-every 0``, alone: the training's time when its watcher runs on other
  hardware, as the paper's evaluation jobs do;
- **a watcher here**: ``--eval-every 0``, and ``gpipe eval --watch OUT --all`` started before it, pinned to
  CPU 1 with one thread. (This VM's two vCPUs share a physical core's resources: a busy neighbour slows
  training too, so this is the worst case, not other hardware.)

Reported: the training's wall time (the process, start to exit), the watcher's lag after the training's
end (until it stopped by itself), and whether the watcher's rows equal the in-training evaluation's
(bitwise: the same K and settings).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
EVALUATION = ["--beam", "4"]  # the paper's beam
INLINE, ALONE, WATCHER = "in training", "without evaluation", "a watcher here"


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    return env


def _gpipe(cpu: int, *args: str) -> subprocess.Popen[bytes]:
    """``gpipe ARGS`` on CPU ``cpu`` alone (training and its watcher on hardware of their own)."""
    return subprocess.Popen([sys.executable, "-m", "gpipe", *args], env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))  # fmt: skip


def _rows(path: Path) -> dict[int, dict[str, Any]]:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def _run(out: Path, steps: int, every: int, way: str) -> dict[str, float]:
    flags = ["--out", str(out), "--steps", str(steps), "--checkpoint-every", str(every), "--threads", "1",
             "--no-progress", "--tensorboard", "off", *EVALUATION]  # fmt: skip
    watch = _gpipe(1, "eval", "--watch", str(out), "--all", "--poll", "1", "--quiet") if way == WATCHER else None
    began = time.perf_counter()
    train = _gpipe(0, "train", *flags, "--eval-every", str(every) if way == INLINE else "0")
    _, err = train.communicate(timeout=1800)
    trained = time.perf_counter()
    assert train.returncode == 0, err.decode()[-3000:]
    result = {"train_s": trained - began}
    if watch is not None:
        _, err = watch.communicate(timeout=600)
        assert watch.returncode == 0, err.decode()[-3000:]
        result["lag_s"] = time.perf_counter() - trained
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[dict[str, float]]] = {INLINE: [], ALONE: [], WATCHER: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for way in times:
                out = Path(tmp) / f"{way.replace(' ', '-')}-{i}"
                times[way].append(_run(out, args.steps, args.every, way))
                print(way, times[way][-1], file=sys.stderr)
        inline = _rows(Path(tmp) / "in-training-0" / "metrics.jsonl")
        watched = _rows(Path(tmp) / "a-watcher-here-0" / "eval" / "metrics.jsonl")
        steps = sorted(watched)
        same = all(watched[s] == {k: v for k, v in inline[s].items() if k in watched[s]} for s in steps)
        bleu = {s: round(watched[s]["bleu"], 2) for s in steps}
    train = {way: statistics.median(t["train_s"] for t in runs) for way, runs in times.items()}
    lag = statistics.median(t["lag_s"] for t in times[WATCHER])
    results = {"steps": args.steps, "every": args.every, "repeats": args.repeats, "times": times,
               "median_train_s": train, "median_lag_s": lag, "evaluated_steps": steps, "bitwise": same,
               "bleu": bleu}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    command = f"`.venv/bin/python benchmarks/eval_job.py --out {args.out}`"
    report = [
        "# The evaluation job: a watcher beside training against evaluation inside it",
        "",
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}. Command: {command}",
        "",
        f"`gpipe train --steps {args.steps} --checkpoint-every {args.every} --threads 1 --beam 4` (the default "
        f"T(2, 256, 4), 2 stages, the built-in translation data, BLEU per pair) on CPU 0, {args.repeats} runs each "
        "way, alternating; medians. This VM's two vCPUs share a physical core's resources: a process busy on CPU 1 "
        "slows the training on CPU 0 (see the module's docstring).",
        "",
        "| evaluation | training's wall time | ratio |",
        "|---|---|---|",
        f"| in training, `--eval-every {args.every}` | {train[INLINE]:.1f} s | 1.00 |",
        f"| `--eval-every 0`, the watcher on other hardware | {train[ALONE]:.1f} s | "
        f"{train[ALONE] / train[INLINE]:.2f} |",
        f"| `--eval-every 0` + `gpipe eval --watch --all` on this VM's other vCPU | {train[WATCHER]:.1f} s | "
        f"{train[WATCHER] / train[INLINE]:.2f} (watcher done {lag:.1f} s after the training) |",
        "",
        f"The watcher evaluated steps {steps} once each; its rows equal the in-training evaluation's "
        f"{'bit for bit' if same else 'NOT bit for bit'} (BLEU {bleu}).",
    ]
    (args.out / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
