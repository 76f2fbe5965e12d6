"""The save of a checkpoint: :func:`save`, every rank's part in it, synchronous or asynchronous."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn

from gpipe.saving.asynchronous import AsyncSave, _stage, _under_way, _wait_for_the_last_save
from gpipe.saving.checksums import ALGORITHM, FILES, _digest
from gpipe.saving.collective import _agree, _group, _run
from gpipe.saving.dcp import _dcp_save
from gpipe.saving.folders import _commit, _owned, _prepare, _remove, write_atomically
from gpipe.saving.keys import FORMAT, _engine, _entries, _optimizer_kind

__all__ = ["save"]


@overload
def save(
    model: nn.Module,
    directory: str | os.PathLike[str],
    step: int,
    *,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: Mapping[str, Callable[[Path], object]] | None = ...,
    asynchronous: Literal[False] = ...,
) -> Path: ...


@overload
def save(
    model: nn.Module,
    directory: str | os.PathLike[str],
    step: int,
    *,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: Mapping[str, Callable[[Path], object]] | None = ...,
    asynchronous: Literal[True],
) -> AsyncSave: ...


@overload
def save(
    model: nn.Module,
    directory: str | os.PathLike[str],
    step: int,
    *,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: Mapping[str, Callable[[Path], object]] | None = ...,
    asynchronous: bool,
) -> Path | AsyncSave: ...


def save(
    model: nn.Module,
    directory: str | os.PathLike[str],
    step: int,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Callable[[Path], object]] | None = None,
    asynchronous: bool = False,
) -> Path | AsyncSave:
    """Save ``model``'s layers (and ``optimizer``'s state, keyed by parameter name) as checkpoint
    ``step`` in ``directory``, replacing any earlier save of that step as a whole; under
    torch.distributed every rank calls it, and each saves its own stages. Returns the checkpoint's
    directory; with ``asynchronous=True``, once this rank's state is copied, an :class:`AsyncSave`.

    ``optimizer``: over parameters of this process's layers (``pipe.parameters()``, or some of them).
    ``extra`` maps more file names to functions writing them (``write(path)``), written by this rank
    into the new folder, before this function returns, so that they appear with the state at once.
    Without ``extra``, the files of an earlier folder of this step that are not the checkpoint's own
    are carried over. A save waits for an asynchronous one under way first (and raises its error if
    no one has seen it).

    The manifest lists every file the save wrote with its size and SHA-256 (``"files"``), which
    :func:`load` and :func:`verify` check: each rank hashes its data file as it writes it (no second
    read), the small files (DCP's index, ``extra``'s) once written; rank 0 gathers them all."""
    _wait_for_the_last_save()
    engine = _engine(model)
    group = _group(model)
    extra = dict(extra or {})
    root = Path(directory)
    target = root / f"step-{step:08d}"
    staging = root / f".{target.name}.tmp"
    leader = group is None or dist.get_rank(group) == 0
    # Data-parallel replicas hold the same layers; sharded ones (fsdp) each hold a part of them, and the
    # first expert-parallel group's replicas each a part of the experts (DCP keeps one copy of the rest).
    writes = engine.comm.dp_rank < engine.comm.expert_parallel or engine.sharding is not None

    # Every rank is here (its files of this step, if any, are written): rank 0 prepares the folder.
    entries, error = _run(lambda: _entries(model, optimizer) if writes else {})
    kinds = _agree(group, _optimizer_kind(optimizer), error)
    if len(set(kinds)) > 1:
        raise ValueError(f"checkpoint not saved: the ranks' optimizers differ (by rank: {kinds})")
    _agree(group, None, _run((lambda: _prepare(root, target, staging, carry=not extra)) if leader else None)[1])

    def write_extra() -> dict[str, Any]:
        for name in extra:  # checked here, where a rank's error reaches every rank
            if not name or name != Path(name).name or name.startswith(".") or _owned(name):
                raise ValueError(f"extra file name {name!r}: a plain file name other than the checkpoint's own")
        for name, write in extra.items():
            write_atomically(staging / name, write)
        return _stage(engine, entries) if asynchronous else entries

    staged, error = _run(write_extra)
    try:
        _agree(group, None, error)
    except BaseException:
        if leader:
            _remove(staging)
        raise
    manifest = {"format": FORMAT, "step": step, "num_layers": sum(engine.balance), "optimizer": kinds[0]}

    def write_and_commit() -> None:
        try:
            written = _dcp_save(staged, staging, group)
            # This rank's extra files, hashed once every rank is past the write (small: read once).
            hashed, error = _run(lambda: written | {name: _digest(staging / name) for name in extra})
            listed = _agree(group, hashed, error)
        except BaseException:
            if leader:  # every rank is past the write: DCP (or the agreement) told them all
                _remove(staging)
            raise
        files = {name: {ALGORITHM: digest, "bytes": size} for each in listed for name, (digest, size) in each.items()}

        def commit() -> None:
            try:
                _commit(root, target, staging, manifest | {FILES: dict(sorted(files.items()))})
            except BaseException:
                _remove(staging)
                raise

        _agree(group, None, _run(commit if leader else None)[1])

    if not asynchronous:
        write_and_commit()
        return target
    handle = AsyncSave(step, target, write_and_commit)
    _under_way.append(handle)
    handle._thread.start()
    return handle
