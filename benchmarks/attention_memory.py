"""Attention without (T, T) matrices (issue 27, item 1): a training step's memory of gpipe's
``transformer_lm`` against the sequence length, before and after attention moved to one fused
``F.scaled_dot_product_attention`` call.

Reproduce (from the repository root; about 3 min here)::

    .venv/bin/python benchmarks/attention_memory.py --out benchmarks/results/attention
    .venv/bin/python benchmarks/attention_memory.py --quick      # T = 256, 512, 1024; runs/attention

*Before* is ``src/gpipe/models/transformer.py`` as of commit ``--before`` (d51368c, the last one with
``nn.MultiheadAttention`` called with a causal mask), read with ``git show`` and imported beside
today's; *after* is today's. Model: ``transformer_lm(2, 1024, 4, dim=256, vocab=1000)`` (heads of 64,
``nn.MultiheadAttention``'s weights), a batch of 4 sequences of T random tokens, loss cross entropy,
one process, one thread. Two settings of dropout: *none* (dropout 0 everywhere: the same model and
arithmetic before and after) and *residual 0.1* (dropout 0.1; before, the attention probabilities
drop too, as its only dropout setting did; after, ``attention_dropout=0``: a CPU has no fused
kernel with dropout).

Each (version, setting, T) runs in a subprocess of its own, which builds the model, takes one
warm-up step, then measures a second step:

- *saved*: the bytes autograd keeps for backward over the step (``Pipeline(..., measure_memory=True)``
  with one stage and one micro-batch: ``gpipe.memory.ActivationMeter``'s peak);
- *peak RSS growth*: the process's peak resident memory (``ru_maxrss``) after the measured step less
  its resident memory before it, which also sees the transients a step makes and frees (scores
  before softmax, a mask); glibc is told to map blocks of 64 KiB and more on their own and to give
  freed memory back (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``), so that resident memory
  follows what is live.

From T to 4T, memory linear in T grows x4 and a term quadratic in T up to x16. The report fits
bytes = a·T + b·T² through the points and gives the share of b·T² at the largest T.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"none": 0.0, "residual 0.1": 0.1}


def _model(version: str, dropout: float, length: int, before: str) -> Any:
    import torch

    if version == "after":
        from gpipe.models import transformer_lm

        torch.manual_seed(0)
        return transformer_lm(2, 1024, 4, dim=256, vocab=1000, max_len=length, dropout=dropout, attention_dropout=0.0)
    source = subprocess.run(
        ["git", "show", f"{before}:src/gpipe/models/transformer.py"], cwd=ROOT, check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "transformer_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("transformer_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.transformer_lm(2, 1024, 4, dim=256, vocab=1000, max_len=length, dropout=dropout)


def _one(version: str, setting: str, length: int, before: str) -> dict[str, float]:
    """In this process: one warm-up step, then the measured one."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    from gpipe import Pipeline

    torch.set_num_threads(1)
    model = _model(version, SETTINGS[setting], length, before)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))

    pipe = Pipeline(model, [len(model)], chunks=1, loss_fn=loss_fn, checkpoint="never", devices=["cpu"],
                    cpu_threads=1, measure_memory=True)  # fmt: skip
    tokens = torch.randint(0, 1000, (4, length), generator=torch.Generator().manual_seed(0))
    pipe.step(tokens, tokens)
    pipe.zero_grad()

    def rss() -> float:  # resident now, from /proc (ru_maxrss is the peak so far)
        return float(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    start = rss()
    pipe.step(tokens, tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    assert pipe.last_trace is not None and pipe.last_trace.peak_activation_bytes is not None
    return {"saved": float(pipe.last_trace.peak_activation_bytes[0]), "rss_growth": max(peak - start, 0.0)}


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a·T + b·T² through the points."""
    s11 = sum(t * t for t, _ in points)
    s12 = sum(t**3 for t, _ in points)
    s22 = sum(t**4 for t, _ in points)
    y1 = sum(t * y for t, y in points)
    y2 = sum(t * t * y for t, y in points)
    det = s11 * s22 - s12 * s12
    return (y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T = 256, 512, 1024 (default: 512, 1024, 2048)")
    parser.add_argument("--before", default="d51368c", help="the commit of the attention before (default d51368c)")
    parser.add_argument("--out", help="where results.json and report.md go (default runs/attention)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # version/setting/T: measure in this process
    args = parser.parse_args()
    if args.one:
        version, setting, length = args.one.split("/")
        print(json.dumps(_one(version, setting, int(length), args.before)))
        return 0
    lengths = [256, 512, 1024] if args.quick else [512, 1024, 2048]
    out = Path(args.out or "runs/attention")
    out.mkdir(parents=True, exist_ok=True)
    # Large blocks mapped on their own and given back when freed: resident memory follows what is live
    # (else glibc keeps the warm-up step's freed memory and the measured step's peak does not show).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "MALLOC_MMAP_THRESHOLD_": "65536",
           "MALLOC_TRIM_THRESHOLD_": "0"}  # fmt: skip
    results: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
    for setting in SETTINGS:
        for version in ("before", "after"):
            for length in lengths:
                cmd = [sys.executable, __file__, "--before", args.before, "--one", f"{version}/{setting}/{length}"]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                results.setdefault(setting, {}).setdefault(version, {})[length] = row
                print(f"{setting:>12} {version:>6} T={length:5d}: saved {row['saved'] / 2**20:8.1f} MiB, "
                      f"peak RSS growth {row['rss_growth'] / 2**20:8.1f} MiB", flush=True)  # fmt: skip
    lines = [
        "# A training step's memory against the sequence length",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/attention_memory.py{' --quick' if args.quick else ''} "
        f"--out {out}`. Machine: {platform.machine()}, {os.cpu_count()} cores, one thread; "
        "`transformer_lm(2, 1024, 4, dim=256, vocab=1000)`, 4 sequences of T tokens, one step.",
        "",
        f"| dropout | attention | measure | {' | '.join(f'T={t} (MiB)' for t in lengths)} | "
        f"x from T={lengths[0]} to {lengths[-1]} | quadratic share at T={lengths[-1]} |",
        "|---|---|---|" + "---|" * (len(lengths) + 2),
    ]
    for setting, versions in results.items():
        for version, rows in versions.items():
            for key, label in (("saved", "saved for backward"), ("rss_growth", "peak RSS growth")):
                points = [(t, rows[t][key]) for t in lengths]
                a, b = _fit(points)
                top = lengths[-1]
                share = b * top * top / max(a * top + b * top * top, 1.0)
                growth = points[-1][1] / max(points[0][1], 1.0)
                cells = " | ".join(f"{y / 2**20:.1f}" for _, y in points)
                lines.append(f"| {setting} | {version} | {label} | {cells} | x{growth:.2f} | {share:.0%} |")
    lines += [
        "",
        "From T to 4T, memory linear in T grows x4; the quadratic share is b·T² / (a·T + b·T²) at the "
        "largest T of the least-squares fit a·T + b·T² (negative: the points bend the other way, within "
        "the noise of the measure).",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
