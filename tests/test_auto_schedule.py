"""The cost-adaptive schedule ('auto'): valid, within the memory cap, never slower than a fixed
generator that fits the same cap, and explained."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest

from gpipe.cli import main
from gpipe.schedule import (
    SCHEDULES,
    ActionKind,
    Candidate,
    Plan,
    Schedule,
    StageCosts,
    auto_schedule,
    fill_drain,
    make_schedule,
    peak_memory,
    plan,
    simulate,
    validate,
)
from gpipe.schedule.ir import B, F, I, W, round_robin, v_shape

EPS = 1e-9


def _trace_b_only(stages: int, microbatches: int, f: float, b: float) -> StageCosts:
    """Costs measured on a schedule without split backwards (a trace with only F and B)."""
    costs = {F(m, s): f for s in range(stages) for m in range(microbatches)}
    costs.update({B(m, s): b for s in range(stages) for m in range(microbatches)})
    return StageCosts.from_trace(costs, stages)


def _mixes(k: int) -> dict[str, StageCosts]:
    return {
        "F=I=W": StageCosts.uniform(k),
        "W=2F": StageCosts.uniform(k, F=1, I=1, W=2),
        "B only": _trace_b_only(k, 4, 1.0, 2.0),
        "fused B cheaper": StageCosts.uniform(k, F=1, I=1, W=1, B=1.5),
        "uneven": StageCosts(
            forward=(1.0, 2.0, 1.5, 0.5)[:k],
            input=(1.0, 2.5, 1.0, 0.5)[:k],
            weight=(2.0, 1.0, 0.5, 1.0)[:k],
            memory=(1.0, 2.0, 0.5, 1.5)[:k],
        ),
        "transfer": StageCosts.uniform(k, F=1, I=1, W=2, transfer=0.3),
    }


def _fixed(k: int, m: int, costs: StageCosts, placement: tuple[int, ...]) -> dict[str, tuple[float, tuple[float, ...]]]:
    """Every fixed generator's (makespan, peak memory per worker) for this placement, under ``costs``."""
    out = {}
    for name, generate in SCHEDULES.items():
        for virtual in (1, 2):
            try:
                schedule = generate(k, m, virtual)
                validate(schedule)
            except ValueError:
                continue
            if schedule.placement == placement:
                sim = simulate(schedule, costs.cost, transfer=costs.transfer)
                out[name] = (sim.makespan, peak_memory(schedule, costs))
                break
    return out


def _check(schedule: Schedule, k: int, m: int, costs: StageCosts, cap: float | list[float] | None) -> None:
    validate(schedule)
    assert schedule.name == "auto" and schedule.num_workers == k and schedule.num_microbatches == m
    if cap is not None:
        caps = [cap] * k if isinstance(cap, int | float) else cap
        peaks = peak_memory(schedule, costs)
        assert all(p <= c + EPS for p, c in zip(peaks, caps)), (peaks, caps)


# (a) validity over sizes and cost mixes; (c) never slower than a fixed generator that fits -----------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 13])
def test_valid_and_no_slower_than_any_fixed_schedule(k: int, m: int) -> None:
    for mix, costs in _mixes(k).items():
        result = plan(k, m, costs)
        _check(result.schedule, k, m, costs, None)
        sim = simulate(result.schedule, costs.cost, transfer=costs.transfer)
        assert sim.makespan == pytest.approx(result.makespan)
        assert result.peak_memory == peak_memory(result.schedule, costs)
        for name, (makespan, _) in _fixed(k, m, costs, round_robin(k, k)).items():
            assert result.makespan <= makespan + EPS, (mix, name, result.makespan, makespan)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_no_slower_than_fixed_schedules_within_the_same_cap(k: int, m: int) -> None:
    for costs in (StageCosts.uniform(k, F=1, I=1, W=2, transfer=0.2), _mixes(k)["uneven"]):
        fixed = _fixed(k, m, costs, round_robin(k, k))
        for cap in sorted({max(peaks) for _, peaks in fixed.values()}):
            result = plan(k, m, costs, memory_cap=cap)
            _check(result.schedule, k, m, costs, cap)
            for name, (makespan, peaks) in fixed.items():
                if max(peaks) <= cap + EPS:
                    assert result.makespan <= makespan + EPS, (cap, name)


