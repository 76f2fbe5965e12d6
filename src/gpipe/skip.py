"""Skip connections across stages: a layer stashes a tensor, a later layer — on the same stage or
another one, in this process or another — pops it. For U-Net- and AmoebaNet-like models.

Two ways to write a skippable layer, one mechanism beneath. Plain calls::

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

or torchgpipe's generator protocol, ``yield stash("down1", x)`` and ``skip = yield pop("down1")``
(``stash`` and ``pop`` act when called; the generator is handed back what it yields). Names are
declared on the class; :meth:`Skippable.isolate` puts a layer's names into a :class:`Namespace`,
so one pair of layer classes can be used several times in a model.

The same model runs plainly (``nn.Sequential``) and in a pipeline. In a pipeline a stashed tensor
travels with the micro-batch's activations, stage to stage, until the stage that pops it: so it
works with every schedule, with re-materialization (a recomputed layer stashes again) and across
processes, and its gradient flows back the same way. The declared names are checked when the
pipeline is built (:func:`check_skips`; torchgpipe's :func:`verify_skippables` checks a module).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

from torch import Tensor, nn

__all__ = ["Namespace", "SkipError", "Skippable", "check_skips", "pop", "skippable", "stash", "verify_skippables"]

_local = threading.local()
_ids = itertools.count()


class SkipError(TypeError, RuntimeError):
    """A stash without its pop, a pop without its stash, or a name used undeclared. (A TypeError
    where torchgpipe checks a module's skips, a RuntimeError where it checks a call.)"""


class Namespace:
    """A namespace isolating skip names (:meth:`Skippable.isolate`).

    Namespaces are numbered in the order a process creates them, so that every process of a
    pipeline building the same model names the same namespaces alike (create them in the same
    order on every rank)."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = next(_ids)

    def __repr__(self) -> str:
        return f"<Namespace {self.id}>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __lt__(self, other: Namespace) -> bool:
        return self.id < other.id


def _key(ns: Namespace | None, name: str) -> str:
    """The name a skip travels under: isolated names carry their namespace."""
    return name if ns is None else f"{name}@ns{ns.id}"


S = TypeVar("S", bound="Skippable")


class Skippable(nn.Module):
    """A layer with declared skip connections: the layer class wrapped by :func:`skippable`
    (``self.module`` is the instance; its ``forward`` may stash and pop)."""

    module_cls: ClassVar[type[nn.Module]]
    stashable_names: ClassVar[frozenset[str]]
    poppable_names: ClassVar[frozenset[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> tuple[Namespace | None, str]:
        return self.namespaces.get(name), name

    def stashable(self) -> Iterable[tuple[Namespace | None, str]]:
        return (self.namespaced(n) for n in sorted(self.stashable_names))

    def poppable(self) -> Iterable[tuple[Namespace | None, str]]:
        return (self.namespaced(n) for n in sorted(self.poppable_names))

    def key(self, name: str) -> str:
        return _key(self.namespaces.get(name), name)

    def isolate(self: S, ns: Namespace, *, only: Iterable[str] | None = None) -> S:
        """Put this layer's skip names (or those in ``only``) into ``ns``; returns the layer."""
        names = self.stashable_names | self.poppable_names if only is None else set(only)
        for name in names:
            self.namespaces[name] = ns
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        frame = _Frame(self)
        stack = _frames()
        stack.append(frame)
        try:
            out = self.module(*args, **kwargs)
            if isinstance(out, Generator):
                out = _drive(out)
        finally:
            stack.pop()
        frame.check()
        return out


class _Frame:
    """The skippable layer whose forward is running, and what it stashed and popped."""

    __slots__ = ("layer", "popped", "stashed")

    def __init__(self, layer: Skippable) -> None:
        self.layer = layer
        self.stashed: set[str] = set()
        self.popped: set[str] = set()

    def check(self) -> None:
        for verb, declared, done in (
            ("stashed", self.layer.stashable_names, self.stashed),
            ("popped", self.layer.poppable_names, self.popped),
        ):
            missing = sorted(declared - done)
            if missing:
                names = ", ".join(f"'{n}'" for n in missing)
                raise SkipError(f"{type(self.layer).__name__}: {names} must be {verb} but have not been")


def _drive(generator: Generator[Any, Any, Any]) -> Any:
    """Run a forward written with torchgpipe's ``yield stash(...)`` / ``x = yield pop(...)``: the
    calls have acted already, so each yielded value is handed back (a popped tensor, or None)."""
    try:
        value = next(generator)
        while True:
            value = generator.send(value)
    except StopIteration as stop:
        return stop.value


def _frames() -> list[_Frame]:
    frames: list[_Frame] | None = getattr(_local, "frames", None)
    if frames is None:
        frames = _local.frames = []
    return frames


def skippable(*, stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Declare the names a layer class stashes and pops: the class becomes a :class:`Skippable`
    of the same name wrapping it (its instances hold the layer as ``.module``)."""
    stashable, poppable = frozenset(stash), frozenset(pop)

    def declare(cls: type[nn.Module]) -> type[Skippable]:
        attrs = {"module_cls": cls, "stashable_names": stashable, "poppable_names": poppable,
                 "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}  # fmt: skip
        return type(cls.__name__, (Skippable,), attrs)

    return declare


def _skips() -> dict[str, Any]:
    skips = getattr(_local, "skips", None)
    if skips is None:  # a plain run, outside any pipeline: one table per thread
        skips = _local.skips = {}
    return skips


def _declared_key(name: str, kind: str) -> str:
    """The key of ``name`` for the running skippable layer (checking it declared the name); the
    name itself outside any skippable layer."""
    frames: list[_Frame] | None = getattr(_local, "frames", None)
    if not frames:
        return name
    frame = frames[-1]
    layer = frame.layer
    declared = layer.stashable_names if kind == "stash" else layer.poppable_names
    if name not in declared:
        raise SkipError(
            f"{type(layer).__name__}: '{name}' has not been declared as {kind}able "
            f"(@skippable({kind}=[...]) names: {sorted(declared)})"
        )
    (frame.stashed if kind == "stash" else frame.popped).add(name)
    return layer.key(name)


def stash(name: str, tensor: Tensor | None) -> None:
    """Keep ``tensor`` under ``name`` for a later layer to :func:`pop` (also as ``yield stash(...)``)."""
    key = _declared_key(name, "stash")
    skips = _skips()
    if key in skips:
        raise SkipError(f"skip '{name}' is stashed again before it was popped")
    skips[key] = tensor


def pop(name: str) -> Any:
    """Take the tensor an earlier layer stashed under ``name`` (also as ``x = yield pop(...)``)."""
    key = _declared_key(name, "pop")
    skips = _skips()
    if key not in skips:
        raise SkipError(f"skip '{name}' is popped but was not stashed (or was popped already)")
    return skips.pop(key)


def enter(skips: dict[str, Any]) -> Any:
    """From now on, on this thread, :func:`stash` and :func:`pop` use ``skips``; returns what
    :func:`leave` needs to put the previous table back. (A pair of calls, not a context manager:
    a stage enters one per micro-batch, and the hot path stays cheap.)"""
    before = getattr(_local, "skips", None)
    _local.skips = skips
    return before


def leave(before: Any) -> None:
    _local.skips = before


def declared(layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(stashed, popped) skip keys a layer declares, its own and its submodules'."""
    stashes: list[str] = []
    pops: list[str] = []
    for m in layer.modules():
        if isinstance(m, Skippable):
            stashes += [_key(ns, n) for ns, n in m.stashable()]
            pops += [_key(ns, n) for ns, n in m.poppable()]
    return tuple(stashes), tuple(pops)


def check_skips(layers: Sequence[nn.Module]) -> None:
    """Every popped name is stashed by an earlier layer, every stashed name popped by a later one."""
    live: dict[str, int] = {}
    for i, layer in enumerate(layers):
        stashes, pops = declared(layer)
        for name in pops:
            if name not in live:
                raise SkipError(
                    f"layer {i} ({type(layer).__name__}) pops skip '{name}', which no earlier layer stashes"
                )
            del live[name]
        for name in stashes:
            if name in live:
                raise SkipError(
                    f"layer {i} ({type(layer).__name__}) stashes skip '{name}', already stashed by layer {live[name]} "
                    "and not popped yet (isolate the layers' names in a gpipe.skip.Namespace to use a name again)"
                )
            live[name] = i
    if live:
        name, i = next(iter(live.items()))
        raise SkipError(f"layer {i} ({type(layers[i]).__name__}) stashes skip '{name}', which no later layer pops")


def verify_skippables(module: nn.Sequential) -> None:
    """torchgpipe's check of a module's skippable children: every (namespace, name) stashed once
    and popped once, later. Raises :class:`SkipError` (a TypeError) listing every mismatch."""
    stashed: set[tuple[Namespace | None, str]] = set()
    popped: set[tuple[Namespace | None, str]] = set()
    problems: list[str] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        for name in sorted(layer.stashable_names & layer.poppable_names):
            problems.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable")
        for ns, name in layer.stashable():
            if name in layer.poppable_names:
                continue
            if (ns, name) in stashed:
                problems.append(f"'{layer_name}' redeclared '{name}' as stashable but not isolated by namespace")
                continue
            stashed.add((ns, name))
        for ns, name in layer.poppable():
            if name in layer.stashable_names:
                continue
            if (ns, name) in popped:
                problems.append(f"'{layer_name}' redeclared '{name}' as poppable but not isolated by namespace")
            elif (ns, name) not in stashed:
                problems.append(f"'{layer_name}' declared '{name}' as poppable but it was not stashed")
            else:
                popped.add((ns, name))
    for _, name in sorted(stashed - popped, key=lambda k: k[1]):
        problems.append(f"no module declared '{name}' as poppable but stashed")
    if problems:
        raise SkipError("one or more pairs of stash and pop do not match:\n\n" + "\n".join(f"* {p}" for p in problems))
