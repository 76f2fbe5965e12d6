"""`gpipe train --data-parallel D [--fsdp] [--tensor-parallel T]` under torchrun: D replicas of a K-stage
pipeline (and layers split over T ranks) give the losses of one replica of the same global batch
(training and held-out), write one set of metrics and checkpoints that resume in another layout; the
layouts that cannot run are refused in one line, and per-parameter clipping clips a sharded gradient
by its whole norm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from gpipe.cli import main
from gpipe.recipe import clip_grad_norm_per_parameter
from gpipe.saving import verify
from tests.dist_harness import POOL, Pool, free_port

ROOT = Path(__file__).resolve().parents[1]
# A tiny run: the default T(2, 256, 4) on synthetic pairs, small batches, held-out losses at 2 and 4.
FLAGS = ["--batch", "16", "--eval-every", "2", "--checkpoint-every", "2", "--no-progress"]


def start_train(nproc: int, *argv: str) -> subprocess.Popen[str]:
    """``gpipe train`` under torchrun with ``nproc`` processes (gloo on CPU), started: its output read
    by :func:`finish`."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
        "-m", "gpipe", "train", *FLAGS, *argv,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def finish(proc: subprocess.Popen[str], ok: bool = True) -> subprocess.CompletedProcess[str]:
    """What ``proc`` (:func:`start_train`) wrote, once it ended, bounded by a timeout (its processes
    killed after it); ``ok``: it must succeed (else fail)."""
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert (done.returncode == 0) == ok, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def gpipe_train(nproc: int, *argv: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """``gpipe train`` under torchrun with ``nproc`` processes, run to its end (see :func:`finish`)."""
    return finish(start_train(nproc, *argv), ok)


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def same_numbers(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """The same steps, losses and held-out losses (float noise: each replica sums its share)."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        keys = sorted(k for k in g if k.startswith(("loss", "eval_")))
        assert keys == sorted(k for k in w if k.startswith(("loss", "eval_"))), (g, w)
        assert [g[k] for k in keys] == pytest.approx([w[k] for k in keys], rel=1e-5), (g["step"], keys)


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Six steps of --partitions 2: what the replicated runs are compared with."""
    out = tmp_path_factory.mktemp("d1") / "run"
    # in this process (two 'cpu' stages: as on two ranks, which test_torchrun checks)
    assert main(["train", *FLAGS, "--partitions", "2", "--steps", "6", "--out", str(out)]) == 0
    return [{k: v for k, v in r.items() if not k.startswith("bleu")} for r in rows(out)]


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_replicas_train_as_one_and_resume_in_another_layout(
    tmp_path: Path, one_replica: list[dict[str, Any]], fsdp: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    sharded = ["--fsdp"] if fsdp else []
    done = gpipe_train(4, "--partitions", "2", "--data-parallel", "2", *sharded, "--steps", "4", "--out", str(out))
    got = rows(out)
    same_numbers(got, one_replica[:4])
    assert not any(k.startswith("bleu") for r in got for k in r)  # (decoding does not run on replicas)
    note = [line for line in done.stderr.splitlines() if line.startswith("note:")]
    assert note == [
        "note: evaluations show no BLEU with --data-parallel 2: decoding does not run on replicas or split layers "
        "of a pipeline (the held-out losses are computed on all of them); decode a checkpoint with gpipe translate "
        f"--checkpoint {out}"
    ]
    assert len(done.stdout.splitlines()) == 1 and done.stdout.startswith("step 4: loss "), done.stdout  # rank 0 alone
    step = out / "checkpoints" / "step-00000004"
    writers = range(4) if fsdp else range(2)  # every rank its shards; or replica 0's ranks, for all replicas
    assert sorted(p.name for p in step.glob("*.distcp")) == [f"__{r}_0.distcp" for r in writers]
    # each writer's file hashed by its rank, all listed by rank 0's manifest with the extra files
    files = json.loads((step / "manifest.json").read_text())["files"]
    assert sorted(files) == sorted(p.name for p in step.iterdir() if p.name != "manifest.json")
    assert verify(step) == []
    config = json.loads((step / "run.json").read_text())["config"]
    assert (config["partitions"], config["data_parallel"], config["fsdp"]) == (2, 2, fsdp)

    # In one process the run's own layout is refused, naming the launch line; --data-parallel 1 continues it.
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    launch = "torchrun --nproc-per-node 4 -m gpipe train --partitions 2 --data-parallel 2" + (" --fsdp" if fsdp else "")
    assert err.count("\n") == 1 and err.startswith("error: --data-parallel 2 runs 2 replicas") and launch in err, err
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--data-parallel", "1", "--no-progress"]) == 0
    changed = "--data-parallel 2 -> 1, --fsdp True -> False" if fsdp else "--data-parallel 2 -> 1"
    assert f"settings changed from the run's: {changed}, --steps 4 -> 6\n" in capsys.readouterr().err
    same_numbers([{k: v for k, v in r.items() if not k.startswith("bleu")} for r in rows(out)], one_replica)


def test_a_sharded_causal_lm_with_tied_weights_trains_as_one_replica(tmp_path: Path) -> None:
    """The built-in GPT-2 ties its token embedding to its output projection (on the first and the
    last stage); 4 steps at D=2 with --fsdp (clipped per parameter: a sharded gradient by its whole
    norm) give D=1's numbers."""
    pytest.importorskip("transformers")
    flags = ["--model", "hf", "--partitions", "2", "--eval-batches", "2", "--steps", "4"]
    started = start_train(4, *flags, "--data-parallel", "2", "--fsdp", "--out", str(tmp_path / "d2"))
    assert main(["train", *FLAGS, *flags, "--out", str(tmp_path / "d1")]) == 0  # (while it runs)
    done = finish(started)
    one = [{k: v for k, v in r.items() if k != "sample"} for r in rows(tmp_path / "d1")]
    same_numbers(rows(tmp_path / "d2"), one)
    assert "eval_perplexity" in rows(tmp_path / "d2")[-1] and "sample" in rows(tmp_path / "d1")[-1]
    assert "note: evaluations show no sample generation with --data-parallel 2" in done.stderr


def test_a_llama_split_over_two_ranks_trains_as_one(tmp_path: Path) -> None:
    """--model hf with a Llama config (its Hugging Face tensor-parallel plan): --partitions 2
    --tensor-parallel 2 on 4 processes gives the losses of --partitions 2 (in one process)."""
    transformers = pytest.importorskip("transformers")
    from gpipe.train.config import TrainConfig
    from gpipe.train.setup import hf_config, make_data

    cfg = TrainConfig(model="hf")
    vocab = hf_config(cfg, make_data(cfg)).vocab_size  # type: ignore[arg-type]
    llama = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    (tmp_path / "llama.json").write_text(llama.to_json_string())
    flags = ["--model", "hf", "--hf-config", str(tmp_path / "llama.json"), "--partitions", "2", "--steps", "2"]
    started = start_train(4, *flags, "--tensor-parallel", "2", "--eval-batches", "1", "--out", str(tmp_path / "t2"))
    # the reference in this process while it runs (two 'cpu' stages: as on two ranks, which test_torchrun checks)
    assert main(["train", *FLAGS, *flags, "--eval-batches", "1", "--out", str(tmp_path / "t1")]) == 0
    finish(started)
    same_numbers(rows(tmp_path / "t2"), rows(tmp_path / "t1"))


def clipped_shards() -> dict[str, torch.Tensor]:
    """One of 2 ranks (tests.dist_entry): a gradient sharded over both, clipped per parameter to 1."""
    if not dist.is_initialized():  # (a case of the session's pool: an earlier case may have started it)
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    p = nn.Parameter(distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    clip_grad_norm_per_parameter([p], 1.0)
    return {"grad": p.grad.full_tensor()}


# a case of the session's pool (tests/dist_harness.py: a few launches in all)
CLIPPED = POOL.add(2, "clipped shards", "test_train_data_parallel:clipped_shards")


def test_a_sharded_gradient_is_clipped_by_its_whole_norm(pool: Pool) -> None:
    whole = nn.Parameter(torch.zeros(6, 2))
    whole.grad = torch.arange(12.0).reshape(6, 2)
    clip_grad_norm_per_parameter([whole], 1.0)
    for rank in pool(CLIPPED):
        torch.testing.assert_close(rank["grad"], whole.grad)


@pytest.mark.parametrize(
    ("world", "argv", "message"),
    [
        (None, ["--data-parallel", "2"], "error: --data-parallel 2 runs 2 replicas of the pipeline, a process per "
         "stage and replica: start it with torchrun --nproc-per-node 4 -m gpipe train --partitions 2 "
         "--data-parallel 2 ... (or give --data-parallel 1 to train in one process)"),
        (None, ["--fsdp"], "error: --fsdp shards each stage over its --data-parallel replicas, but --data-parallel is "
         "1: give --data-parallel 2 or more (under torchrun, D x --partitions processes), or leave --fsdp out"),
        ("4", ["--data-parallel", "1", "--fsdp"], "error: --fsdp shards each stage over its --data-parallel replicas"),
        ("6", ["--data-parallel", "2"], "error: --data-parallel 2 x --partitions 2 needs 4 processes, but torchrun "
         "started 6: start torchrun with 4 processes in all (--nnodes x --nproc-per-node), or give --partitions 3, "
         "or give --data-parallel 3"),
        ("4", ["--partitions", "2"], "error: --partitions 2 differs from the 4 processes of torchrun: give "
         "--partitions 4, or --data-parallel 2 (2 replicas), or start torchrun with --nproc-per-node 2"),
        ("8", ["--data-parallel", "4", "--batch", "6"], "error: --batch 6 does not split into 4 shares, one per "
         "--data-parallel replica (as torch.chunk splits it: 3 shares of up to 2 rows); give a --batch that is a "
         "multiple of 4"),
        ("4", ["--data-parallel", "-1"], "error: --data-parallel must be positive (got -1)"),
        ("3", ["--data-parallel", "0"], "error: --data-parallel 0 takes as many replicas as torchrun's 3 processes "
         "hold, but they are not a multiple of --partitions 2 x --tensor-parallel 1"),
        (None, ["--tensor-parallel", "2", "--head-dim", "16"], "error: --tensor-parallel 2 splits each layer over 2 "
         "processes: start it "
         "with torchrun --nproc-per-node 4 -m gpipe train --partitions 2 --data-parallel 1 --tensor-parallel 2 ..."),
        ("6", ["--tensor-parallel", "2", "--head-dim", "16"], "error: --data-parallel 1 x --partitions 2 x "
         "--tensor-parallel 2 needs 4 "
         "processes, but torchrun started 6"),
    ],
)  # fmt: skip
def test_layouts_that_cannot_run_are_refused_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    world: str | None,
    argv: list[str],
    message: str,
) -> None:
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:  # (as torchrun sets it; the check comes before any process group)
        monkeypatch.setenv("WORLD_SIZE", world)
    assert main(["train", "--out", str(tmp_path / "x"), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err
    assert not (tmp_path / "x").exists()
