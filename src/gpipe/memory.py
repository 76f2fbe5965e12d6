"""Activation memory of a step, measured per worker.

On CUDA ``torch.cuda.max_memory_allocated`` tells a device's peak, but not which stage or which
micro-batch holds it, and on CPU there is no allocator to ask. This meter counts what a stage really
keeps for backward: the bytes of every tensor autograd saves (through ``saved_tensors_hooks``; each
storage once per micro-batch, parameters excluded) plus a re-materialized micro-batch's kept input,
from the forward that saves them to the backward (B, or W after a split backward) that frees them.

Under a selective policy (:class:`gpipe.Selective`) a stage counts, through :func:`keep`, what it
keeps beside autograd (a re-materialized layer's input, the operator outputs it keeps: autograd's
own saving is dropped there by hooks of its own, which hide this meter's) until the recomputation
takes the kept outputs back (:func:`forget`: what its graph saves of them is counted again), and a
backward that frees a layer's recomputation right after that layer's backward counts it as
:func:`transient`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import cast

import torch
from torch import Tensor

__all__ = ["ActivationMeter", "forget", "keep", "transient"]

# The recording on this thread: (meter, stage, micro-batch).
_local = threading.local()


class ActivationMeter:
    """Live and peak activation bytes per worker over one step."""

    def __init__(self, worker_of: dict[int, int], num_workers: int, parameters: Iterable[Tensor]) -> None:
        self._worker_of = worker_of
        self._params = {p.untyped_storage().data_ptr() for p in parameters}
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], int] = {}
        self._seen: dict[tuple[int, int], set[int]] = {}
        self.live = [0] * num_workers
        self.peak = [0] * num_workers
        self.stage_peak: dict[int, int] = {}
        """Per stage, the most bytes one micro-batch held there (its activations, and what a
        re-materialized backward recomputed)."""

    def _add(self, stage: int, microbatch: int, t: Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        key = (stage, microbatch)
        with self._lock:
            seen = self._seen.setdefault(key, set())
            if ptr in self._params or ptr in seen:
                return
            seen.add(ptr)
            # A micro-batch sliced from the caller's batch holds only its slice of the storage.
            nbytes = min(storage.nbytes(), t.numel() * t.element_size())
            self._held[key] = self._held.get(key, 0) + nbytes
            w = self._worker_of[stage]
            self.live[w] += nbytes
            self.peak[w] = max(self.peak[w], self.live[w])

    def hold(self, stage: int, microbatch: int, tensors: Iterable[Tensor]) -> None:
        """Count tensors a stage keeps itself (a re-materialized micro-batch's input)."""
        for t in tensors:
            self._add(stage, microbatch, t)

    @contextmanager
    def recording(self, stage: int, microbatch: int) -> Iterator[None]:
        """Count every tensor autograd saves for backward inside this context."""

        def pack(t: Tensor) -> Tensor:
            self._add(stage, microbatch, t)
            return t

        before = getattr(_local, "active", None)
        _local.active = (self, stage, microbatch)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            _local.active = before

    @contextmanager
    def _transient(self, stage: int, microbatch: int) -> Iterator[None]:
        key = (stage, microbatch)
        with self._lock:
            seen = set(self._seen.get(key, ()))
            held = self._held.get(key, 0)
        try:
            yield
        finally:
            with self._lock:
                now = self._held.get(key, 0)
                self.stage_peak[stage] = max(self.stage_peak.get(stage, 0), now)
                self._held[key] = held
                self.live[self._worker_of[stage]] -= now - held
                self._seen[key] = seen

    def forget(self, stage: int, microbatch: int, tensors: Iterable[Tensor]) -> None:
        """Stop counting tensors a stage no longer keeps itself (autograd's saving may count them again)."""
        key = (stage, microbatch)
        with self._lock:
            seen = self._seen.get(key, set())
            for t in tensors:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in seen:
                    continue
                seen.discard(ptr)
                nbytes = min(storage.nbytes(), t.numel() * t.element_size())
                self._held[key] -= nbytes
                self.live[self._worker_of[stage]] -= nbytes

    def release(self, stage: int, microbatch: int) -> None:
        """The backward of ``microbatch`` on ``stage`` is done: its activations are freed."""
        with self._lock:
            held = self._held.pop((stage, microbatch), 0)
            self.stage_peak[stage] = max(self.stage_peak.get(stage, 0), held)
            self.live[self._worker_of[stage]] -= held
            self._seen.pop((stage, microbatch), None)


def keep(tensors: Iterable[Tensor]) -> None:
    """Count tensors a stage keeps beside autograd, in the recording on this thread (if any)."""
    active = getattr(_local, "active", None)
    if active is not None:
        meter, stage, microbatch = active
        meter.hold(stage, microbatch, tensors)


def forget(tensors: Iterable[Tensor]) -> None:
    """Stop counting, in the recording on this thread (if any), tensors a stage no longer keeps."""
    active = getattr(_local, "active", None)
    if active is not None:
        meter, stage, microbatch = active
        meter.forget(stage, microbatch, tensors)


def transient() -> AbstractContextManager[None]:
    """What the recording on this thread (if any) counts inside is freed at the end."""
    active = getattr(_local, "active", None)
    if active is None:
        return nullcontext()
    meter, stage, microbatch = active
    return cast(AbstractContextManager[None], meter._transient(stage, microbatch))
