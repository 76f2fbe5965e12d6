"""The executor: runs this process's part of a schedule over its stages.

One action loop serves every setting; how values move between workers is a *transport* it is given.
:class:`Transport` (this module) keeps everything in one process: a value lands in a mailbox and the
consuming stage moves it to its device. :class:`gpipe.distributed.ChannelTransport` sends what a stage
on another rank consumes over torch.distributed. Which worker holds which stage, and which workers
this process runs, is the pipeline's :class:`~gpipe.runtime.placement.Placement`.

When this process runs several workers, each gets a thread of its own; a worker runs its list of actions from the
schedule IR in order and waits only for the data an action consumes (an activation from the previous
stage, a gradient from the next). Torch releases the GIL in its kernels, so workers on different
devices — including several ``'cpu'`` devices, each worker then using its share of the intra-op
threads — run concurrently.

Boundary tensors are moved to the consuming stage's device with ``Tensor.to``, which orders the copy
after the producer's work on the devices' current streams.

When a worker raises, every other worker stops before its next action (or at its current wait), so
that a worker whose inputs are all there (the first stage's, in the fill phase) does not go on
computing; all of them are joined, and the original exception (with its traceback, and a note
naming the action) reaches the caller. No worker outlives the call.

A schedule can also run *inline*: in the calling thread, action by action in an order that respects
every dependency. The autograd-driven :class:`gpipe.GPipe` does so for its backward on CUDA devices,
where backward is entered from autograd's own device threads.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe.memory import ActivationMeter
from gpipe.microbatch import Batch
from gpipe.rng import Watch
from gpipe.runtime.context import Grads, Saved, StepContext
from gpipe.runtime.placement import Placement
from gpipe.runtime.stage import Stage
from gpipe.runtime.timing import Trace, TraceEvent
from gpipe.schedule.ir import STAGE_WIDE, Action, ActionKind, Schedule, execution_order

__all__ = ["Executor", "Mailbox", "StepRun", "TraceEvent", "Transport"]


class AbortedError(Exception):
    """Another worker (or rank) failed; this one stops waiting."""


class Mailbox:
    """Where actions leave their results for the actions that consume them.

    Keys: ``("act", m, s)`` is the input activation of stage ``s`` for micro-batch ``m``;
    ``("grad", m, s)`` the gradient of stage ``s``'s output.
    """

    def __init__(self) -> None:
        self._items: dict[tuple[str, int, int], Any] = {}
        self._cond = threading.Condition()
        # Why the step stopped, once a worker (or rank) failed: read without the lock by the workers
        # before each action (a plain attribute read; a stale None costs one more action at most).
        self.failed: str | None = None

    def put(self, key: tuple[str, int, int], value: Any) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def get(self, key: tuple[str, int, int]) -> Any:
        with self._cond:
            while key not in self._items:
                if self.failed is not None:
                    raise AbortedError(self.failed)
                self._cond.wait()
            return self._items.pop(key)

    def fail(self, reason: str = "another worker failed") -> None:
        with self._cond:
            if self.failed is None:
                self.failed = reason
            self._cond.notify_all()


@dataclass
class StepRun:
    """The state of one step: its context, what forwards saved for backwards, and the results."""

    ctx: StepContext
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    mailbox: Mailbox = field(default_factory=Mailbox)
    split: frozenset[tuple[int, int]] = frozenset()
    trace: Trace = field(default_factory=Trace)
    meter: ActivationMeter | None = None

    def recording(self, stage: int, microbatch: int) -> AbstractContextManager[None]:
        return self.meter.recording(stage, microbatch) if self.meter is not None else nullcontext()


class Transport:
    """How values move between workers: here, within one process. A value stays in the step's
    mailbox; the consuming stage moves it to its device (``Stage.receive``)."""

    def mailbox(self, schedule: Schedule) -> Mailbox:
        """The mailbox of a step of ``schedule``."""
        return Mailbox()

    @contextmanager
    def running(self, schedule: Schedule, run: StepRun) -> Iterator[None]:
        """Around this process's actions of a step (a transport between processes moves values and
        watches the other processes here)."""
        yield

    def stopped(self, reason: str) -> BaseException:
        """What a worker running in the caller's thread raises when the step was stopped elsewhere."""
        return RuntimeError(f"the step was stopped: {reason}")


