"""``gpipe eval --watch RUN``: the evaluation job beside a training run, as Lingvo's evaler runs beside
its trainer. It looks at ``RUN/checkpoints`` (waiting for the run to start if need be), evaluates each
complete checkpoint once, the newest first when it falls behind (the older ones it passed are left;
``--all``: every one, in step order), and stops by itself once the run's last step (``--steps`` in the
newest checkpoint's ``run.json``) is evaluated. Between looks it waits 1 s, doubling up to ``--poll``
while nothing is new. What it has done is what its results folder lists (``metrics.jsonl``): started
again, it goes on where it stopped. Under torchrun rank 0 looks and says what every rank does next.

A run that stopped for good (killed, crashed, interrupted and not resumed) ends the watch too: once
every checkpoint it left is evaluated and no live process holds the run (:func:`gpipe.runfile.running`:
the PID and host in ``RUN/.lock``), the watcher says so and stops. A run seen not running is first
given :data:`STARTUP_GRACE` seconds to start again (a ``gpipe train --resume`` launched with the
watcher, or by a retry loop, takes the lock a few seconds after it starts); a torchrun job that did not
finish (its ``.job.json`` is there), which its agent may restart, :data:`RESTART_GRACE` seconds. While
it waits so, the watcher says so. A trainer on another host cannot be seen from here: the watch goes on, and
says why. ``--wait-for-resume`` keeps watching a run that is not running, for a resume to come.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from gpipe.evaluator.job import read_run
from gpipe.evaluator.results import evaluated_steps
from gpipe.runfile import LOCK, running
from gpipe.saving import complete
from gpipe.train.elastic import JOB

__all__ = ["RESTART_GRACE", "STARTUP_GRACE", "Next", "next_checkpoint", "watch"]

RESTART_GRACE = 120.0
"""Seconds a torchrun job that did not finish is given to be restarted by its agent (which waits its
``--shutdown-timeout``, 30 s by default, before it starts the group again)."""

STARTUP_GRACE = 20.0
"""Seconds a run seen not running is given to start again: ``gpipe train --resume`` takes its lock 3-6 s
after it is launched (measured on two busy CPU cores), a retry loop's restart a little later."""


@dataclass(frozen=True)
class Next:
    """What a watcher does next: ``"evaluate"`` the checkpoint ``folder``, ``"wait"`` or ``"stop"``;
    ``message``: why, as it is said."""

    action: str
    folder: str = ""
    message: str = ""
    ok: bool = True  # (a stop: whether the newest checkpoint there is was evaluated)


def step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step-"))


def next_checkpoint(
    run: Path, done: set[int], *, every: bool, failed: set[int], live: bool | None = True, grace: str = ""
) -> Next:
    """What to do next for ``run``, whose evaluated steps are ``done`` (``failed``: checkpoints that
    did not load, not tried again); ``every``: ``--all``; ``live``: whether the run trains (None: it
    cannot be told from here): a run that started (its ``.lock`` is there) and is not running stops the
    watch once nothing is left to evaluate; ``grace``: said while waiting, why a run not running is
    waited for still."""
    found = complete(run / "checkpoints")  # newest first
    if not found:
        started = (run / LOCK).exists()
        if live is False and started:  # (it started, and stopped before its first checkpoint)
            return Next("stop", message=f"the run in {run} is not running and left no checkpoint; --wait-for-resume "
                                        "waits for it to be resumed", ok=False)  # fmt: skip
        return Next("wait", message=f"waiting for the first checkpoint of {run}{grace if started else ''}")
    newest = found[0]
    try:
        last = read_run(newest)[0].steps
    except ValueError:  # (a checkpoint deleted as it was read: look again)
        return Next("wait", message=f"waiting for the checkpoints of {run}")
    steps = [step_of(p) for p in found]
    if last in done or (last in failed and step_of(newest) == last):
        return Next("stop", message=f"the run's last step, {last}, is evaluated" if last in done else "",
                    ok=last in done)  # fmt: skip
    newer = max(done, default=0)
    pending = [p for p, s in zip(found, steps) if s not in done and s not in failed and (every or s > newer)]
    if pending:
        return Next("evaluate", str(pending[-1] if every else pending[0]))
    if live is False:
        passed = sum(s not in done and s not in failed for s in steps)  # (older than one evaluated: not --all)
        if max(steps) in failed:
            what = "its newest checkpoint did not load"
        elif passed:
            what = f"its newest checkpoint is evaluated ({passed} older passed over: --all evaluates every one)"
        else:
            what = "its checkpoints are evaluated"
        return Next(
            "stop",
            message=f"the run in {run} is not running (no live process holds {run / LOCK}; its newest "
            f"checkpoint is of step {max(steps)} of {last}), and {what}; --wait-for-resume waits for it to be "
            "resumed",
            ok=max(steps) not in failed,
        )
    elsewhere = "" if live else " (its trainer runs on another host, which cannot be watched from here)"
    return Next("wait", message=f"waiting for a checkpoint of {run} after step {max(steps)}{elsewhere}{grace}")


