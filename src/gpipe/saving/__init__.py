"""Checkpoints of a pipeline that load into any number of stages, stored with
``torch.distributed.checkpoint`` (DCP).

Every layer's parameters and buffers are saved under the layer's *global* index (``model.12.weight``
is the weight of the model's layer 12, whichever stage and rank held it), and an optimizer's state
under the global name of its parameter (``optimizer.state.12.weight.exp_avg``). A checkpoint saved
with K stages, in one process or under torchrun, therefore loads into a run with another K, or into
the single-process front ends; an optimizer over the new layout's parameters takes the very update
the uninterrupted run would have taken.

Layout of a checkpoint directory::

    ckpt/
      latest                  the name of the newest complete checkpoint
      step-00000100/
        .metadata             DCP's index: every entry's key, dtype and shape, and where its bytes are
        __0_0.distcp          the entries of rank 0 (one data file per writing rank)
        __1_0.distcp
        manifest.json         gpipe's: format, step, number of layers, optimizer class; written last
        run.json              files given by ``extra=``, if any (gpipe train: run.json, scheduler.json)

The entries (DCP's keys)::

    model.<layer>.<name>                      tensor: a parameter or buffer of the layer (its state_dict name)
    optimizer.state.<layer>.<param>.<key>     the optimizer's state of parameter <layer>.<param>: a
                                              tensor (``exp_avg``, ``step``...), or another value, pickled
    optimizer.param_groups.<layer>.<param>    the hyper-parameters of that parameter's group (lr, betas...), pickled

Why DCP: it is PyTorch's format for checkpoints of distributed training. Every rank writes its own
entries, in parallel, into a file of its own; rank 0 writes one index of all of them. A reader plans
from that index and reads only the entries it asks for, from the files that hold them: a rank of a
run with 4 stages reads its layers only, whichever of the files of a run with 2 stages hold them.
Other tools read the format (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` makes
one torch.save file of it). The hyper-parameters are kept per parameter, as in DCP's own flattened
optimizer state dicts: the optimizer's groups are a layout's, a parameter's name is not.

What stays of gpipe's earlier format (one torch.save file per stage, listed by the manifest): the
step folders, ``latest``, the atomic replacement of a folder, and ``manifest.json``, which now names
the format instead of listing files. DCP's ``.metadata`` could carry the same facts, but the manifest
is readable without unpickling anything, and it is written last, after every rank's entries and
extra files are in: it is what makes a folder complete. Folders of the earlier format are not read
(:class:`CheckpointError` says so).

Saving. A save replaces a step's whole folder at once. It builds the new folder under a temporary
sibling name (``.step-00000100.tmp``): rank 0 prepares it, every rank writes its ``extra`` files
there, DCP writes every rank's entries (only the first data-parallel replica's: the others hold
the same tensors, and contribute nothing), then rank 0 writes the manifest, swaps the folder into
place and rewrites ``latest``. The swap exchanges the two folders atomically (Linux
``renameat2(RENAME_EXCHANGE)``); where that is not available, the old folder is first renamed aside
to ``.step-00000100.old``, which :func:`latest` falls back to, and removed once the new folder is in
place. At every instant a crash therefore leaves the previous checkpoint loadable, ``latest`` names
only complete folders, and no file of an earlier save of the same step survives in the new one.
The next save into the directory removes what a killed save left behind (temporary files and
folders); loading never changes the directory, so it is safe while another process saves.

Asynchronous saves. ``save(..., asynchronous=True)`` copies this rank's entries into CPU memory (so
that training may change the weights and the optimizer state at once: the checkpoint holds them as
they were at the call), writes the ``extra`` files, and returns an :class:`AsyncSave`; a thread of
its own then runs DCP's write and, once every rank's write is complete, the commit (manifest, swap,
``latest``). A checkpoint thus appears in ``latest`` only when it is complete, whether or not anyone
waits for it. ``AsyncSave.wait()`` returns its folder or raises its error; a later save first waits
for the one under way, and raises its error if no one has seen it. The copy costs this rank's state
(model and optimizer) once more in CPU memory: its buffers are kept for the next asynchronous save
of the same pipeline, since copying into memory already mapped is several times faster than into new
memory (98 MiB: 7 ms against 70 ms on a small VM, where a synchronous save took 80 ms). The write
then shares the CPU with training: worth it where the CPU has room to spare (a GPU's host) or the
storage is slow. (``dcp.async_save`` is DCP's thread around ``dcp.save``; gpipe runs ``dcp.save`` in
a thread of its own instead, since the commit must follow the write, and copies first, so that every
rank knows every copy succeeded before any rank starts writing: a rank that failed to copy would
otherwise leave the others waiting in DCP's collectives.)

Under torch.distributed every rank calls :func:`save`; the collectives of a save (DCP's and the
agreement of the ranks before the commit) run over a gloo process group of their own, made at the
first save, so that a write in the background never interleaves with a training step's collectives.
A rank that dies stops the others' save at once (its connections close), one that hangs after
30 minutes. :func:`load` is local: each process reads the entries of its own layers (and of its
optimizer's parameters), with no collective.

A full disk raises :class:`NoSpaceError` naming the file, and leaves no partial files; a corrupt or
incomplete checkpoint, or one of another model's shape, raises :class:`CheckpointError` naming the
file (and the layer) and what is wrong; loading checks everything before it changes the model or
the optimizer. DCP's index and the entries that are not tensors are pickles: load checkpoints you
trust, as with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import functools
import json
import os
import re
import shutil
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.engine import Engine
from gpipe.runtime.stage import Stage

if TYPE_CHECKING:
    import io

    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "NoSpaceError",
    "latest",
    "layer_state",
    "load",
    "load_module",
    "save",
    "write_atomically",
]

LATEST = "latest"
MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's index
FORMAT = "gpipe-dcp-1"
"""The manifest's ``format``: DCP entries keyed as this module's docstring says."""

MODEL = "model."
STATE = "optimizer.state."
GROUPS = "optimizer.param_groups."

_STEP = re.compile(r"step-\d{8,}")
_DATA = re.compile(r"__\d+_\d+\.distcp")  # DCP's data files
_OLD_LAYERS = re.compile(r"layers-\d{5,}-\d{5,}\.pt")  # the earlier format's
_TEMP_FILE = re.compile(r"\..+\.tmp-\d+")  # write_atomically's temporary files
_TEMP_ROOT = re.compile(r"\.(step-\d{8,}\.tmp|latest\.tmp-\d+)")  # save's staging folders, latest's temporaries
_WRITER_FAILED = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed", re.IGNORECASE)
_NEARLY_FULL = 16 << 20  # a writer that fails with less free space than this ran out of it
_GROUP_TIMEOUT = timedelta(minutes=30)  # how long a rank waits for another in a save's collectives


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: corrupt, incomplete, or of another model's shape."""


