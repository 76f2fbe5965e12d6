"""torch.distributed.checkpoint's reader and writer as gpipe uses them (naming the file that could
not be read or written; the writer taking each file's checksum as it writes it), and its save (a
collective of every rank) and load (local)."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from gpipe.saving.checksums import _Hashing
from gpipe.saving.collective import _failed_on, _report
from gpipe.saving.folders import METADATA, CheckpointError, _clear_errors

if TYPE_CHECKING:
    import io

    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

__all__ = ["Digests", "_brief", "_dcp_io", "_dcp_load", "_dcp_save"]

# DCP, imported at the first save or load (it takes most of a second).


Digests = dict[str, tuple[str, int]]  # a file's name: (its hex digest, its bytes)


@functools.cache
def _dcp_io() -> tuple[
    Callable[[Path, Digests], FileSystemWriter], Callable[[Path, Metadata | None], FileSystemReader]
]:
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
    from torch.futures import Future

    class WritingFiles(FileSystem):
        """Files written through a hash (``into``: each file's digest, once written, by its name;
        DCP's index, written under a temporary name then renamed, under its own)."""

        def __init__(self, into: Digests) -> None:
            super().__init__()
            self.into = into

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
            with _clear_errors(Path(path)), super().create_stream(path, mode) as stream:
                if mode != "wb":
                    yield stream
                    return
                hashing = _Hashing(stream)
                try:
                    yield hashing
                    self.into[Path(path).name] = hashing.digest()
                finally:
                    hashing.drop()

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            super().rename(path, new_path)
            if (digest := self.into.pop(Path(path).name, None)) is not None:
                self.into[Path(new_path).name] = digest

    class ReadingFiles(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
            try:
                with super().create_stream(path, mode) as stream:
                    yield stream
            except CheckpointError:
                raise
            except FileNotFoundError as e:
                index = Path(path).with_name(METADATA)
                raise CheckpointError(f"{path}: missing, though {index} lists it") from e
            except Exception as e:
                raise CheckpointError(f"{path}: unreadable (truncated or corrupt?): {_brief(e)}") from e

    class Writer(FileSystemWriter):
        """DCP's writer: one file per rank, synced; a full disk named; no file for a rank with nothing."""

        def __init__(self, path: Path, into: Digests) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.fs = WritingFiles(into)

        def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
            if not plan.items:  # a data-parallel replica but the first: nothing to write
                nothing: Future[list[WriteResult]] = Future()
                nothing.set_result([])
                return nothing
            return super().write_data(plan, planner)

    class Reader(FileSystemReader):
        """DCP's reader, naming the file it could not read; given the index already read, it does
        not read it again."""

        def __init__(self, path: Path, metadata: Metadata | None = None) -> None:
            super().__init__(path)
            self.fs = ReadingFiles()
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return self._metadata if self._metadata is not None else super().read_metadata(*args, **kwargs)

    return Writer, Reader


def _quiet() -> None:
    """Silence what dcp.save and dcp.load warn at every call without a process group (that they
    assume one process: what gpipe asks for, with no_dist=True, when it runs in one). Installed at
    each call, not once: a caller's ``warnings.catch_warnings()`` (pytest's, say) drops it."""
    warnings.filterwarnings(
        "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized", category=UserWarning
    )


def _brief(error: BaseException) -> str:
    detail = str(error).splitlines()[0][:200] if str(error) else ""
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


def _dcp_save(entries: dict[str, Any], staging: Path, group: Any) -> Digests:
    """DCP's save of every rank's ``entries`` into ``staging`` (a collective of ``group``); returns
    the digests of the files this rank wrote (its data file; rank 0 DCP's index too). Raises the
    same failure on every rank: the failing rank its own error, the others one naming it."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    writer, _ = _dcp_io()
    _quiet()
    digests: Digests = {}
    try:
        dcp_save(
            entries,
            storage_writer=writer(staging, digests),
            # the keys as given: a value that is not a tensor (a group's hyper-parameters) is one entry
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            process_group=group,
            no_dist=group is None,
        )
    except CheckpointException as e:
        rank = 0 if group is None else dist.get_rank(group)
        failures = e.failures
        if rank in failures:
            raise failures[rank][0]  # noqa: B904 - its own cause (the file's error, say)
        first = min(failures)
        raise _failed_on(first, _report(failures[first][0])) from e
    return digests


def _dcp_load(template: dict[str, Any], target: Path, metadata: Metadata) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    _, reader = _dcp_io()
    _quiet()
    try:
        dcp_load(
            template,
            storage_reader=reader(target, metadata),
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,  # each process reads its own entries
        )
    except CheckpointException as e:
        failure = next(iter(e.failures.values()))[0]
        if isinstance(failure, CheckpointError):
            raise failure  # noqa: B904 - its cause is the file's error
        raise CheckpointError(f"checkpoint {str(target)!r} could not be read: {_brief(failure)}") from e
