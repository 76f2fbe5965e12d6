"""Checkpoints of a pipeline that load into any number of stages.

Every layer's parameters and buffers are saved under its *global* index (``"12.weight"`` is the
weight of the model's layer 12, whichever stage held it), one file per stage. A checkpoint saved with
K stages therefore loads into a run with another K, or into the single-process front ends.

Layout of a checkpoint directory::

    ckpt/
      latest                      the name of the newest complete checkpoint
      step-00000100/
        layers-00000-00011.pt     one file per stage: its layers' state, by global index
        layers-00012-00023.pt
        manifest.json             step, number of layers, files

A save replaces a step's whole folder at once. It builds the new folder under a temporary sibling
name (``.step-00000100.tmp``): every rank writes its own stages' files there, then rank 0 writes the
manifest (which makes the folder complete), swaps the folder into place and rewrites ``latest``.
The swap exchanges the two folders atomically (Linux ``renameat2(RENAME_EXCHANGE)``); where that is
not available, the old folder is first renamed aside to ``.step-00000100.old``, which :func:`latest`
falls back to, and removed once the new folder is in place. At every instant a crash therefore
leaves the previous checkpoint loadable, ``latest`` names only complete folders, and no file of an
earlier save of the same step (saved with another number of stages, say) survives in the new one.
The next save into the directory removes what a killed save left behind (temporary files and
folders); loading never changes the directory, so it is safe while another process saves.

A full disk raises :class:`NoSpaceError` naming the file, and leaves no partial files; a corrupt or
incomplete checkpoint, or one of another model's shape, raises :class:`CheckpointError` naming the
file (and the layer) and what is wrong.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.engine import Engine
from gpipe.stage import Stage

__all__ = ["CheckpointError", "NoSpaceError", "latest", "layer_state", "load", "save", "write_atomically"]

LATEST = "latest"
MANIFEST = "manifest.json"

_STEP = re.compile(r"step-\d{8,}")
_LAYERS = re.compile(r"layers-(\d{5,})-(\d{5,})\.pt")
_TEMP_FILE = re.compile(r"\..+\.tmp-\d+")  # write_atomically's temporary files
_TEMP_ROOT = re.compile(r"\.(step-\d{8,}\.tmp|latest\.tmp-\d+)")  # save's staging folders, latest's temporaries
_WRITER_FAILED = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed", re.IGNORECASE)
_NEARLY_FULL = 16 << 20  # a writer that fails with less free space than this ran out of it


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


# Writing.


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _write_error(path: Path, error: BaseException) -> BaseException:
    """``error``, raised while writing ``path``, as a clear error where it means the disk is full."""
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


def _torch_save(state: object) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        with open(path, "wb") as f:  # a file object, not a path: a failed write keeps its errno
            torch.save(state, f)

    return write


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
    return name == MANIFEST or bool(_LAYERS.fullmatch(name)) or bool(_TEMP_FILE.fullmatch(name))


def _prepare(root: Path, target: Path, staging: Path, carry: bool) -> None:
    """Rank 0, every rank waiting: clean up, create the staging folder and, unless ``carry`` is
    False, carry into it the files of ``target`` that are not the checkpoint's own (another writer's
    files, such as ``gpipe train``'s optimizer state, written there just before the save)."""
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


def _is_distributed(model: nn.Module) -> bool:
    return _engine(model).placement.is_distributed


def _run(what: Callable[[], Any] | None) -> tuple[Any, BaseException | None]:
    if what is None:
        return None, None
    try:
        return what(), None
    except Exception as e:
        return None, e


def _agree(model: nn.Module, value: Any, error: BaseException | None) -> list[Any]:
    """Every rank's ``value``, once every rank got here; raises on every rank if one failed: the
    failing rank its own error, the others one naming it."""
    report = None
    if error is not None:
        code = error.errno if isinstance(error, OSError) else None
        text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        report = (code, text, type(error).__name__)
    if _is_distributed(model):
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (value, report))
    else:
        gathered = [(value, report)]
    if error is not None:
        raise error
    for rank, (_, failed) in enumerate(gathered):
        if failed is not None:
            code, message, kind = failed
            text = f"checkpoint not saved: rank {rank} failed: {kind}: {message}"
            if code == errno.ENOSPC and kind == NoSpaceError.__name__:
                raise NoSpaceError(errno.ENOSPC, f"{message} (on rank {rank})")
            raise OSError(code, text) if code is not None else RuntimeError(text)
    return [v for v, _ in gathered]


