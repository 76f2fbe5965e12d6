"""The checksums of a checkpoint's files: taken while each rank writes its own (:class:`_Hashing`, the
stream DCP's writer writes through), listed by the manifest (``"files"``), checked before a load
(:func:`_check`) and by :func:`verify`.

A manifest lists every file the save wrote, under its name in the folder::

    "files": {"__0_0.distcp": {"sha256": "9f86d0...", "bytes": 104857600}, ".metadata": {...},
              "run.json": {...}, ...}

The digest is of the whole file, as ``sha256sum`` computes it: a folder can be checked without gpipe.
SHA-256 because it is the fastest of the standard library's cryptographic hashes wherever the CPU
has SHA extensions (AMD since Zen, Intel since Ice Lake, most ARMv8 cores): 1.1 GB/s on one core of this
project's VM, against 0.98 for BLAKE2b and 0.72 for MD5 (without them BLAKE2b is the faster); the
manifest names the algorithm per file, so a reader takes whatever the writer chose. Files the save
did not write (another writer's, carried over into the new folder) are not listed: they may change
after the save without damaging it."""

from __future__ import annotations

import hashlib
import io
import os
import queue
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpipe.saving.folders import MANIFEST, CheckpointError, _checkpoint_folder, _read_manifest

__all__ = ["ALGORITHM", "FILES", "_Hashing", "_check", "_digest", "_listed", "verify"]

ALGORITHM = "sha256"
FILES = "files"  # the manifest's key

Listing = dict[str, tuple[str, str, int]]  # a file's name: (algorithm, hex digest, bytes)

_GATHER = 1 << 20  # writes shorter than this are gathered into one piece of about this length to hash
_PIECE = 8 << 20  # longer ones are cut into pieces of at most this length
_TRAIL = 8  # the pieces copied but not yet hashed, at most (64 MiB): the hash's lag behind the writes
_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, the threads)


def _hasher() -> ThreadPoolExecutor:
    """The threads that check files (a new set in a forked process: the parent's are not there)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            workers = max(1, min(8, os.cpu_count() or 1))
            _pool = (os.getpid(), ThreadPoolExecutor(workers, thread_name_prefix="gpipe-checksum"))
        return _pool[1]


class _Hashing(io.IOBase):
    """A stream written sequentially (DCP's writer's) whose bytes are also hashed, so that the
    file's digest is known once it is written, with no second read. The hash runs in a thread of its
    own, behind the writes: each write is copied (the writer's memory may change once ``write``
    returns) into a queue of pieces that the thread hashes in order, at most :data:`_TRAIL` pieces
    behind (64 MiB of copies; a write waits while the queue is full). Hashing the bulk of a file
    thus overlaps writing it and, above all, syncing it to the disk, which a save does before the
    digest is asked for. It cannot seek: a stream that did would make the digest wrong."""

    def __init__(self, raw: io.IOBase) -> None:
        super().__init__()
        self._raw = raw
        self._hash = hashlib.new(ALGORITHM)
        self._gathered = bytearray()
        self._pieces: queue.Queue[bytes | bytearray | None] = queue.Queue(_TRAIL)
        self._dropped = False  # the stream failed: the pieces left are not hashed
        self._thread = threading.Thread(target=self._run, name="gpipe-checksum", daemon=True)
        self._thread.start()
        self.size = 0

    def _run(self) -> None:
        while (piece := self._pieces.get()) is not None:
            if not self._dropped:
                self._hash.update(piece)

    def _send(self) -> None:
        if self._gathered:
            self._pieces.put(self._gathered)
            self._gathered = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # (a bytes-like object)
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        if written is not None and written != view.nbytes:  # (a buffered file writes all or raises)
            raise OSError(f"short write: {written} of {view.nbytes} bytes; the checksum would be wrong")
        if view.nbytes < _GATHER:
            self._gathered += view
            if len(self._gathered) >= _GATHER:
                self._send()
        else:
            self._send()
            for start in range(0, view.nbytes, _PIECE):
                self._pieces.put(bytes(view[start : start + _PIECE]))
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()
        super().close()

    def digest(self) -> tuple[str, int]:
        """The hex digest of the bytes written, and their number (once the hash has caught up)."""
        self._send()
        self._pieces.put(None)
        self._thread.join()
        return self._hash.hexdigest(), self.size

    def drop(self) -> None:
        """End the hashing thread, the digest unwanted (the write failed)."""
        if self._thread.is_alive():
            self._dropped = True
            self._pieces.put(None)
            self._thread.join()


def _digest(path: Path, algorithm: str = ALGORITHM) -> tuple[str, int]:
    """The hex digest of the file ``path``, and its length (one read)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, algorithm).hexdigest()
        return digest, f.tell()