class NoSpaceError(OSError):
    """A checkpoint could not be written for lack of space (``errno.ENOSPC`` or ``errno.EDQUOT``)."""


def _engine(model: nn.Module) -> Engine:
    from gpipe.gpipe import GPipe
    from gpipe.pipeline import Pipeline

    if not isinstance(model, (Pipeline, GPipe)):
        raise TypeError(f"expected a gpipe.Pipeline or gpipe.GPipe, got {type(model).__name__}")
    return model.engine


def _stages(model: nn.Module) -> list[Stage]:
    return _engine(model).stages


def _layers(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    for stage in _stages(model):
        for j, layer in enumerate(stage.module):
            yield stage.first + j, layer


def layer_state(model: nn.Module) -> dict[str, Tensor]:
    """This process's layers' parameters and buffers, keyed ``"<global layer index>.<name>"``."""
    return {f"{i}.{name}": t.detach() for i, layer in _layers(model) for name, t in layer.state_dict().items()}


def _parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """The global names (``"12.weight"``) of this process's parameters, by ``id``."""
    names: dict[int, list[str]] = {}
    for i, layer in _layers(model):
        for name, p in layer.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(f"{i}.{name}")
    return names


def _optimizer_kind(optimizer: torch.optim.Optimizer | None) -> str | None:
    return None if optimizer is None else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _optimizer_params(
    model: nn.Module, optimizer: torch.optim.Optimizer, packed: Mapping[str, Any]
) -> list[list[tuple[int, list[str]]]]:
    """For each of ``optimizer``'s groups: its parameters' indices in ``packed`` (its state_dict)
    with their global names."""
    names = _parameter_names(model)
    groups = []
    for group, saved in zip(optimizer.param_groups, packed["param_groups"], strict=True):
        members = []
        for p, index in zip(group["params"], saved["params"], strict=True):
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is none of the parameters "
                    "of this process's layers: a checkpoint keys optimizer state by the layers' parameter names"
                )
            members.append((index, names[id(p)]))
        groups.append(members)
    return groups


