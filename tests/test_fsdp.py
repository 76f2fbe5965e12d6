"""Pipelines whose stages are sharded over their data-parallel group (``Pipeline(fsdp=True)``):
pp2 x fsdp2 on 4 gloo processes trains as the plain model does (loss and gradients), gathers each
stage's parameters once per step and reduce-scatters its gradients once, and keeps 1/dp of the
parameters, gradients and optimizer state on each rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpipe import Pipeline
from tests import dist_fsdp
from tests.dist_harness import POOL, Pool

CASES = [
    ("mlp", "zb-v"),
    ("mlp", "interleaved-1f1b"),
    ("mlp", "auto"),
    ("transformer", "1f1b"),
    ("transformer", "zb-h1"),
    ("llama", "1f1b"),
    ("llama", "zb-h1"),
]
STAGES = {"zb-v": 2, "interleaved-1f1b": 2}
"""Stages a rank holds under a schedule (1 for the others)."""
STEPS, LR = 3, 1e-2


# The 4-rank runs, as cases of the session's pool (tests/dist_harness.py: a few launches in all); the
# checkpoint saved is loaded in a later launch (other processes: nothing of the saving one's memory helps).
TRAIN = {
    c: POOL.add(4, f"fsdp {c[0]}-{c[1]}", "dist_fsdp:sharded_train", kind=c[0], schedule=c[1], dp=2, steps=STEPS, lr=LR)
    for c in CASES
}
TIED = {
    fsdp: POOL.add(4, f"fsdp tied, fsdp={fsdp}", "dist_fsdp:tied_train", steps=3, fsdp=fsdp) for fsdp in (True, False)
}
SAVE = POOL.add(
    4, "fsdp save", "dist_fsdp:split_save", directory="{pool}/fsdp-ckpt", steps=2, kind="mlp", dp=2, fsdp=True, tp=1,
    chunks=4,
)  # fmt: skip
LOAD = POOL.add(4, "fsdp load", "dist_fsdp:load_and_step", after=SAVE, directory="{pool}/fsdp-ckpt", dp=2, fsdp=True)


def _merged(ranks: list[dict[str, Any]], dp_rank: int) -> dict[str, torch.Tensor]:
    return {n: g for r in ranks if r["dp_rank"] == dp_rank for n, g in r["grads"].items()}


@pytest.mark.parametrize(("kind", "schedule"), CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_sharded_pipeline_trains_as_the_plain_model(pool: Pool, kind: str, schedule: str) -> None:
    ranks = pool(TRAIN[kind, schedule])
    plain = dist_fsdp.plain_reference(kind, STEPS, LR)
    assert sorted(r["dp_rank"] for r in ranks) == [0, 0, 1, 1]
    for r in ranks:
        torch.testing.assert_close(r["losses"][0], plain["losses"][0], rtol=1e-6, atol=0)
        # After Adam steps on gradients summed in another order: float noise, not a drift.
        torch.testing.assert_close(torch.stack(r["losses"]), torch.stack(plain["losses"]), rtol=1e-5, atol=0)
    for dp_rank in (0, 1):
        merged = _merged(ranks, dp_rank)
        assert set(merged) == set(plain["grads"])
        for name, g in merged.items():
            torch.testing.assert_close(g, plain["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    # Per rank, one all-gather and one reduce-scatter per stage it holds and step, not per micro-batch,
    # as the schedule's U, G and R actions say.
    stages = STAGES.get(schedule, 1)
    for r in ranks:
        assert r["stages"] == stages
        assert r["collectives"] == {"all_gather": stages, "reduce_scatter": stages}
        kinds = [a[0] for a in r["actions"]]
        assert kinds.count("U") == kinds.count("G") == kinds.count("R") == stages
        assert kinds[0] == "U" and kinds[-1] == "R"
    # Each rank keeps its share: the 2 replicas' shards of the parameters (of their gradients, Adam's
    # two moments) add up to the model's once.
    total = plain["parameters"]
    elements = [r["elements"] for r in ranks]
    assert sum(e["parameters"] for e in elements) == sum(e["gradients"] for e in elements) == total
    assert sum(e["optimizer"] for e in elements) == 2 * total


def test_fsdp_needs_data_parallel_replicas() -> None:
    model, _, _, loss_fn = dist_fsdp.model_and_data("mlp")
    with pytest.raises(ValueError, match=r"fsdp=True shards .* data_parallel=1: give data_parallel >= 2"):
        Pipeline(model, [16], chunks=2, loss_fn=loss_fn, fsdp=True)
    with pytest.raises(TypeError, match=r"fsdp must be True or False \(fsdp: 'yes'\)"):
        Pipeline(model, [16], chunks=2, loss_fn=loss_fn, fsdp="yes")  # type: ignore[arg-type]


def test_checkpoints_move_between_sharded_and_replicated_layouts(pool: Pool) -> None:
    """Saved at pp2 x fsdp2 (each replica writes its shards), resumed at pp2 x fsdp2 and in one
    process with 1 and 4 stages: the next step's loss is the uninterrupted run's."""
    from tests import dist_cases

    expected = pool(SAVE)[0]["next"]
    for r in pool(LOAD):
        assert r["step"] == 2
        torch.testing.assert_close(r["next"], expected, rtol=1e-6, atol=0)
    for workers in (1, 4):
        one = dist_cases.load_with_optimizer_and_step(str(pool.path("fsdp-ckpt")), workers=workers)
        torch.testing.assert_close(one["next"], expected, rtol=1e-6, atol=0)


def test_tied_weights_and_dropout_across_sharded_stages(pool: Pool) -> None:
    """The embedding on stage 0 and the output projection on stage 1 are one parameter, with dropout
    between: sharded, the copies stay equal, and the run is the replicated run's (dropout's numbers
    follow (layer, micro-batch), not the layout: the losses bitwise)."""
    sharded, replicated = pool(TIED[True]), pool(TIED[False])
    copies = {n: v for r in sharded for n, v in r["copies"].items()}
    assert set(copies) == {"0.weight", "5.weight"}
    assert torch.equal(copies["0.weight"], copies["5.weight"])
    expected = {n: v for r in replicated for n, v in r["copies"].items()}
    for name, value in copies.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7)
    for s, r in zip(sharded, replicated):
        assert all(torch.equal(a, b) for a, b in zip(s["losses"], r["losses"]))
