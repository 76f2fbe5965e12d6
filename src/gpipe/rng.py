"""Randomness that follows the model, not the schedule.

Every random draw inside layer ``i`` on micro-batch ``m`` (dropout masks, ``torch.rand``, ...) comes
from a generator seeded with ``seed(step, i, m)``. The numbers a layer sees therefore do not depend on
how many partitions there are, on the balance, on the order in which a schedule runs the
micro-batches, or on concurrent workers drawing at the same time; and the recomputation of a forward
in backward, seeded alike, replays exactly what the forward drew.

The step's seed is drawn from PyTorch's default generator, so ``torch.manual_seed`` makes a run
reproducible and successive steps draw fresh numbers.

How: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` (thread-local, so each worker has its
own) sees every ATen operator tagged ``nondeterministic_seeded``. Where the operator takes a
``generator`` argument it is given the layer's generator; otherwise the device's default generator is
swapped for the layer's one for the duration of that operator, under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["derive_seed", "layer_randomness", "step_seed"]

_MASK = (1 << 64) - 1
_SWAP_LOCK = threading.Lock()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def derive_seed(step: int, layer: int, microbatch: int) -> int:
    """The seed of layer ``layer`` on micro-batch ``microbatch`` in the step seeded ``step``."""
    return _splitmix64(_splitmix64(_splitmix64(step) ^ layer) ^ microbatch) >> 1


def step_seed() -> int:
    """A fresh seed for one step, drawn from the default CPU generator."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _op_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.device
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return v[0].device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise RuntimeError(f"gpipe cannot seed random numbers on a {device.type!r} device")


class _LayerRandomness(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, seed: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self.generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self.generators[device] = gen
        return gen

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        device = _op_device(args, kwargs)
        gen = self._generator(device)
        if kwargs.get("generator") is None and any(a.name == "generator" for a in func._schema.arguments):
            return func(*args, **{**kwargs, "generator": gen})
        default = _default_generator(device)
        with _SWAP_LOCK:
            saved = default.get_state()
            default.set_state(gen.get_state())
            try:
                out = func(*args, **kwargs)
                gen.set_state(default.get_state())
            finally:
                default.set_state(saved)
        return out


@contextmanager
def layer_randomness(seed: int) -> Iterator[None]:
    """Within this context, on this thread, every random operator draws from a generator seeded with
    ``seed`` (one per device)."""
    with _LayerRandomness(seed):
        yield