def _hyper_parameters(group: Mapping[str, Any]) -> dict[str, Any]:
    # param_names (an optimizer over named_parameters) are this layout's names: not saved, kept on load
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _entries(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This process's DCP entries: its layers' state, and its optimizer's by parameter name."""
    entries: dict[str, Any] = {
        f"{MODEL}{i}.{name}": t.detach() if isinstance(t, Tensor) else t
        for i, layer in _layers(model)
        for name, t in layer.state_dict().items()
    }
    if optimizer is None:
        return entries
    packed = optimizer.state_dict()
    for members, saved in zip(_optimizer_params(model, optimizer, packed), packed["param_groups"]):
        hyper = _hyper_parameters(saved)
        for index, names in members:
            for name in names:
                entries[f"{GROUPS}{name}"] = hyper
                for key, value in packed["state"].get(index, {}).items():
                    entries[f"{STATE}{name}.{key}"] = value.detach() if isinstance(value, Tensor) else value
    return entries


_buffers: tuple[weakref.ref[Engine], dict[str, Tensor]] | None = None
"""The CPU buffers of the last asynchronous save, and its pipeline's engine: the next one copies
into them (free of the page faults of new memory: several times faster)."""


def _forget_buffers(engine: weakref.ref[Engine]) -> None:
    global _buffers
    if _buffers is not None and _buffers[0] is engine:  # its pipeline is gone
        _buffers = None


def _stage(engine: Engine, entries: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``entries`` in CPU memory, which later changes to the model do not reach: into the
    buffers of the previous asynchronous save of ``engine``'s pipeline, which is over (every save
    waits for the one before), where the shapes and dtypes are the same."""
    global _buffers
    if _buffers is None or _buffers[0]() is not engine:
        _buffers = (weakref.ref(engine, _forget_buffers), {})
    buffers = _buffers[1]
    staged: dict[str, Any] = {}
    memo: dict[int, Any] = {}
    for key, value in entries.items():
        if not isinstance(value, Tensor):
            staged[key] = copy.deepcopy(value, memo)
            continue
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = buffers[key] = torch.empty_like(value, device="cpu")
        staged[key] = buffer.copy_(value.detach())
    for key in buffers.keys() - staged.keys():
        del buffers[key]
    return staged


# Writing.


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _write_error(path: Path, error: BaseException) -> BaseException:
    """``error``, raised while writing ``path``, as a clear error where it means the disk is full."""
    if isinstance(error, NoSpaceError):
        return error
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        why = "disk quota exceeded" if error.errno == errno.EDQUOT else error.strerror or "write failed"
        return NoSpaceError(
            errno.ENOSPC, f"no space left on device: {path} could not be written ({why}); free space and save again"
        )
    if isinstance(error, RuntimeError) and _WRITER_FAILED.search(str(error)):
        # torch's writer, given a path, reports a failed write without its errno.
        free = _free_bytes(path.parent)
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        if free is not None and free < _NEARLY_FULL:
            return NoSpaceError(
                errno.ENOSPC,
                f"no space left on device: {path} could not be written ({free} bytes free; torch: {first}); "
                "free space and save again",
            )
        return OSError(errno.EIO, f"writing {path} failed midway ({free} bytes free; torch: {first})")
    return error


def _fsync_dir(directory: Path) -> None:
    """Make the directory's entries (files created, renamed or removed in it) durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # not every platform or file system syncs directories
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Any) -> None:
    """Call ``write(temporary_path)``, make it durable, then rename it to ``path``: readers see the
    old file or the complete new one, never a half-written one. A full disk raises
    :class:`NoSpaceError` naming ``path``; the temporary file is removed whatever happens."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        try:
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:
            clear = _write_error(path, e)
            if clear is e:
                raise
            raise clear from e
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _aside(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def _complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def _exchange(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` in one atomic step; False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), ctypes.c_uint(rename_exchange)) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # a file system (or kernel) without RENAME_EXCHANGE
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def _recover(target: Path) -> None:
    """Finish what a save killed during the fallback swap left: put a complete old folder back in
    place if the new one never got there, or drop it if the new one did."""
    aside = _aside(target)
    if not aside.exists():
        return
    if _complete(target):
        _remove(aside)
    elif not target.exists() and _complete(aside):
        os.rename(aside, target)
    elif not _complete(aside):
        _remove(aside)
    # else: ``target`` is incomplete and ``aside`` complete; the swap drops ``aside`` once it is replaced


def _clean(root: Path) -> None:
    """Remove what killed saves left behind: staging folders and temporary files."""
    for entry in list(root.iterdir()):
        if _TEMP_ROOT.fullmatch(entry.name):
            _remove(entry)
        elif _STEP.fullmatch(entry.name) and entry.is_dir():
            _recover(entry)
            for child in list(entry.iterdir()):
                if _TEMP_FILE.fullmatch(child.name):
                    _remove(child)
        elif entry.name.startswith(".") and entry.name.endswith(".old") and _STEP.fullmatch(entry.name[1:-4]):
            _recover(root / entry.name[1:-4])


def _owned(name: str) -> bool:
    """A file of the checkpoint itself (of this format or the earlier one), or a temporary one."""
    return (
        name == MANIFEST
        or name.startswith(METADATA)
        or any(p.fullmatch(name) for p in (_DATA, _OLD_LAYERS, _TEMP_FILE))
    )


def _prepare(root: Path, target: Path, staging: Path, carry: bool) -> None:
    """Rank 0, every rank waiting: clean up, create the staging folder and, unless ``carry`` is
    False, carry into it the files of ``target`` that are not the checkpoint's own (another writer's
    files, written there just before the save)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean(root)
        _recover(target)
        staging.mkdir()
        for entry in list(target.iterdir()) if carry and target.is_dir() else []:
            if _owned(entry.name):
                continue
            if entry.is_dir():
                shutil.copytree(entry, staging / entry.name)
                continue
            try:
                os.link(entry, staging / entry.name)  # the same file, no copy: it is replaced, never changed
            except OSError:
                shutil.copy2(entry, staging / entry.name)
    except OSError as e:
        clear = _write_error(staging, e)
        if clear is e:
            raise
        raise clear from e


