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
from tests.dist_harness import POOL, Pool, run_ranks

STEPS, LR = 3, 1e-2
TP_CASES = [("transformer", "1f1b"), ("llama", "zb-h1"), ("blocks", "1f1b")]


# The 4-rank pp2 x tp2 and dp2 x tp2 runs, and the save at pp2 x tp2 and its loads at pp1 x tp2 and pp1 x
# fsdp2 x tp2 (in a later launch: other processes), as cases of the session's pool (tests/dist_harness.py:
# a few launches in all).
SPLIT = {"steps": STEPS, "lr": LR, "fsdp": False, "tp": 2}
TRAIN = {
    c: POOL.add(4, f"tp {c[0]}-{c[1]}", "dist_fsdp:sharded_train", kind=c[0], schedule=c[1], dp=1, **SPLIT)
    for c in TP_CASES
}
REPLICAS = POOL.add(4, "tp replicas", "dist_fsdp:sharded_train", kind="transformer", schedule="1f1b", dp=2, **SPLIT)
SAVE = POOL.add(4, "tp save", "dist_fsdp:split_save", directory="{pool}/tp-ckpt", steps=2)
LOAD = {
    world: POOL.add(
        world, f"tp load on {world}", "dist_fsdp:split_load", after=SAVE, directory="{pool}/tp-ckpt", dp=dp,
        fsdp=dp > 1, tp=2,
    )
    for world, dp in ((2, 1), (4, 2))
}  # fmt: skip


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
def test_pipeline_times_tensor_parallel_trains_as_the_plain_model(pool: Pool, kind: str, schedule: str) -> None:
    ranks = pool(TRAIN[kind, schedule])
    _check(ranks, kind, STEPS, LR)
    # Each stage on 2 tp ranks: whole, the 4 ranks would hold the model twice; split, its projections once.
    total = dist_fsdp.plain_reference(kind, STEPS, LR)["parameters"]
    held = sum(r["elements"]["parameters"] for r in ranks)
    assert total < held < 2 * total
    assert held == sum(r["elements"]["gradients"] for r in ranks)


def test_replicas_of_split_layers(pool: Pool) -> None:
    """dp2 x tp2 replicated (one stage): the replicas all-reduce the split layers' shards."""
    _check(pool(REPLICAS), "transformer", STEPS, LR)


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


def test_checkpoints_move_between_split_and_whole_layouts(pool: Pool) -> None:
    """Saved at pp2 x tp2 (each tp rank writes its halves of the split projections), resumed at
    pp1 x tp2 and at pp1 x fsdp2 x tp2, and in one process with 1 and 3 stages: the uninterrupted
    run's next loss."""
    expected = pool(SAVE)[0]["next"]
    for world in (2, 4):
        for r in pool(LOAD[world]):
            assert r["step"] == 2
            torch.testing.assert_close(r["next"], expected, rtol=1e-6, atol=0)
    for workers in (1, 3):
        resumed = dist_fsdp.load_in_one_process(str(pool.path("tp-ckpt")), workers)
        assert resumed["step"] == 2
        torch.testing.assert_close(resumed["next"], expected, rtol=1e-6, atol=0)
