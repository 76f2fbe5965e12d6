"""Properties of the generated schedules, checked on the simulator with unit (or per-kind) costs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.schedule import ActionKind, ScheduleError, kind_cost, make_schedule, simulate, validate
from gpipe.schedule.ir import B, F, I, Schedule, W

sizes = st.tuples(st.integers(1, 16), st.integers(1, 64))


@settings(max_examples=80, deadline=None)
@given(sizes)
def test_one_f_one_b_memory_and_bubble(km: tuple[int, int]) -> None:
    k, m = km
    sim = simulate(make_schedule("1f1b", k, m), kind_cost(F=1, B=2))
    assert all(peak <= k - s for s, peak in enumerate(sim.peak_in_flight)), sim.peak_in_flight
    assert sim.bubble == pytest.approx((k - 1) / (m + k - 1))


@settings(max_examples=80, deadline=None)
@given(sizes)
def test_zb_h1_third_of_1f1b_idle_with_1f1b_memory(km: tuple[int, int]) -> None:
    k, m = km
    one_f_one_b = simulate(make_schedule("1f1b", k, m), kind_cost(F=1, B=2))  # B = I + W
    zb = simulate(make_schedule("zb-h1", k, m))  # F = I = W = 1
    assert all(kind is not ActionKind.BACKWARD for kind in (a.kind for a in zb.spans))
    assert max(zb.peak_in_flight) <= max(one_f_one_b.peak_in_flight) == min(k, m)
    if m >= k:  # the regime zero bubble is made for: a third of the idle time
        assert sum(zb.idle) <= sum(one_f_one_b.idle) / 3 + 1e-9
    assert sum(zb.idle) <= sum(one_f_one_b.idle) + 1e-9


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 4))
def test_interleaved_bubble_shrinks_by_v(k: int, groups: int, v: int) -> None:
    m = k * groups
    one_f_one_b = simulate(make_schedule("1f1b", k, m), kind_cost(F=1, B=2))
    inter = simulate(make_schedule("interleaved-1f1b", k, m, v), kind_cost(F=1, B=2))
    # (K-1)/(vM+K-1): the 1F1B bubble with v times as many (v times shorter) actions per worker.
    assert inter.bubble == pytest.approx((k - 1) / (v * m + k - 1))
    assert inter.bubble <= one_f_one_b.bubble / v * (1 + (k - 1) / m) + 1e-12


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_every_schedule_is_valid(name: str, k: int, m: int) -> None:
    virtual = 2 if name == "interleaved-1f1b" else 1
    schedule = make_schedule(name, k, m, virtual)
    validate(schedule)
    assert schedule.num_stages == k * virtual and schedule.num_workers == k


def test_non_interleaved_schedules_refuse_virtual_stages() -> None:
    with pytest.raises(ValueError, match=r"'1f1b' runs one stage per worker \(virtual: 2\)"):
        make_schedule("1f1b", 2, 4, 2)


def _split(*workers: list[object]) -> Schedule:
    return Schedule("test", len(workers), 1, tuple(tuple(w) for w in workers), tuple(range(len(workers))))  # type: ignore[misc]


def test_validator_on_split_backward() -> None:
    with pytest.raises(ScheduleError, match=r"W0@stage0 at worker 0, position 1 comes before I0@stage0"):
        validate(_split([F(0, 0), W(0, 0), I(0, 0)]))
    with pytest.raises(ScheduleError, match=r"has no W0@stage0: I0@stage0 computes only the input gradient"):
        validate(_split([F(0, 0), I(0, 0)]))
    with pytest.raises(ScheduleError, match=r"has both B0@stage0 and I0@stage0"):
        validate(_split([F(0, 0), I(0, 0), W(0, 0), B(0, 0)]))
