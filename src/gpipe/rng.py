"""Randomness that follows the model, not the schedule.

Every random draw inside layer ``i`` on micro-batch ``m`` (dropout masks, ``torch.rand``, the seeds
of a compiled graph's random ops, ...) comes from a stream seeded with ``derive_seed(step, i, m)``.
The numbers a layer sees therefore do not depend on how many partitions there are, on the balance,
on the order in which a schedule runs the micro-batches, or on concurrent workers; and the
recomputation of a forward in backward, seeded alike, replays exactly what the forward drew.

How: around such a layer call the device's *default* generator is lent to the layer — its state is
saved, it is seeded with the layer's seed, and the saved state is put back afterwards
(:class:`Seeded`). Nothing is intercepted per operator, so eager kernels and ``torch.compile``'d
graphs (whose random ops take their seeds from the default generator) run at full speed; on CUDA
the generator's state is a seed and an offset kept on the host, so lending it needs no device
synchronization. Each device's generator is lent to one layer call at a time (a lock per device):
workers on different GPUs never wait for each other, workers sharing a device (several ``'cpu'``
workers in one process) take turns for the layers that draw random numbers.

Layers that draw nothing pay nothing: a stage learns on a layer's first call whether it draws
(:attr:`Seeded.drew`), and later calls of a layer that does not draw go straight to the layer. A
layer holding a module that may draw (dropout of any probability) is always seeded, so that a
probability raised later in training is seeded too; and should another layer start drawing after a
first call that drew nothing, the step notices (:class:`Watch`), warns, and the stages learn again.

The step's seed is drawn from PyTorch's default generator, so ``torch.manual_seed`` makes a run
reproducible and successive steps draw fresh numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from types import TracebackType

import torch
from torch import nn

__all__ = ["Seeded", "Watch", "derive_seed", "may_draw", "step_seed"]

_MASK = (1 << 64) - 1

# Modules whose forward draws random numbers in training (whatever their probability today).
_RANDOM_MODULES: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)


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


def may_draw(layer: nn.Module) -> bool:
    """Whether ``layer`` holds a module known to draw random numbers in training (dropout, RReLU)."""
    return any(isinstance(m, _RANDOM_MODULES) for m in layer.modules())


_LOCKS: dict[torch.device, threading.RLock] = {}
_LOCKS_LOCK = threading.Lock()


def _lock(device: torch.device) -> threading.RLock:
    lock = _LOCKS.get(device)
    if lock is None:
        with _LOCKS_LOCK:
            lock = _LOCKS.setdefault(device, threading.RLock())
    return lock


def default_generator(device: torch.device) -> torch.Generator:
    """The default generator random operators on ``device`` draw from."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise RuntimeError(
        f"gpipe seeds random numbers on 'cpu' and 'cuda' devices, not on {device.type!r}; run the stage on one of those"
    )


class Seeded:
    """Lend ``device``'s default generator, seeded with ``seed``, to the code inside the context.

    With ``probe=True`` the context also finds out whether that code drew random numbers there
    (:attr:`drew`, set on exit). The generator's own state is restored on exit, so the caller's
    stream of random numbers is untouched.
    """

    __slots__ = ("_fresh", "_gen", "_lock", "_probe", "_saved", "device", "drew", "seed")

    def __init__(self, device: torch.device, seed: int, *, probe: bool = False) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # one lock per generator
        self.device, self.seed = device, seed
        self._probe = probe
        self.drew = True
        self._gen = default_generator(device)
        self._lock = _lock(device)

    def __enter__(self) -> Seeded:
        self._lock.acquire()
        try:
            gen = self._gen
            self._saved = gen.get_state()
            gen.manual_seed(self.seed)
            if self._probe:
                self._fresh = gen.get_state() if self.device.type != "cuda" else torch.empty(0)
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        gen = self._gen
        try:
            if self._probe:
                if self.device.type == "cuda":
                    self.drew = gen.get_offset() != 0  # manual_seed starts the offset at 0
                else:
                    self.drew = not torch.equal(gen.get_state(), self._fresh)
            gen.set_state(self._saved)
        finally:
            self._lock.release()


class Watch:
    """Whether anything drew from the default generators of ``devices`` outside a :class:`Seeded`
    context while the context ran (:attr:`drew`: those devices).

    A stage calls a layer that drew nothing on its first call without lending it a generator. Should
    such a layer start drawing later (a dropout probability raised from 0 inside a functional call),
    its numbers come from the device's own stream, unseeded: the step's executor watches for that,
    so that the stages learn again and the user hears of it.
    """

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self._gens = [(d, default_generator(d)) for d in dict.fromkeys(devices) if d.type in ("cpu", "cuda")]
        self.drew: list[torch.device] = []

    def __enter__(self) -> Watch:
        self._before = [g.get_state() for _, g in self._gens]
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.drew = [d for (d, g), s in zip(self._gens, self._before) if not torch.equal(g.get_state(), s)]
