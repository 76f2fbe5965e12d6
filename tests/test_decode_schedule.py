"""Decode schedules in the IR: forwards only, ``G`` groups in flight, ``F(m, 0)`` after ``F(m-G, S-1)``;
the order every worker runs, where it deadlocks, its steady-state bubble, its pictures and
``gpipe schedule --decode``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from gpipe.cli import main
from gpipe.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    decode,
    decode_bubble,
    decode_order,
    dependencies,
    execution_order,
    min_groups,
    render_timeline,
    simulate,
    validate,
)
from gpipe.schedule.ir import B, F, I, W, round_robin, v_shape


def _unroll(placement: tuple[int, ...], groups: int, steps: int) -> Schedule:
    """The decode's first ``steps`` steps by the rule itself (every worker's forwards sorted by
    ``m + s``, the later stage first), with no check on ``groups``: what validate is given to judge."""
    total = steps * groups
    acts = tuple(
        tuple(
            sorted(
                (F(m, s) for s, o in enumerate(placement) if o == w for m in range(total)),
                key=lambda a: (a.microbatch + a.stage, -a.stage),
            )
        )
        for w in range(max(placement) + 1)
    )
    return Schedule("decode", len(placement), total, acts, placement, feedback=groups)


def _deadlocks(schedule: Schedule) -> bool:
    try:
        validate(schedule)
    except ScheduleError as exc:
        assert "deadlocks" in str(exc), exc
        return True
    return False


def _placements(stages: int) -> list[tuple[int, ...]]:
    """Every placement of ``stages`` stages on workers 0..K-1, each worker holding one at least."""
    return [p for p in itertools.product(range(stages), repeat=stages) if set(p) == set(range(max(p) + 1))]


def _steady_bubble(placement: tuple[int, ...], groups: int, steps: int = 12) -> float:
    """The idle fraction of the steps the simulator adds between ``steps`` and ``2*steps`` steps: the
    steady state, without the pipeline's filling and draining."""
    short, long = (simulate(decode(placement, groups, t)) for t in (steps, 2 * steps))
    return 1 - (sum(long.busy) - sum(short.busy)) / (long.schedule.num_workers * (long.makespan - short.makespan))


# --- the IR ---------------------------------------------------------------------------------------------


def test_a_decode_is_forwards_only_in_the_feedback_order() -> None:
    sched = decode([0, 1, 2], groups=2, steps=3)
    assert sched.feedback == 2 and sched.num_microbatches == 6 and sched.name == "decode"
    assert {a.kind for a in sched} == {ActionKind.FORWARD}
    assert len(list(sched)) == 3 * 6  # every stage's forward of every micro-batch, nothing else
    # F(m, 0) waits for the last stage's output of the same group's step before (m - G).
    assert dependencies(F(4, 0), sched) == (F(2, 2),)
    assert dependencies(F(1, 0), sched) == ()  # a group's first step has its prompt
    assert dependencies(F(4, 1), sched) == (F(4, 0),)
    order = execution_order(sched)
    assert order.index(F(2, 2)) < order.index(F(4, 0))
    spans = simulate(sched).spans
    assert spans[F(4, 0)][0] >= spans[F(2, 2)][1]
    # A training schedule (feedback 0, the default) has no such edge.
    plain = Schedule(
        "plain", 2, 2, ((F(0, 0), F(1, 0), B(1, 0), B(0, 0)), (F(0, 1), F(1, 1), B(1, 1), B(0, 1))), (0, 1)
    )
    assert plain.feedback == 0 and dependencies(F(1, 0), plain) == ()
    validate(plain)


def test_only_keeps_feedback() -> None:
    sched = decode([0, 1], groups=2, steps=2)
    forwards = sched.only(ActionKind.FORWARD)
    assert forwards.feedback == 2 and forwards.actions == sched.actions
    assert dependencies(F(2, 0), forwards) == (F(0, 1),)


@pytest.mark.parametrize("kind", [B, I, W])
def test_validate_refuses_backwards_in_a_decode(kind: Callable[[int, int], Action]) -> None:
    sched = decode([0, 1], groups=1, steps=2)
    acts = (sched.actions[0], (*sched.actions[1], kind(0, 1)))
    with pytest.raises(ScheduleError) as err:
        validate(Schedule("decode", 2, 2, acts, (0, 1), feedback=1))
    assert str(err.value) == (
        f"{kind(0, 1)} at worker 1, position 2: schedule 'decode' is a decode (feedback 1), forwards only; "
        "drop its backward actions, or make feedback 0 for a training step"
    )