def test_measured_cpu_costs_against_zb_h1_and_fill_drain() -> None:
    # F=45, I=45, W=79 ms (measured on our CPU), K=2, M=8. No schedule beats the bound
    # (K-1)F + M(F+I+W) = 1397: worker 1 waits one F, then works M(F+I+W). ZB-H1 reaches it already.
    costs = StageCosts.uniform(2, F=45, I=45, W=79)
    result = plan(2, 8, costs)
    fixed = _fixed(2, 8, costs, round_robin(2, 2))
    assert result.makespan == fixed["zb-h1"][0] == 45 + 8 * (45 + 45 + 79) == 1397
    assert result.bubble == pytest.approx(45 / 1397)  # 3.2%
    assert fixed["gpipe"][0] == 1521  # fill-drain: bubble 11.1%
    assert simulate(fill_drain(2, 8), costs.cost).bubble == pytest.approx(1 / 9)

    # Within 1F1B's memory (2 and 1 micro-batches) ZB-H1 does not fit; 'auto' still defers W.
    capped = plan(2, 8, costs, memory_cap=[2, 1])
    _check(capped.schedule, 2, 8, costs, [2, 1])
    assert capped.chosen.startswith("greedy")
    assert capped.makespan == 1442 < fixed["1f1b"][0] == 1521  # bubble 6.2% vs 11.1%

    # With a 5 ms hand-over between the workers, 'auto' beats ZB-H1 (given ZB-H2's memory).
    slow = StageCosts.uniform(2, F=45, I=45, W=79, transfer=5)
    fixed = _fixed(2, 8, slow, round_robin(2, 2))
    assert plan(2, 8, slow).makespan == 1402 < fixed["zb-h1"][0] == 1412


def test_greedy_beats_zb_h1_within_its_memory_with_slow_w() -> None:
    # Uneven stages, W slower than F and I (the measured ratio 79/45): the greedy scheduler beats
    # every fixed schedule that fits ZB-H1's memory.
    f = (30.0, 45.0, 45.0, 30.0)
    costs = StageCosts(forward=f, input=f, weight=tuple(round(x * 79 / 45) for x in f))
    fixed = _fixed(4, 8, costs, round_robin(4, 4))
    zb_makespan, zb_peaks = fixed["zb-h1"]
    result = plan(4, 8, costs, memory_cap=list(zb_peaks))
    _check(result.schedule, 4, 8, costs, list(zb_peaks))
    assert result.chosen.startswith("greedy")
    assert result.makespan < zb_makespan
    assert all(result.makespan < makespan for makespan, peaks in fixed.values() if peaks <= zb_peaks)


# (b) the memory cap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("m", [4, 8, 13])
def test_never_exceeds_the_memory_cap(k: int, m: int) -> None:
    costs = StageCosts.uniform(k, F=1, I=1, W=2)
    one_f_one_b = peak_memory(make_schedule("1f1b", k, m), costs)
    for cap in [*range(1, m + 1), None]:
        result = plan(k, m, costs, memory_cap=cap)
        _check(result.schedule, k, m, costs, cap)
    # Per worker: 1F1B's own peaks, and a few random caps.
    rng = random.Random(k * 100 + m)
    for caps in [list(one_f_one_b), *([rng.randint(1, m) for _ in range(k)] for _ in range(4))]:
        result = plan(k, m, costs, memory_cap=caps)
        _check(result.schedule, k, m, costs, caps)
        assert result.memory_cap == tuple(caps)


