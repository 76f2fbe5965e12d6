"""Schedules as verified data: the IR, its generators, the simulator and pictures.

Generate → validate → simulate → render → execute::

    >>> from gpipe.schedule import make_schedule, simulate
    >>> sim = simulate(make_schedule("1f1b", 4, 8))
    >>> round(sim.bubble, 3), sim.peak_in_flight
    (0.273, (4, 3, 2, 1))

FSDP-sharded stages: each stage's parameters gathered (U) and its gradients reduce-scattered (G) once
per step, then freed (R), as actions of the schedule::

    >>> from gpipe.schedule import sharded
    >>> simulate(sharded(make_schedule("1f1b", 4, 8))).collectives
    ((1, 1), (1, 1), (1, 1), (1, 1))

A decode (forwards only, ``G`` groups of sequences in flight, each step's input chosen by the last)::

    >>> from gpipe.schedule import decode, decode_bubble
    >>> simulate(decode([0, 1, 2, 3], groups=4, steps=8)).peak_in_flight, decode_bubble([0, 1, 2, 3], 2)
    ((4, 4, 4, 4), 0.5)

Part of the library, at its bottom: plain data, so it imports neither torch nor any other part of gpipe
(matplotlib only when a timeline is drawn); the runtime, the planner and the commands import it.
"""

from gpipe.schedule.auto import Candidate, Plan, StageCosts, auto_schedule, peak_memory, plan
from gpipe.schedule.decode import decode, decode_bubble, decode_order, decode_period, min_groups
from gpipe.schedule.generate import (
    SCHEDULES,
    dualpipe_v,
    fill_drain,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    v_half,
    v_min,
    zb_h1,
    zb_h2,
    zb_v,
)
from gpipe.schedule.ir import (
    STAGE_WIDE,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    dependencies,
    execution_order,
    sharded,
    validate,
)
from gpipe.schedule.render import render_timeline
from gpipe.schedule.simulate import Simulation, kind_cost, simulate, unit_cost

__all__ = [
    "SCHEDULES",
    "STAGE_WIDE",
    "Action",
    "ActionKind",
    "Candidate",
    "Plan",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "StageCosts",
    "auto_schedule",
    "decode",
    "decode_bubble",
    "decode_order",
    "decode_period",
    "dependencies",
    "dualpipe_v",
    "execution_order",
    "fill_drain",
    "interleaved_1f1b",
    "kind_cost",
    "make_schedule",
    "min_groups",
    "one_f_one_b",
    "peak_memory",
    "plan",
    "render_timeline",
    "sharded",
    "simulate",
    "unit_cost",
    "v_half",
    "v_min",
    "validate",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
