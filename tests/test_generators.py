"""Properties of the generated schedules, checked on the simulator with unit (or per-kind) costs."""

from __future__ import annotations

import itertools
import textwrap
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.schedule import ActionKind, ScheduleError, Simulation, generate, kind_cost, make_schedule, simulate, validate
from gpipe.schedule.ir import Action, B, F, I, Schedule, W, round_robin, v_shape

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


# ---- zb-h2, zb-v, dualpipev: the formulas their docstrings state, on a grid of K and M ----


def _edges_and_gaps(sim: Simulation) -> list[tuple[float, float]]:
    """Per worker: idle time before its first action, and idle time between its first and last."""
    origin = min(start for start, _ in sim.spans.values())
    out = []
    for acts in sim.schedule.actions:
        spans = sorted(sim.spans[a] for a in acts)
        out.append((spans[0][0] - origin, sum(b[0] - a[1] for a, b in itertools.pairwise(spans))))
    return out


grid = [(k, m) for k in (1, 2, 3, 4) for m in range(1, 13)]


@pytest.mark.parametrize(("k", "m"), grid)
def test_zb_h2_parallelogram_bubble_and_memory(k: int, m: int) -> None:
    schedule = make_schedule("zb-h2", k, m)
    assert schedule.placement == round_robin(k, k) and schedule.num_stages == k
    assert all(a.kind is not ActionKind.BACKWARD for a in schedule)
    sim = simulate(schedule)  # F = I = W = 1
    idle = max(k - 1, 2 * k - 1 - m)
    assert sim.makespan == 3 * m + idle and sim.idle == (idle,) * k
    assert sim.bubble == pytest.approx(idle / (3 * m + idle))
    assert sim.peak_in_flight == (min(m, 2 * k - 1),) * k
    if m >= 2 * k - 1:  # the parallelogram: worker w idles w units before its first action, none inside
        assert _edges_and_gaps(sim) == [(w, 0) for w in range(k)]


def test_zb_h2_is_the_papers_figure() -> None:
    # Qi et al. (2024), figure 3, bottom: K=4, M=8 (their micro-batches count from 1, their B is our I).
    acts = make_schedule("zb-h2", 4, 8).actions
    assert [a.label for a in acts[0]] == [*(f"F{m}" for m in range(7)), "I0", "W0", "F7"] + [
        f"{kind}{m}" for m in range(1, 8) for kind in "IW"
    ]
    assert [a.label for a in acts[3]] == [f"{kind}{m}" for m in range(7) for kind in "FI"] + ["W0", "F7", "I7"] + [
        f"W{m}" for m in range(1, 8)
    ]


@pytest.mark.parametrize("costs", [{}, {"W": 0.5}, {"F": 2, "I": 2}, {"I": 2}, {"I": 0.5, "W": 0.5}])
def test_zb_h2_never_slower_than_zb_h1(costs: dict[str, float]) -> None:
    for k, m in [(2, 4), (4, 8), (4, 13), (6, 24)]:
        h1 = simulate(make_schedule("zb-h1", k, m), kind_cost(**costs))
        h2 = simulate(make_schedule("zb-h2", k, m), kind_cost(**costs))
        assert h2.makespan <= h1.makespan


@pytest.mark.parametrize(("k", "m"), grid)
def test_zb_v_bubble_and_memory(k: int, m: int) -> None:
    schedule = make_schedule("zb-v", k, m, 2)
    assert schedule.placement == v_shape(k) and schedule.num_stages == 2 * k
    assert all(schedule.stages_of(w) == (w, 2 * k - 1 - w) for w in range(k))
    assert all(a.kind is not ActionKind.BACKWARD for a in schedule)
    sim = simulate(schedule)  # F = I = W = 1
    idle = max(k - 1, 4 * k - 2 - 2 * m)
    assert sim.makespan == 6 * m + idle and sim.idle == (idle,) * k
    assert sim.bubble == pytest.approx(idle / (6 * m + idle))
    # (stage, micro-batch) pairs; a stage is half a worker's layers.
    assert sim.peak_in_flight == tuple(min(m + 1 + w, 2 * m, 2 * k) for w in range(k))
    if m >= 2 * k - 1:
        assert _edges_and_gaps(sim) == [(w, 0) for w in range(k)]
        one_f_one_b = simulate(make_schedule("1f1b", k, m), kind_cost(F=1, B=2))
        assert max(sim.peak_in_flight) == 2 * max(one_f_one_b.peak_in_flight)  # 1F1B's peak in activations