class Executor:
    """Runs schedules over ``stages`` (those of this process) placed by ``placement``; a worker's
    stages must share a device. ``transport`` moves values between workers (default: within this
    process).

    ``stage_wide`` runs a sharded schedule's U, G and R actions (:func:`gpipe.schedule.ir.sharded`;
    :class:`gpipe.distributed.sharding.StageSharding`); a schedule with such actions is refused
    without it.

    ``cpu_threads`` is the number of intra-op threads each worker on a CPU device uses; by default
    the caller's threads (``torch.get_num_threads()``) are shared out among the CPU workers. CPU
    kernels may sum in a different order with a different number of threads, so results are
    bitwise identical across partition counts when this number is fixed (e.g. 1).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        placement: Placement,
        *,
        transport: Transport | None = None,
        cpu_threads: int | None = None,
        stage_wide: Callable[[Action], None] | None = None,
    ) -> None:
        if cpu_threads is not None and cpu_threads <= 0:
            raise ValueError(f"cpu_threads must be a positive integer (cpu_threads: {cpu_threads})")
        self.stages: dict[int, Stage] = {stage.index: stage for stage in stages}
        missing = sorted(set(placement.local_stages) - set(self.stages))
        if missing:
            raise ValueError(f"the placement puts stages {missing} in this process, but no such stage was given")
        self.placement = placement
        self.num_stages = placement.num_stages
        self.transport = transport or Transport()
        self.cpu_threads = cpu_threads
        self.stage_wide = stage_wide

    def run(self, schedule: Schedule, run: StepRun, *, inline: bool = False) -> None:
        """Run this process's actions of ``schedule``; inputs and gradients must already be in the
        mailbox. ``inline``: every worker in the calling thread, in an order that respects them all."""
        if schedule.placement != self.placement.worker_of:
            raise ValueError(
                f"schedule {schedule.name!r} places stages on workers {list(schedule.placement)}, "
                f"but the pipeline was built for {list(self.placement.worker_of)}"
            )
        workers = [w for w in self.placement.local_workers if schedule.actions[w]]
        with self.transport.running(schedule, run), self.watching_randomness():
            if inline or len(workers) <= 1:
                self._run_inline(schedule, workers, run)
            else:
                self._run_threaded(schedule, workers, run)

    @contextmanager
    def watching_randomness(self) -> Iterator[None]:
        """Around a step's actions: if a layer drew random numbers nobody lent it (it drew none on
        its first call, see :mod:`gpipe.rng`), warn and have every stage learn again."""
        with Watch(stage.device for stage in self.stages.values()) as watch:
            yield
        if watch.drew:
            warnings.warn(
                f"gpipe: a layer drew random numbers on {', '.join(map(str, watch.drew))} unseeded: it had drawn "
                "none on its first call. Its numbers in this step depend on the partitioning; from the next "
                "step on it is seeded per (layer, micro-batch) like the others",
                RuntimeWarning,
                stacklevel=3,
            )
            for stage in self.stages.values():
                stage.learn_randomness_again()

    def _device(self, actions: Sequence[Action]) -> torch.device:
        devices = {self.stages[a.stage].device for a in actions}
        if len(devices) != 1:
            raise ValueError(f"the stages of one worker must share a device, got {sorted(map(str, devices))}")
        return devices.pop()

    def _run_inline(self, schedule: Schedule, workers: Sequence[int], run: StepRun) -> None:
        threads_before = torch.get_num_threads()
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)
        try:
            if len(workers) == 1:  # its own order
                order: Sequence[Action] = schedule.actions[workers[0]]
            else:  # several on one thread: an order that respects them all
                mine = set(workers)
                order = [a for a in execution_order(schedule) if schedule.placement[a.stage] in mine]
            devices = {self.stages[a.stage].device for a in order}
            single = len(devices) == 1  # one device: enter its context once
            mailbox = run.mailbox
            with run.ctx.applied(next(iter(devices))) if single else nullcontext():
                for action in order:
                    if mailbox.failed is not None:  # another process failed (its transport said so)
                        raise self.transport.stopped(mailbox.failed)
                    worker = schedule.placement[action.stage]
                    try:
                        if single:
                            self._execute(worker, action, run)
                        else:  # several devices: enter each action's
                            with run.ctx.applied(self.stages[action.stage].device):
                                self._execute(worker, action, run)
                    except AbortedError as exc:
                        raise self.transport.stopped(str(exc)) from None
            for w in workers:
                self._finish(schedule.actions[w], run)
        finally:
            torch.set_num_threads(threads_before)

    def _run_threaded(self, schedule: Schedule, workers: Sequence[int], run: StepRun) -> None:
        lists = [(w, schedule.actions[w], self._device(schedule.actions[w])) for w in workers]
        cpu_workers = sum(1 for _, _, d in lists if d.type == "cpu")
        threads_before = torch.get_num_threads()
        threads = self.cpu_threads or max(1, threads_before // max(1, cpu_workers))
        errors: list[BaseException] = []

        def work(w: int, actions: tuple[Action, ...], device: torch.device) -> None:
            try:
                if device.type == "cpu":
                    torch.set_num_threads(threads)
                mailbox = run.mailbox
                with run.ctx.applied(device):
                    for action in actions:
                        if mailbox.failed is not None:  # another worker failed: no further action
                            return
                        try:
                            self._execute(w, action, run)
                        except AbortedError:
                            return
                        except BaseException as exc:
                            exc.add_note(f"(raised by {action} of the pipeline, on {device})")
                            raise
                    self._finish(actions, run)
            except BaseException as exc:
                errors.append(exc)
                run.mailbox.fail()

        pool = [threading.Thread(target=work, args=item, name=f"gpipe-worker-{item[0]}") for item in lists]
        try:
            for t in pool:
                t.start()
        finally:
            try:
                for t in pool:
                    if t.ident is not None:
                        t.join()
            except BaseException:  # interrupted while joining: stop the workers, then re-raise
                run.mailbox.fail()
                for t in pool:
                    if t.ident is not None:
                        t.join()
                raise
            finally:
                torch.set_num_threads(threads_before)
        if errors:
            raise errors[0]

    def _execute(self, worker: int, action: Action, run: StepRun) -> None:
        """Wait for the action's input, run it (timed, for the trace), hand on its result."""
        stage = self.stages[action.stage]
        m, s = action.microbatch, action.stage
        kind = action.kind
        if kind in STAGE_WIDE:
            if self.stage_wide is None:
                raise ValueError(
                    f"{action}: the schedule gathers and reduces sharded parameters, but this pipeline's "
                    "stages are not sharded (Pipeline(..., fsdp=True) shards them)"
                )
            start = run.trace.stamp(stage.device)
            self.stage_wide(action)
            run.trace.add(worker, action, start, run.trace.stamp(stage.device))
            return
        if kind is ActionKind.FORWARD:
            batch = run.mailbox.get(("act", m, s))
            start = run.trace.stamp(stage.device)
            batch = stage.receive(batch)
            with torch.set_grad_enabled(run.ctx.grad_enabled), run.recording(s, m):
                out, saved = stage.forward(m, batch, run.ctx, split=(s, m) in run.split)
            if saved is not None:
                run.saved[(s, m)] = saved
                if run.meter is not None and saved.outputs is None:
                    run.meter.hold(s, m, saved.inputs.tensors())
            end = run.trace.stamp(stage.device)  # before the hand-over: its consumer may start at once
            run.mailbox.put(("act", m, s + 1), out)
        else:
            saved = run.saved.get((s, m))
            if saved is None:
                raise RuntimeError(
                    f"no saved forward for {action}: was the forward run without autograd "
                    "(torch.no_grad) or is backward running twice?"
                )
            if kind is ActionKind.BACKWARD_WEIGHT:
                start = run.trace.stamp(stage.device)
                stage.backward_weight(m, saved)
                self._release(s, m, run)
                end = run.trace.stamp(stage.device)
            else:
                grads = run.mailbox.get(("grad", m, s))
                start = run.trace.stamp(stage.device)
                grads = stage.receive(grads)
                with run.recording(s, m):  # a re-materialized forward saves anew
                    if kind is ActionKind.BACKWARD:
                        input_grads = stage.backward(m, saved, grads, run.ctx)
                        self._release(s, m, run)
                    else:
                        input_grads = stage.backward_input(m, saved, grads, run.ctx)
                end = run.trace.stamp(stage.device)
                run.mailbox.put(("grad", m, s - 1), input_grads)
        run.trace.add(worker, action, start, end)

    @staticmethod
    def _release(s: int, m: int, run: StepRun) -> None:
        del run.saved[(s, m)]
        if run.meter is not None:
            run.meter.release(s, m)

    def _finish(self, actions: Sequence[Action], run: StepRun) -> None:
        if run.ctx.training and any(a.kind is ActionKind.FORWARD for a in actions):
            for s in sorted({a.stage for a in actions}):
                self.stages[s].finish_forwards()

    # Entry points of a step, in terms of micro-batches.

    def _outputs(self, run: StepRun, count: int) -> list[Batch]:
        """The last stage's outputs, where this process holds it (else [])."""
        if self.num_stages - 1 not in self.stages:
            return []
        return [run.mailbox.get(("act", m, self.num_stages)) for m in range(count)]

    def forward(self, schedule: Schedule, batches: Sequence[Batch], ctx: StepContext) -> tuple[StepRun, list[Batch]]:
        """Run the forward actions of ``schedule``; return the step and the last stage's outputs
        (where this process holds the last stage, else [])."""
        forwards = schedule.only(ActionKind.FORWARD, ActionKind.UNSHARD, ActionKind.RESHARD)
        run = StepRun(ctx, mailbox=self.transport.mailbox(forwards))
        if 0 in self.stages:
            for m, batch in enumerate(batches):
                run.mailbox.put(("act", m, 0), batch)
        self.run(forwards, run)
        return run, self._outputs(run, len(batches))

    def backward(
        self, schedule: Schedule, run: StepRun, grads: Sequence[Grads], *, inline: bool = False
    ) -> list[Grads]:
        """Run the backward actions of ``schedule`` from the gradients of the last stage's outputs;
        return the gradients of the first stage's inputs (the backward phase of a step whose
        forward ran by :meth:`forward`: every stage in this process)."""
        if self.placement.is_distributed:
            raise ValueError("a backward phase apart from its forward runs in one process; use a step instead")
        last = self.num_stages - 1
        for m, g in enumerate(grads):
            run.mailbox.put(("grad", m, last), g)
        self.run(schedule.only(ActionKind.BACKWARD), run, inline=inline)
        return [run.mailbox.get(("grad", m, -1)) for m in range(len(grads))]

    def step(
        self, schedule: Schedule, batches: Sequence[Batch], ctx: StepContext, *, measure_memory: bool = False
    ) -> tuple[StepRun, list[Batch]]:
        """Run a whole training step (every action of ``schedule``), the last stage computing the
        loss; return the step and each micro-batch's (scaled) loss (where this process holds the last
        stage). ``measure_memory`` records every worker's activation memory (``run.meter``)."""
        meter = self.meter_for(schedule) if measure_memory else None
        run = StepRun(ctx, split=self.split_of(schedule), meter=meter, mailbox=self.transport.mailbox(schedule))
        last = self.num_stages - 1
        one = torch.ones((), device=self.stages[last].device) if last in self.stages else None
        for m, batch in enumerate(batches):
            if 0 in self.stages:
                run.mailbox.put(("act", m, 0), batch)
            if one is not None:
                run.mailbox.put(("grad", m, last), (one,))
        self.run(schedule, run)
        return run, self._outputs(run, len(batches))

    @staticmethod
    def split_of(schedule: Schedule) -> frozenset[tuple[int, int]]:
        """The (stage, micro-batch) pairs whose backward the schedule splits into I and W."""
        return frozenset((a.stage, a.microbatch) for a in schedule if a.kind is ActionKind.BACKWARD_INPUT)

    def meter_for(self, schedule: Schedule) -> ActivationMeter:
        params = (p for stage in self.stages.values() for p in stage.module.parameters())
        return ActivationMeter(schedule.worker_of(), schedule.num_workers, params)