def _commit(root: Path, target: Path, staging: Path, manifest: dict[str, Any]) -> None:
    """Rank 0, every rank's files written: complete the staging folder, swap it in, point ``latest``
    at it, then remove the old folder."""
    write_atomically(staging / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1)))
    _fsync_dir(staging)
    aside = _aside(target)
    if not target.exists():
        os.rename(staging, target)
        old = None
    elif _exchange(staging, target):
        old = staging  # now holds the old folder
    else:
        if _complete(target):
            os.rename(target, aside)  # ``latest`` falls back to it until the new folder is in place
        else:
            _remove(target)  # incomplete: nothing loadable is lost
        try:
            os.rename(staging, target)
        except BaseException:
            if not target.exists() and aside.exists():
                os.rename(aside, target)
            raise
        old = aside
    _fsync_dir(root)
    write_atomically(root / LATEST, lambda p: p.write_text(target.name))
    if old is not None:
        _remove(old)
    if aside.exists():
        _remove(aside)


# The ranks' agreement.

_group_lock = threading.Lock()
_group_of_world: tuple[Any, Any] | None = None  # (the default group, the checkpoints' group)


def _group(model: nn.Module) -> Any:
    """The process group of the checkpoint collectives (None in one process): gloo, over every rank,
    made at the first save (a collective: every rank saves)."""
    global _group_of_world
    if not _engine(model).placement.is_distributed:
        return None
    world = dist.group.WORLD
    with _group_lock:
        if _group_of_world is None or _group_of_world[0] is not world:
            _group_of_world = (world, dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT))
        return _group_of_world[1]


def _run(what: Callable[[], Any] | None) -> tuple[Any, BaseException | None]:
    if what is None:
        return None, None
    try:
        return what(), None
    except Exception as e:
        return None, e


Report = tuple[int | None, str, str]


def _report(error: BaseException) -> Report:
    code = error.errno if isinstance(error, OSError) else None
    text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return code, text, type(error).__name__


