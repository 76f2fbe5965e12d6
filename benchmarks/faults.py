"""Faults (issue: survive faults): what a lost rank costs under torchrun's elastic agent, and what the
non-finite check costs a step.

    .venv/bin/python benchmarks/faults.py --out benchmarks/results/faults      # ≈ 4 min here

1. **Recovery.** The acceptance's job: ``torchrun --nproc-per-node 2 --max-restarts 2 -m gpipe train
   --steps 40 --checkpoint-every 10``, rank 1 killed (SIGKILL) or frozen (SIGSTOP) once step 24 is done;
   and two agents as two nodes (``--nnodes 1:2``, ``--data-parallel 0``) of which one is killed with its
   worker. Reported: the time from the fault to the end of the first step after the restart (the
   restart's own log, OUT/restarts.jsonl), the steps run again, whether every step's loss equals the
   uninterrupted run's (bitwise; for the lost node, the largest relative difference).
2. **The non-finite check** (:func:`gpipe.nonfinite.all_finite`: every gradient read once, after the
   step; or, as ``gpipe train`` does when it clips (the default), the norms the clipping computes anyway
   checked), measured side by side with a step without it, alternating, in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.dist_harness import free_port  # noqa: E402
from tests.test_restarts import children, rank_of, rows, strip  # noqa: E402

from gpipe import Pipeline  # noqa: E402
from gpipe.nonfinite import all_finite  # noqa: E402
from gpipe.recipe import clip_grad_norm_per_parameter, grad_norms  # noqa: E402

TRAIN = ["-m", "gpipe", "train", "--steps", "40", "--checkpoint-every", "10", "--eval-every", "10", "--eval-batches",
         "1", "--no-progress", "--tensorboard", "off"]  # fmt: skip
AFTER = 24


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    return env


def _start(args: list[str], out: Path, *train: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, *TRAIN, *train, "--out", str(out)]
    return subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def _wait_for_step(out: Path, job: subprocess.Popen[str]) -> float:
    deadline = time.monotonic() + 300
    while not rows(out) or rows(out)[-1]["step"] < AFTER:
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or stalled before step {AFTER}: {job.communicate()[0][-3000:]}")
        time.sleep(0.01)
    return time.time()


def _finish(job: subprocess.Popen[str]) -> str:
    try:
        output = job.communicate(timeout=400)[0]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    if job.returncode != 0:
        raise RuntimeError(output[-4000:])
    return output


def _compare(out: Path, reference: list[dict[str, Any]]) -> dict[str, Any]:
    got = rows(out)
    worst = max(
        (abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(got, reference) for k in ("loss", "eval_loss") if k in b),
        default=0.0,
    )
    (restart,) = [json.loads(line) for line in (out / "restarts.jsonl").read_text().splitlines()]
    return {
        "steps": len(got),
        "bitwise": [strip(r) for r in got] == [strip(r) for r in reference],
        "max_relative_difference": worst,
        "lost": restart["lost"],
        "resumed_from": restart["resumed_from"],
        "steps_again": restart["steps_again"],
        "fault_to_first_step_s": restart["seconds"],
    }


def recovery(out: Path) -> dict[str, Any]:
    reference_out = out / "reference"
    subprocess.run([sys.executable, *TRAIN, "--out", str(reference_out)], env=_env(), cwd=ROOT, check=True,
                   capture_output=True, timeout=400)  # fmt: skip
    reference = rows(reference_out)
    results: dict[str, Any] = {}
    for name, sig in (("SIGKILL of rank 1", signal.SIGKILL), ("SIGSTOP of rank 1", signal.SIGSTOP)):
        folder = out / name.split()[0].lower()
        job = _start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"], folder)
        _wait_for_step(folder, job)
        (victim,) = [p for p in children(job.pid) if rank_of(p) == 1]
        os.kill(victim, sig)
        _finish(job)
        results[name] = _compare(folder, reference)
    folder, port = out / "node", free_port()
    node = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", f"bench-{port}", "--max-restarts", "2", "--rdzv-conf",
            "last_call_timeout=3"]  # fmt: skip
    first = _start(node, folder, "--partitions", "1", "--data-parallel", "0")
    time.sleep(0.5)
    second = _start(node, folder, "--partitions", "1", "--data-parallel", "0")
    _wait_for_step(folder, first)
    for worker in children(second.pid):
        os.kill(worker, signal.SIGKILL)
    os.killpg(second.pid, signal.SIGKILL)
    second.communicate()
    _finish(first)
    results["one of two nodes killed (--nnodes 1:2)"] = _compare(folder, reference)
    return results


def check_cost(repeats: int, batch: int) -> dict[str, Any]:
    """Steps alternating: plain; with the check reading the gradients; with the paper's per-parameter
    clipping (its norms); with the clipping and the check on its norms (what ``gpipe train`` does)."""
    torch.manual_seed(0)
    width, layers = 1024, 8
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)))
    pipe = Pipeline(model, [layers // 2, layers // 2], chunks=4, devices=["cpu", "cpu"], loss_fn=nn.MSELoss())
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def plain() -> None:
        pipe.step(x, y)

    def checked() -> None:
        assert all_finite(pipe, float(pipe.step(x, y)))

    def clipped() -> None:
        pipe.step(x, y)
        clip_grad_norm_per_parameter(pipe.parameters(), 1.0, norms=grad_norms(pipe.parameters()))

    def clipped_and_checked() -> None:
        loss = float(pipe.step(x, y))
        norms = grad_norms(pipe.parameters())
        assert all_finite(pipe, loss, norms=[n for _, n in norms])
        clip_grad_norm_per_parameter(pipe.parameters(), 1.0, norms=norms)

    kinds = {"plain": plain, "checked": checked, "clipped": clipped, "clipped_and_checked": clipped_and_checked}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for i in range(repeats + 1):
        for name, run in kinds.items():
            began = time.perf_counter()
            run()
            if i:
                times[name].append(time.perf_counter() - began)
            for p in pipe.parameters():
                p.grad = None
    median = {name: statistics.median(t) for name, t in times.items()}
    loss = float(pipe.step(x, y))
    norms = [n for _, n in grad_norms(pipe.parameters())]
    alone: dict[str, list[float]] = {"check_alone": [], "check_on_norms_alone": []}
    for _ in range(repeats):
        for name, run in (("check_alone", lambda: all_finite(pipe, loss)),
                          ("check_on_norms_alone", lambda: all_finite(pipe, loss, norms=norms))):  # fmt: skip
            began = time.perf_counter()
            run()
            alone[name].append(time.perf_counter() - began)
    median |= {name: statistics.median(t) for name, t in alone.items()}
    return {
        "model": f"{layers} x Linear({width}, {width}) + GELU, 2 stages, batch {batch}, 4 micro-batches",
        "parameters": sum(p.numel() for p in pipe.parameters()),
        **{f"{name}_s": t for name, t in median.items()},
        "check_reading_gradients": median["checked"] / median["plain"],
        "check_on_the_clipping_norms": median["clipped_and_checked"] / median["clipped"],
    }


def _earlier_recovery(out: Path) -> dict[str, Any]:
    """--check-only: the recovery measured by an earlier run into ``out``, kept."""
    try:
        return dict(json.loads((out / "results.json").read_text())["recovery"])
    except (OSError, ValueError, KeyError):
        return {}


def _recovery_in_a_temporary_folder() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpipe-faults-") as folder:  # (the runs' checkpoints: not kept)
        return recovery(Path(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/faults")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--check-only", action="store_true",
                        help="the non-finite check alone (an earlier run's recovery is kept)")  # fmt: skip
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "check": [check_cost(args.repeats, batch) for batch in (64, 1024)],
        "recovery": _earlier_recovery(out) if args.check_only else _recovery_in_a_temporary_folder(),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "# Faults", "", f"{results['machine']}. Command: `.venv/bin/python benchmarks/faults.py --out {out}`", "",
        "| fault | fault to the first step after the restart | steps run again | losses |", "|---|---|---|---|",
    ]  # fmt: skip
    for name, r in results["recovery"].items():
        differ = f"max relative difference {r['max_relative_difference']:.1e}"
        same = "bitwise the uninterrupted run's" if r["bitwise"] else differ
        again = f"{r['steps_again']} (from step {r['resumed_from']})"
        lines.append(f"| {name} | {r['fault_to_first_step_s']:.1f} s | {again} | {same} |")
    lines += [
        "",
        "The non-finite check, side by side in one process (medians; ratios to the step without it):",
        "",
        "| model | step | check reading the gradients | with clipping: check on its norms |",
        "|---|---|---|---|",
    ]
    for c in results["check"]:
        lines.append(f"| {c['model']} | {c['plain_s'] * 1e3:.1f} ms | x{c['check_reading_gradients']:.3f}; alone "
                     f"{c['check_alone_s'] * 1e3:.2f} ms | x{c['check_on_the_clipping_norms']:.3f} (of "
                     f"{c['clipped_s'] * 1e3:.1f} ms); alone {c['check_on_norms_alone_s'] * 1e6:.0f} us |")  # fmt: skip
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
