"""What ``gpipe train`` shows and leaves beside its metrics: TensorBoard's writer (with the run's
settings for the HParams tab), the progress bar,
the loss curves (``OUT/loss.png``), the gradient-norm ratio (``OUT/grad_norm_ratio.png``) and the
final BLEU table per language pair."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from gpipe.evaluation import resource_groups
from gpipe.runfile import WHERE_AND_HOW
from gpipe.train.config import TrainConfig, has_tensorboard
from gpipe.train.setup import process_rank

__all__ = [
    "HPARAM_METRICS",
    "bleu_table",
    "curves_figure",
    "eval_postfix",
    "eval_summary",
    "health_figure",
    "hparams_end",
    "plot_curves",
    "plot_health",
    "progress_bar",
    "tensorboard_writer",
]


# The metrics TensorBoard's HParams tab shows beside a run's settings, per model (scalars the run logs)
HPARAM_METRICS = {
    "transformer": ("loss", "eval_loss", "bleu"),
    "amoebanet": ("loss", "eval_loss", "eval_accuracy"),
    "hf": ("loss", "eval_loss", "eval_perplexity"),
}


def tensorboard_writer(cfg: TrainConfig, out: Path, start: int) -> Any:
    """TensorBoard's writer of OUT/tensorboard on rank 0 (None when off, or auto without the package).
    A resumed run purges what an earlier run wrote from its first step on, as metrics.jsonl does.

    It starts with the run's settings as an HParams session (every setting but where and how the run
    writes), whose metrics are :data:`HPARAM_METRICS`' scalars: ``tensorboard --logdir`` over many runs
    (a sweep's trials) shows them as one table of settings and metrics in the HParams tab."""
    if process_rank() != 0 or cfg.tensorboard == "off" or not has_tensorboard():
        return None
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start if start > 1 else None)
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in WHERE_AND_HOW}
    metrics = dict.fromkeys(HPARAM_METRICS[cfg.model], 0.0)
    experiment, start_info, _ = hparams(settings, metrics)  # type: ignore[no-untyped-call]
    for summary in (experiment, start_info):
        writer._get_file_writer().add_summary(summary)  # type: ignore[no-untyped-call]
    return writer


def hparams_end(writer: Any) -> None:
    """The HParams session of :func:`tensorboard_writer` ended: the run is done (or stopped by
    ``gpipe sweep``'s pruner), not lost."""
    from torch.utils.tensorboard.summary import hparams

    writer._get_file_writer().add_summary(hparams({}, {})[2])  # type: ignore[no-untyped-call]


def progress_bar(cfg: TrainConfig, start: int) -> Any:
    """tqdm's bar on a terminal; in a log (standard error not a terminal), a line every few seconds.
    Named ``gpipe train``, and ``gpipe train bf16`` with ``--precision bf16``."""
    if not cfg.progress or process_rank() != 0:
        return None
    from gpipe.train.progress import progress

    desc = "gpipe train" if cfg.precision == "fp32" else f"gpipe train {cfg.precision}"  # (bf16: said on every line)
    return progress(cfg.steps, initial=start - 1, desc=desc, unit="step")


def eval_summary(metrics: dict[str, Any]) -> str:
    """An evaluation's metrics in a line: ``eval loss 1.2345, BLEU 87.6`` (the accuracy of images, the
    perplexity of a causal LM); '' for metrics without an evaluation."""
    if "eval_loss" not in metrics:
        return ""
    said = [f"eval loss {metrics['eval_loss']:.4f}"]
    if "eval_accuracy" in metrics:
        said.append(f"eval accuracy {metrics['eval_accuracy']:.3f}")
    if "bleu" in metrics:
        said.append(f"BLEU {metrics['bleu']:.1f}")
    if "eval_perplexity" in metrics:
        said.append(f"eval perplexity {metrics['eval_perplexity']:.2f}")
    return ", ".join(said)


SAMPLE_SHOWN = 60
"""The most characters of an evaluation's sample the progress bar shows."""


def eval_postfix(metrics: dict[str, Any]) -> dict[str, str]:
    """An evaluation's metrics as the progress bar shows them until the next: the eval loss, and the
    accuracy (images), the mean BLEU (translation), or the perplexity and the sample (a causal LM;
    the sample's start, quoted)."""
    shown = {"eval_loss": f"{metrics['eval_loss']:.3f}"}
    if "eval_accuracy" in metrics:
        shown["accuracy"] = f"{metrics['eval_accuracy']:.3f}"
    if "bleu" in metrics:
        shown["bleu"] = f"{metrics['bleu']:.1f}"
    if "eval_perplexity" in metrics:
        shown["eval_perplexity"] = f"{metrics['eval_perplexity']:.2f}"
    if "sample" in metrics:
        text = str(metrics["sample"])
        shown["sample"] = repr(text if len(text) <= SAMPLE_SHOWN else text[: SAMPLE_SHOWN - 3] + "...")
    return shown