def _failed_on(rank: int, report: Report) -> BaseException:
    """The error that ranks other than ``rank`` raise when it failed."""
    code, message, kind = report
    text = f"checkpoint not saved: rank {rank} failed: {kind}: {message}"
    if code == errno.ENOSPC and kind == NoSpaceError.__name__:
        return NoSpaceError(errno.ENOSPC, f"{message} (on rank {rank})")
    return OSError(code, text) if code is not None else RuntimeError(text)


def _agree(group: Any, value: Any, error: BaseException | None) -> list[Any]:
    """Every rank's ``value``, once every rank got here; raises on every rank if one failed: the
    failing rank its own error, the others one naming it."""
    report = None if error is None else _report(error)
    if group is not None:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (value, report), group=group)
    else:
        gathered = [(value, report)]
    if error is not None:
        raise error
    for rank, (_, failed) in enumerate(gathered):
        if failed is not None:
            raise _failed_on(rank, failed)
    return [v for v, _ in gathered]


# DCP, imported at the first save or load (it takes most of a second).


@functools.cache
def _dcp_io() -> tuple[Callable[[Path], FileSystemWriter], Callable[[Path, Metadata | None], FileSystemReader]]:
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
    from torch.futures import Future

    class WritingFiles(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
            try:
                with super().create_stream(path, mode) as stream:
                    yield stream
            except (OSError, RuntimeError) as e:
                clear = _write_error(Path(path), e)
                if clear is e:
                    raise
                raise clear from e

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

        def __init__(self, path: Path) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.fs = WritingFiles()

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


def _dcp_save(entries: dict[str, Any], staging: Path, group: Any) -> None:
    """DCP's save of every rank's ``entries`` into ``staging`` (a collective of ``group``); raises the
    same failure on every rank: the failing rank its own error, the others one naming it."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    writer, _ = _dcp_io()
    _quiet()
    try:
        dcp_save(
            entries,
            storage_writer=writer(staging),
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


class AsyncSave:
    """A checkpoint that :func:`save` writes in the background (``asynchronous=True``): its step and
    folder, :meth:`done` and :meth:`wait`. The checkpoint appears in ``latest`` once it is complete,
    whether or not anyone waits for it. (Under torch.distributed, wait before destroying the process
    group: the write and the commit use it.)"""

    def __init__(self, step: int, path: Path, work: Callable[[], None]) -> None:
        self.step = step
        self.path = path
        """The checkpoint's folder, once committed."""
        self._error: BaseException | None = None
        self._seen = False
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"gpipe-save-{path.name}")

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # kept for wait(): the thread itself has no one to tell
            self._error = e

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error is not None else "done"
        return f"<AsyncSave of step {self.step} into {str(self.path)!r}: {state}>"

    def done(self) -> bool:
        """Whether the save is over: committed, or failed."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait until the checkpoint is written and committed (at most ``timeout`` seconds: then
        :class:`TimeoutError`); return its folder, or raise what made the save fail."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the checkpoint of step {self.step} is still being written after {timeout} s")
        if self._error is not None:
            self._seen = True
            raise self._error
        return self.path


_under_way: list[AsyncSave] = []  # at most one: each save waits for the one before


def _wait_for_the_last_save() -> None:
    if not _under_way:
        return
    last = _under_way.pop()
    last._thread.join()
    if last._error is not None and not last._seen:
        last._seen = True
        last._error.add_note(f"(in the asynchronous save of step {last.step}, which a later save waited for)")
        raise last._error


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
    no one has seen it)."""
    _wait_for_the_last_save()
    engine = _engine(model)
    group = _group(model)
    extra = dict(extra or {})
    root = Path(directory)
    target = root / f"step-{step:08d}"
    staging = root / f".{target.name}.tmp"
    leader = group is None or dist.get_rank(group) == 0
    writes = engine.comm.dp_rank == 0  # data-parallel replicas hold the same layers

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
            _dcp_save(staged, staging, group)
        except BaseException:
            if leader:  # every rank is past the write: DCP told them all
                _remove(staging)
            raise

        def commit() -> None:
            try:
                _commit(root, target, staging, manifest)
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


