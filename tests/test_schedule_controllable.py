"""V-Half and V-Min (gpipe.schedule.controllable): their memory and bubble against the formulas of the
module's docstring and against 1F1B and ZB-V, 'auto' choosing them under a tight memory cap, and the
steps they run exact against the plain model, bitwise across K, and across two processes."""

from __future__ import annotations

import copy

import pytest
import torch

from gpipe import AutoSchedule
from gpipe.commands import schedule as schedule_command
from gpipe.runtime.planner import AutoPlanner
from gpipe.schedule import StageCosts, controllable, kind_cost, make_schedule, peak_memory, plan, simulate, validate
from gpipe.schedule.controllable import block_slots
from gpipe.schedule.ir import ActionKind, v_shape
from tests import dist_cases
from tests.dist_harness import POOL, Pool
from tests.helpers import assert_all_equal
from tests.test_schedules_run import assert_exact, data, make, mlp, pipe_grads

NAMES = ("v-half", "v-min")
SIZES = [(k, m) for k in (2, 3, 4, 6, 8) for m in (k, 2 * k, 3 * k, 4 * k)]
UNIT = kind_cost(F=1, B=2, I=1, W=1)  # 1F1B's B is an I and a W
PAPER = kind_cost(F=1, B=1.5, I=1, W=0.5)  # W about half of F and I, as the zero-bubble paper measured


