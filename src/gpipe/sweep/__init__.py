"""``gpipe sweep``: a hyper-parameter search over ``gpipe train``'s settings, with Optuna.

    gpipe sweep lr.toml --trials 8 --out runs/lr          # TPE over SPACE's [search], pruned by the median
    gpipe sweep lr.toml --trials 12 --out runs/lr         # the same study continued, up to 12 trials in all
    gpipe sweep grid.toml --trials 6 --sampler grid --out runs/grid
    gpipe sweep lr.toml --trials 8 --metric eval_loss --out runs/lr-loss
    torchrun --nproc-per-node 2 -m gpipe sweep lr.toml --trials 8 --out runs/lr   # each trial on 2 ranks
    gpipe runs runs/lr                                    # the trials side by side
    gpipe train --config runs/lr/best.toml --out runs/best  # the best trial's settings

SPACE.toml holds ``[fixed]``, settings of ``gpipe train`` every trial shares (by flag name), and
``[search]``: ranges ``{ low, high, log, step }`` and ``{ choices = [...] }`` (see
:mod:`gpipe.sweep.space`). The whole space is checked before any trial runs.

Each trial is an ordinary run folder, ``DIR/trial-NNN``, that ``gpipe eval``, ``gpipe train --resume``,
``gpipe runs`` and TensorBoard read like any other. Trials run one after another, each pipelined as its
settings say; under torchrun every rank follows rank 0's trial. A trial reports its evaluation metric
(``--metric``, by default BLEU for translation, the accuracy for images, the held-out loss otherwise)
at each evaluation; the median pruner stops one that is worse than the median of the earlier trials
at the same step. A trial's value is its best evaluation.

The study is kept in ``DIR/study.db`` (SQLite; ``optuna-dashboard sqlite:///DIR/study.db`` shows it):
running the same command again continues it up to ``--trials`` in all, and a trial that was
interrupted is run again, resumed from its newest checkpoint. A failed trial is recorded with its error
and the sweep goes on. After each trial, ``DIR/results.md`` lists every trial, and ``DIR/best.toml``
holds the best one's settings for ``gpipe train --config``.
"""

# An application: imports gpipe.train (the trials), gpipe.runs (a trial's folder read back) and Optuna;
# only the command line (gpipe.cli) imports it.

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from gpipe.commands.args import ArgumentParser, UsageError, refuse
from gpipe.saving import CheckpointError
from gpipe.sweep.settings import DIRECTIONS, PRUNERS, SAMPLERS, SweepSettings, default_direction
from gpipe.sweep.space import Space, SpaceError, read_space
from gpipe.sweep.study import Sweep

__all__ = ["Space", "SpaceError", "Sweep", "SweepSettings", "main", "read_space"]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="gpipe sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("space", metavar="SPACE.toml", help="[fixed] settings of gpipe train and the [search] space")
    parser.add_argument("--trials", type=int, required=True, metavar="N",
                        help="trials in all (a continued study runs those it lacks)")  # fmt: skip
    parser.add_argument("--out", required=True, metavar="DIR", help="the sweep's folder: study.db, trial-NNN/, ...")
    parser.add_argument("--metric", metavar="NAME", help="the evaluation metric to rank and prune by, a key of the "
                        "runs' metrics.jsonl: bleu, eval_loss, eval_accuracy, eval_perplexity, bleu/<pair>, ... "
                        "(default: bleu for translation, eval_accuracy for images, else eval_loss)")  # fmt: skip
    parser.add_argument(
        "--direction", choices=DIRECTIONS, help="default: the metric's (BLEU, accuracy up; losses down)"
    )
    parser.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="Optuna's sampler (default: tpe)")
    parser.add_argument("--pruner", choices=PRUNERS, default="median",
                        help="median: stop a trial worse than the earlier ones' median (default)")  # fmt: skip
    parser.add_argument("--startup-trials", type=int, default=3, metavar="N",
                        help="complete trials before the median pruner prunes (default: 3)")  # fmt: skip
    parser.add_argument("--prune-after", type=int, default=0, metavar="STEP",
                        help="prune no trial before this step (a metric vague early on; default: 0)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed (default: 0)")
    return parser


def _default_metric(space: Space) -> str:
    cfg = space.config({d.name: d.corners()[0] for d in space.search}, out="")
    if cfg.model == "amoebanet":
        return "eval_accuracy"
    if cfg.model == "transformer" and cfg.data_parallel == 1 and cfg.tensor_parallel == 1:
        return "bleu"  # (decoding does not run on replicas or split layers)
    return "eval_loss"


def settings(args: argparse.Namespace, space: Space) -> SweepSettings:
    """The sweep's settings from its flags, checked."""
    if args.trials < 1:
        raise UsageError(f"--trials must be positive (got {args.trials})")
    if args.startup_trials < 0:
        raise UsageError(f"--startup-trials must be 0 or more (got {args.startup_trials})")
    if args.prune_after < 0:
        raise UsageError(f"--prune-after must be 0 or more (got {args.prune_after})")
    metric = args.metric or _default_metric(space)
    direction = args.direction or default_direction(metric)
    if direction is None:
        raise UsageError(f"--metric {metric!r}: say which way is better with --direction maximize or minimize")
    if args.sampler == "grid" and args.trials > (size := space.grid_size()):
        print(f"note: the grid has {size} points: the sweep ends after {size} trials")
    return SweepSettings(trials=args.trials, metric=metric, direction=direction, sampler=args.sampler,
                         pruner=args.pruner, startup_trials=args.startup_trials, prune_after=args.prune_after,
                         seed=args.seed)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe sweep``: 0 when the trials are done (failed ones included); a bad space, flag or folder is one
    line ``error: ...`` and status 2, before any trial runs."""
    try:
        args = _parser().parse_args(argv)
        if importlib.util.find_spec("optuna") is None:
            raise UsageError("gpipe sweep needs Optuna: pip install 'gpipe-pytorch[sweep]' (or make: it does)")
        space = read_space(args.space, args.out)
        return Sweep(space, settings(args, space), Path(args.out)).run()
    except (UsageError, CheckpointError) as exc:
        return refuse(exc)
    except KeyboardInterrupt:
        return 130
