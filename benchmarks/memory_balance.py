"""The stages of a causal LM balanced by FLOPs alone against FLOPs and memory (``balance_by_flops(...,
state_bytes=...)``, what ``gpipe train --model hf`` does), side by side: each rank's parameters, peak
memory and the step time, 4 ranks under torchrun.

The model: a Llama (``LlamaConfig``: hidden 1024, intermediate 2048, 24 layers, 16 heads, vocabulary
32000, 128 positions, untied embeddings; 317M parameters), random weights, trained on a generated text
(``--model hf --hf-config --data text.txt``) with ``--optimizer adafactor --partitions 4 --batch 4
--chunks 4``, ``--steps`` steps, one process per stage (``torchrun --standalone --nproc-per-node 4``),
the two balances taking turns. Each rank reports its stage's parameters and its peak RSS (``VmHWM``,
the whole process: imports, the model, the step, the final checkpoint); the step time is the median of
the steps after the first but the last, which also evaluates (``metrics.jsonl``). "by FLOPs" is the
same run with the balance of FLOPs alone (the driver replaces the memory-aware balance with it).

Reproduce (from the repository root; about 5 min here)::

    .venv/bin/python benchmarks/memory_balance.py --out benchmarks/results/memory_balance
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
         "vocab_size": 32000}  # fmt: skip

DRIVER = """
import json, os, sys
from pathlib import Path
import gpipe.train.loop as loop
import gpipe.train.setup as setup
from gpipe.cli import main

mode, report, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
made = []
build = setup.make_pipeline
if mode == "flops":  # the balance of FLOPs alone, as before
    flops = setup.balance_by_flops
    setup.balance_by_flops = lambda *args, state_bytes=None, **kwargs: flops(*args, **kwargs)
loop.make_pipeline = lambda *args, **kwargs: made.append(build(*args, **kwargs)) or made[-1]
code = main(argv)
status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
rank = int(os.environ.get("RANK", "0"))
pipe = made[0]
(report / f"rank-{rank}.json").write_text(json.dumps({
    "rank": rank, "code": code, "balance": list(pipe.balance),
    "params": sum(p.numel() for p in pipe.parameters()),
    "peak_mib": int(status["VmHWM"].split()[0]) / 1024,
}))
sys.exit(code)
"""


def _text(path: Path, lines: int = 2000) -> None:
    rng = random.Random(0)
    words = ["".join(rng.choice("aeioubdgklmnprstvz") for _ in range(rng.randint(2, 8))) for _ in range(600)]
    path.write_text(
        "".join(" ".join(rng.choice(words) for _ in range(rng.randint(6, 30))) + "\n" for _ in range(lines))
    )


def _run(mode: str, work: Path, steps: int) -> dict[str, Any]:
    out, report = work / f"run-{mode}", work / f"report-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(report, ignore_errors=True)
    report.mkdir()
    argv = ["train", "--model", "hf", "--hf-config", str(work / "config.json"), "--data", str(work / "text.txt"),
            "--partitions", "4", "--optimizer", "adafactor", "--batch", "4", "--chunks", "4", "--steps", str(steps),
            "--eval-every", "1000", "--checkpoint-every", "1000", "--no-progress", "--tensorboard", "off",
            "--out", str(out)]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(work / "driver.py"), mode, str(report), *argv], env=env, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{mode}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    ranks = [json.loads((report / f"rank-{r}.json").read_text()) for r in range(4)]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(rows)][:-1]  # (the last: + evaluation)
    return {"ranks": ranks, "step_s": statistics.median(times), "steps_s": times, "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/memory_balance", help="where report.md and results.json go")
    parser.add_argument("--steps", type=int, default=7, help="training steps of each run (default 7)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each balance, taking turns (default 1)")
    args = parser.parse_args()
    import transformers

    work = Path(tempfile.mkdtemp(prefix="gpipe-memory-balance-"))
    try:
        transformers.LlamaConfig(**SIZES, max_position_embeddings=128, tie_word_embeddings=False,
                                 bos_token_id=1, eos_token_id=2).to_json_file(work / "config.json")  # fmt: skip
        _text(work / "text.txt")
        (work / "driver.py").write_text(DRIVER)
        results: dict[str, list[dict[str, Any]]] = {"flops": [], "memory": []}
        for _ in range(args.repeats):
            for mode in results:
                results[mode].append(_run(mode, work, args.steps))
                print(mode, json.dumps({k: v for k, v in results[mode][-1].items() if k != "steps_s"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "# A causal LM's stages balanced by FLOPs alone, and by FLOPs and memory",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/memory_balance.py --out {args.out}` ({time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} cores). The 317M Llama, Adafactor, 4 ranks under torchrun, {args.steps} steps per run, "
        f"{args.repeats} run(s) of each, taking turns.",
        "",
        "| balance | stages (layers) | parameters per rank (M) | peak RSS per rank (MiB) | largest / mean peak "
        "| step (s, median) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, name in (("flops", "FLOPs alone (before)"), ("memory", "FLOPs and memory (gpipe train --model hf)")):
        for run in results[mode]:
            ranks = sorted(run["ranks"], key=lambda r: r["rank"])
            peaks = [r["peak_mib"] for r in ranks]
            params = ", ".join(f"{r['params'] / 1e6:.1f}" for r in ranks)
            lines.append(
                f"| {name} | {ranks[0]['balance']} | {params} | "
                f"{', '.join(f'{p:,.0f}' for p in peaks)} | **{max(peaks) / statistics.mean(peaks):.3f}** | "
                f"{run['step_s']:.2f} |"
            )
    ratios = [m["step_s"] / f["step_s"] for m, f in zip(results["memory"], results["flops"], strict=True)]
    lines += ["", f"Step time, memory-aware over FLOPs alone, per repetition (the two taking turns): "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; median **{statistics.median(ratios):.2f}** (target: no worse "
              "than 1.0 beyond noise; the largest rank's peak target: at most 1.25x the mean)."]  # fmt: skip
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