class _Life:
    """Whether the watched run trains, as :func:`next_checkpoint` asks it: a run seen not running
    counts as live for :data:`STARTUP_GRACE` seconds (a torchrun job that did not finish:
    :data:`RESTART_GRACE`), :attr:`grace` saying so; with ``resume`` always live."""

    def __init__(self, run: Path, resume: bool) -> None:
        self.run, self.resume = run, resume
        self.dead_since: float | None = None
        self.grace = ""

    def __call__(self) -> bool | None:
        state = True if self.resume else running(self.run)
        self.grace = ""
        if state is not False:
            self.dead_since = None
            return state
        now = time.monotonic()
        self.dead_since = now if self.dead_since is None else self.dead_since
        if (self.run / JOB).exists():  # (its agent may start it again)
            seconds, what = RESTART_GRACE, "its torchrun job did not finish, and its agent may restart it"
        else:
            seconds, what = STARTUP_GRACE, "it may be starting"
        if now - self.dead_since >= seconds:
            return False
        self.grace = f" (it is not running now; {what}: the watch ends unless it runs again within {seconds:.0f} s)"
        return True


def _agreed(decided: Next | None) -> Next:
    """Rank 0's decision, on every rank."""
    if not dist.is_initialized():
        assert decided is not None
        return decided
    shared = [decided]
    dist.broadcast_object_list(shared, src=0)
    assert shared[0] is not None
    return shared[0]


def watch(
    run: Path,
    results: Path,
    evaluate: Callable[[Path], bool],
    *,
    every: bool,
    poll: float,
    quiet: bool = False,
    resume: bool = False,
) -> bool:
    """Watch ``run`` until its last step is evaluated, or until it is not running and every checkpoint
    it left is (``resume``: ``--wait-for-resume``, only the former): ``evaluate(folder)`` for each
    checkpoint chosen (False: it did not load), its results listed in ``results``. Returns whether the
    newest checkpoint was evaluated (False: it did not load)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    failed: set[int] = set()
    delay, said = 1.0, ""
    life = _Life(run, resume)
    while True:
        decided: Next | None = None
        if rank == 0:
            live = life()
            decided = next_checkpoint(run, evaluated_steps(results), every=every, failed=failed, live=live,
                                      grace=life.grace)  # fmt: skip
        chosen = _agreed(decided)
        if chosen.action == "stop":
            if rank == 0 and chosen.message and not quiet:
                print(f"gpipe eval --watch: {chosen.message}; stopping", file=sys.stderr)
            return chosen.ok
        if chosen.action == "wait":
            if rank == 0 and chosen.message != said and not quiet:
                print(f"gpipe eval --watch: {chosen.message}", file=sys.stderr)
            said = chosen.message
            time.sleep(delay)
            delay = min(2 * delay, poll)
            continue
        delay, said = 1.0, ""
        folder = Path(chosen.folder)
        if not evaluate(folder):
            failed.add(step_of(folder))