def _listed(manifest: Mapping[str, Any], path: Path) -> Listing | None:
    """The files the manifest at ``path`` lists, checked; None where it lists none (a checkpoint
    saved before checksums)."""
    files = manifest.get(FILES)
    if files is None:
        return None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: {FILES!r} should be an object of files, got {files!r:.80}")
    listing: Listing = {}
    for name, entry in files.items():
        if not name or name != Path(name).name or name in (".", ".."):
            raise CheckpointError(f"{path}: lists {name!r:.80}, not a file of the checkpoint's folder")
        kinds = [k for k in entry if k != "bytes"] if isinstance(entry, dict) else []
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if len(kinds) != 1 or not isinstance(entry[kinds[0]], str) or not isinstance(size, int) or size < 0:
            raise CheckpointError(
                f"{path}: the entry of {name!r} should be {{<algorithm>: <hex digest>, 'bytes': <size>}}, "
                f"got {entry!r:.120}"
            )
        listing[name] = (kinds[0], entry[kinds[0]], size)
    return listing


def _problem(folder: Path, name: str, listed: tuple[str, str, int], *, read: bool = True) -> str | None:
    """What is wrong with the file ``name`` of ``folder`` against its entry in the manifest, if
    anything; without ``read``, its size only."""
    algorithm, expected, size = listed
    path = folder / name
    try:
        actual = path.stat().st_size
        if actual < size:
            return f"{path}: truncated: {actual} of {size} bytes"
        if actual > size:
            return f"{path}: {actual} bytes, {actual - size} more than the manifest's {size}"
        if not read:
            return None
        if algorithm not in hashlib.algorithms_available:
            return f"{path}: cannot be checked: its checksum is a {algorithm!r}, which this Python lacks"
        digest, actual = _digest(path, algorithm)
    except FileNotFoundError:
        return f"{path}: missing, though {folder / MANIFEST} lists it"
    except OSError as e:
        return f"{path}: unreadable: {e.strerror or e}"
    if actual != size:
        return f"{path}: {actual} bytes, the manifest's {size} (changed while it was read?)"
    if digest != expected:
        return f"{path}: corrupt: its {algorithm} differs from the manifest's"
    return None


def _problems(folder: Path, listing: Listing, names: Iterable[str] | None = None) -> list[str]:
    """What is wrong with the files ``names`` (default: all) of those ``listing`` lists: their
    sizes first (a truncated file is found without reading any), then their digests, the files read
    in parallel."""
    chosen = sorted(listing if names is None else {n for n in names if n in listing})
    problems = [p for n in chosen if (p := _problem(folder, n, listing[n], read=False)) is not None]
    if problems or not chosen:
        return problems
    found = list(_hasher().map(lambda n: _problem(folder, n, listing[n]), chosen))
    return [p for p in found if p is not None]


def _check(folder: Path, manifest: Mapping[str, Any], names: Iterable[str] | None = None) -> None:
    """Raise :class:`CheckpointError` naming each file of ``names`` (default: all) the manifest
    lists that is missing, of another size or another digest; nothing where it lists none."""
    listing = _listed(manifest, folder / MANIFEST)
    if listing is None:
        return
    problems = _problems(folder, listing, names)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError("; ".join(problems[:3]) + more)


def verify(directory: str | os.PathLike[str]) -> list[str]:
    """Check every file the manifest of checkpoint ``directory`` (a ``step-*`` folder, or the newest
    complete one of a checkpoints folder, as :func:`load` takes) lists: its size and its checksum.
    Returns the problems found, each naming the file (``.../__1_0.distcp: truncated: 1234 of 5678
    bytes``, ``...: corrupt: its sha256 differs from the manifest's``), empty when it is intact; a
    manifest that cannot be read is one. A checkpoint saved before checksums (its manifest lists no
    files) has nothing to check: []. In one process, without torch.distributed; the files are read
    in parallel threads."""
    folder = _checkpoint_folder(directory)
    path = folder / MANIFEST
    try:
        listing = _listed(_read_manifest(path), path)
    except CheckpointError as e:
        return [str(e)]
    except OSError as e:
        return [f"{path}: unreadable: {e.strerror or e}"]
    return [] if listing is None else _problems(folder, listing)
