"""Every schedule runs, in one process: gradient-exact against the plain model on the same
micro-batches, bitwise equal across partition counts, placed only where the schedule says, and
``schedule='auto'`` (:class:`gpipe.AutoSchedule`) planned from measured costs within its memory cap."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe import AutoSchedule, Pipeline, load_checkpoint, save_checkpoint
from gpipe.runtime.planner import AutoPlanner, mixed_backwards
from gpipe.saving import layer_state
from gpipe.schedule import SCHEDULES, Schedule, StageCosts, peak_memory, plan, validate
from gpipe.schedule.ir import Action, B, round_robin
from gpipe.schedule.ir import F as Fwd
from tests.helpers import assert_all_close, assert_all_equal, even

VIRTUAL = {"interleaved-1f1b": 2, "zb-v": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}
"""Stages per worker each schedule runs with here (1 for the others)."""

BATCH, WIDTH = 16, 8


def allowed(name: str, k: int, m: int) -> bool:
    """Whether schedule ``name`` exists for K workers and M micro-batches (DualPipeV needs M >= 2K)."""
    return name != "dualpipev" or m >= 2 * k


CASES = [(name, k, m) for name in SCHEDULES for k in (1, 2, 4) for m in (1, 4, 8) if allowed(name, k, m)]


class Sleepy(nn.Module):
    """Tanh that sleeps ``delay`` seconds in its forward (0: not at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0

    def forward(self, x: Tensor) -> Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.tanh(x)


def mlp(dropout: float = 0.0, sleepy: bool = False) -> nn.Sequential:
    """8 x (Linear(8, 8), Tanh or Dropout); ``sleepy``: the last Tanh is a :class:`Sleepy`."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Dropout(dropout) if dropout else nn.Tanh()]
    if sleepy:
        layers[-1] = Sleepy()
    return nn.Sequential(*layers)


def data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def make(model: nn.Sequential, schedule: str | AutoSchedule, k: int, m: int, **kwargs: Any) -> Pipeline:
    """``model`` (a copy) on K 'cpu' workers, one intra-op thread each."""
    virtual = kwargs.pop("virtual", VIRTUAL.get(schedule, 1) if isinstance(schedule, str) else 1)
    kwargs.setdefault("devices", ["cpu"] * k)
    return Pipeline(
        copy.deepcopy(model),
        even(len(model), k * virtual),
        chunks=m,
        schedule=schedule,
        loss_fn=F.mse_loss,
        virtual=virtual,
        cpu_threads=1,
        **kwargs,
    )


def plain_step(model: nn.Module, x: Tensor, y: Tensor, m: int) -> tuple[Tensor, list[Tensor]]:
    """The plain model (in place) on the pipeline's micro-batches: the sum of each micro-batch's
    mean loss weighted by its share of the mini-batch; the loss and the gradients."""
    model.zero_grad()
    total = torch.zeros(())
    chunks = list(zip(x.chunk(m), y.chunk(m)))
    assert len(chunks) == m
    for xs, ys in chunks:
        loss = F.mse_loss(model(xs), ys) * (xs.size(0) / x.size(0))
        loss.backward()
        total = total + loss.detach()
    return total, [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def pipe_grads(pipe: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]


def assert_exact(pipe: Pipeline, model: nn.Module, x: Tensor, y: Tensor, m: int, loss: Tensor) -> None:
    """``pipe``'s last step (its loss and gradients) is the plain model's on the same micro-batches."""
    plain_loss, plain = plain_step(model, x, y, m)
    torch.testing.assert_close(loss, plain_loss)
    assert_all_close(pipe_grads(pipe), plain)


def auto_planner(pipe: Pipeline) -> AutoPlanner:
    planner = pipe.engine.planner
    assert isinstance(planner, AutoPlanner)
    return planner


def names(schedule: Schedule) -> list[list[str]]:
    return [[str(a) for a in acts] for acts in schedule.actions]


# 1a. Every schedule is gradient-exact.


@pytest.mark.parametrize(("name", "k", "m"), CASES, ids=[f"{n}-K{k}-M{m}" for n, k, m in CASES])
def test_every_schedule_equals_the_plain_model(name: str, k: int, m: int) -> None:
    model = mlp()
    x, y = data()
    pipe = make(model, name, k, m)
    loss = pipe.step(x, y)
    assert pipe.last_trace is not None and pipe.last_trace.schedule.name == name
    assert_exact(pipe, copy.deepcopy(model), x, y, m, loss)
    torch.testing.assert_close(pipe(x), model(x))  # the forwards alone, for evaluation


def test_the_cases_cover_every_schedule() -> None:
    assert {n for n, _, _ in CASES} == set(SCHEDULES)
    assert ("dualpipev", 4, 8) in CASES and ("dualpipev", 2, 1) not in CASES and ("zb-v", 4, 1) in CASES


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_with_checkpointing(name: str, checkpoint: str) -> None:
    model = mlp()
    x, y = data()
    pipe = make(model, name, 2, 4, checkpoint=checkpoint)
    loss = pipe.step(x, y)
    assert_exact(pipe, copy.deepcopy(model), x, y, 4, loss)


# 1b. Bitwise equal across partition counts, dropout included.


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("name", ["zb-h2", "zb-v", "dualpipev", "zb-h1", "interleaved-1f1b"])
def test_bitwise_equal_across_partition_counts(name: str, checkpoint: str) -> None:
    """Dropout's random numbers are seeded per (layer, micro-batch), and each stage sums its
    micro-batches' gradients in the same order whatever K: one thread per worker gives bitwise
    the same gradients on 1, 2 and 4 workers."""
    model = mlp(dropout=0.3)
    x, y = data()
    results = {}
    for k in (1, 2, 4):
        torch.manual_seed(11)
        pipe = make(model, name, k, 8, checkpoint=checkpoint)
        results[k] = (pipe.step(x, y), pipe_grads(pipe))
    for k in (2, 4):
        assert torch.equal(results[k][0], results[1][0]), k
        assert_all_equal(results[k][1], results[1][1])
    torch.manual_seed(12)
    other = make(model, name, 2, 8, checkpoint=checkpoint).step(x, y)
    assert not torch.equal(other, results[1][0]), "another seed must draw other dropout masks"


# 1c. The placement comes from the schedule alone.


def fill_drain_on(placement: tuple[int, ...]) -> Callable[[int, int, int], Schedule]:
    """A generator of fill-drain on any placement: every worker runs, in the order of one sequential
    fill-drain (all forwards stage by stage, then all backwards back), the actions of its stages."""

    def generate(workers: int, microbatches: int, virtual: int) -> Schedule:
        stages, ms = len(placement), range(microbatches)
        order: list[Action] = [Fwd(m, s) for s in range(stages) for m in ms]
        order += [B(m, s) for s in reversed(range(stages)) for m in reversed(ms)]
        acts = tuple(tuple(a for a in order if placement[a.stage] == w) for w in range(workers))
        return Schedule("placed", stages, microbatches, acts, placement)

    return generate


PLACEMENTS = [(1, 0), (3, 2, 1, 0), (1, 0, 0, 1), (0, 0, 1, 1), (1, 0, 1, 0)]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=["".join(map(str, p)) for p in PLACEMENTS])
def test_a_registered_schedule_with_its_own_placement(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, placement: tuple[int, ...]
) -> None:
    monkeypatch.setitem(SCHEDULES, "placed", fill_drain_on(placement))
    k = max(placement) + 1
    virtual = len(placement) // k
    # Two labels of the CPU, to tell the workers' devices apart.
    devices = [torch.device("cpu") if w % 2 == 0 else torch.device("cpu", 0) for w in range(k)]
    model = mlp()
    x, y = data()
    pipe = make(model, "placed", k, 4, virtual=virtual, devices=devices)
    schedule = pipe.schedule_for(4)
    validate(schedule)
    assert schedule.placement == placement and schedule.placement != round_robin(len(placement), k)
    found = pipe.engine.placement
    assert found.worker_of == placement
    assert found.stage_devices == [devices[w] for w in placement]
    # Every stage is built here, on its worker's device, with its layers.
    assert sorted(pipe.partitions, key=int) == [str(s) for s in range(len(placement))]
    first = 0
    for s, w in enumerate(placement):
        assert pipe.engine.executor.stages[s].device == devices[w], s
        layers = pipe.engine.partitions[s]
        assert len(layers) == pipe.balance[s]
        assert [int(n) for n in layers._modules] == list(range(first, first + pipe.balance[s]))
        first += pipe.balance[s]
        for p in layers.parameters():
            assert p.device == torch.empty(0, device=devices[w]).device, s
    loss = pipe.step(x, y)
    assert pipe.last_trace is not None
    assert {(e.worker, e.action.stage) for e in pipe.last_trace.events} == set(
        (w, s) for s, w in enumerate(placement)
    ), "every action ran on the worker of its stage"
    assert_exact(pipe, copy.deepcopy(model), x, y, 4, loss)
    # Saving reads the placement too: what it writes loads into a pipeline placed otherwise.
    torch.optim.SGD(pipe.parameters(), lr=0.5).step()
    save_checkpoint(pipe, tmp_path, 1)
    other = make(mlp(), "gpipe", 1, 4, virtual=1)
    assert not torch.equal(next(other.parameters()), next(pipe.parameters()))
    assert load_checkpoint(other, tmp_path) == 1
    assert_all_equal(list(layer_state(other).values()), list(layer_state(pipe).values()))
    assert list(layer_state(other)) == list(layer_state(pipe))


# 1d. schedule='auto'.


def train(pipe: Pipeline, model: nn.Module, m: int, steps: int) -> list[Schedule]:
    """``steps`` SGD steps of ``pipe`` and of the plain ``model`` alike, each checked to be exact;
    the schedule each step ran."""
    x, y = data()
    ours = torch.optim.SGD(pipe.parameters(), lr=0.1)
    theirs = torch.optim.SGD(model.parameters(), lr=0.1)
    ran = []
    for _ in range(steps):
        ours.zero_grad()
        loss = pipe.step(x, y)
        assert pipe.last_trace is not None
        ran.append(pipe.last_trace.schedule)
        assert_exact(pipe, model, x, y, m, loss)
        ours.step()
        theirs.step()
    return ran


@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("schedule", ["auto", AutoSchedule()], ids=["auto", "AutoSchedule()"])
def test_auto_is_exact_while_it_replans(schedule: str | AutoSchedule, m: int) -> None:
    model = mlp()
    pipe = make(model, schedule, 2, m)
    planner = auto_planner(pipe)
    assert pipe.schedule == "auto" and planner.replans == 0
    ran = train(pipe, copy.deepcopy(model), m, 3)
    # The first step ran the plan for equal costs, its backwards half fused and half split (so that
    # both are measured); from then on, plans from the measured costs.
    assert names(ran[0]) == names(mixed_backwards(plan(2, m, StageCosts.uniform(2), placement=(0, 1)).schedule))
    assert {a.kind.value for a in ran[0]} == {"F", "B", "I", "W"}
    assert planner.replans >= 1 and m in planner.costs
    assert planner.costs[m].split_estimated == (False, False)  # I, W measured; B as well:
    assert all(b != i + w for b, i, w in zip(planner.costs[m].fused, planner.costs[m].input, planner.costs[m].weight))
    assert all(s.name == "auto" and s.placement == (0, 1) for s in ran)
    chosen = pipe.schedule_for(m)
    assert planner.last_plan is not None and names(chosen) == names(planner.last_plan.schedule)


@pytest.mark.parametrize("m", [4, 8])
def test_auto_is_exact_when_the_plan_changes(m: int) -> None:
    """With a cap in bytes the first step holds one micro-batch per worker (the bytes of one are not
    known yet); once measured, a roomy cap lets the plan hold more: another schedule, still exact."""
    model = mlp()
    pipe = make(model, AutoSchedule(memory_cap="1GB"), 2, m)
    ran = train(pipe, copy.deepcopy(model), m, 3)
    assert peak_memory(ran[0], StageCosts.uniform(2)) == (1.0, 1.0)
    assert names(ran[1]) != names(ran[0])
    assert max(peak_memory(ran[1], StageCosts.uniform(2))) > 1


def measured_peaks(schedule: str | AutoSchedule, m: int, steps: int = 1) -> list[tuple[int, ...]]:
    """Each step's measured peak activation bytes per worker (K=2, no re-materialization)."""
    pipe = make(mlp(), schedule, 2, m, checkpoint="never", measure_memory=True)
    x, y = data()
    peaks = []
    for _ in range(steps):
        pipe.step(x, y)
        assert pipe.last_trace is not None and pipe.last_trace.peak_activation_bytes is not None
        peaks.append(pipe.last_trace.peak_activation_bytes)
    return peaks


def metered(pipe: Pipeline) -> list[dict[int, int]]:
    """Record, for each step of ``pipe``, its meter's most bytes one micro-batch held on each stage."""
    found: list[dict[int, int]] = []
    step = pipe.engine.executor.step

    def spy(*args: Any, **kwargs: Any) -> Any:
        run, losses = step(*args, **kwargs)
        assert run.meter is not None
        found.append(dict(run.meter.stage_peak))
        return run, losses

    pipe.engine.executor.step = spy  # type: ignore[method-assign]
    return found


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_a_cap_in_microbatches_bounds_the_measured_peak(cap: int) -> None:
    """A worker holds at most ``cap`` micro-batches: its measured peak is at most the schedule's
    simulated peak (<= cap) times the most one micro-batch held on its stages, measured alike."""
    m = 8
    pipe = make(mlp(), AutoSchedule(memory_cap=cap), 2, m, checkpoint="never", measure_memory=True)
    per_microbatch = metered(pipe)
    x, y = data()
    for step in range(4):
        pipe.step(x, y)
        trace = pipe.last_trace
        assert trace is not None and trace.peak_activation_bytes is not None
        held = peak_memory(trace.schedule, StageCosts.uniform(2))
        assert max(held) <= cap  # the simulated peak, in micro-batches
        for w, peak in enumerate(trace.peak_activation_bytes):
            one = max(b for s, b in per_microbatch[step].items() if trace.schedule.placement[s] == w)
            assert 0 < peak <= held[w] * one <= cap * one, (step, w, peak, held, one)
    assert auto_planner(pipe).replans >= 1


def test_a_cap_in_bytes_holds_the_measured_peak() -> None:
    m = 8
    (one_f_one_b,) = measured_peaks("1f1b", m)
    (fill_drain,) = measured_peaks("gpipe", m)
    cap = (max(one_f_one_b) + min(fill_drain)) // 2
    assert max(one_f_one_b) < cap < min(fill_drain)
    peaks = measured_peaks(AutoSchedule(memory_cap=f"{cap}B"), m, steps=4)
    for step, peak in enumerate(peaks):
        assert max(peak) <= cap, (step, peak, cap)
    assert max(peaks[-1]) > max(one_f_one_b), "the planner uses the room the cap leaves"


def test_given_costs_never_change_the_schedule() -> None:
    costs = StageCosts.uniform(2, F=1, I=1, W=2)
    model = mlp()
    pipe = make(model, AutoSchedule(costs=costs, replan_every=1, drift=0.0), 2, 4)
    expected = names(plan(2, 4, costs, placement=(0, 1)).schedule)
    assert names(pipe.schedule_for(4)) == expected
    ran = train(pipe, copy.deepcopy(model), 4, 4)
    assert all(names(s) == expected for s in ran)
    assert auto_planner(pipe).replans == 0 and auto_planner(pipe).costs == {}


def test_replans_when_a_stage_slows_down() -> None:
    model = mlp(sleepy=True)
    pipe = make(model, AutoSchedule(replan_every=1, drift=0.25), 2, 4, checkpoint="never")
    planner = auto_planner(pipe)
    (sleepy,) = [mod for mod in pipe.modules() if isinstance(mod, Sleepy)]
    x, y = data()
    for _ in range(3):
        pipe.step(x, y)
    before = planner.replans
    assert before >= 1 and planner.costs[4].forward[1] < 0.03
    sleepy.delay = 0.03  # the last stage's forward now takes 30 ms more
    pipe.step(x, y)
    assert planner.replans > before
    slow = planner.costs[4]
    assert slow.forward[1] >= 0.03 > slow.forward[0]
    pipe.step(x, y)  # the plan for the new costs runs (every step measures: backwards half fused, half split)
    assert pipe.last_trace is not None
    assert names(pipe.last_trace.schedule) == names(mixed_backwards(plan(2, 4, slow, placement=(0, 1)).schedule))
    pipe.zero_grad()
    loss = pipe.step(x, y)
    assert_exact(pipe, copy.deepcopy(model), x, y, 4, loss)


@pytest.mark.parametrize("cap", [0, -3, "", "12 parsecs", "0MiB", "-1GB", "1.5 MiB!", 1.5, True, [1]])
def test_bad_memory_caps(cap: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"memory_cap: {cap!r}")):
        AutoSchedule(memory_cap=cap)


