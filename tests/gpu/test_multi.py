"""Two ranks on two GPUs (``make gpu-check-multi``): a 1F1B step under NCCL, as torchrun starts it
(tests/dist_entry.py's ``step`` case, NCCL's own point-to-point), against the same pipeline on the two
GPUs in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests import dist_cases
from tests.dist_harness import ROOT, _rank_env, free_port, wait
from tests.gpu.common import cuda_multi

pytestmark = cuda_multi

WORLD, CHUNKS, TIMEOUT = 2, 4, 240


def test_two_ranks_step_as_one_process_does(tmp_path: Path, record: Callable[..., Any]) -> None:
    port, procs = free_port(), []
    for rank in range(WORLD):
        env = _rank_env(rank, WORLD, port)
        env.pop("CUDA_VISIBLE_DEVICES")  # (the harness hides GPUs from its CPU ranks) each rank its GPU
        env["GPIPE_TEST_P2P"] = "nccl"  # NCCL's own semantics, not the gloo emulation
        kwargs = json.dumps({"schedule": "1f1b", "chunks": CHUNKS})
        cmd = [sys.executable, "-m", "tests.dist_entry", "step", str(tmp_path / f"rank{rank}.pt"), kwargs]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    codes, outputs, seconds = wait(procs, TIMEOUT)
    assert codes == [0] * WORLD, "\n".join(f"--- rank {r} ({c}) ---\n{o[-3000:]}" for r, (c, o) in
                                           enumerate(zip(codes, outputs, strict=True)))  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt", map_location="cpu") for r in range(WORLD)]

    torch.manual_seed(5)
    pipe = dist_cases.build("1f1b", WORLD, CHUNKS, devices=["cuda:0", "cuda:1"])
    x, y = dist_cases.data()
    loss = pipe.step(x, y).detach().cpu()
    single = {n: g.cpu() for n, g in dist_cases.grads_of(pipe).items()}
    merged = {n: g for r in ranks for n, g in r["grads"].items()}
    norm = lambda grads: float(sum(float(g.double().pow(2).sum()) for g in grads.values()))  # noqa: E731
    record(seconds=seconds, losses=[float(r["losses"][0]) for r in ranks], single_loss=float(loss),
           grad_sq_norm=norm(merged), single_grad_sq_norm=norm(single),
           same_names=set(merged) == set(single))  # fmt: skip
    for r in ranks:
        torch.testing.assert_close(r["losses"][0].cpu(), loss, rtol=1e-5, atol=1e-6)
    assert abs(norm(merged) - norm(single)) <= 1e-5 * norm(single)
    if set(merged) == set(single):
        for name, g in single.items():
            torch.testing.assert_close(merged[name], g, rtol=1e-5, atol=1e-6)