def test_cap_in_memory_units_with_uneven_activations() -> None:
    costs = StageCosts(forward=(1.0,) * 3, input=(1.0,) * 3, weight=(2.0,) * 3, memory=(2.5, 1.0, 0.5))
    for cap in (2.5, 3.0, 5.0, 7.5, 10.0):
        result = plan(3, 8, costs, memory_cap=cap)
        _check(result.schedule, 3, 8, costs, cap)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_v_shape_placement(k: int, m: int) -> None:
    costs = StageCosts.uniform(2 * k, F=1, I=1, W=2)
    for cap in (2, 4, None):
        result = plan(k, m, costs, memory_cap=cap, placement=v_shape(k))
        _check(result.schedule, k, m, costs, cap)
        assert result.schedule.placement == v_shape(k)
        for name, (makespan, peaks) in _fixed(k, m, costs, v_shape(k)).items():
            if cap is None or max(peaks) <= cap:
                assert result.makespan <= makespan + EPS, name


def test_random_costs_placements_and_caps() -> None:
    # Zero costs, skewed stages, fused backwards, hand-overs, uneven activations, tight caps: always a
    # valid schedule within the cap (the greedy scheduler never gets stuck).
    rng = random.Random(5)
    for _ in range(60):
        k, m = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 5, 8])
        placement = rng.choice([round_robin(k, k), round_robin(2 * k, k), v_shape(k)])
        n = len(placement)

        def pick(n: int = n) -> tuple[float, ...]:
            return tuple(rng.choice([0.0, 0.1, 1.0, 3.0, 10.0]) for _ in range(n))

        costs = StageCosts(
            forward=pick(),
            input=pick(),
            weight=pick(),
            backward=pick() if rng.random() < 0.3 else None,
            memory=tuple(rng.choice([0.5, 1.0, 2.0]) for _ in range(n)),
            transfer=rng.choice([0.0, 0.5, 5.0]),
        )
        least = [sum(costs.activation[s] for s in range(n) if placement[s] == w) for w in range(k)]
        cap = rng.choice([None, [x * rng.choice([1, 1.5, 2, 3]) for x in least]])
        result = plan(k, m, costs, memory_cap=cap, placement=placement)
        _check(result.schedule, k, m, costs, cap)
        assert result.schedule.placement == placement


def test_peak_memory_counts_micro_batches_like_the_simulator() -> None:
    costs = StageCosts.uniform(4)
    for name in ("gpipe", "1f1b", "zb-h1"):
        schedule = make_schedule(name, 4, 8)
        assert peak_memory(schedule, costs) == tuple(map(float, simulate(schedule).peak_in_flight))


# (d) near-zero bubble with F = I = W and unlimited memory -------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [4, 8, 13])
def test_equal_costs_reach_the_lower_bound(k: int, m: int) -> None:
    # The last worker cannot start before K-1 forwards and then has 3M units of work: makespan >=
    # 3M + K - 1, every worker idles >= K - 1, bubble >= (K-1)/(3M+K-1). 'auto' reaches it (M >= K).
    result = plan(k, m, StageCosts.uniform(k))
    assert result.makespan == 3 * m + k - 1
    assert result.bubble == pytest.approx((k - 1) / (3 * m + k - 1))


# (e) a cap below one micro-batch ------------------------------------------------------------------


def test_cap_error_names_the_minimum() -> None:
    with pytest.raises(ValueError, match=r"smallest cap that works is 1, 1 per worker"):
        plan(2, 4, StageCosts.uniform(2), memory_cap=0.5)
    costs = StageCosts(forward=(1.0,) * 4, input=(1.0,) * 4, weight=(1.0,) * 4, memory=(2.0, 1.0, 1.0, 3.0))
    with pytest.raises(
        ValueError, match=r"cap 4 on worker 0: .* stages 0, 3 take 5 .* smallest cap that works is 5, 2"
    ):
        plan(2, 4, costs, memory_cap=4, placement=v_shape(2))
    result = plan(2, 4, costs, memory_cap=[5, 2], placement=v_shape(2))  # the minimum itself works
    assert result.peak_memory == (5.0, 2.0)


