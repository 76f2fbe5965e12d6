"""``OUT/loss.png``: the losses and, beside them on the same steps, BLEU per language pair, where
pairs with equal scores stay visible."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from gpipe.train.metrics import curves_figure, plot_curves


def _rows() -> list[dict[str, Any]]:
    """A run of 40 steps evaluated every 10 from step 10: two pairs of each group at 100 BLEU, one
    pair apart, so each group's mean equals a pair's line too."""
    rows: list[dict[str, Any]] = []
    for step in range(1, 41):
        row: dict[str, Any] = {"step": step, "loss": 5.0 / step}
        if step % 10 == 0:
            bleu = {"xs-ya": 100.0, "xs-yb": 100.0, "xs-yc": 100.0, "xs-yd": step / 2}
            row |= {"eval_loss": 6.0 / step, **{f"bleu/{k}": v for k, v in bleu.items()}}
            row |= {"bleu/high": 100.0, "bleu/low": (100.0 + step / 2) / 2}
        rows.append(row)
    return rows


def test_equal_bleu_lines_stay_visible_and_share_the_loss_steps() -> None:
    fig = curves_figure(_rows(), 4.95, "unigram entropy")
    try:
        loss_axes, bleu_axes = fig.axes
        assert bleu_axes.get_xlim() == loss_axes.get_xlim()  # from step 1, not from the first evaluation
        lines = {line.get_label(): line for line in bleu_axes.get_lines()}
        pairs = [lines[name] for name in ("xs-ya", "xs-yb", "xs-yc", "xs-yd")]
        means = [lines["high-resource mean"], lines["low-resource mean"]]
        looks = {(line.get_marker(), line.get_linestyle(), line.get_color()) for line in pairs}
        assert len(looks) == len(pairs)  # each pair its own marker, dash pattern and colour
        assert all(line.get_markerfacecolor() == "none" for line in pairs)  # hollow: one over another shows both
        for mean in means:  # thin and under the pairs: a pair at the mean's value is not hidden by it
            assert all(mean.get_linewidth() < p.get_linewidth() and mean.get_zorder() < p.get_zorder() for p in pairs)
    finally:
        plt.close(fig)


def test_plot_curves_writes_the_picture(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    plot_curves(metrics, tmp_path / "loss.png", 4.95, "unigram entropy")
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert not plt.get_fignums()  # closed
