"""The local executor: runs a schedule over stages placed on the devices of one process.

Each worker of the schedule gets a thread of its own; a worker runs its list of actions from the
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
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe.memory import ActivationMeter
from gpipe.microbatch import Batch
from gpipe.rng import Watch
from gpipe.schedule.ir import Action, ActionKind, Schedule, execution_order
from gpipe.stage import Grads, Saved, Stage, StepContext

__all__ = ["LocalExecutor", "StepRun", "TraceEvent"]


class _AbortedError(Exception):
    """Another worker (or rank) failed; this one stops waiting."""


class _Mailbox:
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
                    raise _AbortedError(self.failed)
                self._cond.wait()
            return self._items.pop(key)

    def fail(self, reason: str = "another worker failed") -> None:
        with self._cond:
            if self.failed is None:
                self.failed = reason
            self._cond.notify_all()


@dataclass(frozen=True)
class TraceEvent:
    """One executed action: on which worker, and when (``time.perf_counter_ns``)."""

    worker: int
    action: Action
    start_ns: int
    end_ns: int


@dataclass
class StepRun:
    """The state of one step: its context, what forwards saved for backwards, and the results."""

    ctx: StepContext
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    mailbox: _Mailbox = field(default_factory=_Mailbox)
    split: frozenset[tuple[int, int]] = frozenset()
    trace: list[TraceEvent] = field(default_factory=list)
    meter: ActivationMeter | None = None

    def recording(self, stage: int, microbatch: int) -> AbstractContextManager[None]:
        return self.meter.recording(stage, microbatch) if self.meter is not None else nullcontext()


class LocalExecutor:
    """Runs schedules over ``stages`` in one process; a stage runs on the worker whose action list
    holds it, and a worker's stages must share a device.

    ``cpu_threads`` is the number of intra-op threads each worker on a CPU device uses; by default
    the caller's threads (``torch.get_num_threads()``) are shared out among the CPU workers. CPU
    kernels may sum in a different order with a different number of threads, so results are
    bitwise identical across partition counts when this number is fixed (e.g. 1).
    """

    def __init__(self, stages: Sequence[Stage], *, cpu_threads: int | None = None) -> None:
        if cpu_threads is not None and cpu_threads <= 0:
            raise ValueError(f"cpu_threads must be a positive integer (cpu_threads: {cpu_threads})")
        self.stages: dict[int, Stage] = {stage.index: stage for stage in stages}
        self.num_stages = len(self.stages)
        self.cpu_threads = cpu_threads

    def run(self, schedule: Schedule, run: StepRun, *, inline: bool = False) -> None:
        """Run every action of ``schedule``; inputs and gradients must already be in the mailbox."""
        if schedule.num_stages != self.num_stages:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_stages} stages, the pipeline {self.num_stages}"
            )
        with self.watching_randomness():
            if inline or schedule.num_workers == 1:
                self._run_inline(schedule, run)
            else:
                self._run_threaded(schedule, run)

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

    def _run_inline(self, schedule: Schedule, run: StepRun) -> None:
        threads_before = torch.get_num_threads()
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)
        try:
            worker = schedule.worker_of()
            # one worker: its own order; several (inline on one thread): an order that respects them all
            order = schedule.actions[0] if schedule.num_workers == 1 else execution_order(schedule)
            devices = {self.stages[s].device for s in worker}
            if len(devices) == 1:  # one device: enter its context once
                with run.ctx.applied(devices.pop()):
                    for action in order:
                        self._execute(worker[action.stage], action, run)
            else:
                for action in order:
                    with run.ctx.applied(self.stages[action.stage].device):
                        self._execute(worker[action.stage], action, run)
            for acts in schedule.actions:
                self._finish(acts, run)
        finally:
            torch.set_num_threads(threads_before)

    def _run_threaded(self, schedule: Schedule, run: StepRun) -> None:
        lists = [(w, acts, self._device(acts)) for w, acts in enumerate(schedule.actions) if acts]
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
                        except _AbortedError:
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
        if kind is ActionKind.FORWARD:
            batch = run.mailbox.get(("act", m, s))
            start = time.perf_counter_ns()
            batch = stage.receive(batch)
            with torch.set_grad_enabled(run.ctx.grad_enabled), run.recording(s, m):
                out, saved = stage.forward(m, batch, run.ctx, split=(s, m) in run.split)
            if saved is not None:
                run.saved[(s, m)] = saved
                if run.meter is not None and saved.outputs is None:
                    run.meter.hold(s, m, saved.inputs.tensors())
            run.mailbox.put(("act", m, s + 1), out)
        else:
            saved = run.saved.get((s, m))
            if saved is None:
                raise RuntimeError(
                    f"no saved forward for {action}: was the forward run without autograd "
                    "(torch.no_grad) or is backward running twice?"
                )
            if kind is ActionKind.BACKWARD_WEIGHT:
                start = time.perf_counter_ns()
                stage.backward_weight(m, saved)
                self._release(s, m, run)
            else:
                grads = run.mailbox.get(("grad", m, s))
                start = time.perf_counter_ns()
                grads = stage.receive(grads)
                with run.recording(s, m):  # a re-materialized forward saves anew
                    if kind is ActionKind.BACKWARD:
                        input_grads = stage.backward(m, saved, grads, run.ctx)
                        self._release(s, m, run)
                    else:
                        input_grads = stage.backward_input(m, saved, grads, run.ctx)
                run.mailbox.put(("grad", m, s - 1), input_grads)
        run.trace.append(TraceEvent(worker, action, start, time.perf_counter_ns()))

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

    def forward(self, schedule: Schedule, batches: Sequence[Batch], ctx: StepContext) -> tuple[StepRun, list[Batch]]:
        """Run the forward actions of ``schedule``; return the step and the last stage's outputs."""
        run = StepRun(ctx)
        for m, batch in enumerate(batches):
            run.mailbox.put(("act", m, 0), batch)
        self.run(schedule.only(ActionKind.FORWARD), run)
        last = self.num_stages
        return run, [run.mailbox.get(("act", m, last)) for m in range(len(batches))]

    def backward(
        self, schedule: Schedule, run: StepRun, grads: Sequence[Grads], *, inline: bool = False
    ) -> list[Grads]:
        """Run the backward actions of ``schedule`` from the gradients of the last stage's outputs;
        return the gradients of the first stage's inputs."""
        last = self.num_stages - 1
        for m, g in enumerate(grads):
            run.mailbox.put(("grad", m, last), g)
        self.run(schedule.only(ActionKind.BACKWARD), run, inline=inline)
        return [run.mailbox.get(("grad", m, -1)) for m in range(len(grads))]

    def step(
        self, schedule: Schedule, batches: Sequence[Batch], ctx: StepContext, *, measure_memory: bool = False
    ) -> tuple[StepRun, list[Batch]]:
        """Run a whole training step (every action of ``schedule``), the last stage computing the
        loss; return the step and each micro-batch's (scaled) loss. ``measure_memory`` records
        every worker's activation memory (``run.meter``)."""
        meter = self.meter_for(schedule) if measure_memory else None
        run = StepRun(ctx, split=self.split_of(schedule), meter=meter)
        self._seed(run, batches)
        self.run(schedule, run)
        return run, [run.mailbox.get(("act", m, self.num_stages)) for m in range(len(batches))]

    def _seed(self, run: StepRun, batches: Sequence[Batch]) -> None:
        """Hand the first stage its micro-batches and the last stage its loss gradients."""
        last = self.num_stages - 1
        one = torch.ones((), device=self.stages[last].device) if last in self.stages else None
        for m, batch in enumerate(batches):
            if 0 in self.stages:
                run.mailbox.put(("act", m, 0), batch)
            if one is not None:
                run.mailbox.put(("grad", m, last), (one,))

    @staticmethod
    def split_of(schedule: Schedule) -> frozenset[tuple[int, int]]:
        """The (stage, micro-batch) pairs whose backward the schedule splits into I and W."""
        return frozenset((a.stage, a.microbatch) for a in schedule if a.kind is ActionKind.BACKWARD_INPUT)

    def meter_for(self, schedule: Schedule) -> ActivationMeter:
        params = (p for stage in self.stages.values() for p in stage.module.parameters())
        return ActivationMeter(schedule.worker_of(), schedule.num_workers, params)