def test_validate_wants_every_forward_and_no_backward() -> None:
    sched = decode([0, 1], groups=2, steps=2)
    validate(sched)  # no backward asked for
    acts = (sched.actions[0], sched.actions[1][:-1])
    with pytest.raises(ScheduleError, match=r"has no F3@stage1: every stage needs the forward of every micro-batch"):
        validate(Schedule("decode", 2, 4, acts, (0, 1), feedback=2))
    with pytest.raises(ScheduleError, match=r"has feedback -1: give 0 for a training step, or the number of groups"):
        validate(Schedule("decode", 2, 4, sched.actions, (0, 1), feedback=-1))


def test_the_feedback_edge_deadlocks_a_worker_that_runs_the_next_step_first() -> None:
    """Stage 0 and the last stage on one worker, F(G, 0) before F(0, S-1): the worker waits for itself."""
    acts = ((F(0, 0), F(1, 0), F(0, 1), F(1, 1)),)
    with pytest.raises(ScheduleError) as err:
        validate(Schedule("loop", 2, 2, acts, (0, 0), feedback=1))
    assert str(err.value) == "schedule 'loop' deadlocks: worker 0 at F1@stage0 (waits for F0@stage1)"
    # The same actions with the last stage's forward first run, one after the other.
    validate(Schedule("loop", 2, 2, ((F(0, 0), F(0, 1), F(1, 0), F(1, 1)),), (0, 0), feedback=1))


# --- the order and its unroll ----------------------------------------------------------------------------


@pytest.mark.parametrize("placement", [(0, 1, 2, 3), v_shape(3), round_robin(6, 2)])
def test_decode_order_is_prefix_stable_and_decode_is_it_cut_at_t_steps(placement: tuple[int, ...]) -> None:
    groups = len(placement)
    for w in range(max(placement) + 1):
        long = list(itertools.islice(decode_order(placement, groups, w), 200))
        for n in (1, 7, 23):
            assert list(itertools.islice(decode_order(placement, groups, w), n)) == long[:n]
        assert [a.microbatch + a.stage for a in long] == sorted(a.microbatch + a.stage for a in long)
        assert {a.stage for a in long} == {s for s, o in enumerate(placement) if o == w}
        for steps in (1, 3):
            sched = decode(placement, groups, steps)
            total = steps * groups
            assert sched.actions[w] == _unroll(placement, groups, steps).actions[w]
            assert list(sched.actions[w]) == [a for a in long if a.microbatch < total][: len(sched.actions[w])]


def test_decode_refuses_bad_values() -> None:
    for call, message in [
        (lambda: decode([0, 1], 0, 2), "groups must be an integer >= 1 (got 0)"),
        (lambda: decode([0, 1], 2, 0), "steps must be an integer >= 1 (got 0)"),
        (lambda: decode([], 2, 2), "a decode needs at least one stage"),
        (lambda: decode([0, 2], 2, 2), "placement [0, 2] puts no stage on worker 1: number the workers 0..K-1"),
        (lambda: decode([0, -1], 2, 2), "placement [0, -1] must hold worker numbers >= 0"),
        (lambda: decode_order([0, 1], 2, 2), "worker 2 is not one of the placement's workers 0..1"),
        (lambda: decode_order([0, 1, 1, 0], 2, 0), "keep at least 3 groups in flight"),
    ]:
        with pytest.raises(ValueError) as err:
            call()
        assert message in str(err.value)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_v_placement_needs_2k_minus_1_groups(k: int) -> None:
    """On a V, worker 0 holds stage 0 and stage S-1 = 2K-1: with G < S-1 groups the order puts
    F(m, 0) (place m) before F(m-G, S-1) (place m-G+S-1), which it needs. validate's deadlock
    detection on the unroll says where it starts; decode refuses those up front."""
    place = v_shape(k)
    need = 2 * k - 1
    assert min_groups(place) == need
    for groups in range(1, need):
        assert _deadlocks(_unroll(place, groups, 2 * len(place)))
        with pytest.raises(
            ValueError, match=f"{groups} group\\(s\\) in flight deadlock .* keep at least {need} groups"
        ):
            decode(place, groups, 4)
    for groups in (need, need + 1):
        assert not _deadlocks(_unroll(place, groups, 2 * len(place)))
        decode(place, groups, 4)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_min_groups_is_where_the_unroll_stops_deadlocking_on_every_placement(stages: int) -> None:
    for place in _placements(stages):
        need = min_groups(place)
        for groups in range(1, stages + 1):
            assert _deadlocks(_unroll(place, groups, 3 * stages + 3)) == (groups < need), (place, groups)
    assert min_groups(tuple(range(stages))) == 1  # one stage per worker never deadlocks


