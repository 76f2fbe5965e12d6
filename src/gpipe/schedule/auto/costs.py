"""Per-stage costs for planning: :class:`StageCosts` (measured from a trace, or uniform), with the
spread of measured times (jitter), and :func:`peak_memory`, a schedule's activation memory per worker."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpipe.schedule.ir import STAGE_WIDE, Action, ActionKind, Schedule

__all__ = ["StageCosts", "_check_value", "peak_memory"]


def _check_value(what: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number (got {value!r})") from None
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"{what} must be a finite number >= 0 (got {value!r})")
    return v


def _per_stage(what: str, values: Sequence[float], stages: int) -> tuple[float, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValueError(f"{what} must be a sequence of one number per stage (got {values!r})")
    if len(values) != stages:
        raise ValueError(f"{what} has {len(values)} values but there are {stages} stages: give one per stage")
    return tuple(_check_value(f"{what}[{s}]", v) for s, v in enumerate(values))


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Measured (or assumed) costs of one training step's pieces, per stage.

    ``forward[s]``, ``input[s]``, ``weight[s]`` and ``backward[s]`` are the times of F, I, W and B on
    stage ``s`` (any time unit, the same for all; seconds from a trace). ``backward`` defaults to
    ``input + weight`` (what a split backward costs in all); give it when a fused backward was measured
    and is cheaper. ``memory[s]`` is the activation memory one micro-batch holds on stage ``s``, in any
    unit (default 1.0: "one micro-batch"), the unit of a memory cap. ``transfer`` is the time a
    hand-over (an activation or a gradient) between two workers takes (default 0).

    ``jitter`` is how much an action's time varies around its stage's mean, as a coefficient of
    variation (0: every action takes its mean). With jitter, :func:`plan` ranks candidates by their
    mean step time over random draws of the action times, which favours schedules with slack.

    ``split_estimated[s]`` is true where I and W were not measured but estimated from B (see
    :meth:`from_trace`); it is informational (the estimate is used as the cost).

    Every value must be finite and >= 0; a bad one raises ``ValueError`` naming it.
    """

    forward: tuple[float, ...]
    input: tuple[float, ...]
    weight: tuple[float, ...]
    backward: tuple[float, ...] | None = None
    memory: tuple[float, ...] | None = None
    transfer: float = 0.0
    split_estimated: tuple[bool, ...] | None = None
    jitter: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.forward) if isinstance(self.forward, Sequence) else 0
        if n == 0:
            raise ValueError(f"forward must give one cost per stage, at least one stage (got {self.forward!r})")
        set_ = object.__setattr__
        set_(self, "forward", _per_stage("forward", self.forward, n))
        set_(self, "input", _per_stage("input", self.input, n))
        set_(self, "weight", _per_stage("weight", self.weight, n))
        if self.backward is None:
            set_(self, "backward", tuple(i + w for i, w in zip(self.input, self.weight)))
        else:
            set_(self, "backward", _per_stage("backward", self.backward, n))
        set_(self, "memory", (1.0,) * n if self.memory is None else _per_stage("memory", self.memory, n))
        set_(self, "transfer", _check_value("transfer", self.transfer))
        set_(self, "jitter", _check_value("jitter", self.jitter))
        if self.split_estimated is None:
            set_(self, "split_estimated", (False,) * n)
        elif len(self.split_estimated) != n:
            raise ValueError(f"split_estimated has {len(self.split_estimated)} values but there are {n} stages")
        else:
            set_(self, "split_estimated", tuple(bool(x) for x in self.split_estimated))

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @property
    def fused(self) -> tuple[float, ...]:
        """B per stage (``backward`` with its default filled in)."""
        assert self.backward is not None  # filled in by __post_init__
        return self.backward

    @property
    def activation(self) -> tuple[float, ...]:
        """Activation memory per stage (``memory`` with its default filled in)."""
        assert self.memory is not None  # filled in by __post_init__
        return self.memory

    @classmethod
    def uniform(
        cls,
        stages: int,
        *,
        F: float = 1.0,  # noqa: N803 - the paper's letters
        I: float = 1.0,  # noqa: N803, E741
        W: float = 1.0,  # noqa: N803
        B: float | None = None,  # noqa: N803
        memory: float = 1.0,
        transfer: float = 0.0,
    ) -> StageCosts:
        """The same costs on every stage; B defaults to I + W."""
        if not isinstance(stages, int) or stages <= 0:
            raise ValueError(f"stages must be a positive integer (got {stages!r})")
        return cls(
            forward=(F,) * stages,
            input=(I,) * stages,
            weight=(W,) * stages,
            backward=None if B is None else (B,) * stages,
            memory=(memory,) * stages,
            transfer=transfer,
        )

    @classmethod
    def from_trace(
        cls,
        costs: Mapping[Action, float],
        num_stages: int,
        *,
        input_share: float = 0.5,
        memory: Sequence[float] | None = None,
        transfer: float = 0.0,
    ) -> StageCosts:
        """The median of measured durations (``StepTrace.costs()``: action → seconds) per stage and kind.

        Every stage needs its F, and its I and W or its B. Where I and W were both measured they are
        used (and B, if it was measured too, is kept as the fused backward's cost; else B = I + W).
        Where only B was measured — a trace of a schedule without split backwards — B is kept as
        measured and the split is estimated: ``I = input_share * B``, ``W = (1 - input_share) * B``
        (default half and half, the zero-bubble paper's F ≈ I ≈ W); ``split_estimated`` marks those
        stages. Planning then treats a split backward as costing what the fused one did; the next
        trace, of the split schedule, measures the real I and W. A sharded step's stage-wide actions
        (U, G, R) are no part of these costs: they are left out.
        """
        if not isinstance(num_stages, int) or num_stages <= 0:
            raise ValueError(f"num_stages must be a positive integer (got {num_stages!r})")
        share = _check_value("input_share", input_share)
        if share > 1:
            raise ValueError(f"input_share is the fraction of B that I takes, in [0, 1] (got {input_share!r})")
        sums: dict[tuple[int, str], list[float]] = {}
        for action, seconds in costs.items():
            if not 0 <= action.stage < num_stages:
                raise ValueError(f"the trace has {action} but there are {num_stages} stages")
            value = _check_value(f"the cost of {action}", seconds)
            if action.kind in STAGE_WIDE:
                continue
            sums.setdefault((action.stage, action.kind.value), []).append(value)
        # The median: robust to the slow first calls of a step (a stage learning its layers, caches).
        mean = {key: statistics.median(v) for key, v in sums.items()}
        fwd, inp, wgt, bwd, estimated = [], [], [], [], []
        jitter = _jitter(sums, mean)
        for s in range(num_stages):
            if (s, "F") not in mean:
                raise ValueError(f"the trace has no forward (F) of stage {s}: give a trace of a whole step")
            has_split = (s, "I") in mean and (s, "W") in mean
            if not has_split and (s, "B") not in mean:
                missing = "W" if (s, "I") in mean else "I" if (s, "W") in mean else "B, or I and W"
                raise ValueError(f"the trace has no {missing} of stage {s}: give a trace of a whole step")
            fwd.append(mean[s, "F"])
            if has_split:
                inp.append(mean[s, "I"])
                wgt.append(mean[s, "W"])
                bwd.append(mean.get((s, "B"), mean[s, "I"] + mean[s, "W"]))
            else:
                b = mean[s, "B"]
                inp.append(share * b)
                wgt.append(b - share * b)
                bwd.append(b)
            estimated.append(not has_split)
        return cls(
            forward=tuple(fwd),
            input=tuple(inp),
            weight=tuple(wgt),
            backward=tuple(bwd),
            memory=None if memory is None else tuple(memory),
            transfer=transfer,
            split_estimated=tuple(estimated),
            jitter=jitter,
        )

    def cost(self, action: Action) -> float:
        """The time of ``action`` (a cost function for :func:`~gpipe.schedule.simulate.simulate`); a
        stage-wide action (U, G, R) takes none, as under :func:`~gpipe.schedule.simulate.unit_cost`."""
        s, kind = action.stage, action.kind
        if kind in STAGE_WIDE:
            return 0.0
        if kind is ActionKind.FORWARD:
            return self.forward[s]
        if kind is ActionKind.BACKWARD_INPUT:
            return self.input[s]
        if kind is ActionKind.BACKWARD_WEIGHT:
            return self.weight[s]
        return self.fused[s]

    def describe(self) -> str:
        """One line, e.g. ``F=1, I=1, W=2, B=3, transfer=0`` (per stage lists where stages differ)."""

        def fmt(values: Sequence[float]) -> str:
            return f"{values[0]:g}" if len(set(values)) == 1 else "[" + ", ".join(f"{v:g}" for v in values) + "]"

        parts = [
            f"F={fmt(self.forward)}",
            f"I={fmt(self.input)}",
            f"W={fmt(self.weight)}",
            f"B={fmt(self.fused)}",
            f"transfer={self.transfer:g}",
        ]
        if self.jitter:
            parts.append(f"jitter={self.jitter:.2g}")
        if len(set(self.activation)) > 1 or self.activation[0] != 1.0:
            parts.append(f"memory={fmt(self.activation)}")
        return ", ".join(parts)