def test_bad_arguments() -> None:
    costs = StageCosts.uniform(2)
    with pytest.raises(ValueError, match=r"memory_cap has 3 values but there are 2 workers"):
        plan(2, 4, costs, memory_cap=[1, 2, 3])
    with pytest.raises(ValueError, match=r"memory_cap\[1\] must be a finite number >= 0 \(got nan\)"):
        plan(2, 4, costs, memory_cap=[1, math.nan])
    with pytest.raises(ValueError, match=r"placement places 3 stages but the costs are for 2"):
        plan(2, 4, costs, placement=[0, 1, 0])
    with pytest.raises(ValueError, match=r"placement puts no stage on worker 2"):
        plan(3, 4, costs, placement=[0, 1])
    with pytest.raises(ValueError, match=r"costs are for 2 stages, fewer than the 3 workers"):
        plan(3, 4, costs)
    with pytest.raises(ValueError, match=r"micro-batches: 0"):
        plan(2, 0, costs)


# (f) costs -----------------------------------------------------------------------------------------


def test_stage_costs_validate_eagerly() -> None:
    with pytest.raises(ValueError, match=r"weight\[1\] must be a finite number >= 0 \(got -1\)"):
        StageCosts(forward=(1, 1), input=(1, 1), weight=(1, -1))
    with pytest.raises(ValueError, match=r"forward\[0\] must be a finite number >= 0 \(got nan\)"):
        StageCosts.uniform(2, F=math.nan)
    with pytest.raises(ValueError, match=r"transfer must be a finite number >= 0 \(got -0.5\)"):
        StageCosts.uniform(2, transfer=-0.5)
    with pytest.raises(ValueError, match=r"input has 1 values but there are 2 stages"):
        StageCosts(forward=(1, 1), input=(1,), weight=(1, 1))
    with pytest.raises(ValueError, match=r"stages must be a positive integer"):
        StageCosts.uniform(0)
    costs = StageCosts.uniform(2, F=1, I=2, W=3)
    assert costs.fused == (5.0, 5.0) and costs.activation == (1.0, 1.0)
    assert [costs.cost(a) for a in (F(0, 1), I(0, 1), W(0, 1), B(0, 1))] == [1.0, 2.0, 3.0, 5.0]


def test_stage_costs_from_a_trace() -> None:
    trace = {
        F(0, 0): 1.0,
        F(1, 0): 3.0,  # stage 0: F averages 2
        I(0, 0): 1.0,
        I(1, 0): 2.0,
        W(0, 0): 4.0,
        W(1, 0): 6.0,
        F(0, 1): 0.5,
        F(1, 1): 1.5,
        B(0, 1): 3.0,  # stage 1: only B, averaging 4, split half and half
        B(1, 1): 5.0,
    }
    costs = StageCosts.from_trace(trace, 2)
    assert costs.forward == (2.0, 1.0)
    assert costs.input == (1.5, 2.0) and costs.weight == (5.0, 2.0)
    assert costs.fused == (6.5, 4.0)
    assert costs.split_estimated == (False, True)
    shared = StageCosts.from_trace(trace, 2, input_share=0.25, memory=[2.0, 1.0], transfer=0.1)
    assert shared.input[1] == 1.0 and shared.weight[1] == 3.0
    assert shared.activation == (2.0, 1.0) and shared.transfer == 0.1
    # The trace of a real schedule run on paper gives back its costs.
    assert StageCosts.from_trace({a: 2.0 if a.kind is ActionKind.BACKWARD else 1.0 for a in fill_drain(3, 4)}, 3) == (
        StageCosts(forward=(1.0,) * 3, input=(1.0,) * 3, weight=(1.0,) * 3, split_estimated=(True,) * 3)
    )


def test_stage_costs_from_a_bad_trace() -> None:
    with pytest.raises(ValueError, match=r"the cost of F0@stage0 must be a finite number >= 0 \(got -1.0\)"):
        StageCosts.from_trace({F(0, 0): -1.0, B(0, 0): 1.0}, 1)
    with pytest.raises(ValueError, match=r"no forward \(F\) of stage 1"):
        StageCosts.from_trace({F(0, 0): 1.0, B(0, 0): 1.0, B(0, 1): 1.0}, 2)
    with pytest.raises(ValueError, match=r"no W of stage 0"):
        StageCosts.from_trace({F(0, 0): 1.0, I(0, 0): 1.0}, 1)
    with pytest.raises(ValueError, match=r"the trace has F0@stage2 but there are 2 stages"):
        StageCosts.from_trace({F(0, 2): 1.0}, 2)


