"""Decoding through the stages: groups of sequences in flight, their caches kept in the stages.

Generation is a loop with the pipeline inside it: a step of a group of sequences runs through the
stages, the last stage's output chooses the next tokens, and they are the group's next input at the
first stage. With one group the stages would take turns; with G groups in flight (G >= the number
of stages) every stage works on some group's step while the others work on theirs. The order in
which a worker runs its stages' steps is the decode schedule of the IR
(:func:`gpipe.schedule.decode.decode_order`: step ``t`` of group ``g`` is micro-batch ``t * G + g``),
consumed lazily, as the number of steps is known only when the groups are done.

What the model decodes is a :class:`Feed`'s business, the model-independent rest this module's:

- ``feed.start(g)``: group ``g``'s first input for the first stage (the prompts, the sources);
- the stages run their layers on it with the group's :class:`~gpipe.cache.Cache` current (one per
  stage and group, on the stage's device: the layers keep what they need of the sequences seen);
- ``feed.next(g, output)``, where the last stage runs: what to do next, a :class:`Next` — the next
  input (the new tokens), which cached rows to keep (beam search reorders, finished sequences leave),
  whether the group starts over on new sequences (a stream of inputs refills a finished group), or
  that the group is done.

Every stage applies a step's reordering (or clearing) to its cache of the group before it runs the
step; a finished group's end travels through every stage, which frees its caches; a worker stops
when all its groups are done. Under torch.distributed the messages travel over channels between
the ranks (:mod:`gpipe.distributed.streams`), the last stage's choice from its rank to the first
stage's; ``feed.next`` runs only on the last stage's rank.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from gpipe.cache import Cache, using
from gpipe.microbatch import Batch
from gpipe.runtime.context import StepContext
from gpipe.runtime.executor import AbortedError, Executor, Mailbox
from gpipe.runtime.timing import Stamp, Trace
from gpipe.schedule.decode import decode_order
from gpipe.schedule.ir import Action

__all__ = ["DONE", "RESTART", "STEP", "DecodeTrace", "Feed", "Next", "Streams", "decode"]

DONE, STEP, RESTART = 0, 1, 2
"""What a message tells a stage about its group: it is done (free its caches and pass the word
on); a step (keep the rows named, if any, then run); new sequences (forget the caches, then run)."""

Message = tuple[int, Tensor | None, Batch | None]
"""(DONE | STEP | RESTART, the cached rows to keep or None, the stage's input)."""


@dataclass(frozen=True)
class Next:
    """The last stage's decision for a group after a step."""

    inputs: Any = None
    """The first stage's next input for the group; ``None``: the group is done."""
    rows: Tensor | None = None
    """The rows of the group's caches to keep, in their new order (indices into the rows of the
    step just run; repeats allowed); ``None``: all, as they are."""
    restart: bool = False
    """``inputs`` starts new sequences: every stage forgets the group's caches first."""


class Feed(Protocol):
    """The model's side of a decode (see the module's docstring)."""

    @property
    def groups(self) -> int:
        """G, the groups of sequences in flight."""

    def start(self, group: int) -> Any:
        """The first input of ``group`` (the first stage's), or None if it has nothing to decode.
        Called where the first stage runs."""

    def next(self, group: int, output: Any) -> Next:
        """What ``group`` does after a step whose last-stage output is ``output``. Called where
        the last stage runs, in the order of the steps of each group."""


@dataclass
class DecodeTrace:
    """What a decode did: every step's time on its worker, and the caches' peak bytes per stage."""

    events: Trace = field(default_factory=Trace)
    """(worker, F(micro-batch, stage), start ns, end ns) of every step this process ran (on a CUDA
    device, when its stream ran it: :mod:`gpipe.runtime.timing`)."""
    cache_bytes: dict[int, int] = field(default_factory=dict)
    """Per stage of this process, the most bytes its caches (all groups) held after a step."""
    steps: int = 0
    """The steps the last stage ran here (a group's step counts once)."""

    def busy(self) -> dict[int, float]:
        """Seconds each worker computed."""
        out: dict[int, float] = {}
        for w, _, start, end in self.events:
            out[w] = out.get(w, 0.0) + (end - start) / 1e9
        return out


class Streams:
    """How a decode's messages move between workers: within this process, a mailbox.
    :class:`gpipe.distributed.streams.ChannelStreams` sends them between ranks."""

    def open(self, groups: int, trace: DecodeTrace) -> AbstractContextManager[Mailbox]:
        return _plain(Mailbox())

    def finished(self, worker: int, mailbox: Mailbox) -> None:
        """``worker`` sent its last message."""


@contextmanager
def _plain(mailbox: Mailbox) -> Iterator[Mailbox]:
    yield mailbox


def decode(executor: Executor, feed: Feed, *, streams: Streams | None = None, seed: int = 0) -> DecodeTrace:
    """Run ``feed``'s groups through ``executor``'s stages until every group is done (see the
    module's docstring); returns what this process did."""
    groups = feed.groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"a decode needs at least one group of sequences (groups: {groups!r})")
    placement = executor.placement
    run = _Run(executor, feed, groups, seed)
    streams = streams or Streams()
    with streams.open(groups, run.trace) as mailbox:
        run.mailbox = mailbox
        if 0 in executor.stages:
            for g in range(groups):
                inputs = feed.start(g)
                mailbox.put(("act", g, 0), (DONE, None, None) if inputs is None else (STEP, None, Batch.of(inputs)))
        run.go(placement.local_workers, streams)
    return run.trace


