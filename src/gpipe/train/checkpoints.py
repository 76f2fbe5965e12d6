"""A run's checkpoints and their resumption (:class:`Checkpoints`, with ``run.json`` and
``scheduler.json``), the metrics a resumed run writes again (:func:`truncate_metrics`), and Ctrl-C and
SIGTERM held off while a step completes (:class:`Interrupts`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gpipe.data import Dataset, ParallelCorpus, TokenDataset, TranslationDataset, tokenizer
from gpipe.data.instruct import InstructionData
from gpipe.data.prepare_records import PreparedRecords
from gpipe.data.prepared import PreparedCorpus, PreparedText
from gpipe.data.text import TextLines
from gpipe.models import hf, lora
from gpipe.pipeline import Pipeline
from gpipe.runfile import RUN
from gpipe.saving import AsyncSave, CheckpointError, complete, latest, load, prune, save, write_atomically
from gpipe.train.config import ConfigError, TrainConfig
from gpipe.train.learned import RATES
from gpipe.train.setup import hf_config, process_rank

__all__ = ["RUN", "SCHEDULER", "Checkpoints", "Interrupts", "truncate_metrics"]

SCHEDULER = "scheduler.json"  # in every checkpoint: the learning-rate schedule's state
_STEP = re.compile(r"step-(\d{8,})")


class Checkpoints:
    """``OUT/checkpoints`` of a run: the layers and the optimizer's state through
    :func:`gpipe.saving.save` (torch.distributed.checkpoint, keyed by global layer index, so that
    ``--resume`` may change ``--partitions``), beside them the learning-rate schedule's state,
    ``run.json`` and the vocabulary; for ``--model hf`` the model's ``config.json`` and the text's
    tokenizer too, all ``gpipe export`` needs. With ``--async-checkpoint`` a save returns once the
    state is copied and writes in the background; the next save, and :meth:`finish`, wait for it."""

    def __init__(
        self, cfg: TrainConfig, pipe: Pipeline, optimizer: Any, scheduler: Any, out: Path, data: Dataset
    ) -> None:
        self.cfg, self.pipe, self.optimizer, self.scheduler, self.data = cfg, pipe, optimizer, scheduler, data
        self.root = out / "checkpoints"
        self.pending: AsyncSave | None = None
        self.saved = 0  # the step of the newest save started
        self.config: str | None = None  # --model hf: the config the model was built from
        self.lora: str | None = None  # --lora: the adapters' lora.json (set by the loop)
        self.loaded: Path | None = None  # the checkpoint resumed from
        self.spare: Path | None = None  # the checkpoint resumed from past damaged newer ones: never pruned
        self.guard: Callable[[], str] | None = None  # the bad-step guard's state, for guard.json (set by the loop)
        self.rates: Any = None  # --lr-hypergradient: the LearnedRates, for learned_rates.json (set by the loop)
        if cfg.model == "hf" and isinstance(data, TokenDataset):
            self.config = hf.config_json(hf_config(cfg, data), keep_dtype=bool(cfg.init))

    def _extra(self) -> dict[str, Any]:
        if process_rank() != 0:
            return {}
        scheduler = json.dumps(self.scheduler.state_dict())
        extra: dict[str, Any] = {SCHEDULER: lambda p: p.write_text(scheduler + "\n")}
        data = self.data  # what `gpipe translate` rebuilds the model from, beside its weights
        run: dict[str, Any] = {"config": dataclasses.asdict(self.cfg), "data": type(data).__name__}
        if isinstance(data, TokenDataset):
            run |= {"vocab": data.vocab, "length": data.length}
        if isinstance(data, TranslationDataset):
            run["pairs"] = data.pair_sizes
        extra[RUN] = lambda p: p.write_text(json.dumps(run, indent=1) + "\n")
        if isinstance(data, (ParallelCorpus, PreparedCorpus)):
            extra["vocab.model"] = lambda p: shutil.copyfile(data.vocab_model.path, p)
        if self.config is not None:
            extra[hf.CONFIG] = lambda p, config=self.config: p.write_text(config + "\n")
        if self.lora is not None:
            extra[lora.LORA] = lambda p, settings=self.lora: p.write_text(settings)
        if self.guard is not None:
            guard = self.guard()
            extra["guard.json"] = lambda p: p.write_text(guard)
        if self.rates is not None:
            rates = json.dumps(self.rates.state_dict())
            extra[RATES] = lambda p: p.write_text(rates + "\n")
        if isinstance(data, (TextLines, PreparedText, InstructionData, PreparedRecords)):
            for name, source in tokenizer.checkpoint_files(data.tokenizer).items():
                extra[name] = lambda p, source=source: shutil.copyfile(source, p)
        return extra

    def save(self, step: int, *, background: bool = False) -> None:
        """Checkpoint ``step`` (the last step whose update is complete); in the background if
        asked and ``--async-checkpoint`` is on. A step already saved is not saved again."""
        if step < 1 or step == self.saved:
            return
        self.finish()  # (a save waits for the one under way: then the older ones are pruned)
        self.saved = step
        if background and self.cfg.async_checkpoint:
            self.pending = save(self.pipe, self.root, step, optimizer=self.optimizer, extra=self._extra(),
                                asynchronous=True)  # fmt: skip
            return
        save(self.pipe, self.root, step, optimizer=self.optimizer, extra=self._extra())
        self._prune()

    def finish(self) -> None:
        """Wait for a save under way (raising its error), then prune."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()
            self._prune()

    def _prune(self) -> None:
        """``--keep N``: rank 0 deletes the complete checkpoints but the newest N (never the one
        ``latest`` names: the newest complete one, which a resumed run started from or succeeded;
        nor the one a resumed run fell back to, past damaged newer ones)."""
        if self.cfg.keep and process_rank() == 0:
            prune(self.root, self.cfg.keep, spare=self.spare)

    def resume(self) -> int:
        """Load the newest checkpoint into the pipeline, the optimizer and the schedule; returns the
        first step to run. A damaged one (a file that fails the checksum the manifest lists, or
        any other :class:`CheckpointError` of its load) is passed over for the newest older one,
        with a warning naming the file; under torch.distributed every rank loads the same one (the
        ranks agree after each: one rank's damaged file passes it over for all). If none loads,
        :class:`ConfigError` names them. A checkpoint resumed from past damaged newer ones is never
        deleted by ``--keep`` (:meth:`_prune`): the damaged ones count among the newest N."""
        found = latest(self.root)
        if found is None:
            raise ConfigError(f"--resume: no checkpoint in {str(self.root)!r}")
        damaged: list[tuple[str, str]] = []
        with _ranks() as gather:
            for folder in [found, *_older(self.root, found)]:
                problem = _agreed(gather, folder.name, functools.partial(self._load, folder))
                if problem is None:
                    break
                damaged.append((folder.name, problem))
            else:
                said = "; ".join(f"{name}: {problem}" for name, problem in damaged)
                raise ConfigError(f"--resume: no checkpoint in {str(self.root)!r} loads ({said})")
        if damaged and process_rank() == 0:
            for name, problem in damaged:
                print(f"warning: checkpoint {name} is damaged ({problem}); resuming from {folder.name} instead",
                      file=sys.stderr)  # fmt: skip
        self.loaded, self.spare = folder, folder if damaged else None
        return self.saved + 1

    def _load(self, folder: Path) -> None:
        step = load(self.pipe, folder, optimizer=self.optimizer)
        try:
            self.scheduler.load_state_dict(json.loads((folder / SCHEDULER).read_text()))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{str(folder / SCHEDULER)!r}: the learning-rate schedule's state: {exc}") from None
        self.saved = step