# Reading.


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``directory``, if any."""
    root = Path(directory)
    pointer = root / LATEST
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{pointer}: unreadable ({e})") from e
    if not _STEP.fullmatch(name):
        raise CheckpointError(f"{pointer}: names {name[:80]!r}, not a step-* checkpoint folder")
    target = root / name
    if _complete(target):
        return target
    aside = _aside(target)  # a save was swapping it, or was killed while it did
    return aside if _complete(aside) else None


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:  # not UTF-8, or not JSON
        raise CheckpointError(f"{path}: not a checkpoint manifest: not JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a checkpoint manifest: expected a JSON object, got {type(data).__name__}")
    if "format" not in data and "files" in data:
        raise CheckpointError(
            f"{path}: a checkpoint of gpipe's earlier format (a torch.save file per stage: "
            f"{data['files']!r:.120}), which this version does not read; load it with the gpipe that saved it "
            "and save it again with this one"
        )
    for key, kind in (("format", str), ("step", int), ("num_layers", int)):
        if key not in data:
            raise CheckpointError(f"{path}: not a checkpoint manifest: lacks {key!r}")
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise CheckpointError(
                f"{path}: {key!r} should be a{'n integer' if kind is int else ' string'}, got {data[key]!r:.80}"
            )
    if data["format"] != FORMAT:
        raise CheckpointError(f"{path}: a checkpoint of format {data['format']!r:.80}; this version reads {FORMAT!r}")
    if not isinstance(data.get("optimizer"), (str, type(None))):
        raise CheckpointError(f"{path}: 'optimizer' should be a class name or null, got {data['optimizer']!r:.80}")
    return data


def _read_metadata(target: Path, num_layers: int) -> tuple[Metadata, dict[str, Path]]:
    """DCP's index of checkpoint ``target``, checked, and the data file of each entry."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = target / METADATA
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, though {target / MANIFEST} says the checkpoint is complete")
    _, reader = _dcp_io()
    try:
        metadata = reader(target, None).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable (truncated or corrupt?): {_brief(e)}") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: not DCP's index of a checkpoint (a {type(metadata).__name__})")
    for key in metadata.state_dict_metadata:
        if not isinstance(key, str) or not key.startswith((MODEL, STATE, GROUPS)):
            raise CheckpointError(f"{path}: holds {key!r:.80}, not an entry of a gpipe checkpoint")
        if key.startswith(MODEL):
            index, _, rest = key[len(MODEL) :].partition(".")
            if not index.isdigit() or not rest:
                raise CheckpointError(f"{path}: holds {key!r:.80}, not a 'model.<layer>.<name>' entry")
            if int(index) >= num_layers:
                raise CheckpointError(f"{path}: holds {key!r:.80} of layer {index}, of a model of {num_layers} layers")
    files: dict[str, Path] = {}
    for index, where in (metadata.storage_data or {}).items():
        name = getattr(where, "relative_path", None)
        if not isinstance(name, str) or not name or name != Path(name).name or name.startswith("."):
            raise CheckpointError(
                f"{path}: places {getattr(index, 'fqn', index)!r:.80} in {name!r:.80}, not a file of it"
            )
        files.setdefault(getattr(index, "fqn", ""), target / name)
    return metadata, files


def _same(a: Any, b: Any) -> bool:
    """Whether two hyper-parameter values are identical (tensors bitwise)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _template(md: Any) -> Any:
    """Where DCP reads an entry of metadata ``md``: a tensor of its shape and dtype, or None (a pickle)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None