# (g) transfer time in the simulator ----------------------------------------------------------------


def test_transfer_time_on_the_critical_path() -> None:
    schedule = fill_drain(2, 1)  # F0 on stage 0, hand-over, F0 and B0 on stage 1, hand-over, B0 on 0
    assert simulate(schedule).makespan == 4
    assert simulate(schedule, transfer=0.25).makespan == 4.5
    # As a function of (producer, consumer): only the activation's hand-over costs here.
    assert simulate(schedule, transfer=lambda p, c: 1.0 if p.kind is ActionKind.FORWARD else 0.0).makespan == 5
    # Stages on one worker hand over nothing (a V of one worker).
    one = Schedule("v", 2, 1, ((F(0, 0), F(0, 1), B(0, 1), B(0, 0)),), (0, 0))
    assert simulate(one, transfer=10).makespan == 4
    with pytest.raises(ValueError, match=r"transfer time must be a finite number >= 0 \(got -1\)"):
        simulate(schedule, transfer=-1)
    # 'auto' plans with the transfer time: the same step as simulated.
    costs = StageCosts.uniform(2, F=1, I=1, W=1, transfer=0.25)
    result = plan(2, 1, costs)
    assert result.makespan == simulate(result.schedule, costs.cost, transfer=0.25).makespan == 5.5


# determinism, speed, the explanation ---------------------------------------------------------------


def test_deterministic() -> None:
    # (How long planning takes is not asserted: a loaded 2-core machine breaks any bound.)
    costs = StageCosts.uniform(4, F=1, I=1.2, W=1.7, transfer=0.1)
    first = auto_schedule(4, 32, costs, memory_cap=4)
    assert auto_schedule(4, 32, costs, memory_cap=4) == first


def test_plan_explains_the_choice() -> None:
    result = plan(2, 8, StageCosts.uniform(2, F=45, I=45, W=79), memory_cap=2)
    names = [c.name for c in result.candidates]
    assert {"gpipe", "1f1b", "zb-h1"} <= set(names) and any(n.startswith("greedy") for n in names)
    assert result.chosen == "zb-h1"  # ties go to the first candidate (here a fixed generator)
    assert [c.fits for c in result.candidates if c.name == "gpipe"] == [False]
    text = result.explain()
    assert "chose zb-h1: makespan 1397, bubble 0.0322 (3.2%)" in text
    assert "memory cap per worker: 2, 2" in text
    assert "* zb-h1" in text and "fits cap" in text


# (h) the command line ------------------------------------------------------------------------------


def test_cli_auto_prints_the_candidates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/auto.png"
    assert (
        main(["schedule", "--auto", "--stages", "2", "--chunks", "8", "--costs", "F=45,I=45,W=79", "--out", out]) == 0
    )
    text = capsys.readouterr().out
    assert "chose zb-h1: makespan 1397" in text
    assert "candidate" in text and "fits cap" in text
    for name in ("gpipe", "1f1b", "zb-h1", "greedy("):
        assert name in text
    with open(out, "rb") as f:
        assert f.read(4) == b"\x89PNG"
    argv = ["schedule", "--auto", "--stages", "4", "--chunks", "8", "--costs", "F=1,I=1,W=2,transfer=1"]
    assert main([*argv, "--memory-cap", "4,3,2,1"]) == 0
    text = capsys.readouterr().out
    assert "memory cap per worker: 4, 3, 2, 1" in text
    assert "transfer=1" in text
    assert "worker 3 |" in text  # integer costs: the timeline as text


