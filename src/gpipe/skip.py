"""Skip connections across stages: a layer stashes a tensor, a later layer — on the same stage or
another one, in this process or another — pops it. For U-Net- and AmoebaNet-like models.

::

    from gpipe.skip import pop, skippable, stash

    @skippable(stash=["down1"])
    class Down(nn.Module):
        def forward(self, x):
            x = self.conv(x)
            stash("down1", x)
            return self.pool(x)

    @skippable(pop=["down1"])
    class Up(nn.Module):
        def forward(self, x):
            return self.conv(torch.cat([self.up(x), pop("down1")], dim=1))

The same model runs plainly (``nn.Sequential``) and in a pipeline. In a pipeline a stashed tensor
travels with the micro-batch's activations, stage to stage, until the stage that pops it: so it
works with every schedule, with re-materialization (a recomputed layer stashes again) and across
processes, and its gradient flows back the same way. The declared names are checked when the
pipeline is built: every pop needs an earlier stash of the name, every stash a later pop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from torch import Tensor, nn

__all__ = ["SkipError", "check_skips", "pop", "skippable", "stash"]

T = TypeVar("T", bound=type[nn.Module])

_local = threading.local()


class SkipError(ValueError):
    """A stash without its pop, a pop without its stash, or a name used undeclared."""


def skippable(*, stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[T], T]:
    """Declare the names a layer class stashes and pops."""

    def declare(cls: T) -> T:
        cls._gpipe_stash = tuple(stash)  # type: ignore[attr-defined]
        cls._gpipe_pop = tuple(pop)  # type: ignore[attr-defined]
        return cls

    return declare


def declared(layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(stashed, popped) names a layer declares, its own and its submodules'."""
    stashes: list[str] = []
    pops: list[str] = []
    for m in layer.modules():
        stashes += getattr(type(m), "_gpipe_stash", ())
        pops += getattr(type(m), "_gpipe_pop", ())
    return tuple(stashes), tuple(pops)


def _skips() -> dict[str, Any]:
    skips = getattr(_local, "skips", None)
    if skips is None:  # a plain run, outside any pipeline: one table per thread
        skips = _local.skips = {}
    return skips


def stash(name: str, tensor: Tensor) -> None:
    """Keep ``tensor`` under ``name`` for a later layer to :func:`pop`."""
    skips = _skips()
    if name in skips:
        raise SkipError(f"skip {name!r} is stashed again before it was popped")
    skips[name] = tensor


def pop(name: str) -> Tensor:
    """Take the tensor an earlier layer stashed under ``name``."""
    skips = _skips()
    if name not in skips:
        raise SkipError(f"skip {name!r} is popped but was not stashed (or was popped already)")
    return skips.pop(name)  # type: ignore[no-any-return]


def enter(skips: dict[str, Any]) -> Any:
    """From now on, on this thread, :func:`stash` and :func:`pop` use ``skips``; returns what
    :func:`leave` needs to put the previous table back. (A pair of calls, not a context manager:
    a stage enters one per micro-batch, and the hot path stays cheap.)"""
    before = getattr(_local, "skips", None)
    _local.skips = skips
    return before


def leave(before: Any) -> None:
    _local.skips = before


def check_skips(layers: Sequence[nn.Module]) -> None:
    """Every popped name is stashed by an earlier layer, every stashed name popped by a later one."""
    live: dict[str, int] = {}
    for i, layer in enumerate(layers):
        stashes, pops = declared(layer)
        for name in pops:
            if name not in live:
                raise SkipError(
                    f"layer {i} ({type(layer).__name__}) pops skip {name!r}, which no earlier layer stashes"
                )
            del live[name]
        for name in stashes:
            if name in live:
                raise SkipError(
                    f"layer {i} ({type(layer).__name__}) stashes skip {name!r}, already stashed by layer {live[name]} "
                    "and not popped yet"
                )
            live[name] = i
    if live:
        name, i = next(iter(live.items()))
        raise SkipError(f"layer {i} ({type(layers[i]).__name__}) stashes skip {name!r}, which no later layer pops")
