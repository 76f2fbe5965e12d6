"""Pictures of a timeline, like the paper's Figure 2c: workers as rows, time as columns, forward and
backward passes in distinct colours, micro-batch numbers in the cells (a decode's: group and step,
``g1t3``), the bubble in the title. A sharded schedule's stage-wide actions are marks across a
worker's row at their time (a thin bar where they take time), lettered U, G (above) and R (below).

Works for a simulated timeline and for a measured one (``StepTrace.timeline()``) alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpipe.schedule.ir import STAGE_WIDE
from gpipe.schedule.simulate import Simulation

__all__ = ["COLORS", "check_timeline_path", "render_timeline"]

COLORS = {
    "F": "#4C78A8",
    "B": "#54A24B",
    "I": "#F58518",
    "W": "#B279A2",
    "U": "#222222",
    "G": "#E45756",
    "R": "#8C8C8C",
}
_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "backward (input)",
    "W": "backward (weight)",
    "U": "all-gather (U)",
    "G": "reduce-scatter (G)",
    "R": "free (R)",
}


def _formats() -> list[str]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return sorted(FigureCanvasAgg.get_supported_filetypes())


def check_timeline_path(path: str | os.PathLike[str]) -> Path:
    """``path`` if a picture can be written there: its suffix names a format matplotlib writes
    (.png, .svg, .pdf, ...) and its folder exists; otherwise a ``ValueError`` that says why."""
    out = Path(path)
    suffix = out.suffix.lower().lstrip(".")
    formats = _formats()
    if suffix not in formats:
        what = f"extension .{suffix}" if suffix else "no extension"
        raise ValueError(f"{str(out)!r} has {what}; end the name with one of {', '.join('.' + f for f in formats)}")
    if out.is_dir():
        raise ValueError(f"{str(out)!r} is a folder; name a file in it, e.g. {str(out / ('timeline.' + suffix))!r}")
    folder = out.parent
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
        raise ValueError(f"the folder {str(folder)!r} of {str(out)!r} {problem}; create it or write elsewhere")
    return out


def render_timeline(
    sim: Simulation, path: str | os.PathLike[str], *, title: str | None = None, unit: str = "time"
) -> Path:
    """Draw ``sim`` to ``path``; the format follows the suffix (.png, .svg, .pdf, ...)."""
    out = check_timeline_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    schedule = sim.schedule
    origin = min(start for start, _ in sim.spans.values())
    workers = schedule.num_workers
    virtual = max(1, schedule.num_stages // workers)
    width = min(24.0, max(6.0, 0.28 * sum(a.kind not in STAGE_WIDE for a in schedule.actions[0]) + 2))
    fig, ax = plt.subplots(figsize=(width, 0.55 * workers + 1.4))
    kinds_seen: dict[str, None] = {}
    for w, acts in enumerate(schedule.actions):
        for a in acts:
            start, end = (t - origin for t in sim.spans[a])
            kind = a.kind.value
            kinds_seen[kind] = None
            if a.kind in STAGE_WIDE:
                _mark(ax, w, start, end, kind)
                continue
            chunk = a.stage // workers
            ax.barh(
                w,
                end - start,
                left=start,
                height=0.8,
                color=COLORS[kind],
                alpha=1.0 - 0.45 * chunk / max(1, virtual - 1) if virtual > 1 else 1.0,
                edgecolor="white",
                linewidth=0.6,
            )
            if end - start > 0.012 * sim.makespan:
                text = schedule.label(a) if schedule.feedback else str(a.microbatch)
                ax.text((start + end) / 2, w, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(workers), [f"worker {w}" for w in range(workers)])
    ax.invert_yaxis()
    pad = 0.01 * sim.makespan if any(a.kind in STAGE_WIDE for a in schedule) else 0.0  # marks at the ends
    ax.set_xlim(-pad, sim.makespan + pad)
    ax.set_xlabel(unit)
    if schedule.feedback:  # a decode: G groups, T steps each
        steps = -(-schedule.num_microbatches // schedule.feedback)
        sizes, held = f"G={schedule.feedback}, T={steps}", "caches per worker"
    else:
        sizes, held = f"M={schedule.num_microbatches}", "peak in flight"
    if any(u for u, _ in sim.collectives):
        sizes += ", sharded"
    ax.set_title(
        title
        or f"{schedule.name}: K={workers}, {sizes}"
        + (f", v={virtual}" if virtual > 1 else "")
        + f" — bubble {sim.bubble:.1%}, {held} {max(sim.peak_in_flight)}"
    )
    ax.legend(
        handles=[Patch(color=COLORS[k], label=_NAMES[k]) for k in kinds_seen],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if workers < 4 else -0.15),
        ncol=min(len(kinds_seen), 4),
        frameon=False,
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def _mark(ax: Any, w: int, start: float, end: float, kind: str) -> None:
    """A stage-wide action on worker ``w``'s row: a tick across the row (at its start for U, its end
    for G and R, so back-to-back G and R stay after the backward), a thin bar where it takes time,
    and its letter above the row (U, G) or below it (R)."""
    color = COLORS[kind]
    if end > start:
        ax.barh(w, end - start, left=start, height=0.3, color=color, edgecolor="white", linewidth=0.4)
    at = start if kind == "U" else end
    ax.vlines(at, w - 0.4, w + 0.4, colors=color, linewidth=1.2)
    above = kind != "R"  # the y axis is inverted: row w - 0.4 is its top
    y, va = (w - 0.42, "bottom") if above else (w + 0.42, "top")
    ax.text(at, y, kind, ha="center", va=va, fontsize=6, color=color)
