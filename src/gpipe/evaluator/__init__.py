"""``gpipe eval``: evaluate a run's checkpoints apart from its training, on other hardware if need be.

    gpipe eval --checkpoint runs/mt                      # the newest checkpoint of the run
    gpipe eval --checkpoint runs/mt --step 2000 --beam 4 # one step's, with beam search
    gpipe eval --checkpoint runs/mt --partitions 4 --out runs/mt/eval-k4
    gpipe eval --watch runs/mt                           # beside the training: each new checkpoint once
    gpipe eval --watch runs/mt --all                     # every checkpoint, none passed over
    gpipe eval --watch runs/mt --wait-for-resume         # a run killed: wait for its resume
    gpipe eval --checkpoint runs/mt --devices cpu       # on the CPU, whatever the run trained on
    torchrun --nproc-per-node 2 -m gpipe eval --checkpoint runs/mt --partitions 2

The evaluation is training's own (``gpipe train --eval-every``) on the run's held-out data: for
translation the loss and BLEU per language pair, for images the loss and accuracy, for ``--model hf``
the loss, perplexity and a sample. The run's settings, data and model are rebuilt from the
checkpoint's ``run.json``; at the run's ``--partitions`` and evaluation settings the numbers are those
training logged at that step, bit for bit, at another ``--partitions`` the same within float rounding.
The devices are not the run's but this machine's: ``--devices`` (default ``auto``), as ``gpipe train``
takes it.

Results go to ``--out`` (default ``RUN/eval``): ``metrics.jsonl``, a row per evaluated step (``step``
and training's evaluation keys, so the curves lie over the training run's), TensorBoard events in
``tensorboard/`` (``tensorboard --logdir RUN`` shows both), and ``settings.json``, the evaluation
settings its rows share. A step evaluated there already is refused unless ``--overwrite``.

``--watch RUN`` is the evaluation job of the paper's team (training, evaluation and inference as
three jobs): it waits for the run to start, evaluates each complete checkpoint once (the newest first
when it falls behind; ``--all``: every one, oldest first), and stops by itself once the run's last
step is evaluated, or once the run is not running and every checkpoint it left is (``--wait-for-resume``:
not then). Started again, it skips what ``metrics.jsonl`` lists. A run trained with ``--eval-every 0``
then never pauses to decode.
"""

# An application: imports the library, gpipe.train (the run's settings, data, model and pipeline), gpipe.evaluation
# and gpipe.translate (find_checkpoint); only the command line (gpipe.cli) imports it.

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from gpipe.commands.args import ArgumentParser, UsageError, refuse
from gpipe.data import TranslationDataset
from gpipe.distributed import choose_devices
from gpipe.evaluator.job import EvalSettings, Evaluator, run_folder
from gpipe.evaluator.results import Results, evaluated_steps
from gpipe.evaluator.watch import watch
from gpipe.saving import CheckpointError
from gpipe.train.metrics import bleu_table, eval_summary
from gpipe.translate import add_devices_flag, find_checkpoint

__all__ = ["EvalSettings", "Evaluator", "main"]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="gpipe eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", metavar="PATH", help="a run's --out (its newest checkpoint), its checkpoints "
                      "folder, or a step-* folder: evaluate it once")  # fmt: skip
    what.add_argument("--watch", metavar="RUN", help="a run's --out: evaluate its checkpoints as they come, until its "
                      "last step")  # fmt: skip
    parser.add_argument("--step", type=int, help="with --checkpoint RUN: the checkpoint of this step")
    parser.add_argument("--all", action="store_true", help="with --watch: every checkpoint, none passed over")
    parser.add_argument(
        "--wait-for-resume",
        action="store_true",
        help="with --watch: keep watching a run that is not running (killed, or stopped and not resumed) for it "
        "to be resumed, until its last step is evaluated (default: stop once its checkpoints are evaluated)",
    )
    parser.add_argument(
        "--poll", type=float, default=10.0, metavar="SECONDS",
        help="with --watch: the longest wait between looks for a new checkpoint (default: 10)",
    )  # fmt: skip
    parser.add_argument(
        "--partitions", type=int, metavar="K",
        help="pipeline stages (default: the run's; under torchrun, dividing the world size)",
    )  # fmt: skip
    add_devices_flag(parser)  # (not the run's: this machine's)
    for name, kind, what_ in (
        ("beam", int, "translation: beam size (1: greedy)"),
        ("length-penalty", float, "translation: beam search's length penalty alpha"),
        ("batch", int, "sentences or images per forward"),
        ("eval-batches", int, "held-out batches (not translation: its held-out sentences)"),
    ):
        parser.add_argument(f"--{name}", type=kind, help=f"{what_} (default: the run's)")
    parser.add_argument(
        "--data", metavar="PATH",
        help="the run's data where it is now, if it moved (default: the path the run was given)",
    )  # fmt: skip
    parser.add_argument("--out", metavar="DIR", help="where the results go (default: RUN/eval)")
    parser.add_argument("--overwrite", action="store_true", help="evaluate a step --out holds again, replacing its row")
    parser.add_argument("--quiet", action="store_true", help="with --watch: say nothing while it waits")
    return parser


