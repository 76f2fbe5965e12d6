"""A schedule's traffic between ranks checked under NCCL's point-to-point rules
(gpipe.schedule.wire): every generator's, and one whose receiver needs its messages in another order
than they are sent — run across two ranks too, under tests/rendezvous.py's semantics."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from gpipe.schedule import SCHEDULES, make_schedule, sharded
from gpipe.schedule.ir import B, F, Schedule, ScheduleError, validate
from gpipe.schedule.wire import check_wire, links
from tests import dist_cases
from tests.dist_harness import POOL, Pool


def reversed_receiver() -> Schedule:
    """Two workers, two micro-batches: worker 1 runs micro-batch 1 first, worker 0 micro-batch 0."""
    return Schedule(
        "reversed",
        2,
        2,
        ((F(0, 0), F(1, 0), B(0, 0), B(1, 0)), (F(1, 1), F(0, 1), B(1, 1), B(0, 1))),
        (0, 1),
    )


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_generator_runs_under_nccl_semantics(name: str) -> None:
    for workers in (2, 4):
        for microbatches in (workers, 2 * workers, 3 * workers + 1):
            for virtual in (1, 2):
                try:
                    schedule = make_schedule(name, workers, microbatches, virtual)
                except ValueError:
                    continue  # (a size the generator does not take)
                for s in (schedule, sharded(schedule)):
                    traffic = check_wire(s)
                    # every boundary between two workers carries each micro-batch once each way
                    crossing = sum(1 for a, b in zip(s.placement, s.placement[1:], strict=False) if a != b)
                    assert sum(len(t.messages) for t in traffic.values()) == 2 * crossing * microbatches, name
                    for (src, dst, _), t in traffic.items():
                        assert src != dst and len(set(t.messages)) == len(t.messages)


def test_a_receiver_that_needs_messages_out_of_order_receives_ahead() -> None:
    schedule = reversed_receiver()
    validate(schedule)
    traffic = check_wire(schedule)
    assert links(schedule) == {
        (0, 1, "act"): (("act", 0, 1), ("act", 1, 1)),
        (1, 0, "grad"): (("grad", 1, 0), ("grad", 0, 0)),
    }
    assert {link: t.ahead for link, t in traffic.items()} == {(0, 1, "act"): 1, (1, 0, "grad"): 1}


def test_a_schedule_that_would_wait_forever_is_refused() -> None:
    stuck = Schedule("stuck", 2, 1, ((B(0, 0), F(0, 0)), (F(0, 1), B(0, 1))), (0, 1))
    with pytest.raises(ScheduleError, match="would wait forever: worker 0 at B0@stage0, worker 1 at F0@stage1"):
        check_wire(stuck)


def out_of_order(chunks: int = 2) -> dict[str, Any]:
    """The reversed schedule across two ranks against fill-drain's step on the same model and data."""
    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {}
    for name in ("gpipe", "reversed"):
        torch.manual_seed(5)
        pipe = dist_cases.build("gpipe", world, chunks)
        if name == "reversed":
            pipe.engine.planner.schedule_for = lambda m: reversed_receiver()  # type: ignore[method-assign]
        x, y = dist_cases.data()
        out[name] = {"loss": pipe.step(x, y), "grads": dist_cases.grads_of(pipe)}
    return out


CASE = POOL.add(2, "wire out of order", "test_schedule_wire:out_of_order")


def test_out_of_order_receives_across_ranks_give_fill_drains_gradients(pool: Pool) -> None:
    for r, out in enumerate(pool(CASE)):
        assert torch.equal(out["reversed"]["loss"], out["gpipe"]["loss"]), r
        assert out["gpipe"]["grads"], r
        for name, g in out["gpipe"]["grads"].items():
            assert torch.equal(out["reversed"]["grads"][name], g), (r, name)


def uneven(chunks: int = 4) -> dict[str, Any]:
    """A step whose micro-batches differ in size (10 rows in 4: the last message of each link changes
    its layout, so its receiver's receives posted ahead with the sizes before meet something else)."""
    torch.manual_seed(5)
    pipe = dist_cases.build("1f1b", int(os.environ["WORLD_SIZE"]), chunks)
    x, y = dist_cases.data()
    return {"loss": pipe.step(x[:10], y[:10]), "grads": dist_cases.grads_of(pipe)}


UNEVEN = POOL.add(2, "wire uneven micro-batches", "test_schedule_wire:uneven")


def test_micro_batches_of_other_sizes_cross_ranks_as_in_one_process(pool: Pool) -> None:
    torch.manual_seed(5)
    pipe = dist_cases.build("1f1b", 2, 4, devices=["cpu", "cpu"], cpu_threads=1)
    x, y = dist_cases.data()
    loss = pipe.step(x[:10], y[:10])
    grads = dist_cases.grads_of(pipe)
    ranks = pool(UNEVEN)
    merged = {n: g for r in ranks for n, g in r["grads"].items()}
    assert set(merged) == set(grads)
    for r in ranks:
        assert torch.equal(r["loss"], loss)
    for name, g in grads.items():
        assert torch.equal(merged[name], g), name
