"""A rank lost at any point of a step — killed (SIGKILL) or stopped (SIGSTOP) — in the step's first
collective (the seed's broadcast), in its actions, in the loss's broadcast or in the data-parallel
all-reduce: every other rank exits within the timeout with a PipelineError that names it, the raw
gloo error kept as its cause.

The scenarios of the selected tests start with the session, a few at a time, in threads beside the
other tests (tests/background.py): each spends most of its time waiting for a timeout, not computing."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.background import BACKGROUND
from tests.dist_harness import start, wait

TIMEOUT = 5.0  # Pipeline(timeout=...): how long a transfer or a collective may take
EXIT = 2.0  # what a process takes to exit once it raised (the process group's teardown)
# Room for a loaded 2-core machine: a bound tells "ended by the timeout" from "hung until the test's
# 60 s limit", and must not trip on a scheduler that is slow by a second or a few.
SLACK = 10.0


@dataclass
class Lost:
    codes: list[int | None]
    outputs: list[str]
    seconds: dict[int, float]  # per survivor: from the victim's loss to its exit


def lose(
    tmp_path: Path, world: int, victim: int, where: str, how: str, dp: int = 1, limit: float = 60, *, retry: bool = True
) -> Lost:
    """Run ``lost_at`` on ``world`` ranks; wait for every rank but the victim to exit, then kill
    whatever is left (a stopped victim too: SIGKILL ends a stopped process). Ranks that never met
    (their rendezvous failed, under the load of the session's start) run once more."""
    mark = tmp_path / "lost_at"
    procs = start("lost_at", world, tmp_path, rank=victim, where=where, how=how, timeout=TIMEOUT, mark=str(mark), dp=dp)
    outputs = [""] * world

    def drain(r: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        outputs[r] = p.stdout.read()

    readers = [threading.Thread(target=drain, args=(r, p), daemon=True) for r, p in enumerate(procs)]
    for t in readers:
        t.start()
    ended: dict[int, float] = {}
    try:
        deadline = time.monotonic() + limit
        while len(ended) < world - 1 and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r != victim and r not in ended and p.poll() is not None:
                    ended[r] = time.time()
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
        for t in readers:
            t.join(10)
    if not mark.exists() and retry and any("DistNetworkError" in o for o in outputs):
        # (the ranks never met: the rendezvous failed, under the load of the session's start; once more)
        return lose(tmp_path / "again", world, victim, where, how, dp, limit, retry=False)
    assert mark.exists(), f"the victim never got to {where!r}:\n" + "\n".join(o[-3000:] for o in outputs)
    lost_at = float(mark.read_text())
    return Lost([p.returncode for p in procs], outputs, {r: t - lost_at for r, t in ended.items()})


# Each test's scenario, by the test's name: (world, victim, where, how, dp).
SCENARIOS = {
    "test_a_rank_killed_between_steps_is_named_at_once": (2, 1, "between", "kill", 1),
    "test_a_rank_stopped_between_steps_is_named_after_the_timeout": (2, 1, "between", "stop", 1),
    "test_a_rank_lost_before_the_loss_broadcast_is_named[kill]": (2, 1, "loss", "kill", 1),
    "test_a_rank_lost_before_the_loss_broadcast_is_named[stop]": (2, 1, "loss", "stop", 1),
    "test_a_rank_stopped_in_a_step_is_named": (2, 1, "step", "stop", 1),
    "test_rank_0_lost_between_steps_takes_the_store_and_is_named[kill]": (2, 0, "between", "kill", 1),
    "test_rank_0_lost_between_steps_takes_the_store_and_is_named[stop]": (2, 0, "between", "stop", 1),
    "test_a_replica_lost_before_the_gradient_all_reduce_is_named_everywhere": (4, 3, "grads", "kill", 2),
}


for _test, _scenario in SCENARIOS.items():  # (each a job of the session's start: tests/background.py)
    BACKGROUND.add(__name__, _test, lambda folder, s=_scenario: lose(folder, *s))


@pytest.fixture
def lost(request: pytest.FixtureRequest) -> Lost:
    """This test's scenario, run (see :data:`SCENARIOS`)."""
    return BACKGROUND.result(__name__, request.node.name)  # type: ignore[no-any-return]


def check(lost: Lost, victim: int, bound: float, message: str, raw: str) -> None:
    for r, out in enumerate(lost.outputs):
        if r == victim:
            continue
        assert r in lost.seconds, f"rank {r} did not exit:\n{out[-3000:]}"
        assert lost.codes[r] not in (0, None), (r, lost.codes)
        assert lost.seconds[r] < bound + SLACK, (r, lost.seconds[r], out[-3000:])
        assert f"gpipe.distributed.PipelineError: {message}" in out, (r, out[-3000:])
        assert raw in out, (r, out[-3000:])  # the transport's own words stay, as the cause or the tail


def test_a_rank_killed_between_steps_is_named_at_once(lost: Lost) -> None:
    """The next step's first collective (the seed's broadcast) finds rank 1's socket closed."""
    check(lost, 1, TIMEOUT, "rank 1 is gone: the broadcast of the step's seed", "gloo")
    assert "The above exception was the direct cause" in lost.outputs[0]


def test_a_rank_stopped_between_steps_is_named_after_the_timeout(lost: Lost) -> None:
    check(lost, 1, TIMEOUT + 3 + EXIT, "rank 1 is not responding: the broadcast of the step's seed", "Timed out")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_lost_before_the_loss_broadcast_is_named(lost: Lost, how: str) -> None:
    """Rank 1 holds the last stage: rank 0 waits for the loss it broadcasts."""
    state, bound = ("gone", TIMEOUT) if how == "kill" else ("not responding", TIMEOUT + 3 + EXIT)
    check(lost, 1, bound, f"rank 1 is {state}: the broadcast from the last stage's rank 1", "gloo")


def test_a_rank_stopped_in_a_step_is_named(lost: Lost) -> None:
    check(lost, 1, TIMEOUT + 3 + EXIT, "rank 1 is not responding (rank 0 lost its connection to rank 1", "Timed out")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_rank_0_lost_between_steps_takes_the_store_and_is_named(lost: Lost, how: str) -> None:
    """Rank 0 hosts the process group's store: the others name it from the store's silence."""
    state, bound = ("gone", TIMEOUT) if how == "kill" else ("not responding", TIMEOUT + 3 + EXIT)
    check(lost, 0, bound, f"rank 0 is {state} (the process group's store", "gloo")


def test_a_replica_lost_before_the_gradient_all_reduce_is_named_everywhere(lost: Lost) -> None:
    """dp=2 x pp=2: rank 3 dies before the all-reduce of its gradients; its replica peer (rank 1)
    loses it there, its stage peer (rank 2) in the loss's broadcast, rank 0 through the store."""
    check(lost, 3, TIMEOUT, "rank 3 (dp 1, pp 1) is gone", "gloo")  # with its coordinates on the mesh
    assert "the all-reduce of the gradients over the data-parallel replicas over ranks [1, 3]" in lost.outputs[1]


@pytest.mark.parametrize("victim", [1, 0])
def test_a_lost_rank_is_named_while_the_process_group_is_torn_down(tmp_path: Path, victim: int) -> None:
    """The survivor destroys its process group (a cleanup, or the exit) while a failure is being
    named: the failed collective, the report of a transfer thread still running and the exit's
    watch name the lost rank from what they captured, not from the group that is gone (rank 0
    lost: from its store's silence)."""
    survivor = 1 - victim
    codes, outputs, _ = wait(start("named_after_teardown", 2, tmp_path, rank=victim, timeout=TIMEOUT), timeout=90)
    assert codes[victim] == -signal.SIGKILL, (codes, outputs[victim][-3000:])
    out = outputs[survivor]
    assert codes[survivor] == 0, out[-3000:]
    assert "has not been initialized" not in out, out[-3000:]
    said = torch.load(tmp_path / f"rank{survivor}.pt")
    for where in ("step", "collective", "transfer"):
        assert f"rank {victim} is gone" in said[where], (where, said)
    assert said["collective"].startswith("PipelineError: "), said