# Each language pair's BLEU line its own marker and dash pattern (with the colour, distinct for up to 40
# pairs): equal scores, such as 100 for several pairs, stay visible as lines drawn over one another.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_DASHES = ("-", "--", "-.", ":")


def plot_curves(metrics: Path, path: Path, baseline: float, baseline_name: str) -> None:
    """The loss curves, and BLEU per language pair beside them when there is any (:func:`curves_figure`)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    fig = curves_figure(rows, baseline, baseline_name)
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


def curves_figure(rows: list[dict[str, Any]], baseline: float, baseline_name: str) -> Any:
    """The figure of ``rows`` (metrics.jsonl's): the training and eval losses; beside them, on the same
    steps, BLEU per language pair (hollow markers, a marker and dash pattern each) and the high- and
    low-resource means (thin, under the pairs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in rows if "eval_loss" in r]
    pairs = sorted({k.split("/", 1)[1] for r in evals for k in r if k.startswith("bleu/")} - {"high", "low"})
    fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(12 if pairs else 7, 4), squeeze=False, sharex=True)
    ax = axes[0][0]
    losses = [math.nan if r.get("loss") is None else r["loss"] for r in rows]  # (None: a skipped step's NaN)
    ax.plot([r["step"] for r in rows], losses, label="train loss", lw=1)
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.axhline(baseline, color="gray", ls="--", label=f"{baseline_name} {baseline:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.legend()
    if pairs:
        ax = axes[0][1]
        for i, name in enumerate(pairs):
            points = [(r["step"], r[f"bleu/{name}"]) for r in evals if f"bleu/{name}" in r]
            ax.plot(*zip(*points), marker=_MARKERS[i % len(_MARKERS)], ls=_DASHES[i % len(_DASHES)],
                    mfc="none", ms=5, lw=1.2, label=name, zorder=3)  # fmt: skip
        for group, style in (("high", (0, (6, 3))), ("low", (0, (1, 2)))):
            points = [(r["step"], r[f"bleu/{group}"]) for r in evals if f"bleu/{group}" in r]
            if points:
                ax.plot(*zip(*points), ls=style, color="black", lw=0.7, alpha=0.6, zorder=2,
                        label=f"{group}-resource mean")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel("BLEU")
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_health(metrics: Path, path: Path) -> None:
    """The training health's curves (:func:`health_figure`), if ``--health-every`` logged any."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    if not any("grad_norm" in r for r in rows):
        return
    fig = health_figure(rows)
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


def health_figure(rows: list[dict[str, Any]]) -> Any:
    """The figure of ``rows``' health steps: Bapna et al.'s gradient-norm ratio between the first and
    the last block (large early, then flat when the lower layers train), and beside it the global
    gradient norm before clipping; both on a log scale (a skipped step's None is a gap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    health = [r for r in rows if "grad_norm" in r]
    steps = [r["step"] for r in health]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), squeeze=False, sharex=True)
    for ax, key, label in (
        (axes[0][0], "grad_norm_ratio", "‖∇h_first L‖ / ‖∇h_last L‖"),
        (axes[0][1], "grad_norm", "gradient norm (before clipping)"),
    ):
        values = [math.nan if r.get(key) is None else r[key] for r in health]
        ax.plot(steps, values, ".-", lw=1)
        if any(v > 0 for v in values):  # (log of no positive value: matplotlib warns)
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(key)
    fig.tight_layout()
    return fig


def bleu_table(metrics: dict[str, Any], sizes: dict[str, int]) -> str:
    """The final evaluation per language pair: training sentences, group, eval loss, BLEU."""
    groups = resource_groups(sizes)
    lines = [f"{'pair':<12} {'sentences':>10} {'group':<5} {'eval loss':>9} {'BLEU':>6}"]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lines.append(
            f"{name:<12} {sizes[name]:>10} {groups[name]:<5} {metrics[f'eval_loss/{name}']:>9.3f} "
            f"{metrics[f'bleu/{name}']:>6.1f}"
        )
    for group in ("high", "low"):
        if f"bleu/{group}" in metrics:
            lines.append(f"{'average ' + group:<29} {'':>9} {metrics[f'bleu/{group}']:>6.1f}")
    return "\n".join(lines)