def test_cli_auto_shows_each_workers_peak_against_its_cap(capsys: pytest.CaptureFixture[str]) -> None:
    """With a cap per worker, a candidate's verdict is explained by its peaks per worker: zb-h1 and 1F1B
    have the same largest peak, but only zb-h1's last worker holds more than its cap."""
    assert main(["schedule", "--auto", "--stages", "2", "--chunks", "8", "--memory-cap", "2,1"]) == 0
    rows = {line[2:].split("  ")[0]: line for line in capsys.readouterr().out.splitlines() if line[:2] in ("* ", "  ")}
    result = plan(2, 8, StageCosts.uniform(2, F=1, I=1, W=1), memory_cap=(2, 1))
    assert result.memory_cap == (2, 1)
    verdicts = {}
    for c in result.candidates:
        peaks = ", ".join(f"{p:g}" for p in c.peak_memory)
        over = [f"worker {w}: {p:g} > {cap:g}" for w, (p, cap) in enumerate(zip(c.peak_memory, (2, 1))) if p > cap]
        verdicts[c.name] = "yes" if c.fits else f"no ({', '.join(over)})"
        assert f"  {peaks}  " in rows[c.name] and rows[c.name].endswith(f"  {verdicts[c.name]}"), rows[c.name]
    assert verdicts["1f1b"] == "yes" and verdicts["zb-h1"] == "no (worker 1: 2 > 1)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--auto", "--schedule", "1f1b"], "--auto picks the schedule"),
        (["--memory-cap", "3"], "--memory-cap needs --auto"),
        (["--auto", "--memory-cap", "0.5"], "smallest cap that works is 1, 1, 1, 1"),
        (["--auto", "--memory-cap", "3,x"], "expected a number, or one per worker"),
        (["--auto", "--memory-cap", "3,3"], "--memory-cap: give one number, or one per worker (4); got 2"),
        (["--auto", "--memory-cap", "-1"], "must be positive and finite"),
        (["--auto", "--costs", "transfer=-1"], "transfer must be finite and >= 0"),
        (["--auto", "--costs", "X=1"], "KIND one of F, B, I, W, or transfer=TIME"),
    ],
)
def test_cli_auto_rejects_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_fixed_schedule_with_transfer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "--schedule", "gpipe", "--stages", "2", "--chunks", "1", "--costs", "transfer=1"]) == 0
    assert "makespan 6," in capsys.readouterr().out  # 4 + two hand-overs


def test_jitter_from_a_trace_is_the_spread_of_actions_of_a_stage_and_kind() -> None:
    trace = {F(0, 0): 0.9, F(1, 0): 1.0, F(2, 0): 1.1, B(0, 0): 2.0, B(1, 0): 2.0, B(2, 0): 2.0}
    costs = StageCosts.from_trace(trace, 1)
    # F: median 1, median absolute deviation 0.1: CV 0.14826, weight 3 (its time); B: CV 0, weight 6
    assert costs.jitter == pytest.approx(0.14826 / math.sqrt(3))
    assert StageCosts.from_trace({F(0, 0): 1.0, B(0, 0): 2.0}, 1).jitter == 0
    slow_first = {**trace, F(0, 0): 9.0}  # a first call 9x slower moves the median by nothing
    assert StageCosts.from_trace(slow_first, 1).forward == (1.1,)


def test_jitter_prefers_the_schedule_with_slack() -> None:
    """With F = I = 45, W = 79 (this CPU's measured costs) zb-h1 and zb-h2 take the same simulated
    time; when action times vary, zb-h2's extra warm-up forwards absorb the variation."""
    steady = plan(2, 8, StageCosts.uniform(2, F=45, I=45, W=79))
    assert steady.chosen == "zb-h1"  # as fast, and fewer micro-batches held
    noisy_costs = dataclasses.replace(StageCosts.uniform(2, F=45, I=45, W=79), jitter=0.2)
    noisy = plan(2, 8, noisy_costs)
    by_name = {c.name: c for c in noisy.candidates}
    assert by_name["zb-h2"].expected < by_name["zb-h1"].expected < by_name["gpipe"].expected
    assert noisy.chosen != "zb-h1" and _no_slower(noisy, by_name)
    assert plan(2, 8, noisy_costs).schedule == noisy.schedule  # the same draws every time
    assert "expected" in noisy.table() and "jitter=0.2" in noisy.explain()
    with pytest.raises(ValueError, match="jitter"):
        dataclasses.replace(noisy_costs, jitter=-1.0)


def _no_slower(p: Plan, by_name: dict[str, Candidate]) -> bool:
    chosen = by_name[p.chosen].expected
    return all(math.isnan(c.expected) or chosen <= c.expected for c in p.candidates if c.fits)
