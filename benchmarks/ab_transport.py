"""The transport between ranks of two gpipe source trees, taking turns: a 2-rank step's time.

Reproduce (from the repository root; BEFORE is a checkout of the commit to compare with)::

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/ab_transport.py /tmp/before . --out benchmarks/results/transport

Each round launches, for tree A and then tree B (the order alternating between rounds), two processes
over gloo (``PYTHONPATH=TREE/src``, one intra-op thread each, CUDA hidden) that train the same model —
8 blocks of Linear(1024, 1024)-ReLU, batch 256, M=8, ``checkpoint='never'`` — for a few warm-up steps,
then time ``--steps`` steps of each schedule; rank 0 reports the median step. The report: per tree and
schedule the median [min-max] of the rounds' medians, and B / A of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")

# Runs inside each rank, with the tree's gpipe on the path.
_MEASURE = """
import json, statistics, sys, time, torch, torch.nn as nn, torch.nn.functional as F
from gpipe import Pipeline
from gpipe.distributed import init_from_env
init_from_env()
torch.set_num_threads(1)
steps, out = int(sys.argv[1]), {}
for schedule in sys.argv[2].split(","):
    virtual = 2 if schedule in ("interleaved-1f1b", "zb-v") else 1
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(8)])
    pipe = Pipeline(model, [8 // (2 * virtual)] * (2 * virtual), chunks=8, loss_fn=F.mse_loss, schedule=schedule,
                    virtual=virtual, checkpoint="never")
    x, y = torch.randn(256, 1024), torch.randn(256, 1024)
    for _ in range(3):
        pipe.step(x, y)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pipe.step(x, y)
        times.append(time.perf_counter() - start)
    out[schedule] = statistics.median(times)
if torch.distributed.get_rank() == 0:
    print("RESULT " + json.dumps(out))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _round(tree: Path, steps: int, schedules: str) -> dict[str, float]:
    port = _port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(tree / "src"),
        }  # fmt: skip
        cmd = [sys.executable, "-c", _MEASURE, str(steps), schedules]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        if p.returncode:
            raise SystemExit(f"a rank of {tree} failed:\n{output[-3000:]}")
    line = next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))


def _name(tree: Path) -> str:
    """The tree's commit, where it is a git checkout (its folder otherwise)."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"commit {done.stdout.strip()}" if done.returncode == 0 else str(tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("a", type=Path, help="tree A (before)")
    parser.add_argument("b", type=Path, help="tree B (after)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("runs/ab_transport"))
    args = parser.parse_args()
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            results[side].append(_round(trees[side], args.steps, ",".join(SCHEDULES)))
            print(f"round {r} {side}: {results[side][-1]}", flush=True)
    lines = [
        "# The transport between ranks: two trees side by side",
        "",
        f"Reproduce: `python benchmarks/ab_transport.py A B --rounds {args.rounds} --steps {args.steps}`; "
        f"A = {_name(trees['A'])}, B = {_name(trees['B'])}. 2 ranks over gloo, 1 thread each; see the script's "
        "docstring.",
        "",
        "| schedule | A step (ms) | B step (ms) | B / A |",
        "|---|---|---|---|",
    ]
    for s in SCHEDULES:
        a, b = ([1000 * x[s] for x in results[side]] for side in ("A", "B"))
        ma, mb = statistics.median(a), statistics.median(b)
        lines.append(
            f"| {s} | {ma:.1f} [{min(a):.1f}-{max(a):.1f}] | {mb:.1f} [{min(b):.1f}-{max(b):.1f}] | {mb / ma:.3f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