class _Run:
    def __init__(self, executor: Executor, feed: Feed, groups: int, seed: int) -> None:
        self.executor, self.feed, self.groups = executor, feed, groups
        self.placement = executor.placement
        self.last = self.placement.num_stages - 1
        self.ctx = StepContext.capture(num_microbatches=groups, checkpoint_stop=0, training=False, seed=seed)
        self.caches = {(s, g): Cache() for s in executor.stages for g in range(groups)}
        self.trace = DecodeTrace()
        self._bytes: dict[int, list[int]] = {}
        self.mailbox = Mailbox()
        self._lock = threading.Lock()

    def go(self, workers: Sequence[int], streams: Streams) -> None:
        devices = {w: self.placement.devices[w] for w in workers}
        cpu_workers = sum(1 for d in devices.values() if d.type == "cpu")
        before = torch.get_num_threads()
        threads = self.executor.cpu_threads or max(1, before // max(1, cpu_workers))
        errors: list[BaseException] = []

        def work(w: int) -> None:
            try:
                if devices[w].type == "cpu":
                    torch.set_num_threads(threads)
                with self.ctx.applied(devices[w]), torch.no_grad():
                    self._work(w)
                streams.finished(w, self.mailbox)
            except AbortedError as exc:
                errors.append(exc)
            except BaseException as exc:
                errors.insert(0, exc)
                self.mailbox.fail(f"worker {w} failed: {type(exc).__name__}: {exc}")

        try:
            if len(workers) == 1:
                work(workers[0])
            else:
                pool = [threading.Thread(target=work, args=(w,), name=f"gpipe-decode-{w}") for w in workers]
                for t in pool:
                    t.start()
                for t in pool:
                    t.join()
        finally:
            torch.set_num_threads(before)
        if errors:
            raise errors[0]

    def _work(self, w: int) -> None:
        """Worker ``w``'s steps, in the decode schedule's order, until its groups are done."""
        groups, last, mailbox = self.groups, self.last, self.mailbox
        stages = [s for s, worker in enumerate(self.placement.worker_of) if worker == w]
        live = {(g, s) for g in range(groups) for s in stages}
        for action in decode_order(self.placement.worker_of, groups, w):
            if not live:
                return
            m, s = action.microbatch, action.stage
            g = m % groups
            if (g, s) not in live:
                continue
            control, rows, payload = mailbox.get(("act", m, s))
            cache = self.caches[(s, g)]
            if control == DONE:
                live.discard((g, s))
                cache.clear()
                if s < last:
                    mailbox.put(("act", m, s + 1), (DONE, None, None))
                continue
            if control == RESTART:
                cache.clear()
            elif rows is not None:
                cache.reorder(rows)
            stage = self.executor.stages[s]
            assert payload is not None
            start = self.trace.events.stamp(stage.device)
            with using(cache):
                out, _ = stage.forward(m, stage.receive(payload), self.ctx)
            if s < last:
                end = self.trace.events.stamp(stage.device)
                mailbox.put(("act", m, s + 1), (control, rows, out))
            else:
                nxt = self.feed.next(g, out.value)
                end = self.trace.events.stamp(stage.device)
                if nxt.inputs is None:
                    mailbox.put(("act", m + groups, 0), (DONE, None, None))
                else:
                    kind = RESTART if nxt.restart else STEP
                    mailbox.put(("act", m + groups, 0), (kind, nxt.rows, Batch.of(nxt.inputs)))
            self._record(w, action, start, end, s)

    def _record(self, w: int, action: Action, start: Stamp, end: Stamp, s: int) -> None:
        held = self._bytes.setdefault(s, [0] * self.groups)  # (per group, after its last step here)
        held[action.microbatch % self.groups] = self.caches[(s, action.microbatch % self.groups)].nbytes
        size = sum(held)
        with self._lock:
            self.trace.events.add(w, action, start, end)
            self.trace.cache_bytes[s] = max(self.trace.cache_bytes.get(s, 0), size)
            if s == self.last:
                self.trace.steps += 1
