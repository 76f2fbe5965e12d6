"""A checkpoint directory on disk: files written atomically, the atomic replacement of a step's
folder (and the clean-up of what a killed save left), ``latest`` and the manifest; a full disk
as :class:`NoSpaceError`."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import stat
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpipe.saving.keys import FORMAT

__all__ = [
    "LATEST",
    "MANIFEST",
    "METADATA",
    "CheckpointError",
    "NoSpaceError",
    "_checkpoint_folder",
    "_clear_errors",
    "_commit",
    "_owned",
    "_prepare",
    "_read_manifest",
    "_remove",
    "_write_error",
    "complete",
    "find",
    "latest",
    "prune",
    "write_atomically",
]

LATEST = "latest"
MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's index

_STEP = re.compile(r"step-\d{8,}")
_DATA = re.compile(r"__\d+_\d+\.distcp")  # DCP's data files
_OLD_LAYERS = re.compile(r"layers-\d{5,}-\d{5,}\.pt")  # the earlier format's
_TEMP_FILE = re.compile(r"\..+\.tmp-\d+")  # write_atomically's temporary files
_TEMP_ROOT = re.compile(r"\.(step-\d{8,}\.tmp|latest\.tmp-\d+)")  # save's staging folders, latest's temporaries
_WRITER_FAILED = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed", re.IGNORECASE)
_NEARLY_FULL = 16 << 20  # a writer that fails with less free space than this ran out of it


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: corrupt, incomplete, or of another model's shape."""


class NoSpaceError(OSError):
    """A checkpoint could not be written for lack of space (``errno.ENOSPC`` or ``errno.EDQUOT``)."""


CheckpointError.__module__ = NoSpaceError.__module__ = "gpipe.saving"  # their public name, which tracebacks print

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


@contextlib.contextmanager
def _clear_errors(path: Path) -> Iterator[None]:
    """A write of ``path`` failing inside raises what :func:`_write_error` makes of its error."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        clear = _write_error(path, e)
        if clear is e:
            raise
        raise clear from e


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
    :class:`NoSpaceError` naming ``path``; the temporary file is removed whatever happens.

    Only a regular file (or a new path) is replaced so: a symbolic link is followed, and its target
    written (the link stays); a character device, a FIFO or a socket (``/dev/null``, a pipe) is
    written in place, ``write(path)`` itself, never replaced by a file (its errors, such as
    ``/dev/full``'s ENOSPC, raised as for a file); a directory is refused
    (:class:`IsADirectoryError`)."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise _write_error(path, e) from e
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, f"{path} is a directory; name a file")
    if mode is not None and not stat.S_ISREG(mode):
        with _clear_errors(path):
            write(target)
        return
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with _clear_errors(path):
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(target.parent)


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
    with _clear_errors(staging):
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


# Reading.


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``directory``, if any: the one ``latest`` names, or — when
    that one is gone or incomplete (a folder deleted by hand, a copy that left some out), or there is
    no ``latest`` — the complete ``step-*`` folder of the highest step, with a warning that says so."""
    root = Path(directory)
    pointer = root / LATEST
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return _newest_complete(root, f"{pointer} is missing")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{pointer}: unreadable ({e})") from e
    if not _STEP.fullmatch(name):
        raise CheckpointError(f"{pointer}: names {name[:80]!r}, not a step-* checkpoint folder")
    target = root / name
    if _complete(target):
        return target
    aside = _aside(target)  # a save was swapping it, or was killed while it did
    if _complete(aside):
        return aside
    return _newest_complete(root, f"{pointer} names {name}, which is {'incomplete' if target.exists() else 'missing'}")


def find(path: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``path`` names: itself (a complete checkpoint folder), the newest of a run's
    ``checkpoints`` folder, or the newest of a folder of checkpoints (:func:`latest`); None where it
    holds none. Raises :class:`CheckpointError` where one there is unreadable (a damaged ``latest``)."""
    root = Path(path)
    if _complete(root):
        return root
    for folder in (root / "checkpoints", root):
        found = latest(folder) if folder.is_dir() else None
        if found is not None:
            return found
    return None


def complete(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete ``step-*`` checkpoint folders of ``directory``, newest (highest step) first; a
    folder a save is still writing, or one it has put aside, is not among them."""
    root = Path(directory)
    steps = [p for p in root.glob("step-*") if _STEP.fullmatch(p.name) and _complete(p)] if root.is_dir() else []
    return sorted(steps, key=lambda p: int(p.name.removeprefix("step-")), reverse=True)


def _newest_complete(root: Path, why: str) -> Path | None:
    """The complete ``step-*`` folder of the highest step in ``root`` (announced, with ``why``), or None."""
    found = next(iter(complete(root)), None)
    if found is not None:
        warnings.warn(f"{why}; using {found.name}, the newest complete checkpoint there", RuntimeWarning, stacklevel=3)
    return found


def prune(directory: str | os.PathLike[str], keep: int, *, spare: str | os.PathLike[str] | None = None) -> list[str]:
    """Delete the complete ``step-*`` checkpoints of ``directory`` but the newest ``keep`` (by step),
    never the one ``latest`` names (nor the folder a save has put aside), nor ``spare`` (a
    checkpoint folder of ``directory``: the one a run resumed from, say, when ``latest`` names
    another), and nothing a save is still writing (an incomplete folder is neither counted nor
    deleted); returns the names deleted, oldest first. Call it where no save is under way in
    ``directory``."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive number of checkpoints (keep: {keep!r})")
    root = Path(directory)
    steps = complete(root)
    newest = latest(root)
    deleted = []
    kept = {p.name for p in (newest, None if spare is None else Path(spare)) if p is not None}
    for folder in reversed(steps[keep:]):
        if folder.name in kept:
            continue
        _remove(folder)
        deleted.append(folder.name)
    if deleted:
        _fsync_dir(root)
    return deleted


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


def _checkpoint_folder(directory: str | os.PathLike[str]) -> Path:
    path = Path(directory)
    target = path if _complete(path) else latest(path)
    if target is None:
        raise FileNotFoundError(f"no complete checkpoint in {str(directory)!r} (no {LATEST} or {MANIFEST})")
    return target