def _jitter(sums: Mapping[tuple[int, str], Sequence[float]], median: Mapping[tuple[int, str], float]) -> float:
    """How much action times vary: per stage and kind a robust coefficient of variation (1.4826 x
    the median absolute deviation over the median: a slow first call does not count), pooled as a
    root mean square weighted by the group's time (a long, jittery W matters more than a short F)."""
    weighted, total = 0.0, 0.0
    for key, values in sums.items():
        mid = median[key]
        if mid <= 0 or len(values) < 3:
            continue
        cv = 1.4826 * statistics.median(abs(x - mid) for x in values) / mid
        weighted += cv**2 * mid * len(values)
        total += mid * len(values)
    return math.sqrt(weighted / total) if total else 0.0


def peak_memory(schedule: Schedule, costs: StageCosts) -> tuple[float, ...]:
    """Per worker, the most activation memory it holds at once (in ``costs.memory``'s unit): a
    (stage, micro-batch) holds its stage's memory from its F until its B, or its W."""
    if costs.num_stages != schedule.num_stages:
        raise ValueError(f"the costs are for {costs.num_stages} stages but the schedule has {schedule.num_stages}")
    mem = costs.activation
    peaks = []
    for acts in schedule.actions:
        live = peak = 0.0
        for a in acts:
            if a.kind is ActionKind.FORWARD:
                live += mem[a.stage]
                peak = max(peak, live)
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                live -= mem[a.stage]
        peaks.append(peak)
    return tuple(peaks)
