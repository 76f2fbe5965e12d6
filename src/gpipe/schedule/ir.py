"""The schedule IR: a pipeline schedule as plain data.

A schedule says, for every worker (a device in one process, or a rank), the ordered list of actions it
runs in one training step. An action is one of

=====  ==========================================================================================
F      forward of micro-batch ``m`` on stage ``s``
B      full backward (input and weight gradients) of ``m`` on ``s``
I      backward for the *input* gradient only (the zero-bubble papers' "B")
W      backward for the *weight* gradient, after I of the same micro-batch and stage
U      gather stage ``s``'s sharded parameters (all-gather), before the stage's first action of the step
G      reduce-scatter the gradients of ``s``, after its last backward (B or W)
R      free the gathered parameters of ``s``, after G and its last action
=====  ==========================================================================================

The last three are *stage-wide* (:data:`STAGE_WIDE`; ``U(s)``, ``G(s)``, ``R(s)``, micro-batch -1): a
schedule of FSDP-sharded stages (:func:`sharded`) runs each once per stage and step, on the stage's
worker; they consume no other action's result, their place in the worker's order is all they need.

Dependencies of the others are implied by the model and are the same for every schedule::

    F(m, s)    needs F(m, s-1)                   the activation from the previous stage
    B|I(m, s)  needs F(m, s) and B|I(m, s+1)     its own forward, the gradient from the next stage
    W(m, s)    needs I(m, s)

A *decode* (generating tokens, the key/value caches kept in the stages) is forwards only, with a feedback
loop: ``feedback = G`` groups of sequences are in flight, step ``t`` of group ``g`` is micro-batch
``m = t*G + g``, and the last stage's output of ``m`` chooses micro-batch ``m + G``'s input::

    F(m, 0)    needs F(m-G, S-1)  (m >= G)       the tokens the previous step of its group chose

A schedule also says where every stage lives: ``placement[s]`` is the worker that holds stage ``s``
(its layers, its activations, its gradients). Everything that places stages — partitioning, tied
parameters, saving, the executors' transports — reads it from here (through
:class:`gpipe.runtime.placement.Placement`); a V-shaped schedule (stage ``s`` and ``2K-1-s`` on one worker) thus
runs with no special case anywhere else. With virtual stages a worker holds several stages.
Schedules are generated (:mod:`gpipe.schedule.generate`), validated here, simulated
(:mod:`gpipe.schedule.simulate`) and then executed; executors only ever see this IR.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = [
    "STAGE_WIDE",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "Transfer",
    "dependencies",
    "execution_order",
    "round_robin",
    "sharded",
    "timeline",
    "v_shape",
    "validate",
]


class ScheduleError(ValueError):
    """A schedule that cannot be run: a missing, duplicate or misplaced action, or a deadlock."""


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    UNSHARD = "U"
    RESHARD = "R"
    REDUCE_GRAD = "G"


STAGE_WIDE = (ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD)
"""The kinds that act on a whole stage once per step (micro-batch -1): a sharded stage's collectives."""


@dataclass(frozen=True, slots=True)
class Action:
    """One step of work on one stage: ``kind`` of micro-batch ``microbatch`` on ``stage``."""

    kind: ActionKind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.label}@stage{self.stage}"

    @property
    def label(self) -> str:
        """Kind and micro-batch (``F3``); a stage-wide action's kind alone (``U``)."""
        if self.microbatch == -1 and self.kind in STAGE_WIDE:
            return self.kind.value
        return f"{self.kind.value}{self.microbatch}"


def F(microbatch: int, stage: int) -> Action:  # noqa: N802 - the paper's letters
    return Action(ActionKind.FORWARD, microbatch, stage)


def B(microbatch: int, stage: int) -> Action:  # noqa: N802
    return Action(ActionKind.BACKWARD, microbatch, stage)


def I(microbatch: int, stage: int) -> Action:  # noqa: N802, E743
    return Action(ActionKind.BACKWARD_INPUT, microbatch, stage)


