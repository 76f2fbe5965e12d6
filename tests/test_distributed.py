"""One process per stage over torch.distributed (gloo): the same results as one process."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import gpipe.schedule
from gpipe import AutoSchedule
from gpipe.schedule import StageCosts, make_schedule, plan
from tests import dist_cases
from tests.dist_harness import POOL, Pool, RanksFailedError, run_ranks, start, wait

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
NEW_SCHEDULES = ["zb-h2", "zb-v", "dualpipev"]
CASES = [(s, w) for s in SCHEDULES + NEW_SCHEDULES for w in (2, 4)]
DATA_PARALLEL = ["1f1b", "zb-h1"]


# The runs that succeed, as cases of the session's pool (tests/dist_harness.py: a few launches in all).
CHUNKS = {("dualpipev", 4): 8}  # (DualPipeV needs 2K micro-batches)
STEP = {(s, w): POOL.add(w, f"distributed {s}-{w}", "step", schedule=s, chunks=CHUNKS.get((s, w), 4)) for s, w in CASES}
DROPOUT = {w: POOL.add(w, f"distributed dropout-{w}", "step", schedule="1f1b", chunks=4, dropout=0.3) for w in (2, 4)}
DP = {s: POOL.add(4, f"distributed dp {s}", "data_parallel", schedule=s, dp=2, chunks=2) for s in DATA_PARALLEL}
AUTO = {w: POOL.add(w, f"distributed auto-{w}", "auto_steps", chunks=4, steps=3) for w in (2, 4)}
TRACE = POOL.add(2, "distributed trace", "trace_of_rank")


def single_process(schedule: Any, world: int, chunks: int, dropout: float = 0.0) -> dict[str, object]:
    torch.manual_seed(5)
    pipe = dist_cases.build(schedule, world, chunks, dropout, devices=["cpu"] * world, cpu_threads=1)
    x, y = dist_cases.data()
    loss = pipe.step(x, y)
    return {"loss": loss, "grads": dist_cases.grads_of(pipe), "eval": pipe(x)}


def plain_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = dist_cases.mlp()
    x, y = dist_cases.data()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}  # type: ignore[misc]


@pytest.mark.parametrize(("schedule", "world"), CASES, ids=[f"{s}-{w}" for s, w in CASES])
def test_every_schedule_across_processes(pool: Pool, schedule: str, world: int) -> None:
    ranks = pool(STEP[schedule, world])
    chunks = CHUNKS.get((schedule, world), 4)
    reference = single_process(schedule, world, chunks)
    plain_loss, plain = plain_grads()
    merged: dict[str, torch.Tensor] = {}
    for r, out in enumerate(ranks):
        # the mini-batch loss reaches every rank, bitwise equal to one process's
        assert torch.equal(out["losses"][0], reference["loss"]), r
        assert out["grads"], f"rank {r} holds no parameters"
        assert not set(out["grads"]) & set(merged), "a parameter lives on two ranks"
        merged.update(out["grads"])
    assert set(merged) == set(reference["grads"])  # type: ignore[arg-type]
    for name, g in merged.items():
        assert torch.equal(g, reference["grads"][name]), name  # type: ignore[index]
        torch.testing.assert_close(g, plain[next(iter(by_layer({name: g})))])
    torch.testing.assert_close(reference["loss"], plain_loss)
    last = ranks[make_schedule(schedule, world, chunks, dist_cases.VIRTUAL.get(schedule, 1)).placement[-1]]
    assert torch.equal(last["eval"], reference["eval"])
    assert all(out["eval"] is None for out in ranks if out is not last)


def test_every_schedule_is_covered() -> None:
    # v-half and v-min run across processes in tests/test_schedule_controllable.py, both in one launch
    assert {s for s, _ in CASES} | {"v-half", "v-min"} == set(gpipe.schedule.SCHEDULES)


@pytest.mark.parametrize("world", [2, 4])
def test_auto_plans_alike_on_every_rank(pool: Pool, world: int) -> None:
    """The ranks gather their measured costs and build the same schedule; from given costs the plan
    is fixed, and the step bitwise one process's."""
    ranks = pool(AUTO[world])
    auto = [r["auto"] for r in ranks]
    for other in auto[1:]:
        assert auto[0]["ran"] == other["ran"] and auto[0]["next"] == other["next"]
        assert auto[0]["replans"] == other["replans"] >= 1
        assert torch.equal(auto[0]["losses"][-1], other["losses"][-1])
    assert len(auto[0]["ran"]) == 3 and all(len(acts) == world for acts in auto[0]["ran"])
    _, plain = plain_grads()
    merged = by_layer({n: g for a in auto for n, g in a["grads"].items()})
    assert set(merged) == set(plain)
    for name, g in merged.items():
        torch.testing.assert_close(g, plain[name])
    costs = StageCosts.uniform(world, F=1, I=1, W=2)
    reference = single_process(AutoSchedule(costs=costs), world, 4)
    expected = dist_cases.actions_of(plan(world, 4, costs, placement=tuple(range(world))).schedule)
    fixed = {n: g for r in ranks for n, g in r["fixed"]["grads"].items()}
    assert set(fixed) == set(reference["grads"])  # type: ignore[arg-type]
    for r in ranks:
        assert r["fixed"]["schedule"] == expected
        assert torch.equal(r["fixed"]["loss"], reference["loss"])
    for name, g in fixed.items():
        assert torch.equal(g, reference["grads"][name]), name  # type: ignore[index]