@pytest.mark.parametrize(("k", "m"), [(k, m) for k, m in grid if m >= 2 * k])
def test_dualpipev_bubble_and_memory(k: int, m: int) -> None:
    schedule = make_schedule("dualpipev", k, m, 2)
    assert schedule.placement == v_shape(k) and schedule.num_stages == 2 * k
    sim = simulate(schedule, kind_cost(F=1, B=2, I=1, W=1))
    assert sim.makespan == 6 * m + k - 1 and sim.idle == (k - 1,) * k
    assert sim.bubble == pytest.approx((k - 1) / (6 * m + k - 1))
    assert sim.peak_in_flight == (2 * k + 1,) * k
    assert _edges_and_gaps(sim) == [(w, k - 1 - w) for w in range(k)]


def _torch_order(cls_name: str, k: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """The action order PyTorch's schedule class computes for each rank (its private helper)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls, kinds = getattr(schedules, cls_name, None), getattr(schedules, "_ComputationType", None)
    if cls is None or kinds is None or not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip(f"this PyTorch has no {cls_name}._calculate_single_rank_operations")
    ours = {"F": "FORWARD", "B": "FULL_BACKWARD", "I": "BACKWARD_INPUT", "W": "BACKWARD_WEIGHT"}
    kind_of = {getattr(kinds, name): ActionKind(kind) for kind, name in ours.items()}
    me = SimpleNamespace(pp_group_size=k, _n_microbatches=m, num_stages=2 * k)
    ranks = []
    for rank in range(k):
        acts = []
        for a in cls._calculate_single_rank_operations(me, rank):
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                acts.append(Action(kind_of[sub.computation_type], sub.microbatch_index, sub.stage_index))
        ranks.append(tuple(acts))
    return tuple(ranks)


@pytest.mark.parametrize(("name", "cls_name"), [("zb-v", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")])
def test_v_schedules_run_pytorchs_order(name: str, cls_name: str) -> None:
    for k, m in [(1, 2), (2, 4), (3, 7), (4, 8), (4, 11)]:
        assert make_schedule(name, k, m, 2).actions == _torch_order(cls_name, k, m)


@pytest.mark.parametrize("name", ["zb-h2", "zb-v", "dualpipev"])
def test_new_schedules_are_valid(name: str) -> None:
    virtual = 1 if name == "zb-h2" else 2
    for k in range(1, 7):
        for m in range(2 * k if name == "dualpipev" else 1, 17):
            validate(make_schedule(name, k, m, virtual))


def test_v_schedules_refuse_other_virtual_and_too_few_microbatches() -> None:
    for virtual in (1, 3):
        with pytest.raises(ValueError, match=rf"'zb-v' runs two stages per worker, in a V \(virtual: {virtual}\)"):
            make_schedule("zb-v", 2, 4, virtual)
    with pytest.raises(ValueError, match=r"'dualpipev' runs two stages per worker, in a V \(virtual: 1\)"):
        make_schedule("dualpipev", 2, 4)
    with pytest.raises(ValueError, match=r"'zb-h2' runs one stage per worker \(virtual: 2\)"):
        make_schedule("zb-h2", 2, 4, 2)
    too_few = r"'dualpipev' needs at least 2K = 6 micro-batches on 3 workers \(micro-batches: 5\)"
    with pytest.raises(ValueError, match=too_few):
        make_schedule("dualpipev", 3, 5, 2)


@pytest.mark.parametrize(
    ("name", "k", "m", "costs"),
    [("zb-h2", 4, 8, {}), ("interleaved-1f1b", 2, 4, {}), ("zb-v", 2, 4, {}), ("dualpipev", 2, 4, {"B": 2})],
)
def test_docstring_tables_are_the_simulators(name: str, k: int, m: int, costs: dict[str, float]) -> None:
    text = simulate(make_schedule(name, k, m, 1 if name == "zb-h2" else 2), kind_cost(**costs)).text()
    assert textwrap.indent(text, "    ") in (generate.__doc__ or "")