def W(microbatch: int, stage: int) -> Action:  # noqa: N802
    return Action(ActionKind.BACKWARD_WEIGHT, microbatch, stage)


def U(stage: int) -> Action:  # noqa: N802
    """Gather ``stage``'s sharded parameters, before its first action of the step."""
    return Action(ActionKind.UNSHARD, -1, stage)


def R(stage: int) -> Action:  # noqa: N802
    """Free ``stage``'s gathered parameters, after its last action of the step."""
    return Action(ActionKind.RESHARD, -1, stage)


def G(stage: int) -> Action:  # noqa: N802
    """Reduce-scatter ``stage``'s gradients, after its last backward (B or W) of the step."""
    return Action(ActionKind.REDUCE_GRAD, -1, stage)


BACKWARDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
"""The kinds that produce the gradient a previous stage waits for."""

RELEASES = (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)
"""The kinds after which a micro-batch's activations on a stage are freed."""


@dataclass(frozen=True)
class Schedule:
    """Per worker, the ordered actions of one step, and where each stage lives.

    ``actions[w]`` is worker ``w``'s list; ``placement[s]`` the worker holding stage ``s``;
    ``num_stages`` counts virtual stages (``num_workers * virtual`` for an interleaved schedule).
    ``feedback`` is 0 for a training step; ``G > 0`` makes the schedule a decode of ``G`` groups
    (forwards only, ``F(m, 0)`` after ``F(m-G, S-1)``: :mod:`gpipe.schedule.decode`).
    """

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]
    feedback: int = 0

    @property
    def num_workers(self) -> int:
        return len(self.actions)

    def worker_of(self) -> dict[int, int]:
        """Which worker holds each stage."""
        return dict(enumerate(self.placement))

    def stages_of(self, worker: int) -> tuple[int, ...]:
        """The stages ``worker`` holds, in pipeline order."""
        return tuple(s for s, w in enumerate(self.placement) if w == worker)

    def only(self, *kinds: ActionKind) -> Schedule:
        """The same schedule with only the actions of ``kinds`` (a phase of a fill-drain step); a
        stage-wide action stays where its kind is named (``only(F, U, R)``: a sharded step's forwards)."""
        acts = tuple(tuple(a for a in w if a.kind in kinds) for w in self.actions)
        return Schedule(self.name, self.num_stages, self.num_microbatches, acts, self.placement, self.feedback)

    def label(self, action: Action) -> str:
        """``action`` in a timeline's cell: kind and micro-batch (``F3``); in a decode, the group and the
        group's step (``g1t3``: micro-batch ``3*G + 1``)."""
        if self.feedback and action.kind not in STAGE_WIDE:
            step, group = divmod(action.microbatch, self.feedback)
            return f"g{group}t{step}"
        return action.label

    def __iter__(self) -> Iterator[Action]:
        return (a for acts in self.actions for a in acts)


def round_robin(num_stages: int, workers: int) -> tuple[int, ...]:
    """Stage ``s`` on worker ``s mod K``: one stage per worker, or Megatron's interleaving."""
    return tuple(s % workers for s in range(num_stages))


def v_shape(workers: int) -> tuple[int, ...]:
    """Two stages per worker in a V: stages ``w`` and ``2K-1-w`` on worker ``w`` (the first and the
    last stage share worker 0, so the loss's gradient starts the backward where the forward began)."""
    return tuple(range(workers)) + tuple(reversed(range(workers)))