def test_unknown_schedule_lists_auto() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'") as info:
        make(mlp(), "zigzag", 2, 4)
    listed = str(info.value).split("choose one of", 1)[1]
    assert set(re.findall(r"[\w-]+", listed)) == {*SCHEDULES, "auto"}


@pytest.mark.parametrize(("name", "virtual"), [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)])
def test_mixed_backwards_measures_both_and_holds_no_more(name: str, virtual: int) -> None:
    for k, m in [(1, 1), (2, 4), (3, 5), (4, 8)]:
        if name == "zb-v" and m < 2 * k - 1:
            continue
        original = SCHEDULES[name](k, m, virtual)
        mixed = mixed_backwards(original)  # validates
        kinds = {(a.microbatch % 2, a.kind.value) for a in mixed}
        assert kinds <= {(0, "F"), (0, "B"), (1, "F"), (1, "I"), (1, "W")}
        assert (m == 1) or {(0, "B"), (1, "I"), (1, "W")} <= kinds
        costs = StageCosts.uniform(original.num_stages)
        assert all(a <= b for a, b in zip(peak_memory(mixed, costs), peak_memory(original, costs)))


def test_the_meter_counts_a_micro_batch_as_its_slice_of_the_batch() -> None:
    """Micro-batches are views of the caller's batch: each holds its slice, not the whole storage."""
    model = mlp()
    x, y = data()
    peaks = []
    for batch, m in [(16, 8), (2, 1)]:
        pipe = make(model, "gpipe", 2, m, checkpoint="never", measure_memory=True)
        meters = []
        step = pipe.engine.executor.step

        def keep(*args: Any, step: Any = step, meters: list[Any] = meters, **kwargs: Any) -> Any:
            run, out = step(*args, **kwargs)
            meters.append(run.meter)
            return run, out

        pipe.engine.executor.step = keep  # type: ignore[method-assign]
        pipe.step(x[:batch], y[:batch])
        peaks.append(dict(meters[0].stage_peak))
    assert peaks[0] == peaks[1]