def save(
    model: nn.Module,
    directory: str | os.PathLike[str],
    step: int,
    *,
    extra: Mapping[str, Callable[[Path], object]] | None = None,
) -> Path:
    """Save ``model``'s layers as checkpoint ``step`` in ``directory``, replacing any earlier save of
    that step as a whole; under torch.distributed every rank calls it and writes its own stages.
    Returns the checkpoint's directory.

    ``extra`` maps more file names to functions writing them (``write(path)``), written by this rank
    into the new folder with the layers, so that they appear with them at once. Without ``extra``,
    the files of an earlier folder of this step that are not the checkpoint's own are carried over."""
    stages = _stages(model)
    extra = dict(extra or {})
    root = Path(directory)
    target = root / f"step-{step:08d}"
    staging = root / f".{target.name}.tmp"
    leader = not _is_distributed(model) or dist.get_rank() == 0
    writes = _engine(model).comm.dp_rank == 0  # data-parallel replicas hold the same layers

    # Every rank is here (its files of this step, if any, are written): rank 0 prepares the folder.
    _agree(model, None, None)
    _agree(model, None, _run((lambda: _prepare(root, target, staging, carry=not extra)) if leader else None)[1])

    def write_mine() -> list[str]:
        for name in extra:  # checked here, where a rank's error reaches every rank
            if not name or name != Path(name).name or name.startswith(".") or _owned(name):
                raise ValueError(f"extra file name {name!r}: a plain file name other than the checkpoint's own")
        names = []
        for stage in stages if writes else []:
            last = stage.first + len(stage.module) - 1
            path = staging / f"layers-{stage.first:05d}-{last:05d}.pt"
            state = {
                f"{stage.first + j}.{name}": t.detach().cpu()
                for j, layer in enumerate(stage.module)
                for name, t in layer.state_dict().items()
            }
            write_atomically(path, _torch_save(state))
            names.append(path.name)
        for name, write in extra.items():
            write_atomically(staging / name, write)
        return names

    files, error = _run(write_mine)
    try:
        written = _agree(model, files, error)
    except BaseException:
        if leader:
            _remove(staging)
        raise
    manifest = {
        "step": step,
        "num_layers": sum(_engine(model).balance),
        "files": sorted({name for names in written if names for name in names}),
    }

    def commit() -> None:
        try:
            _commit(root, target, staging, manifest)
        except BaseException:
            _remove(staging)
            raise

    _agree(model, None, _run(commit if leader else None)[1])
    return target


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


def _read_manifest(path: Path) -> tuple[int, int, list[tuple[str, int, int]]]:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:  # not UTF-8, or not JSON
        raise CheckpointError(f"{path}: not a checkpoint manifest: not JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a checkpoint manifest: expected a JSON object, got {type(data).__name__}")
    for key, kind in (("step", int), ("num_layers", int), ("files", list)):
        if key not in data:
            raise CheckpointError(f"{path}: not a checkpoint manifest: lacks {key!r}")
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise CheckpointError(
                f"{path}: {key!r} should be a{'n integer' if kind is int else ' list'}, got {data[key]!r:.80}"
            )
    files = []
    for name in data["files"]:
        match = _LAYERS.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise CheckpointError(f"{path}: lists {name!r:.80}, not a layers-<first>-<last>.pt file")
        files.append((name, int(match[1]), int(match[2])))
    ranges = sorted((first, last, name) for name, first, last in files)
    for (_, end, before), (start, _, after) in itertools.pairwise(ranges):
        if start <= end:
            raise CheckpointError(f"{path}: lists {before} and {after}, which overlap")
    return data["step"], data["num_layers"], files


def _read_layers(path: Path, first: int, last: int, manifest: Path) -> dict[int, dict[str, Tensor]]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, though {manifest} lists it")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        raise CheckpointError(
            f"{path}: not a readable layers file (truncated or corrupt?): {type(e).__name__}: {detail}"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    layers: dict[int, dict[str, Tensor]] = {}
    for key, tensor in state.items():
        index, _, rest = key.partition(".") if isinstance(key, str) else ("", "", "")
        if not index.isdigit() or not rest or not isinstance(tensor, Tensor):
            raise CheckpointError(f"{path}: holds {key!r:.80}, not a '<layer>.<name>' tensor")
        if not first <= int(index) <= last:
            raise CheckpointError(f"{path}: holds {key!r} of layer {index}, outside its layers {first} to {last}")
        layers.setdefault(int(index), {})[rest] = tensor
    return layers


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def load(model: nn.Module, directory: str | os.PathLike[str]) -> int:
    """Load the newest complete checkpoint of ``directory`` (or a ``step-*`` directory itself) into
    ``model``'s layers, whatever the number of stages it was saved with. Returns its step.

    Raises :class:`CheckpointError` (a ValueError) naming the file, and the layer, where the
    checkpoint is corrupt, incomplete or of another shape than the model."""
    path = Path(directory)
    target = path if _complete(path) else latest(path)
    if target is None:
        raise FileNotFoundError(f"no complete checkpoint in {str(directory)!r} (no {LATEST} or {MANIFEST})")
    manifest = target / MANIFEST
    step, saved_layers, files = _read_manifest(manifest)
    num_layers = sum(_engine(model).balance)
    if saved_layers != num_layers:
        raise CheckpointError(f"checkpoint {str(target)!r} holds {saved_layers} layers, the model has {num_layers}")
    wanted = dict(_layers(model))
    found: dict[int, dict[str, Tensor]] = {}
    source: dict[int, Path] = {}
    for name, first, last in files:
        if not any(first <= i <= last for i in wanted):
            continue
        for i, state in _read_layers(target / name, first, last, manifest).items():
            if i in wanted:
                found.setdefault(i, {}).update(state)
                source[i] = target / name
    for i, layer in wanted.items():
        expected = layer.state_dict()
        saved = found.get(i, {})
        where = source.get(i, target)
        missing = sorted(set(expected) - set(saved))
        if missing:
            raise CheckpointError(f"checkpoint {str(where)!r} lacks {[f'{i}.{k}' for k in missing]} of layer {i}")
        unexpected = sorted(set(saved) - set(expected))
        if unexpected:
            raise CheckpointError(
                f"checkpoint {str(where)!r} holds {[f'{i}.{k}' for k in unexpected]}, which the model's layer {i} "
                f"({type(layer).__name__}) lacks"
            )
        for key, tensor in expected.items():
            if saved[key].shape != tensor.shape:
                raise CheckpointError(
                    f"checkpoint layer {i} ({f'{i}.{key}'!r}, {type(layer).__name__}) in {str(where)!r}: "
                    f"saved shape {_shape(saved[key])}, model's {_shape(tensor)}"
                )
        layer.load_state_dict(saved)
    return step