def dependencies(action: Action, schedule: Schedule, present: set[Action] | None = None) -> tuple[Action, ...]:
    """The actions of ``schedule`` whose results ``action`` consumes."""
    if action.kind in STAGE_WIDE:
        return ()  # the worker's order carries them: U before its stage's actions, G and R after
    present = present if present is not None else set(schedule)
    m, s = action.microbatch, action.stage
    if action.kind is ActionKind.FORWARD:
        deps = [F(m, s - 1)] if s > 0 else []
        if s == 0 and schedule.feedback and m >= schedule.feedback:
            deps.append(F(m - schedule.feedback, schedule.num_stages - 1))
    elif action.kind is ActionKind.BACKWARD_WEIGHT:
        deps = [I(m, s)]
    else:
        deps = [F(m, s)]
        if s < schedule.num_stages - 1:
            deps.append(I(m, s + 1) if I(m, s + 1) in present else B(m, s + 1))
    return tuple(d for d in deps if d in present)


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages <= 0 or num_microbatches <= 0:
        raise ValueError(
            "a schedule needs at least one stage and one micro-batch "
            f"(stages: {num_stages}, micro-batches: {num_microbatches})"
        )


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` pointing at the first offending action, if any."""
    check_sizes(schedule.num_stages, schedule.num_microbatches)
    _check_placement(schedule)
    if not (isinstance(schedule.feedback, int) and schedule.feedback >= 0):
        raise ScheduleError(
            f"schedule {schedule.name!r} has feedback {schedule.feedback!r}: give 0 for a training step, "
            "or the number of groups in flight (>= 1) for a decode"
        )
    seen: dict[Action, tuple[int, int]] = {}
    for w, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            where = f"worker {w}, position {i}"
            _check_action(schedule, a, where, seen, w)
            seen[a] = (w, i)
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            _check_complete(schedule, m, s, seen)
    if any(a.kind in STAGE_WIDE for a in seen):
        _check_sharded(schedule, seen)
    timeline(schedule, lambda a: 1.0)


def _check_placement(schedule: Schedule) -> None:
    placement, k = schedule.placement, schedule.num_workers
    if len(placement) != schedule.num_stages:
        raise ScheduleError(
            f"schedule {schedule.name!r} places {len(placement)} stages but has {schedule.num_stages}: "
            "give placement one worker per stage"
        )
    bad = [s for s, w in enumerate(placement) if not (isinstance(w, int) and 0 <= w < k)]
    if bad:
        raise ScheduleError(
            f"schedule {schedule.name!r} places stage {bad[0]} on worker {placement[bad[0]]!r}, "
            f"but it has workers 0..{k - 1}"
        )
    idle = [w for w in range(k) if w not in placement]
    if idle:
        raise ScheduleError(f"schedule {schedule.name!r} places no stage on worker {idle[0]}: drop the worker")


def _check_action(
    schedule: Schedule,
    a: Action,
    where: str,
    seen: dict[Action, tuple[int, int]],
    w: int,
) -> None:
    wide = a.kind in STAGE_WIDE
    if wide and a.microbatch != -1:
        raise ScheduleError(
            f"{a} at {where} has micro-batch {a.microbatch}, but a stage-wide action belongs to none: "
            f"build it with {a.kind.value}({a.stage}) (micro-batch -1)"
        )
    if not (0 <= a.stage < schedule.num_stages and (wide or 0 <= a.microbatch < schedule.num_microbatches)):
        raise ScheduleError(
            f"{a} at {where} is out of range "
            f"(stages: {schedule.num_stages}, micro-batches: {schedule.num_microbatches})"
        )
    if a in seen:
        if wide:
            raise ScheduleError(
                f"{a} at {where} is a second {a.kind.value} of stage {a.stage} (the first at worker {seen[a][0]}, "
                f"position {seen[a][1]}): a sharded stage {_DOES[a.kind]} once per step; drop one"
            )
        raise ScheduleError(f"{a} at {where} is a duplicate of worker {seen[a][0]}, position {seen[a][1]}")
    if schedule.placement[a.stage] != w:
        raise ScheduleError(f"{a} at {where}: stage {a.stage} is placed on worker {schedule.placement[a.stage]}")
    if schedule.feedback and a.kind is ActionKind.REDUCE_GRAD:
        raise ScheduleError(
            f"{a} at {where}: schedule {schedule.name!r} is a decode (feedback {schedule.feedback}), which computes "
            "no gradients to reduce; drop it (a decode's sharded stage has U and R only)"
        )
    if schedule.feedback and a.kind not in (ActionKind.FORWARD, ActionKind.UNSHARD, ActionKind.RESHARD):
        raise ScheduleError(
            f"{a} at {where}: schedule {schedule.name!r} is a decode (feedback {schedule.feedback}), forwards only; "
            "drop its backward actions, or make feedback 0 for a training step"
        )
    before = I(a.microbatch, a.stage) if a.kind is ActionKind.BACKWARD_WEIGHT else F(a.microbatch, a.stage)
    if a.kind is not ActionKind.FORWARD and not wide and before not in seen:
        raise ScheduleError(f"{a} at {where} comes before {before}, which it needs")


def _check_complete(schedule: Schedule, m: int, s: int, seen: dict[Action, tuple[int, int]]) -> None:
    def need(a: Action, why: str) -> None:
        if a not in seen:
            raise ScheduleError(f"schedule {schedule.name!r} has no {a}: {why}")

    need(F(m, s), "every stage needs the forward of every micro-batch")
    if schedule.feedback:
        return  # a decode: forwards only (_check_action refused any other kind)
    if B(m, s) in seen:
        for split in (I(m, s), W(m, s)):
            if split in seen:
                raise ScheduleError(f"schedule {schedule.name!r} has both {B(m, s)} and {split}: use B, or I and W")
    elif I(m, s) in seen:
        need(W(m, s), f"{I(m, s)} computes only the input gradient")
    elif W(m, s) in seen:
        need(I(m, s), f"{W(m, s)} needs the input-gradient pass first")
    else:
        need(B(m, s), "every stage needs the backward of every micro-batch (B, or I and W)")


_DOES = {
    ActionKind.UNSHARD: "gathers its parameters",
    ActionKind.RESHARD: "frees its gathered parameters",
    ActionKind.REDUCE_GRAD: "reduce-scatters its gradients",
}


def _check_sharded(schedule: Schedule, seen: dict[Action, tuple[int, int]]) -> None:
    """The rules of a schedule with stage-wide actions (see :func:`sharded`): every stage has one U
    before all its actions, one G after its last B or W where it has any (else none), one R after G and
    all its actions. A stage's actions are all on its worker (checked before), so positions compare."""
    first: dict[int, Action] = {}
    last: dict[int, Action] = {}
    last_grad: dict[int, Action] = {}
    for a in seen:  # in each worker's order
        if a.kind not in STAGE_WIDE:
            first.setdefault(a.stage, a)
            last[a.stage] = a
            if a.kind in RELEASES:
                last_grad[a.stage] = a

    def at(a: Action) -> str:
        return f"{a} at worker {seen[a][0]}, position {seen[a][1]}"

    for s in range(schedule.num_stages):
        u, g, r = U(s), G(s), R(s)
        for need in (u, g, r) if s in last_grad else (u, r):
            if need not in seen:
                why = f"stage {s} has backward actions and " if need is g else ""
                raise ScheduleError(
                    f"schedule {schedule.name!r} has stage-wide actions but no {need}: {why}a sharded stage "
                    f"{_DOES[need.kind]} once per step (sharded(schedule) places U, G and R)"
                )
        if g in seen and s not in last_grad:
            raise ScheduleError(f"{at(g)}: stage {s} has no backward (B or W) whose gradients it would reduce; drop it")
        if s in first and seen[u][1] > seen[first[s]][1]:
            raise ScheduleError(
                f"{at(u)} comes after {at(first[s])}: gather a stage's parameters before its first action"
            )
        if s in last_grad and seen[g][1] < seen[last_grad[s]][1]:
            raise ScheduleError(
                f"{at(g)} comes before {at(last_grad[s])}: reduce-scatter a stage's gradients after its last B or W"
            )
        if g in seen and seen[r][1] < seen[g][1]:
            raise ScheduleError(f"{at(r)} comes before {at(g)}: free a stage's parameters after reducing its gradients")
        if s in last and seen[r][1] < seen[last[s]][1]:
            raise ScheduleError(f"{at(r)} comes before {at(last[s])}, which needs the parameters: free them after it")


def sharded(schedule: Schedule) -> Schedule:
    """``schedule`` with its stages sharded (FSDP): on every worker, for each stage ``s`` it holds,
    ``U(s)`` just before its first action of ``s`` and, after its last B or W of ``s``, ``G(s)`` then
    ``R(s)``; a stage without backward actions (forwards only, a decode) gets ``R(s)`` after its last
    action and no G. So parameters are gathered once and gradients reduce-scattered once per step.
    Everything else (name, sizes, placement, feedback) is ``schedule``'s."""
    done = next((a for a in schedule if a.kind in STAGE_WIDE), None)
    if done is not None:
        raise ScheduleError(
            f"schedule {schedule.name!r} is sharded already (it has {done}): shard the unsharded schedule, once"
        )
    out: list[tuple[Action, ...]] = []
    for acts in schedule.actions:
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        last_grad: dict[int, int] = {}
        for i, a in enumerate(acts):
            first.setdefault(a.stage, i)
            last[a.stage] = i
            if a.kind in RELEASES:
                last_grad[a.stage] = i
        seq: list[Action] = []
        for i, a in enumerate(acts):
            s = a.stage
            seq += [U(s), a] if first[s] == i else [a]
            if last_grad.get(s) == i:
                seq.append(G(s))
            if last[s] == i:
                seq.append(R(s))
        out.append(tuple(seq))
    name, stages, micro = schedule.name, schedule.num_stages, schedule.num_microbatches
    return Schedule(name, stages, micro, tuple(out), schedule.placement, schedule.feedback)


Transfer = float | Callable[[Action, Action], float]
"""The latency of a hand-over between workers: seconds (or any time unit) for every dependency whose
producer and consumer stages are placed on different workers, or a function of (producer, consumer)
called only for such dependencies."""


def timeline(
    schedule: Schedule, cost: Callable[[Action], float], transfer: Transfer = 0.0
) -> dict[Action, tuple[float, float]]:
    """Start and end time of every action when each worker runs its list in order and waits for
    dependencies (plus ``transfer`` for a dependency that crosses workers). Dependencies outside the
    schedule (an earlier phase's) count as done. Raises :class:`ScheduleError` on a deadlock."""
    present = set(schedule)
    deps_of = {a: dependencies(a, schedule, present) for a in present}
    place = schedule.placement

    def lag(d: Action, a: Action) -> float:
        if place[d.stage] == place[a.stage]:
            return 0.0
        return transfer(d, a) if callable(transfer) else float(transfer)

    # Each dependency with the hand-over it adds (none unless it crosses workers), computed once.
    lags = {a: tuple(lag(d, a) for d in deps) for a, deps in deps_of.items()} if callable(transfer) or transfer else {}
    spans: dict[Action, tuple[float, float]] = {}
    pos = [0] * schedule.num_workers
    free = [0.0] * schedule.num_workers
    progress = True
    while progress:
        progress = False
        for w, acts in enumerate(schedule.actions):
            while pos[w] < len(acts):
                a = acts[pos[w]]
                if any(d not in spans for d in deps_of[a]):
                    break
                if lags:
                    start = max([free[w], *(spans[d][1] + t for d, t in zip(deps_of[a], lags[a]))])
                else:
                    start = max([free[w], *(spans[d][1] for d in deps_of[a])])
                free[w] = start + cost(a)
                spans[a] = (start, free[w])
                pos[w] += 1
                progress = True
    stuck = [
        f"worker {w} at {acts[pos[w]]} (waits for {', '.join(str(d) for d in deps_of[acts[pos[w]]] if d not in spans)})"
        for w, acts in enumerate(schedule.actions)
        if pos[w] < len(acts)
    ]
    if stuck:
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))
    return spans


def execution_order(schedule: Schedule) -> list[Action]:
    """All actions in one sequence that respects every dependency and every worker's order (for
    running a schedule, or a phase of one, on a single thread)."""
    spans = timeline(schedule, lambda a: 1.0)
    return sorted(spans, key=lambda a: spans[a])
