from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.schedule import (
    Schedule,
    ScheduleError,
    execution_order,
    fill_drain,
    make_schedule,
    simulate,
    validate,
)
from gpipe.schedule.ir import B, F


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 24), st.integers(1, 96))  # (sizes up to 64 x 256 cost 20 s for the same formula)
def test_fill_drain_bubble(k: int, m: int) -> None:
    sim = simulate(fill_drain(k, m))
    assert sim.bubble == pytest.approx((k - 1) / (m + k - 1), abs=1e-12)
    assert sim.makespan == 2 * (m + k - 1)
    # Without re-materialization every stage holds all M micro-batches at its peak.
    assert sim.peak_in_flight == (m,) * k


def test_fill_drain_bubble_with_backward_twice_forward() -> None:
    sim = simulate(fill_drain(4, 8), lambda a: 1.0 if a.kind.value == "F" else 2.0)
    assert sim.bubble == pytest.approx(3 / 11)


def test_text_timeline() -> None:
    text = simulate(fill_drain(2, 2)).text()
    assert text.splitlines() == ["worker 0 | F0 F1 .  .  B1 B0", "worker 1 | .  F0 F1 B1 B0 ."]


@pytest.mark.parametrize(("name", "k", "v"), [("interleaved-1f1b", 2, 2), ("interleaved-1f1b", 2, 3), ("zb-v", 3, 2)])
def test_text_timeline_names_the_stage_where_a_worker_holds_several(name: str, k: int, v: int) -> None:
    """Every cell of a worker's row is one of its actions, told apart from the same micro-batch's on the
    worker's other stages by a letter; the last line says which stage each letter is."""
    sched = make_schedule(name, k, 2 * k, v)
    *rows, legend = simulate(sched).text().splitlines()
    assert len(rows) == k and legend.startswith("stage of each letter: ")
    for w, row in enumerate(rows):
        assert row.startswith(f"worker {w} | ")
        letters = dict(item.split("=") for item in legend.split(f"worker {w} ")[1].split(",")[0].split())
        assert sorted(int(stage) for stage in letters.values()) == sorted(sched.stages_of(w))
        stage_of = {letter: int(stage) for letter, stage in letters.items()}
        cells = [cell for cell in row.split(" | ")[1].split() if cell != "."]
        shown = {(cell[0], int(cell[1:-1]), stage_of[cell[-1]]) for cell in cells}
        assert len(shown) == len(cells) == len(sched.actions[w])  # unit costs: one cell per action, none alike
        assert shown == {(a.kind.value, a.microbatch, a.stage) for a in sched.actions[w]}


def test_execution_order_respects_dependencies() -> None:
    order = execution_order(fill_drain(3, 4))
    position = {a: i for i, a in enumerate(order)}
    assert len(order) == 24
    for a in order:
        if a.stage > 0 and a.kind.value == "F":
            assert position[F(a.microbatch, a.stage - 1)] < position[a]
        if a.kind.value == "B":
            assert position[F(a.microbatch, a.stage)] < position[a]
            if a.stage < 2:
                assert position[B(a.microbatch, a.stage + 1)] < position[a]


def _schedule(*workers: list[object]) -> Schedule:
    return Schedule("test", len(workers), 2, tuple(tuple(w) for w in workers), tuple(range(len(workers))))  # type: ignore[misc]


def test_validator_rejects_missing_action() -> None:
    s = _schedule([F(0, 0), F(1, 0), B(1, 0)], [F(0, 1), F(1, 1), B(1, 1), B(0, 1)])
    with pytest.raises(ScheduleError, match=r"no B0@stage0"):
        validate(s)


def test_validator_rejects_duplicate() -> None:
    s = _schedule([F(0, 0), F(1, 0), F(1, 0), B(1, 0), B(0, 0)], [F(0, 1), F(1, 1), B(1, 1), B(0, 1)])
    with pytest.raises(
        ScheduleError, match=r"F1@stage0 at worker 0, position 2 is a duplicate of worker 0, position 1"
    ):
        validate(s)


def test_validator_rejects_backward_before_forward() -> None:
    s = _schedule([F(0, 0), B(1, 0), F(1, 0), B(0, 0)], [F(0, 1), F(1, 1), B(1, 1), B(0, 1)])
    with pytest.raises(
        ScheduleError, match=r"B1@stage0 at worker 0, position 1 comes before F1@stage0, which it needs"
    ):
        validate(s)


def test_validator_rejects_deadlock() -> None:
    # Worker 1 wants micro-batch 1 first, but worker 0 only forwards it after a backward that needs worker 1.
    s = _schedule([F(0, 0), B(0, 0), F(1, 0), B(1, 0)], [F(1, 1), F(0, 1), B(0, 1), B(1, 1)])
    with pytest.raises(ScheduleError, match=r"deadlocks: worker 0 at B0@stage0 \(waits for B0@stage1\)"):
        validate(s)


def test_validator_rejects_out_of_range_and_split_stage() -> None:
    with pytest.raises(ScheduleError, match="out of range"):
        validate(_schedule([F(0, 0), F(5, 0)], [F(0, 1)]))
    with pytest.raises(ScheduleError, match="stage 0 is placed on worker 0"):
        validate(_schedule([F(0, 0), F(1, 0)], [F(0, 1), F(1, 1), B(1, 0)]))


def test_make_schedule_unknown_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        make_schedule("zigzag", 2, 4)
    with pytest.raises(ValueError, match="stages: 0"):
        make_schedule("gpipe", 0, 4)
