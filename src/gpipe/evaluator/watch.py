"""``gpipe eval --watch RUN``: the evaluation job beside a training run, as Lingvo's evaler runs beside
its trainer. It looks at ``RUN/checkpoints`` (waiting for the run to start if need be), evaluates each
complete checkpoint once, the newest first when it falls behind (the older ones it passed are left;
``--all``: every one, in step order), and stops by itself once the run's last step (``--steps`` in the
newest checkpoint's ``run.json``) is evaluated. Between looks it waits 1 s, doubling up to ``--poll``
while nothing is new. What it has done is what its results folder lists (``metrics.jsonl``): started
again, it goes on where it stopped. Under torchrun rank 0 looks and says what every rank does next.
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
from gpipe.saving import complete

__all__ = ["Next", "next_checkpoint", "watch"]


@dataclass(frozen=True)
class Next:
    """What a watcher does next: ``"evaluate"`` the checkpoint ``folder``, ``"wait"`` or ``"stop"``;
    ``message``: why, as it is said."""

    action: str
    folder: str = ""
    message: str = ""


def step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step-"))


def next_checkpoint(run: Path, done: set[int], *, every: bool, failed: set[int]) -> Next:
    """What to do next for ``run``, whose evaluated steps are ``done`` (``failed``: checkpoints that
    did not load, not tried again); ``every``: ``--all``."""
    found = complete(run / "checkpoints")  # newest first
    if not found:
        return Next("wait", message=f"waiting for the first checkpoint of {run}")
    newest = found[0]
    try:
        last = read_run(newest)[0].steps
    except ValueError:  # (a checkpoint deleted as it was read: look again)
        return Next("wait", message=f"waiting for the checkpoints of {run}")
    steps = [step_of(p) for p in found]
    if last in done or (last in failed and step_of(newest) == last):
        return Next("stop", message=f"the run's last step, {last}, is evaluated" if last in done else "")
    newer = max(done, default=0)
    pending = [p for p, s in zip(found, steps) if s not in done and s not in failed and (every or s > newer)]
    if pending:
        return Next("evaluate", str(pending[-1] if every else pending[0]))
    return Next("wait", message=f"waiting for a checkpoint of {run} after step {max(steps)}")


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
) -> bool:
    """Watch ``run`` until its last step is evaluated: ``evaluate(folder)`` for each checkpoint
    chosen (False: it did not load), its results listed in ``results``. Returns whether the last
    step was evaluated (False: it did not load)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    failed: set[int] = set()
    delay, said = 1.0, ""
    while True:
        decided = next_checkpoint(run, evaluated_steps(results), every=every, failed=failed) if rank == 0 else None
        chosen = _agreed(decided)
        if chosen.action == "stop":
            if rank == 0 and chosen.message and not quiet:
                print(f"gpipe eval --watch: {chosen.message}; stopping", file=sys.stderr)
            return bool(chosen.message)
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