def peak_pairs(name: str, k: int) -> int:
    """The docstring's peak (stage, micro-batch) pairs per worker, M >= K: the paper's (K+4)//3 and
    (K+2)//2 micro-batches of a worker's layers, two pairs each."""
    return 2 * ((k + 4) // 3) if name == "v-min" else 2 * ((k + 2) // 2)


def idle(name: str, k: int) -> int:
    """The docstring's idle time per worker with F = I = W = 1, M >= K."""
    if name == "v-min":
        return 4 * k - 5 + (2 if k % 3 == 0 else 0)
    return (7 * k - 4) // 2 if k % 2 == 0 else (7 * k - 7) // 2


def sim(name: str, k: int, m: int, cost: object = UNIT):  # type: ignore[no-untyped-def]
    return simulate(make_schedule(name, k, m, 1 if name == "1f1b" else 2), cost)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
def test_memory_and_bubble_are_the_formulas(name: str) -> None:
    for k, m in SIZES:
        schedule = make_schedule(name, k, m, 2)  # validated
        assert schedule.placement == v_shape(k) and schedule.name == name
        kinds = {a.kind for a in schedule}
        assert kinds == {ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
        ours, one_f_one_b, zb_v = sim(name, k, m), sim("1f1b", k, m), sim("zb-v", k, m)
        assert set(ours.peak_in_flight) <= set(range(peak_pairs(name, k) + 1)), (k, m)
        assert max(ours.peak_in_flight) == peak_pairs(name, k), (k, m)
        assert ours.idle == (idle(name, k),) * k, (k, m)
        assert ours.makespan == 6 * m + idle(name, k)
        assert zb_v.bubble < ours.bubble < one_f_one_b.bubble, (k, m)
        # against 1F1B's peak (K micro-batches on its first worker), a pair being half a micro-batch
        ratio = max(ours.peak_in_flight) / 2 / max(one_f_one_b.peak_in_flight)
        assert ratio == ((k + 4) // 3 if name == "v-min" else (k + 2) // 2) / k


@pytest.mark.parametrize("name", NAMES)
def test_the_memory_tends_to_a_third_and_a_half(name: str) -> None:
    """(K+4)//3 and (K+2)//2 of 1F1B's K micro-batches: a third and a half as K grows."""
    target = 1 / 3 if name == "v-min" else 1 / 2
    k, m = 30, 30
    ratio = max(sim(name, k, m).peak_in_flight) / 2 / max(sim("1f1b", k, m).peak_in_flight)
    assert target <= ratio <= target + 2 / k


@pytest.mark.parametrize("name", NAMES)
def test_any_number_of_micro_batches_is_valid(name: str) -> None:
    for k in (1, 2, 3, 4, 5):
        for m in range(1, 2 * k + 2):
            schedule = make_schedule(name, k, m, 2)
            validate(schedule)
            assert max(simulate(schedule).peak_in_flight) <= min(2 * m, peak_pairs(name, k))


def test_the_blocks_use_six_distinct_slots_and_respect_the_loop() -> None:
    """Each worker's four F and I slots differ modulo 6 (two left for the W passes), and micro-batch
    0 reaches each worker after it left the one it needs."""
    for name in NAMES:
        for k in range(1, 14):
            slots = [block_slots(name, k, w) for w in range(k)]
            for w, mine in enumerate(slots):
                assert len({t % 6 for t in mine}) == 4, (name, k, w)
                down, up, up_i, down_i = mine
                assert down < up < up_i < down_i
                if w:
                    assert down > slots[w - 1][0] and up_i > slots[w - 1][2]
                if w < k - 1:
                    assert up > slots[w + 1][1] and down_i > slots[w + 1][3]
    with pytest.raises(ValueError, match="no building block named 'v-max'"):
        block_slots("v-max", 2, 0)


def test_the_docstring_tables_are_the_simulated_timelines() -> None:
    doc = controllable.__doc__ or ""
    for name in NAMES:
        table = simulate(make_schedule(name, 2, 3, 2)).text()
        assert "\n".join("    " + line for line in table.splitlines()) in doc, name


@pytest.mark.parametrize("name", NAMES)
def test_refuses_other_virtual(name: str) -> None:
    with pytest.raises(ValueError, match=rf"schedule '{name}' runs two stages per worker.*\(virtual: 1\)"):
        make_schedule(name, 2, 4, 1)


def test_with_the_papers_unequal_costs() -> None:
    """W half of F and I: V-Half's slack lets its step shrink (between ZB-V's bubble and 1F1B's from
    K = 3 on); V-Min's loop holds no W, so its step shrinks only by the last W's saving, and its
    bubble is above 1F1B's once M >= 2K."""
    for k, m in SIZES:
        half, zb_v, one_f_one_b = sim("v-half", k, m, PAPER), sim("zb-v", k, m, PAPER), sim("1f1b", k, m, PAPER)
        if k >= 3:
            assert zb_v.bubble < half.bubble < one_f_one_b.bubble, (k, m)
        assert half.makespan < sim("v-half", k, m).makespan
        assert sim("v-min", k, m, PAPER).makespan == sim("v-min", k, m).makespan - 0.5
        if m >= 2 * k:
            assert sim("v-min", k, m, PAPER).bubble > one_f_one_b.bubble, (k, m)


# 'auto' under a memory cap


def test_auto_picks_v_min_under_a_cap_only_it_fits_fast() -> None:
    for k, m in [(4, 8), (4, 16), (6, 12)]:
        costs = StageCosts.uniform(2 * k)
        v_min = max(peak_memory(make_schedule("v-min", k, m, 2), costs))
        v_half = max(peak_memory(make_schedule("v-half", k, m, 2), costs))
        assert v_min < v_half
        result = plan(k, m, costs, memory_cap=(v_min + v_half) / 2, placement=v_shape(k))
        assert result.chosen == "v-min", result.explain()
        others = [c for c in result.candidates if c.fits and c.name != "v-min"]
        assert all(c.makespan > result.makespan for c in others)


def test_auto_under_v_halfs_cap_is_v_half_or_better() -> None:
    for k, m in [(4, 8), (6, 12), (8, 16)]:
        costs = StageCosts.uniform(2 * k)
        v_half = make_schedule("v-half", k, m, 2)
        cap = max(peak_memory(v_half, costs))
        assert cap < max(peak_memory(make_schedule("zb-v", k, m, 2), costs))
        result = plan(k, m, costs, memory_cap=cap, placement=v_shape(k))
        assert {"v-half", "v-min"} <= {c.name for c in result.candidates}
        assert max(result.peak_memory) <= cap
        assert result.makespan <= simulate(v_half).makespan


def test_a_pipeline_with_a_tight_cap_runs_v_min() -> None:
    """AutoSchedule(memory_cap=...) on a V (virtual=2) plans with the V schedules among its candidates."""
    model, (x, y) = mlp(), data()
    options = AutoSchedule(memory_cap=5, costs=StageCosts.uniform(8))
    pipe = make(model, options, 4, 8, virtual=2)
    loss = pipe.step(x, y)
    planner = pipe.engine.planner
    assert isinstance(planner, AutoPlanner) and planner.last_plan is not None
    assert planner.last_plan.chosen == "v-min"
    assert pipe.last_trace is not None
    assert pipe.last_trace.schedule.actions == make_schedule("v-min", 4, 8, 2).actions
    assert_exact(pipe, copy.deepcopy(model), x, y, 8, loss)


def test_the_command_shows_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert schedule_command.main(["--schedule", "v-min", "--stages", "4", "--chunks", "8", "--virtual", "2"]) == 0
    out = capsys.readouterr().out
    assert "schedule 'v-min'" in out and "idle per worker: 11, 11, 11, 11" in out
    assert "peak in-flight activations per worker: 4, 4, 4, 4" in out
    argv = ["--auto", "--stages", "4", "--chunks", "8", "--virtual", "2", "--memory-cap", "5"]
    assert schedule_command.main(argv) == 0
    out = capsys.readouterr().out
    assert "chose v-min" in out and "v-half" in out


# Running them


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_equals_the_plain_model(name: str, k: int) -> None:
    model, (x, y) = mlp(), data()
    pipe = make(model, name, k, 8)
    loss = pipe.step(x, y)
    assert pipe.last_trace is not None and pipe.last_trace.schedule.name == name
    assert_exact(pipe, copy.deepcopy(model), x, y, 8, loss)


@pytest.mark.parametrize("name", NAMES)
def test_bitwise_across_partition_counts_with_dropout(name: str) -> None:
    model, (x, y) = mlp(dropout=0.3), data()
    results = {}
    for k in (2, 4):
        torch.manual_seed(11)
        pipe = make(model, name, k, 8)
        results[k] = (pipe.step(x, y), pipe_grads(pipe))
    assert torch.equal(results[2][0], results[4][0])
    assert_all_equal(results[2][1], results[4][1])


# a case of the session's pool (tests/dist_harness.py: a few launches in all)
ACROSS = {w: POOL.add(w, f"controllable-{w}", "controllable_steps", chunks=4) for w in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_across_processes(pool: Pool, world: int) -> None:
    ranks = pool(ACROSS[world])
    model = dist_cases.mlp()
    x, y = dist_cases.data()
    plain_loss = torch.nn.functional.mse_loss(model(x), y)
    plain_loss.backward()
    plain = {n: p.grad for n, p in model.named_parameters()}
    for name in NAMES:
        merged: dict[str, torch.Tensor] = {}
        for out in ranks:
            torch.testing.assert_close(out[name]["loss"], plain_loss.detach())
            merged.update({n.split(".", 2)[2]: g for n, g in out[name]["grads"].items()})
        assert set(merged) == set(plain), name
        for n, g in merged.items():
            torch.testing.assert_close(g, plain[n], msg=f"{name}: {n}")