def _older(root: Path, found: Path) -> list[Path]:
    """The complete checkpoints of ``root`` before ``found``'s step, newest first."""
    before = int(m[1]) if (m := _STEP.search(found.name)) else 0
    return [p for p in complete(root) if int(p.name.removeprefix("step-")) < before]


@contextlib.contextmanager
def _ranks() -> Iterator[Callable[[Any], list[Any]]]:
    """A gather of a value from every rank (in one process, a list of one), over a gloo group of
    its own: the default one may be NCCL's, and a rank's load may outlast its timeout."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield lambda value: [value]
        return
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=2))

    def gather(value: Any) -> list[Any]:
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, value, group=group)
        return found

    try:
        yield gather
    finally:
        dist.destroy_process_group(group)


def _agreed(gather: Callable[[Any], list[Any]], name: str, load: Callable[[], None]) -> str | None:
    """Every rank's ``load()`` of checkpoint ``name``: None where all loaded it, else what the first
    rank that could not says (its :class:`CheckpointError`). Another error is raised on every rank."""
    problem: str | None = None
    error: Exception | None = None
    try:
        load()
    except CheckpointError as exc:
        problem = str(exc)
    except Exception as exc:  # told to the other ranks, which would wait for this one's answer
        error = exc
    outcomes = gather((name, problem, None if error is None else f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    for rank, (seen, _, failed) in enumerate(outcomes):
        if failed is not None:
            raise RuntimeError(f"--resume: rank {rank} failed to load {seen}: {failed}")
        if seen != name:
            raise ConfigError(
                f"--resume: rank {rank} loads {seen}, rank {process_rank()} {name}: do they share the folder?"
            )
    return next((problem for _, problem, _ in outcomes if problem is not None), None)


def truncate_metrics(path: Path, start: int) -> float:
    """Drop metrics of steps at or after ``start`` (a resumed run writes them again), and a torn last
    line (a crash in the middle of writing it). Returns the kept rows' last ``elapsed_s`` (the seconds
    the run had trained; 0 for none), which a resumed run counts on from."""
    if not path.exists():
        return 0.0
    elapsed = 0.0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, TypeError, KeyError):
            if i == len(lines) - 1:
                break  # torn by a crash while it was written
            raise ConfigError(
                f"{str(path)!r} line {i + 1} is not a metrics record: {line[:80]!r}; repair or remove the file"
            ) from None
        if step < start:
            kept.append(line)
            elapsed = float(row.get("elapsed_s") or elapsed)
    write_atomically(path, lambda p: p.write_text("".join(line + "\n" for line in kept)))
    return elapsed


class Interrupts:
    """Ctrl-C (SIGINT) and SIGTERM raise ``KeyboardInterrupt`` — except inside :meth:`held`, where
    the signal waits until the block ends. (In the main thread only; elsewhere signals are as they were.)"""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._held = 0
        self._pending: int | None = None
        self._before: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._before[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._held:
            self._pending = signum
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held and self._pending is not None:
            signum, self._pending = self._pending, None
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._before.items():
            signal.signal(sig, handler)
        self._before = {}