# --- simulation and pictures -----------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
def test_steady_state_bubble_with_one_stage_per_worker(stages: int) -> None:
    place = tuple(range(stages))
    for groups in range(1, stages + 3):
        measured = _steady_bubble(place, groups)
        assert decode_bubble(place, groups) == pytest.approx(measured, abs=1e-9)
        if groups >= stages:
            assert measured == pytest.approx(0, abs=1e-9)
        else:
            assert measured == pytest.approx(1 - groups / stages)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_steady_state_bubble_matches_the_simulator_on_every_placement(stages: int) -> None:
    for place in _placements(stages):
        for groups in range(min_groups(place), stages + 2):
            assert decode_bubble(place, groups) == pytest.approx(_steady_bubble(place, groups), abs=1e-9), place


def test_interleaved_and_v_placements_in_steady_state() -> None:
    for place in (round_robin(4, 2), round_robin(6, 3), round_robin(8, 4), v_shape(2), v_shape(3)):
        for groups in range(min_groups(place), len(place) + 2):
            assert decode_bubble(place, groups) == pytest.approx(_steady_bubble(place, groups), abs=1e-9), place
        assert decode_bubble(place, len(place)) == 0  # a group per stage fills the pipeline


def test_simulation_of_a_decode() -> None:
    sim = simulate(decode([0, 1], groups=2, steps=2))
    assert sim.text().splitlines() == [
        "worker 0 | g0t0 g1t0 g0t1 g1t1 .",
        "worker 1 | .    g0t0 g1t0 g0t1 g1t1",
    ]
    assert sim.makespan == 5 and sim.bubble == pytest.approx(2 / 10)
    # No activations are kept, but every worker holds each group's cache on each of its stages.
    assert sim.peak_in_flight == (2, 2)
    assert simulate(decode(v_shape(2), groups=3, steps=2)).peak_in_flight == (6, 6)
    # A V: worker 0 holds stages 0 and 3 (letters a, b), worker 1 stages 1 and 2; the later stage first.
    assert simulate(decode(v_shape(2), groups=3, steps=1)).text().splitlines() == [
        "worker 0 | g0t0a g1t0a g2t0a g0t0b .     g1t0b .     g2t0b",
        "worker 1 | .     g0t0a g0t0b g1t0a g1t0b g2t0a g2t0b .",
        "stage of each letter: worker 0 a=0 b=3, worker 1 a=1 b=2",
    ]


def test_picture_of_a_decode(tmp_path: Path) -> None:
    sim = simulate(decode([0, 1, 2], groups=3, steps=2))
    text = render_timeline(sim, tmp_path / "decode.svg").read_text()
    assert "decode: K=3, G=3, T=2" in text and "caches per worker 3" in text and "g2t1" in text


# --- gpipe schedule --decode -----------------------------------------------------------------------------


def test_schedule_command_decode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decode.png"
    assert main(["schedule", "--decode", "--stages", "4", "--groups", "2", "--steps", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    sim = simulate(decode([0, 1, 2, 3], 2, 3))
    assert f"makespan {sim.makespan:g}, bubble {sim.bubble:.4f}" in text
    assert "steady state: bubble 0.5000 (50.0%); throughput 2.00x one worker's" in text
    assert "key/value caches per worker (one per group and stage): 2, 2, 2, 2" in text
    assert sim.text() in text
    assert out.read_bytes().startswith(b"\x89PNG")
    # The default: a group per stage, the pipeline full in steady state; --virtual: stages round robin.
    assert main(["schedule", "--decode", "--stages", "2", "--virtual", "2"]) == 0
    text = capsys.readouterr().out
    assert "K=2 workers, 4 stages, G=4 groups in flight, T=4 steps" in text
    assert "steady state: bubble 0.0000 (0.0%); throughput 2.00x" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--decode", "--auto"],
            "--decode makes its own schedule of --groups x --steps forwards, every one a unit long: drop --auto",
        ),
        (["--decode", "--chunks", "4"], "drop --chunks"),
        (["--decode", "--schedule", "1f1b", "--memory-cap", "2"], "drop --schedule, --memory-cap"),
        (["--decode", "--costs", "F=2"], "drop --costs"),
        (["--groups", "2"], "--groups needs --decode"),
        (["--groups", "2", "--steps", "3"], "--groups and --steps need --decode"),
        (["--decode", "--groups", "0"], "--groups must be positive (got 0)"),
        (["--decode", "--steps", "-1"], "--steps must be positive (got -1)"),
        (["--decode", "--stages", "2", "--virtual", "2", "--groups", "1"], "keep at least 2 groups in flight"),
    ],
)
def test_schedule_command_decode_refuses_bad_flags(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
