"""Layers split over tensor-parallel ranks (``Pipeline(tensor_parallel=t)``): pp2 x tp2 on 4 gloo
processes trains as the plain model does, for gpipe's Transformer and a Hugging Face Llama config
under 1F1B and a zero-bubble schedule; pp2 x fsdp2 x tp2 on 8 processes too. Bad plans and layouts
are refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from gpipe import Pipeline
from gpipe.distributed.tensor_parallel import check_plan, plan_of
from gpipe.models.transformer import DecoderLayer, EncoderLayer
from tests import dist_fsdp
from tests.dist_harness import Cases, Launches, run_ranks

STEPS, LR = 3, 1e-2
TP_CASES = [("transformer", "1f1b"), ("llama", "zb-h1"), ("blocks", "1f1b")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    """The 4-rank runs of this module in two launches of 4 processes (each launch costs seconds):
    'train' trains pp2 x tp2 on each of TP_CASES and dp2 x tp2, and saves a checkpoint at pp2 x tp2;
    'load' (other processes: nothing of the saving one's memory helps) loads it at pp1 x fsdp2 x
    tp2."""
    root = tmp_path_factory.mktemp("tp")
    ckpt = str(root / "ckpt")
    common = {"steps": STEPS, "lr": LR, "fsdp": False, "tp": 2}
    train: Cases = {
        f"{kind}-{schedule}": ("dist_fsdp:sharded_train", {"kind": kind, "schedule": schedule, "dp": 1, **common})
        for kind, schedule in TP_CASES
    }
    train["replicas"] = ("dist_fsdp:sharded_train", {"kind": "transformer", "schedule": "1f1b", "dp": 2, **common})
    train["save"] = ("dist_fsdp:split_save", {"directory": ckpt, "steps": 2})
    load: Cases = {"load": ("dist_fsdp:split_load", {"directory": ckpt, "dp": 2, "fsdp": True, "tp": 2})}
    return Launches(root, {"train": (4, train), "load": (4, load)}, timeout=280, needs={"load": "train"})


def _check(ranks: list[dict[str, Any]], kind: str, steps: int, lr: float) -> None:
    plain = dist_fsdp.plain_reference(kind, steps, lr)
    for r in ranks:
        # every split layer's all-reduce waited for, a recomputed micro-batch's last one too (an
        # unwaited one keeps its buffers to the end of the process, which warns of it)
        assert r["in_flight"] == 0, r["in_flight"]
        torch.testing.assert_close(r["losses"][0], plain["losses"][0], rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.stack(r["losses"]), torch.stack(plain["losses"]), rtol=1e-5, atol=0)
    grads = {n: g for r in ranks for n, g in r["grads"].items()}  # whole (gathered) on every rank
    assert set(grads) == set(plain["grads"])
    for name, g in grads.items():
        # (a key projection's bias has a gradient of zero but for rounding: atol)
        torch.testing.assert_close(g, plain["grads"][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(("kind", "schedule"), TP_CASES)
def test_pipeline_times_tensor_parallel_trains_as_the_plain_model(runs: Launches, kind: str, schedule: str) -> None:
    ranks = runs("train", f"{kind}-{schedule}")
    _check(ranks, kind, STEPS, LR)
    # Each stage on 2 tp ranks: whole, the 4 ranks would hold the model twice; split, its projections once.
    total = dist_fsdp.plain_reference(kind, STEPS, LR)["parameters"]
    held = sum(r["elements"]["parameters"] for r in ranks)
    assert total < held < 2 * total
    assert held == sum(r["elements"]["gradients"] for r in ranks)


def test_replicas_of_split_layers(runs: Launches) -> None:
    """dp2 x tp2 replicated (one stage): the replicas all-reduce the split layers' shards."""
    _check(runs("train", "replicas"), "transformer", STEPS, LR)


def test_pipeline_times_fsdp_times_tensor_parallel(tmp_path: Path) -> None:
    """pp2 x fsdp2 x tp2 on 8 processes (the slowest test here, ~1 min): the plain model's losses and
    gradients; one all-gather and one reduce-scatter per stage and step."""
    steps, lr = 3, 1e-2
    ranks = run_ranks(
        "dist_fsdp:sharded_train", 8, tmp_path, timeout=400, kind="transformer", schedule="1f1b", dp=2, steps=steps,
        lr=lr, fsdp=True, tp=2,
    )  # fmt: skip
    _check(ranks, "transformer", steps, lr)
    for r in ranks:
        assert r["collectives"] == {"all_gather": 1, "reduce_scatter": 1}


@pytest.fixture(scope="module")
def llama() -> nn.Sequential:
    """The Llama of dist_fsdp as layers (traced once: the tests below only read its plans)."""
    return dist_fsdp.model_and_data("llama")[0]


def test_auto_plans(llama: nn.Sequential) -> None:
    """gpipe's Transformer layers split by heads and feed-forward features; a Llama block by its
    Hugging Face plan; an embedding not at all."""
    layer = EncoderLayer(32, 64, 4, 0.0, 1.0, head_dim=8)
    plan = plan_of(layer, 2, "auto")
    assert plan is not None
    assert {n for n, s in plan.items() if isinstance(s, ColwiseParallel)} == {"attn.q", "attn.k", "attn.v", "ff.inner"}
    assert {n for n, s in plan.items() if isinstance(s, RowwiseParallel)} == {"attn.out_proj", "ff.outer"}
    decoder = plan_of(DecoderLayer(32, 64, 4, 0.0, 1.0, cross=True, head_dim=8), 4, "auto")
    assert decoder is not None and "cross_attn.k" in decoder and "self_attn.out_proj" in decoder
    assert plan_of(nn.Embedding(10, 4), 2, "auto") is None

    block = llama[1]
    found = plan_of(block, 2, "auto")
    assert found is not None
    assert {n.rsplit(".", 1)[1] for n, s in found.items() if isinstance(s, RowwiseParallel)} == {"o_proj", "down_proj"}
    assert len(found) == 7


def test_refusals(llama: nn.Sequential) -> None:
    with pytest.raises(ValueError, match=r"nn\.MultiheadAttention.*build the Transformer with head_dim=dim // heads"):
        plan_of(EncoderLayer(32, 64, 4, 0.0, 1.0), 2, "auto")
    with pytest.raises(ValueError, match=r"tensor_parallel=3 does not divide the 4 heads of EncoderLayer\.attn"):
        plan_of(EncoderLayer(32, 64, 4, 0.0, 1.0, head_dim=8), 3, "auto")
    with pytest.raises(ValueError, match=r"tensor_parallel=3 does not divide the model's num_attention_heads \(4\)"):
        plan_of(llama[1], 3, "auto")
    with pytest.raises(TypeError, match=r"tp_plan must be 'auto', a dict .* \(tp_plan: 'rows'\)"):
        check_plan("rows")
    with pytest.raises(TypeError, match=r"tp_plan must be"):
        check_plan({"*.q": "colwise"})
    mlp, _, _, mse = dist_fsdp.model_and_data("mlp")
    with pytest.raises(ValueError, match=r"tensor_parallel=2 needs torch.distributed"):
        Pipeline(mlp, [16], chunks=2, loss_fn=mse, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"tensor_parallel must be a positive integer \(tensor_parallel: 0\)"):
        Pipeline(mlp, [16], chunks=2, loss_fn=mse, tensor_parallel=0)
    with pytest.raises(ValueError, match=r"tensor_parallel must be a positive integer \(tensor_parallel: '2'\)"):
        Pipeline(mlp, [16], chunks=2, loss_fn=mse, tensor_parallel="2")  # type: ignore[arg-type]


def test_checkpoints_move_between_split_and_whole_layouts(runs: Launches, tmp_path: Path) -> None:
    """Saved at pp2 x tp2 (each tp rank writes its halves of the split projections), resumed at
    pp1 x tp2 and at pp1 x fsdp2 x tp2, and in one process with 1 and 3 stages: the uninterrupted
    run's next loss."""
    ckpt, expected = str(runs.root / "ckpt"), runs("train", "save")[0]["next"]
    moved = {
        2: run_ranks("dist_fsdp:split_load", 2, tmp_path / "b2", directory=ckpt, dp=1, fsdp=False, tp=2),
        4: runs("load", "load"),
    }
    for world in (2, 4):
        for r in moved[world]:
            assert r["step"] == 2
            torch.testing.assert_close(r["next"], expected, rtol=1e-6, atol=0)
    for workers in (1, 3):
        resumed = dist_fsdp.load_in_one_process(ckpt, workers)
        assert resumed["step"] == 2
        torch.testing.assert_close(resumed["next"], expected, rtol=1e-6, atol=0)
