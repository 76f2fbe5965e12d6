"""The engine's hot path of two gpipe source trees, taking turns: did a change (a refactoring, say) move it?

Reproduce (from the repository root; BEFORE is a checkout of the commit to compare with)::

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/ab_engine.py /tmp/before .

Each round runs, for tree A and then tree B (the order alternating between rounds), a fresh process
with ``PYTHONPATH=TREE/src`` that measures ``gpipe bench``'s engine workloads with that tree's gpipe:
(b) the host overhead of 24 tiny ``nn.Linear(8, 8)`` layers, M=8, in µs per (layer, micro-batch), and
(a) a step of ``transformer_lm(2, 1024, 4, dim=256)`` at M=32 with dropout 0.1 — each as the Pipeline's
time over a plain PyTorch loop's in the same process (``gpipe.bench.engine.host`` / ``lm``), so that
machine noise common to both sides cancels. Both trees must have that module. The report: per tree the
median [min-max] of the per-round medians, and B / A of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Runs inside each measuring process, with the tree's gpipe on the path.
_MEASURE = """
import dataclasses, json, statistics, torch
from gpipe.bench.common import Bench
from gpipe.bench.engine import host, lm, sizes
torch.set_num_threads(1)
s = dataclasses.replace(sizes(Bench(quick=True, repeats=REPEATS)), chunks=(32,), dropouts=(0.1,))
h = host(s)
a = lm(s)
print(json.dumps({"host_ratio": statistics.median(h["ratio"]), "host_extra_us": statistics.median(h["extra_us"]),
                  "lm": a}))
"""


def _measure(tree: Path, repeats: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve() / "src")}
    code = _MEASURE.replace("REPEATS", str(repeats))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"measuring {tree} failed:\n{out.stderr[-2000:]}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    lm_ratios = [r for variant in data["lm"].values() for r in variant["ratio"]]
    return {
        "host_ratio": data["host_ratio"],
        "host_extra_us": data["host_extra_us"],
        "lm_ratio": statistics.median(lm_ratios),
    }


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="the tree to compare with (before)")
    parser.add_argument("b", type=Path, help="the tree to compare (after)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each measuring both trees (default: 6)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions inside a measurement (default: 3)")
    args = parser.parse_args()
    for tree in (args.a, args.b):
        if not (tree / "src" / "gpipe" / "bench" / "engine.py").is_file():
            raise SystemExit(f"{tree}: no src/gpipe/bench/engine.py (give the root of a gpipe checkout)")
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        order = [("A", args.a), ("B", args.b)] if r % 2 == 0 else [("B", args.b), ("A", args.a)]
        for name, tree in order:
            results[name].append(_measure(tree, args.repeats))
            print(f"round {r + 1}/{args.rounds} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    print(f"A = {args.a}, B = {args.b}; {args.rounds} rounds, the order alternating\n")
    print("| measure | A | B | B / A |\n|---|---|---|---|")
    for key, label in (("host_ratio", "(b) tiny layers: Pipeline / plain"),
                       ("host_extra_us", "(b) tiny layers: Pipeline - plain, µs per (layer, micro-batch)"),
                       ("lm_ratio", "(a) LM, M=32, dropout 0.1: Pipeline / plain")):  # fmt: skip
        a, b = [x[key] for x in results["A"]], [x[key] for x in results["B"]]
        print(f"| {label} | {_summary(a)} | {_summary(b)} | {statistics.median(b) / statistics.median(a):.3f} |")


if __name__ == "__main__":
    main()