def by_layer(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter names without the stage: 'partitions.1.8.weight' -> '8.weight' (a global layer index)."""
    return {re.sub(r"^partitions\.\d+\.", "", n): g for n, g in grads.items()}


def test_dropout_bitwise_across_one_two_four_ranks(pool: Pool) -> None:
    one = single_process("1f1b", 1, 4, dropout=0.3)
    expected = by_layer(one["grads"])  # type: ignore[arg-type]
    for world in (2, 4):
        ranks = pool(DROPOUT[world])
        merged = by_layer({n: g for out in ranks for n, g in out["grads"].items()})
        assert set(merged) == set(expected)
        assert torch.equal(ranks[0]["losses"][0], one["loss"])
        for name, g in merged.items():
            assert torch.equal(g, expected[name]), (world, name)


@pytest.mark.parametrize("world", [2, 4])
def test_a_raising_rank_stops_the_others_naming_it(tmp_path: Path, world: int) -> None:
    failed = world - 1
    with pytest.raises(RanksFailedError) as info:
        run_ranks("raise_on", world, tmp_path, timeout=90, rank=failed)
    assert all(code != 0 for code in info.value.returncodes)
    for r, out in enumerate(info.value.outputs):
        expected = "boom on purpose" if r == failed else f"rank {failed} failed: ValueError: boom on purpose"
        assert expected in out, (r, out[-2000:])


def test_a_killed_rank_stops_the_others_within_a_minute(tmp_path: Path) -> None:
    world, victim = 4, 2
    codes, outputs, seconds = wait(start("die_on", world, tmp_path, rank=victim, after=0.5), timeout=90)
    assert codes[victim] == -9
    assert seconds < 60, seconds
    for r in range(world):
        if r != victim:
            assert codes[r] not in (0, None), (r, codes)
            assert f"rank {victim} is gone" in outputs[r], (r, outputs[r][-2000:])


@pytest.mark.parametrize("schedule", DATA_PARALLEL)
def test_data_parallel_times_pipeline(pool: Pool, schedule: str) -> None:
    """dp=2 x pp=2 on 4 processes equals one process on the same global batch."""
    ranks = pool(DP[schedule])
    reference = single_process(schedule, 2, 4)  # the global batch of 16 in micro-batches of 4 alike
    assert sorted(r["dp_rank"] for r in ranks) == [0, 0, 1, 1]
    for r in ranks:
        torch.testing.assert_close(r["loss"], reference["loss"])
    for dp_rank in (0, 1):
        merged = {n: g for r in ranks if r["dp_rank"] == dp_rank for n, g in r["grads"].items()}
        assert set(merged) == set(reference["grads"])  # type: ignore[arg-type]
        for name, g in merged.items():
            torch.testing.assert_close(g, reference["grads"][name])  # type: ignore[index]


def test_each_rank_traces_its_own_actions(pool: Pool) -> None:
    ranks = pool(TRACE)
    for r in ranks:
        assert r["actions"] == 3 * 4  # F, I, W of 4 micro-batches on its one stage
        assert r["workers"] == 1 and r["busy"][0] > 0
