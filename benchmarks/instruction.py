"""Packed rows against one example a row: padding and answer tokens per second of ``gpipe train
--model hf --data chats.jsonl``, with and without ``--pack``, side by side.

    .venv/bin/python benchmarks/instruction.py --out benchmarks/results/instruction

The data: chats (tests/chat_data.py) whose answers have long-tailed lengths (most a few tokens, one
in ten near ``--longest``), a small Llama with a ChatML tokenizer. Each round runs both settings in
fresh processes, in turn (the order rotating); a run's figures are the mean ``padding`` and the
median ``tokens_per_s`` (the answers' tokens the loss counts, per second of step) of its steps after
the first few.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import chat_data  # noqa: E402

SETTINGS = {"one example a row": [], "--pack": ["--pack"]}


def _run(folder: Path, data: Path, out: Path, extra: list[str], args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, "-m", "gpipe", "train", "--model", "hf", "--init", str(folder), "--data", str(data),
               "--max-length", str(args.max_length), "--batch", str(args.batch), "--chunks", str(args.chunks),
               "--partitions", str(args.partitions), "--steps", str(args.steps), "--eval-every", "0",
               "--health-every", "0", "--checkpoint-every", str(args.steps), "--no-progress", "--tensorboard", "off",
               "--out", str(out), *extra]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in rows if r["step"] > args.warmup]
    return {
        "padding": statistics.fmean(r["padding"] for r in kept),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in kept),
        "tokens_per_step": statistics.fmean(r["tokens"] for r in kept),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-instruction"))
    parser.add_argument("--records", type=int, default=600)
    parser.add_argument("--longest", type=int, default=110, help="the longest answers, in words")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256, help="the Llama's hidden size (4 blocks)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    began = time.time()
    load = os.getloadavg()[0]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        folder = chat_data.model_folder(root / "llama", positions=args.max_length, hidden=args.hidden, layers=4)
        data = chat_data.write(root / "chats.jsonl", chat_data.chat_records(args.records, longest=args.longest))
        names = list(SETTINGS)
        for r in range(args.rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                results[name].append(_run(folder, data, root / f"run-{r}-{len(name)}", SETTINGS[name], args))
                print(name, results[name][-1], file=sys.stderr)
    summary = {
        name: {key: statistics.median(run[key] for run in runs) for key in runs[0]} for name, runs in results.items()
    }
    plain, packed = summary["one example a row"], summary["--pack"]
    ratios = [p["tokens_per_s"] / u["tokens_per_s"] for u, p in zip(results["one example a row"], results["--pack"])]
    args.out.mkdir(parents=True, exist_ok=True)
    written = {"settings": vars(args) | {"out": str(args.out)}, "runs": results, "summary": summary}
    (args.out / "results.json").write_text(json.dumps(written, indent=1) + "\n")
    lines = [
        "# Instruction data: packed rows against one example a row",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/instruction.py --out {args.out}` ({(time.time() - began) / 60:.1f} "
        f"min). Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), Python "
        f"{platform.python_version()}, load average (1 min) {load:.1f} at the start.",
        "",
        f"Data: {args.records} chats (tests/chat_data.py), answers of long-tailed lengths (most 1-4 words, one in ten "
        f"{args.longest * 3 // 4}-{args.longest}), a 4-block Llama (hidden {args.hidden}) with a ChatML tokenizer. "
        f"`gpipe train --model hf --max-length {args.max_length} --batch {args.batch} --chunks {args.chunks} "
        f"--partitions {args.partitions} --steps {args.steps}`, {args.rounds} rounds, each setting in a fresh "
        f"process, in turn; per run the mean padding and the median tokens/s of steps {args.warmup + 1}-{args.steps}, "
        "then the median over the rounds.",
        "",
        "| rows | padding | answer tokens / step | answer tokens / s |",
        "|---|---|---|---|",
        *(
            f"| {name} | {s['padding']:.3f} | {s['tokens_per_step']:.0f} | {s['tokens_per_s']:.0f} |"
            for name, s in summary.items()
        ),
        "",
        f"Packed over one example a row, answer tokens per second, per round: "
        f"{', '.join(f'{x:.2f}x' for x in ratios)} (median {statistics.median(ratios):.2f}x). Padding "
        f"{packed['padding']:.3f} packed against {plain['padding']:.3f}.",
        "",
    ]
    (args.out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
