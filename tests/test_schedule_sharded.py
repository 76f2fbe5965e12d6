"""FSDP-sharded stages in the schedule IR: each stage's U (gather its parameters), G (reduce-scatter its
gradients) and R (free them) once per step — :func:`gpipe.schedule.ir.sharded`, their validation, their
simulation and pictures, the planner handing them out and ``gpipe schedule --fsdp``. Pure data."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gpipe.cli import main
from gpipe.distributed.collectives import Collectives
from gpipe.engine import planner_of
from gpipe.runtime.executor import TraceEvent
from gpipe.runtime.placement import Placement
from gpipe.runtime.planner import AutoPlanner, AutoSchedule, FixedPlanner, mixed_backwards
from gpipe.runtime.trace import StepTrace
from gpipe.schedule import (
    SCHEDULES,
    STAGE_WIDE,
    ActionKind,
    Schedule,
    ScheduleError,
    StageCosts,
    decode,
    execution_order,
    kind_cost,
    make_schedule,
    min_groups,
    render_timeline,
    sharded,
    simulate,
    unit_cost,
    validate,
)
from gpipe.schedule.ir import Action, G, R, U, dependencies, round_robin, v_shape

FORWARD, UNSHARD, RESHARD, REDUCE_GRAD = (ActionKind.FORWARD, *STAGE_WIDE)
COMPUTE = tuple(k for k in ActionKind if k not in STAGE_WIDE)
VIRTUAL = {"interleaved-1f1b": 2, "zb-v": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}


def _cases() -> Iterator[tuple[str, int, int]]:
    for name in SCHEDULES:
        for k in (2, 4):
            for m in (1, k, 2 * k + 1):
                try:
                    make_schedule(name, k, m, VIRTUAL.get(name, 1))
                except ValueError:  # e.g. dualpipev needs M >= 2K
                    continue
                yield name, k, m


def _stage_order(acts: tuple[Action, ...], s: int) -> list[Action]:
    return [a for a in acts if a.stage == s]


def test_the_stage_wide_actions() -> None:
    assert [k.value for k in STAGE_WIDE] == ["U", "R", "G"]
    assert (U(1), R(1), G(1)) == (Action(UNSHARD, -1, 1), Action(RESHARD, -1, 1), Action(REDUCE_GRAD, -1, 1))
    assert [str(a) for a in (U(1), G(2), R(0))] == ["U@stage1", "G@stage2", "R@stage0"]
    assert U(1).label == "U" and Action(UNSHARD, 3, 1).label == "U3"  # a wrong micro-batch shows
    sched = sharded(make_schedule("1f1b", 2, 2))
    assert [dependencies(a, sched) for a in (U(0), G(1), R(1))] == [(), (), ()]


@pytest.mark.parametrize(("name", "k", "m"), list(_cases()))
def test_sharded_generated_schedules(name: str, k: int, m: int) -> None:
    """U just before a worker's first action of each stage it holds, G then R just after its last B or W;
    the same schedule otherwise, simulated alike under unit costs (U, G, R take no time)."""
    plain = make_schedule(name, k, m, VIRTUAL.get(name, 1))
    sched = sharded(plain)
    validate(sched)
    assert (sched.name, sched.num_stages, sched.num_microbatches, sched.placement, sched.feedback) == (
        plain.name, plain.num_stages, plain.num_microbatches, plain.placement, plain.feedback
    )  # fmt: skip
    assert sched.only(*COMPUTE) == plain
    for w, acts in enumerate(sched.actions):
        for s in plain.stages_of(w):
            mine = _stage_order(acts, s)
            kinds = [a.kind for a in mine]
            assert (kinds.count(UNSHARD), kinds.count(REDUCE_GRAD), kinds.count(RESHARD)) == (1, 1, 1)
            assert mine[0] == U(s) and mine[-2:] == [G(s), R(s)]
            assert acts[acts.index(U(s)) + 1] == mine[1]  # immediately before the stage's first action
            last_grad = max(
                i
                for i, a in enumerate(acts)
                if a.stage == s and a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)
            )
            assert acts[last_grad + 1 : last_grad + 3] == (G(s), R(s))
    sim, base = simulate(sched), simulate(plain)
    assert (sim.makespan, sim.bubble, sim.idle, sim.peak_in_flight) == (
        base.makespan, base.bubble, base.idle, base.peak_in_flight
    )  # fmt: skip
    assert sim.text() == base.text()  # U, G, R take no time, so no cell
    held = [len(plain.stages_of(w)) for w in range(plain.num_workers)]
    assert sim.collectives == tuple((h, h) for h in held)
    assert base.collectives == ((0, 0),) * plain.num_workers
    order = execution_order(sched)
    assert sorted(order, key=str) == sorted(sched, key=str)


@pytest.mark.parametrize(("placement", "groups"), [(round_robin(4, 2), 4), (v_shape(2), min_groups(v_shape(2)))])
def test_sharded_decode_has_no_reduce_scatter(placement: tuple[int, ...], groups: int) -> None:
    plain = decode(placement, groups, 3)
    sched = sharded(plain)
    validate(sched)
    assert sched.feedback == plain.feedback and not any(a.kind is REDUCE_GRAD for a in sched)
    for w, acts in enumerate(sched.actions):
        for s in plain.stages_of(w):
            mine = _stage_order(acts, s)
            assert mine[0] == U(s) and mine[-1] == R(s) and all(a.kind is FORWARD for a in mine[1:-1])
    sim, base = simulate(sched), simulate(plain)
    assert (sim.makespan, sim.peak_in_flight, sim.text()) == (base.makespan, base.peak_in_flight, base.text())
    assert sim.collectives == tuple((len(plain.stages_of(w)), 0) for w in range(plain.num_workers))
    assert sched.label(U(0)) == "U" and sched.label(plain.actions[0][0]) == "g0t0"


def _with(sched: Schedule, worker: int, acts: list[Action], **changes: int) -> Schedule:
    lists = list(sched.actions)
    lists[worker] = tuple(acts)
    return Schedule(sched.name, sched.num_stages, sched.num_microbatches, tuple(lists), sched.placement,
                    changes.get("feedback", sched.feedback))  # fmt: skip


def _refused(sched: Schedule) -> str:
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_validate_refuses_misplaced_stage_wide_actions() -> None:
    sched = sharded(make_schedule("1f1b", 2, 2))
    w0 = list(sched.actions[0])
    u, f0, f1, b0, b1, g, r = w0
    assert (u, g, r) == (U(0), G(0), R(0)) and [a.kind.value for a in (f0, f1, b0, b1)] == ["F", "F", "B", "B"]
    cases = [
        ([f0, f1, b0, b1, g, r], "has stage-wide actions but no U@stage0: a sharded stage gathers its parameters"),
        ([u, f0, u, f1, b0, b1, g, r], "U@stage0 at worker 0, position 2 is a second U of stage 0 (the first at "
                                       "worker 0, position 0): a sharded stage gathers its parameters once"),
        ([f0, u, f1, b0, b1, g, r], "U@stage0 at worker 0, position 1 comes after F0@stage0 at worker 0, "
                                    "position 0: gather a stage's parameters before its first action"),
        ([u, f0, f1, b0, g, b1, r], "G@stage0 at worker 0, position 4 comes before B1@stage0 at worker 0, "
                                    "position 5: reduce-scatter a stage's gradients after its last B or W"),
        ([u, f0, f1, b0, b1, r, g], "R@stage0 at worker 0, position 5 comes before G@stage0 at worker 0, "
                                    "position 6: free a stage's parameters after reducing its gradients"),
        ([u, f0, f1, b0, b1, r], "no G@stage0: stage 0 has backward actions and a sharded stage reduce-scatters"),
        ([u, f0, f1, b0, b1, g], "no R@stage0: a sharded stage frees its gathered parameters once per step"),
        ([Action(UNSHARD, 0, 0), f0, f1, b0, b1, g, r],
         "U0@stage0 at worker 0, position 0 has micro-batch 0, but a stage-wide action belongs to none: "
         "build it with U(0) (micro-batch -1)"),
        ([U(1), u, f0, f1, b0, b1, g, r], "U@stage1 at worker 0, position 0: stage 1 is placed on worker 1"),
    ]  # fmt: skip
    for acts, message in cases:
        assert message in _refused(_with(sched, 0, acts))


def test_validate_refuses_a_reduce_scatter_in_a_decode_and_an_early_free() -> None:
    sched = sharded(decode([0, 1], groups=2, steps=2))
    w1 = list(sched.actions[1])
    assert _refused(_with(sched, 1, [*w1, G(1)])) == (
        f"G@stage1 at worker 1, position {len(w1)}: schedule 'decode' is a decode (feedback 2), which computes "
        "no gradients to reduce; drop it (a decode's sharded stage has U and R only)"
    )
    early = [*w1[:-2], w1[-1], w1[-2]]  # R before the last forward
    assert _refused(_with(sched, 1, early)) == (
        f"R@stage1 at worker 1, position {len(w1) - 2} comes before {w1[-2]} at worker 1, position {len(w1) - 1}, "
        "which needs the parameters: free them after it"
    )


def test_sharding_twice_is_refused() -> None:
    sched = sharded(make_schedule("gpipe", 2, 2))
    with pytest.raises(ScheduleError, match=r"^schedule 'gpipe' is sharded already \(it has U@stage0\): shard the"):
        sharded(sched)


def test_the_forward_phase_of_a_sharded_step() -> None:
    """``only(F, U, R)``: per stage U, its forwards, R. It satisfies every rule of the stage-wide
    actions (no G without a backward); validate's one complaint is the training step's missing
    backwards, as for ``only(F)`` of the unsharded schedule."""
    plain = make_schedule("zb-h1", 4, 8)
    forwards = sharded(plain).only(FORWARD, UNSHARD, RESHARD)
    for w, acts in enumerate(forwards.actions):
        (s,) = plain.stages_of(w)
        assert acts == (U(s), *plain.only(FORWARD).actions[w], R(s))
    assert _refused(forwards) == _refused(plain.only(FORWARD))
    assert [a for a in execution_order(forwards) if a.kind is FORWARD] == execution_order(plain.only(FORWARD))


@pytest.mark.parametrize(("name", "virtual"), [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-v", 2)])
def test_mixed_backwards_keeps_the_stage_wide_actions(name: str, virtual: int) -> None:
    plain = make_schedule(name, 2, 4, virtual)
    mixed = mixed_backwards(sharded(plain))  # validated inside
    assert mixed.only(*COMPUTE) == mixed_backwards(plain)
    assert [a for a in mixed if a.kind in STAGE_WIDE] == [a for a in sharded(plain) if a.kind in STAGE_WIDE]
    assert simulate(mixed).collectives == simulate(sharded(plain)).collectives


def test_costs_of_the_stage_wide_actions() -> None:
    assert [unit_cost(a) for a in (U(0), G(0), R(0))] == [0.0, 0.0, 0.0]
    cost = kind_cost(F=2, U=0.5)
    assert [cost(a) for a in (U(0), G(0), R(0), Action(FORWARD, 0, 0), Action(ActionKind.BACKWARD, 0, 0))] == [
        0.5, 0.0, 0.0, 2.0, 1.0
    ]  # fmt: skip
    assert [StageCosts.uniform(2, F=2).cost(a) for a in (U(1), G(1), R(1))] == [0.0, 0.0, 0.0]
    # A gather and a reduce-scatter that take time: the first forward waits for U, the step ends after G.
    plain = make_schedule("gpipe", 2, 3)
    assert simulate(sharded(plain), kind_cost(U=1, G=1)).makespan == simulate(plain).makespan + 2


def _trace(sched: Schedule, costs: dict[str, float]) -> list[TraceEvent]:
    """The events of a step that ran as ``sched`` simulates under ``costs`` (seconds)."""
    spans = simulate(sched, kind_cost(**costs)).spans
    return [TraceEvent(w, a, round(spans[a][0] * 1e9), round(spans[a][1] * 1e9))
            for w, acts in enumerate(sched.actions) for a in acts]  # fmt: skip


def test_measured_costs_leave_the_collectives_out() -> None:
    sched = sharded(make_schedule("zb-h1", 2, 4))
    events = _trace(sched, {"F": 1, "I": 1, "W": 2, "U": 5, "G": 7, "R": 3})
    costs = StageCosts.from_trace(StepTrace(sched, events).costs(), 2)
    assert (costs.forward, costs.input, costs.weight) == ((1.0, 1.0), (1.0, 1.0), (2.0, 2.0))
    chrome = StepTrace(sched, events).chrome()["traceEvents"]
    assert isinstance(chrome, list)
    names = {(e["name"], e["cat"]) for e in chrome if e.get("ph") == "X"}
    assert {("U s0", "all-gather"), ("G s1", "reduce-scatter"), ("R s1", "reshard"), ("F0 s0", "forward")} <= names


def test_fixed_planner_hands_out_sharded_schedules() -> None:
    assert FixedPlanner("zb-v", 2, 2).schedule_for(4) == make_schedule("zb-v", 2, 4, 2)
    planner = FixedPlanner("zb-v", 2, 2, sharded=True)
    assert planner.schedule_for(4) == sharded(make_schedule("zb-v", 2, 4, 2))
    assert planner.schedule_for(4) is planner.schedule_for(4)
    place = Placement(worker_of=(0, 1), devices=(torch.device("cpu"),) * 2)
    for schedule, kind in (("1f1b", FixedPlanner), ("auto", AutoPlanner)):
        made = planner_of(schedule, place, 1, Collectives(), sharded=True)
        assert isinstance(made, kind) and getattr(made, "sharded") is True  # noqa: B009
        assert any(a.kind is UNSHARD for a in made.schedule_for(4))
        assert getattr(planner_of(schedule, place, 1, Collectives()), "sharded") is False  # noqa: B009


def test_auto_planner_hands_out_sharded_schedules() -> None:
    """The measuring schedules and the plans alike; the plans themselves stay unsharded, planned from
    costs measured without the collectives."""
    planner = AutoPlanner(2, (0, 1), AutoSchedule(), lambda value: [value], sharded=True)
    first = planner.schedule_for(4)
    assert planner.schedule_for(4) is first  # made once: the transports key their routes by it
    assert planner.last_plan is not None and first == sharded(planner.last_plan.schedule)
    planner.observe(4, first, _trace(first, {"F": 1, "B": 2, "I": 1, "W": 1, "U": 9, "G": 9, "R": 9}), None)
    assert planner.costs[4].forward == (1.0, 1.0) and planner.costs[4].weight == (1.0, 1.0)
    second = planner.schedule_for(4)  # step 2 measures again: mixed backwards, sharded
    validate(second)
    assert planner.last_plan is not None and second == sharded(mixed_backwards(planner.last_plan.schedule))
    fixed = AutoPlanner(2, (0, 1), AutoSchedule(costs=StageCosts.uniform(2)), lambda value: [value], sharded=True)
    chosen = fixed.schedule_for(4)
    assert fixed.last_plan is not None and chosen == sharded(fixed.last_plan.schedule)
    assert simulate(chosen).collectives == ((1, 1), (1, 1))


@pytest.mark.parametrize("costs", [None, kind_cost(U=0.5, G=0.5, R=0.25)])
def test_picture_of_a_sharded_schedule(tmp_path: Path, costs: Callable[[Action], float] | None) -> None:
    sim = simulate(sharded(make_schedule("interleaved-1f1b", 2, 4, 2)), costs)
    text = render_timeline(sim, tmp_path / "t.svg").read_text()
    assert "sharded" in text and "all-gather (U)" in text and "reduce-scatter (G)" in text and "free (R)" in text
    plain = render_timeline(simulate(make_schedule("interleaved-1f1b", 2, 4, 2)), tmp_path / "p.svg").read_text()
    assert "sharded" not in plain and "all-gather" not in plain


def _timeline(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("worker ")]


def test_schedule_command_fsdp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["schedule", "--schedule", "1f1b", "--stages", "4", "--chunks", "8"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    out = str(tmp_path / "t.png")
    assert main([*argv, "--fsdp", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "4 stages, sharded (FSDP); costs F=1, B=1, I=1, W=1, U=0, G=0, R=0" in text
    assert "bubble 0.2727" in text and _timeline(text) == _timeline(plain)
    assert "collectives per step, per worker: all-gathers (U) 1, 1, 1, 1; reduce-scatters (G) 1, 1, 1, 1" in text
    assert Path(out).read_bytes()[:4] == b"\x89PNG"

    interleaved = ["schedule", "--schedule", "interleaved-1f1b", "--stages", "2", "--chunks", "4", "--virtual", "2"]
    assert main([*interleaved, "--fsdp", "--costs", "U=1,G=1"]) == 0
    text = capsys.readouterr().out
    assert "all-gathers (U) 2, 2; reduce-scatters (G) 2, 2" in text
    assert re.search(r"^worker 0 \| Ua ", text, re.M), text  # a U that takes time takes a cell

    assert main(["schedule", "--decode", "--stages", "2", "--fsdp"]) == 0
    text = capsys.readouterr().out
    assert "2 stages, sharded (FSDP)" in text and "all-gathers (U) 1, 1; reduce-scatters (G) 0, 0" in text

    assert main(["schedule", "--auto", "--stages", "2", "--chunks", "4", "--fsdp"]) == 0
    text = capsys.readouterr().out
    assert "sharded: makespan" in text and "all-gathers (U) 1, 1; reduce-scatters (G) 1, 1" in text


def test_schedule_command_collective_costs_need_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "--costs", "U=1"]) == 2
    err = capsys.readouterr().err
    assert "--costs U=... times a sharded stage's collectives: add --fsdp, or drop it" in err
    assert len(err.splitlines()) == 1
    assert main(["schedule", "--fsdp", "--costs", "G=-1"]) == 2
    assert "G must be finite and >= 0" in capsys.readouterr().err