def _check(args: argparse.Namespace) -> None:
    if args.step is not None and args.watch:
        raise UsageError("--step is for --checkpoint; --watch evaluates every new checkpoint")
    if args.all and not args.watch:
        raise UsageError("--all is for --watch")
    if args.wait_for_resume and not args.watch:
        raise UsageError("--wait-for-resume is for --watch")
    for name in ("step", "partitions", "beam", "batch", "eval_batches"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive (got {value})")
    if args.length_penalty is not None and not 0 <= args.length_penalty < math.inf:
        raise UsageError(f"--length-penalty must be a finite number >= 0 (got {args.length_penalty})")
    if not 0 < args.poll < math.inf:
        raise UsageError(f"--poll must be a positive number of seconds (got {args.poll})")
    try:  # (a list's length against the stages: once the run's --partitions are known)
        choose_devices(args.devices, args.partitions or len(args.devices.split(",")))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _checkpoint(path: str, step: int | None) -> Path:
    """The checkpoint ``--checkpoint`` (and ``--step``) name."""
    if step is None:
        return find_checkpoint(path)
    found = find_checkpoint(path)
    folder = found.parent / f"step-{step:08d}"
    if not folder.is_dir():
        have = sorted(int(m[1]) for p in found.parent.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name)))
        raise UsageError(f"{str(found.parent)!r} holds no checkpoint of step {step} (it holds steps {have})")
    return folder


class _Job:
    """The evaluations of one command: the evaluator built from the first checkpoint, the results
    opened (rank 0) once there is something to write."""

    def __init__(self, args: argparse.Namespace, run: Path) -> None:
        self.args, self.run = args, run
        self.out = Path(args.out) if args.out else run / "eval"
        self.evaluator: Evaluator | None = None
        self.results: Results | None = None
        self.baseline = 0.0  # the data's baseline loss, on the curves

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def __call__(self, folder: Path) -> bool:
        """Evaluate ``folder``; False if it did not load."""
        a = self.args
        if self.evaluator is None:
            self.evaluator = Evaluator(folder, partitions=a.partitions, data=a.data, devices=a.devices, beam=a.beam,
                                       batch=a.batch, length_penalty=a.length_penalty,
                                       eval_batches=a.eval_batches)  # fmt: skip
            if self.rank == 0:
                self.results = Results(self.out, dataclasses.asdict(self.evaluator.settings))
                self.baseline = self.evaluator.data.baseline()
                if (left := self.evaluator.left_out) is not None:
                    print(f"note: no {left} with {self.evaluator.cfg.data_parallel} replicas", file=sys.stderr)
        step, error = self.evaluator.load(folder)
        if error is not None:
            if self.rank == 0:
                gone = "" if folder.exists() else " (deleted by the run's --keep before it was read)"
                print(f"warning: {folder} is not evaluated{gone}: {error}", file=sys.stderr)
            return False
        row = self.evaluator.evaluate(step)
        if self.results is not None:
            self.results.add(row)
            data = self.evaluator.data
            self.results.plot(self.run, self.baseline, data.baseline_name)
            print(f"step {step}: {eval_summary(row)} ({self.out / 'metrics.jsonl'})", flush=True)
            if isinstance(data, TranslationDataset) and "bleu" in row and not self.args.watch:
                print(bleu_table(row, data.pair_sizes))
        return True

    def close(self) -> None:
        if self.results is not None:
            self.results.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``gpipe eval``: 0 when done; a bad flag, run or checkpoint is one line ``error: ...`` and status 2;
    with ``--watch``, 1 if the run's last checkpoint did not load."""
    try:
        args = _parser().parse_args(argv)
        _check(args)
        if args.watch:
            run = Path(args.watch)
            if run.exists() and not run.is_dir():
                raise UsageError(f"--watch {args.watch!r} is a file; give a run's --out folder")
            job = _Job(args, run)
            try:
                done = watch(run, job.out, job, every=args.all, poll=args.poll, quiet=args.quiet,
                             resume=args.wait_for_resume)  # fmt: skip
                return 0 if done else 1
            finally:
                job.close()
        folder = _checkpoint(args.checkpoint, args.step)
        job = _Job(args, run_folder(folder))
        step = int(folder.name.removeprefix("step-")) if folder.name.startswith("step-") else None
        if step in evaluated_steps(job.out) and not args.overwrite:
            raise UsageError(
                f"step {step} is evaluated in {str(job.out / 'metrics.jsonl')!r} already: add --overwrite to "
                "evaluate it again and replace its row, or give another --out"
            )
        try:
            if not job(folder):
                raise UsageError(f"{str(folder)!r} did not load (see the warning above)")
        finally:
            job.close()
    except (UsageError, CheckpointError) as exc:
        return refuse(exc)
    except KeyboardInterrupt:
        return 130
    return 0
