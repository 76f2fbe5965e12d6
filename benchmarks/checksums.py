"""What the checksums of a checkpoint's files cost: saves without them, with them taken inline (each
write hashed in the writing thread), and as gpipe takes them (copied into a queue that a thread of
their own hashes, up to 64 MiB behind the writes: the hash overlaps the writes and the file's sync);
then a load with and without checking them, and ``verify`` alone.

The state: a pipeline of 8 Linear(1792, 1792) layers on 2 'cpu' stages (98 MiB of weights), after one
Adam step, in one process; saved without and with the optimizer's state (3x the bytes). Within each
repetition the variants take turns (in reverse order every other repetition), each into a fresh folder
on the same disk (fsynced, as every save is), after ``os.sync()`` (no earlier writeback under way):

- none: the save with the hashing taken out (a stream that only counts; the extra files unread);
- inline: SHA-256 of each write in the writing thread, after the write;
- trailing (gpipe's): each write copied into the queue of the hashing thread;
- async, none / async, trailing: ``save(..., asynchronous=True)`` until ``.wait()`` returns.

Loading, from the folder the 'trailing' save wrote: ``load(pipe, folder, optimizer=...)`` with the
manifest's ``"files"`` removed (unchecked: as before checksums) and as saved (checked: every file
this process reads checked first, all of them in one process); each cold (its files dropped from the
page cache first, with ``posix_fadvise(POSIX_FADV_DONTNEED)``: read from the disk) then cached (the
same load again, from the page cache); and ``verify(folder)``, cached. For reference, SHA-256 over
256 MiB in memory, one thread.

Reported: medians [min-max] in ms, and the ratio to the first variant within each repetition,
median [min-max] (the variants of a repetition ran one after the other: machine noise mostly cancels).

Reproduce (from the repository root; about 2.5 min on the disk, 1.5 min on tmpfs):

    .venv/bin/python benchmarks/checksums.py --repeats 15 --json benchmarks/results/checksums/results.json
    .venv/bin/python benchmarks/checksums.py --repeats 15 --dir /dev/shm/ck-bench \
        --json benchmarks/results/checksums/results-tmpfs.json      # the CPU's cost alone (no disk; 'cold' is cached)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import gpipe.saving.dcp
import gpipe.saving.saver
from checkpoints import LAYERS, WIDTH, pipeline, summary  # (the same 98 MiB model; run from benchmarks/)
from gpipe.saving import load, save, verify


class Counting(io.IOBase):
    """The stream of the 'none' variant: writes through, counting, hashing nothing."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw, self.size = raw, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = int(self._raw.write(data))
        self.size += n
        return n

    def tell(self) -> int:
        return int(self._raw.tell())

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def close(self) -> None:
        self._raw.close()
        super().close()

    def digest(self) -> tuple[str, int]:
        return "", self.size

    def drop(self) -> None:
        pass


class Inline(Counting):
    """The stream of the 'inline' variant: each write hashed in the writing thread."""

    def __init__(self, raw: Any) -> None:
        super().__init__(raw)
        self._hash = hashlib.sha256()

    def write(self, data: Any) -> int:
        n = super().write(data)
        self._hash.update(data)
        return n

    def digest(self) -> tuple[str, int]:
        return self._hash.hexdigest(), self.size


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The hashing as variant ``name`` takes it, for the block."""
    hashing, digest = gpipe.saving.dcp._Hashing, gpipe.saving.saver._digest
    if name.endswith("none"):
        gpipe.saving.dcp._Hashing = Counting  # type: ignore[assignment,misc]
        gpipe.saving.saver._digest = lambda path, *_: ("", os.path.getsize(path))
    elif name == "inline":
        gpipe.saving.dcp._Hashing = Inline  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gpipe.saving.dcp._Hashing = hashing  # type: ignore[misc]
        gpipe.saving.saver._digest = digest


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (this process's own files only, the machine's
    cache otherwise untouched): the next read comes from the disk."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(work: Any, *args: Any, **kwargs: Any) -> float:
    began = time.perf_counter()
    work(*args, **kwargs)
    return time.perf_counter() - began


def save_and_wait(*args: Any, **kwargs: Any) -> None:
    save(*args, asynchronous=True, **kwargs).wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the raw numbers to this file")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="gpipe-checksum-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    pipe, optimizer, _ = pipeline()
    mib = sum(p.numel() * p.element_size() for p in pipe.parameters()) / 2**20
    print(f"{LAYERS} x Linear({WIDTH}) on 2 stages: {mib:.0f} MiB of weights; torch {torch.__version__}; "
          f"{os.cpu_count()} cores; {args.repeats} repetitions after 2 warm-ups")  # fmt: skip
    data = os.urandom(256 << 20)
    memory = [timed(hashlib.sha256, data) for _ in range(3)]
    print(f"SHA-256 in memory, one thread: {256 / min(memory):.0f} MiB/s")
    results: dict[str, dict[str, list[float]]] = {}
    saves = ("none", "inline", "trailing", "async, none", "async, trailing")
    try:
        for label, kwargs in (("model", {}), ("model + Adam", {"optimizer": optimizer})):
            times = results.setdefault(f"save, {label}", {name: [] for name in saves})
            loads = results.setdefault(f"load, {label}", {})
            for rep in range(args.repeats + 2):
                for name in saves if rep % 2 == 0 else reversed(saves):
                    folder = root / f"{label.replace(' ', '')}-{rep}-{name.replace(', ', '-')}"
                    os.sync()  # (the disk idle first: no earlier save's writeback in this one's time)
                    with variant(name):
                        took = timed(save_and_wait if name.startswith("async") else save, pipe, folder, 1, **kwargs)
                    if rep >= 2:
                        times[name].append(took)
                    if name != "trailing":
                        shutil.rmtree(folder)
                folder = root / f"{label.replace(' ', '')}-{rep}-trailing" / "step-00000001"
                unchecked = folder.with_name("unchecked")
                shutil.copytree(folder, unchecked)
                manifest = json.loads((unchecked / "manifest.json").read_text())
                del manifest["files"]
                (unchecked / "manifest.json").write_text(json.dumps(manifest))
                os.sync()  # (the copy's pages clean: evict() can drop them)
                took = {}
                for name, what in (("unchecked", unchecked), ("checked", folder)):
                    evict(what)
                    took[f"{name}, cold"] = timed(load, pipe, what, **kwargs)
                    took[f"{name}, cached"] = timed(load, pipe, what, **kwargs)
                took["verify alone, cached"] = timed(verify, folder)
                assert verify(folder) == []
                if rep >= 2:
                    for name, value in took.items():
                        loads.setdefault(name, []).append(value)
                shutil.rmtree(folder.parent)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    for label, times in results.items():
        print(f"\n{label}: ms, median [min-max]")
        base = next(iter(times.values()))
        for name, values in times.items():
            ratios = [v / b for v, b in zip(values, base)]
            spread = f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
            print(f"  {name:<24} {summary(values):>16}   {spread}")
    if args.json:
        Path(args.json).write_text(json.dumps({"sha256 in memory, s per 256 MiB": memory, **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