class _OptimizerLoad:
    """What to read of a checkpoint for ``optimizer``, and its state dict once read."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata, target: Path) -> None:
        self.packed = optimizer.state_dict()
        self.target = target
        self.groups = _optimizer_params(model, optimizer, self.packed)
        saved = metadata.state_dict_metadata
        local = {name for members in self.groups for _, names in members for name in names}
        self.keys: dict[str, list[str]] = {name: [] for name in local}
        for key in saved:
            if not key.startswith(STATE):
                continue
            rest = key[len(STATE) :]
            for at in (i for i, c in enumerate(rest) if c == "."):  # the parameter's name ends at a dot
                if rest[:at] in local:
                    self.keys[rest[:at]].append(rest[at + 1 :])
                    break
        self.template: dict[str, Any] = {}
        self.chosen: list[list[tuple[int, str]]] = []
        for members in self.groups:
            chosen = []
            for index, names in members:
                name = next((n for n in names if f"{GROUPS}{n}" in saved), None)
                if name is None:
                    raise CheckpointError(
                        f"checkpoint {str(target)!r} holds no optimizer state of parameter {names[0]!r}: "
                        "the optimizer saved did not hold it"
                    )
                chosen.append((index, name))
                self.template[f"{GROUPS}{name}"] = None
                for key in self.keys[name]:
                    self.template[f"{STATE}{name}.{key}"] = _template(saved[f"{STATE}{name}.{key}"])
            self.chosen.append(chosen)

    def state_dict(self, read: Mapping[str, Any]) -> dict[str, Any]:
        state: dict[Any, Any] = {}
        groups = []
        for g, (chosen, packed) in enumerate(zip(self.chosen, self.packed["param_groups"])):
            hyper: dict[str, Any] | None = None
            first = ""
            for index, name in chosen:
                value = read[f"{GROUPS}{name}"]
                if not isinstance(value, dict):
                    raise CheckpointError(
                        f"checkpoint {str(self.target)!r}: {GROUPS}{name} should be a dict of hyper-parameters, "
                        f"got a {type(value).__name__}"
                    )
                if hyper is None:
                    hyper, first = value, name
                elif not _same(value, hyper):
                    raise CheckpointError(
                        f"checkpoint {str(self.target)!r}: the optimizer's param group {g} holds parameters "
                        f"saved with other hyper-parameters ({first!r}: {hyper}; {name!r}: {value}); group the "
                        "parameters as when the checkpoint was saved"
                    )
                if self.keys[name]:
                    state[index] = {key: read[f"{STATE}{name}.{key}"] for key in self.keys[name]}
            group = dict(packed) if hyper is None else {**hyper, "params": packed["params"]}
            if "param_names" in packed:
                group["param_names"] = packed["param_names"]
            groups.append(group)
        return {"state": state, "param_groups": groups}


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


def _shape(t: Tensor | Any) -> str:
    return str(tuple(t.shape if isinstance(t, Tensor) else t.size))


def load(model: nn.Module, directory: str | os.PathLike[str], *, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load the newest complete checkpoint of ``directory`` (or a ``step-*`` directory itself) into
    ``model``'s layers, whatever the number of stages it was saved with, and into ``optimizer`` (over
    parameters of this process's layers) its saved state and hyper-parameters. Returns its step.

    Raises :class:`CheckpointError` (a ValueError) naming the file, and the layer, where the
    checkpoint is corrupt, incomplete or of another shape than the model, or lacks the optimizer
    state asked for; nothing is changed then."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    target = _checkpoint_folder(directory)
    manifest = _read_manifest(target / MANIFEST)
    num_layers = sum(_engine(model).balance)
    if manifest["num_layers"] != num_layers:
        raise CheckpointError(
            f"checkpoint {str(target)!r} holds {manifest['num_layers']} layers, the model has {num_layers}"
        )
    if optimizer is not None:
        saved_kind, kind = manifest.get("optimizer"), _optimizer_kind(optimizer)
        if saved_kind is None:
            raise CheckpointError(
                f"checkpoint {str(target)!r} holds no optimizer state (saved without optimizer=); "
                "load it without optimizer="
            )
        if saved_kind != kind:
            raise CheckpointError(f"checkpoint {str(target)!r} holds the state of a {saved_kind}, not of a {kind}")
    metadata, files = _read_metadata(target, num_layers)
    saved = metadata.state_dict_metadata
    template: dict[str, Any] = {}
    wanted = dict(_layers(model))
    for i, layer in wanted.items():
        expected = layer.state_dict()
        prefix = f"{MODEL}{i}."
        held = {key[len(prefix) :] for key in saved if key.startswith(prefix)}
        where = next((files[prefix + k] for k in sorted(held) if prefix + k in files), target)
        missing = sorted(set(expected) - held)
        if missing:
            raise CheckpointError(f"checkpoint {str(where)!r} lacks {[f'{i}.{k}' for k in missing]} of layer {i}")
        unexpected = sorted(held - set(expected))
        if unexpected:
            raise CheckpointError(
                f"checkpoint {str(where)!r} holds {[f'{i}.{k}' for k in unexpected]}, which the model's layer {i} "
                f"({type(layer).__name__}) lacks"
            )
        for key, value in expected.items():
            md = saved[prefix + key]
            where = files.get(prefix + key, target)
            if isinstance(value, Tensor) != isinstance(md, TensorStorageMetadata):
                raise CheckpointError(
                    f"checkpoint layer {i} ({f'{i}.{key}'!r}, {type(layer).__name__}) in {str(where)!r}: saved "
                    f"{'a tensor' if isinstance(md, TensorStorageMetadata) else 'an object'}, the model's is "
                    f"{'a tensor' if isinstance(value, Tensor) else 'not'}"
                )
            if isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(value.shape):
                raise CheckpointError(
                    f"checkpoint layer {i} ({f'{i}.{key}'!r}, {type(layer).__name__}) in {str(where)!r}: "
                    f"saved shape {_shape(md)}, model's {_shape(value)}"
                )
            template[prefix + key] = _template(md)
    plan = None if optimizer is None else _OptimizerLoad(model, optimizer, metadata, target)
    if plan is not None:
        template.update(plan.template)
    _dcp_load(template, target, metadata)
    if plan is not None and optimizer is not None:  # first: the likelier to refuse what it is given
        optimizer.load_state_dict(plan.state_dict(template))
    for i, layer in wanted.items():
        prefix = f"{MODEL}{i}."
        layer.load_state_dict({key: template[prefix + key] for key in layer.state_dict()})
    return int(manifest["step"])


def _checkpoint_folder(directory: str | os.PathLike[str]) -> Path:
    path = Path(directory)
    target = path if _complete(path) else latest(path)
    if target is None:
        raise FileNotFoundError(f"no complete checkpoint in {str(directory)!r} (no {LATEST} or {MANIFEST})")
    return target


def load_module(module: nn.Module, directory: str | os.PathLike[str]) -> int:
    """Load the newest checkpoint of ``directory`` (or a ``step-*`` folder) into the plain,
    unpipelined model the pipeline was cut from; returns its step. The entries map to the module's
    own names: an ``nn.Sequential``'s by layer index (``model.12.weight`` is ``12.weight``); a
    module given to :func:`gpipe.to_sequential` (a Hugging Face model, say) by the qualified names
    its layers kept (``model.3.transformer.h.2.attn.c_attn.weight`` is
    ``transformer.h.2.attn.c_attn.weight``; a tied parameter, held by two layers, is both of its
    names). Every entry of the module must be in the checkpoint and every model entry of the
    checkpoint in the module, with its shape: else :class:`CheckpointError`, naming them, and the
    module is left unchanged. The optimizer's state is not read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    target = _checkpoint_folder(directory)
    manifest = _read_manifest(target / MANIFEST)
    metadata, _ = _read_metadata(target, manifest["num_layers"])
    saved = {key[len(MODEL) :]: md for key, md in metadata.state_dict_metadata.items() if key.startswith(MODEL)}
    expected = module.state_dict()
    if isinstance(module, nn.Sequential) and set(saved) == set(expected):
        sources = {name: [name] for name in expected}  # indices are the Sequential's own names
    else:
        sources = {}
        for key in saved:
            sources.setdefault(key.partition(".")[2], []).append(key)
    missing = sorted(set(expected) - set(sources))
    unexpected = sorted(set(sources) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(target)!r} does not match the {type(module).__name__}: it lacks {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} and holds {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
            "(load_module takes the nn.Sequential, or the module given to to_sequential, the pipeline was cut from)"
        )
    template: dict[str, Any] = {}
    for name, keys in sources.items():
        for key in keys:
            md = saved[key]
            value = expected[name]
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(value.shape):
                raise CheckpointError(
                    f"checkpoint {str(target)!r}: {MODEL}{key} is saved as {_shape(md)}, the module's {name!r} is "
                    f"{_shape(value)}"
                )
            template[MODEL + key] = _template(md)
    _dcp_load(template, target, metadata)
    state = {}
    for name, keys in sources.items():
        first = template[MODEL + keys[0]]
        for other in keys[1:]:  # a parameter several layers hold: one value
            if not torch.equal(first, template[MODEL + other]):
                raise CheckpointError(
                    f"checkpoint {str(target)!r}: layers hold different values of {name!r} ({MODEL}{keys[0]}, "
                    f"{MODEL}{other})"
                )
        state[name] = first
    module.load_state_dict(state)
    return int(manifest["step"])
