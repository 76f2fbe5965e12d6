"""A run's checkpoints and their resumption (:class:`Checkpoints`, with ``run.json`` and
``scheduler.json``), the metrics a resumed run writes again (:func:`truncate_metrics`), and Ctrl-C and
SIGTERM held off while a step completes (:class:`Interrupts`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpipe.data import Dataset, ParallelCorpus, TokenDataset, TranslationDataset, tokenizer
from gpipe.data.prepared import PreparedCorpus, PreparedText
from gpipe.data.text import TextLines
from gpipe.models import hf, lora
from gpipe.pipeline import Pipeline
from gpipe.saving import AsyncSave, CheckpointError, latest, load, prune, save, write_atomically
from gpipe.train.config import ConfigError, TrainConfig
from gpipe.train.setup import hf_config, process_rank

__all__ = ["RUN", "SCHEDULER", "Checkpoints", "Interrupts", "truncate_metrics"]

RUN = "run.json"  # in every checkpoint: the settings and what the model was sized from
SCHEDULER = "scheduler.json"  # in every checkpoint: the learning-rate schedule's state


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
        self.guard: Callable[[], str] | None = None  # the bad-step guard's state, for guard.json (set by the loop)
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
        if isinstance(data, (TextLines, PreparedText)):
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
        ``latest`` names: the newest complete one, which a resumed run started from or succeeded)."""
        if self.cfg.keep and process_rank() == 0:
            prune(self.root, self.cfg.keep)

    def resume(self) -> int:
        """Load the newest checkpoint into the pipeline, the optimizer and the schedule; returns the
        first step to run."""
        found = latest(self.root)
        if found is None:
            raise ConfigError(f"--resume: no checkpoint in {str(self.root)!r}")
        step = load(self.pipe, found, optimizer=self.optimizer)
        try:
            self.scheduler.load_state_dict(json.loads((found / SCHEDULER).read_text()))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{str(found / SCHEDULER)!r}: the learning-rate schedule's state: {exc}") from None
        self.saved = step
        return step + 1


def truncate_metrics(path: Path, start: int) -> None:
    """Drop metrics of steps at or after ``start`` (a resumed run writes them again), and a torn last
    line (a crash in the middle of writing it)."""
    if not path.exists():
        return
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
    write_atomically(path, lambda p: p.write_text("".join(line + "\n" for line in kept)))


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
