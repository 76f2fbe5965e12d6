"""The data of ``gpipe train --data``: a folder of language pairs is prepared once (``gpipe
prepare``'s work, :mod:`gpipe.data.prepare`) into ``OUT/prepared`` and read from there, memory-mapped;
``--data PREPARED`` is read as it is. What a step draws (:func:`train_batch`): ``--batch`` sentences,
or about ``--batch-tokens`` tokens from a length bucket. The training sentence pairs with a side longer than
``--max-length`` tokens are left out, and said so once, counted (:func:`left_out`)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gpipe.data import ImageFiles
from gpipe.data.batches import DrawnPairs
from gpipe.data.prepare import prepare
from gpipe.data.prepared import PreparedError, file_digest, is_prepared, read_manifest, source_fingerprint
from gpipe.saving import write_atomically
from gpipe.train.checks import ROWS
from gpipe.train.config import ConfigError, TrainConfig

__all__ = ["CACHE", "ROWS", "left_out", "on_rank_zero", "prepared_folder", "reads_shares", "train_batch"]

CACHE = "prepared"  # OUT/prepared: --data FOLDER prepared by the run
WAIT_HOURS = 24  # how long the other ranks wait for rank 0 to prepare the data


def train_batch(data: Any, cfg: TrainConfig, replica: int, step: int) -> Any:
    """Step ``step``'s training batch: about ``--batch-tokens`` tokens from one length bucket, else
    ``--batch`` rows. A pure function of (seed, step): the same whatever the layout (``--partitions``,
    ``--data-parallel`` dividing :data:`ROWS`; the config checks that the longest bucket's batch holds a
    row for each micro-batch of each replica). With ``--data-parallel`` D > 1, data sets that can read a
    share alone (prepared or in-memory language pairs, image files) read only data-parallel replica
    ``replica``'s rows (a :class:`~gpipe.data.base.ReplicaBatch`); the others give the whole mini-batch,
    which the pipeline shares out."""
    share = (replica, cfg.data_parallel) if cfg.data_parallel > 1 and reads_shares(data) else None
    if cfg.batch_tokens:
        return data.token_batch(cfg.batch_tokens, step, multiple=ROWS, share=share)
    if share is not None:
        return data.batch(cfg.batch, step, share=share)
    return data.batch(cfg.batch, step)


def left_out(data: Any, cfg: TrainConfig) -> str | None:
    """The note that ``data``'s training leaves out its sentence pairs with a side longer than
    ``--max-length`` (language pairs count them: ``skipped``), in one line with the counts; None when
    it leaves out none."""
    skipped = getattr(data, "skipped", None)
    if not isinstance(skipped, dict) or not (count := sum(skipped.values())):
        return None
    total = count + sum(data.pair_sizes.values())
    pairs = ", ".join(f"{name}: {n}" for name, n in skipped.items() if n)
    return (
        f"note: {count} of the {total} training sentence pairs have a side longer than --max-length {cfg.max_length} "
        f"tokens and are left out of training ({pairs}); raise --max-length to train on them"
    )


def reads_shares(data: Any) -> bool:
    """Whether ``data`` reads a data-parallel replica's share of a batch alone."""
    return isinstance(data, (DrawnPairs, ImageFiles))


def prepared_folder(cfg: TrainConfig) -> Path:
    """The prepared folder the run reads: ``--data`` itself if prepared, else ``OUT/prepared``, made
    from the folder ``--data`` by rank 0 (the other ranks wait) and reused while the folder's files,
    the vocabulary (``--vocab``, or ``OUT/vocab.model``, trained on the first run) and the held-out
    settings (``--eval-sentences``, ``--seed``) are those it was made from."""
    if is_prepared(cfg.data):
        return Path(cfg.data)
    cache = Path(cfg.out) / CACHE
    on_rank_zero(lambda: _refresh(cfg, cache), cfg)
    return cache


def on_rank_zero(work: Callable[[], None], cfg: TrainConfig) -> None:
    """``work()`` on rank 0 alone (all of it in one process) while the other ranks wait (up to
    :data:`WAIT_HOURS`, not the default group's timeout); its
    ``ValueError`` (a ``ConfigError`` as it is, any other naming ``--data``) raised on every rank as a
    :class:`ConfigError`."""
    error = None
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        try:
            work()
        except ValueError as exc:  # (ConfigError too)
            error = str(exc) if isinstance(exc, ConfigError) else f"--data {cfg.data!r}: {exc}"
    if dist.is_initialized():
        # (on a group of its own: preparing a large corpus outlasts the default group's 60 s; should rank 0
        # die, torchrun's agent stops the others)
        group = dist.new_group(backend="gloo", timeout=timedelta(hours=WAIT_HOURS))
        shared = [error]
        dist.broadcast_object_list(shared, src=0, group=group)
        dist.destroy_process_group(group)
        error = shared[0]
    if error is not None:
        raise ConfigError(error)


def _fresh(cfg: TrainConfig, cache: Path, vocab: Path) -> bool:
    if not is_prepared(cache) or not vocab.is_file():
        return False
    try:
        manifest = read_manifest(cache)
    except PreparedError:
        return False
    settings = manifest.get("settings", {})
    return bool(
        manifest.get("source") == source_fingerprint(Path(cfg.data))
        and settings.get("held_out") == cfg.eval_sentences
        and settings.get("seed") == cfg.seed
        and manifest.get("vocab", {}).get("sha256") == file_digest(vocab)
    )


def _refresh(cfg: TrainConfig, cache: Path) -> None:
    vocab = cfg.vocab_path()
    if not vocab.exists() and cfg.resume:
        raise ConfigError(f"--resume: the run's vocabulary {str(vocab)!r} is missing; restore it, or start afresh")
    if _fresh(cfg, cache, vocab):
        return
    if vocab.exists() and not cfg.vocab and not cfg.resume:
        print(f"using the vocabulary {vocab} of an earlier run (delete it to train a new one)", file=sys.stderr)
    print(f"preparing --data {cfg.data} into {cache} (once: later runs and --resume reuse it)", file=sys.stderr)
    prepare(cfg.data, cache, vocab=vocab if vocab.exists() else None, vocab_size=cfg.vocab_size,
            temperature=cfg.temperature, held_out=cfg.eval_sentences, seed=cfg.seed, workers=max(cfg.workers, 1),
            overwrite=True)  # fmt: skip
    if not vocab.exists():  # the vocabulary trained: OUT/vocab.model, kept for later runs (as before)
        for suffix in (".vocab", ".model"):  # (the model last: a complete vocabulary appears at once)
            made = (cache / "vocab").with_suffix(suffix)
            if made.is_file():
                write_atomically(vocab.with_suffix(suffix), lambda tmp, made=made: shutil.copyfile(made, tmp))
