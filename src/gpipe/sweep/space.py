"""A sweep's ``SPACE.toml``: the ``[fixed]`` settings of ``gpipe train`` every trial shares and the
``[search]`` space Optuna samples, read and checked whole before any trial runs.

    [fixed]                                   # gpipe train's settings, by flag name (- or _)
    steps = 300
    eval-every = 50

    [search]
    lr = { low = 1e-4, high = 1e-1, log = true }   # a float range (log: sampled on a log scale)
    warmup = { low = 10, high = 200, step = 10 }   # an integer range, for an integer setting
    schedule = { choices = ["gpipe", "1f1b"] }     # choices, of the setting's own type

A range of an integer setting is an integer range (integer bounds); a float setting's bounds may be
written as integers. A string or boolean setting takes ``choices`` only.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gpipe.commands.args import UsageError
from gpipe.train.checks import ConfigError, flag, typed
from gpipe.train.config import TrainConfig

__all__ = ["OWNED", "Dimension", "Space", "SpaceError", "read_space"]

OWNED = ("out", "resume", "overwrite")  # the sweep sets them for each trial


class SpaceError(UsageError):
    """A bad ``SPACE.toml``: one line, before any trial runs."""


_KINDS = {f.name: str(f.type) for f in fields(TrainConfig)}
_RANGE_KEYS = {"low", "high", "log", "step"}


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """One setting of ``[search]``: a range (``low``, ``high``, ``log``, ``step``) or ``choices``."""

    name: str  # TrainConfig's field
    kind: str  # "float", "int" (ranges) or "choices"
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Any) -> Any:
        """The Optuna trial's value."""
        if self.kind == "choices":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def grid(self) -> list[Any] | None:
        """Every value, for the grid sampler; None for a continuous range."""
        if self.kind == "choices":
            return list(self.choices)
        if self.step is None and self.kind == "float":
            return None
        step = self.step or 1
        count = math.floor((self.high - self.low) / step + 1e-9) + 1
        values = [self.low + i * step for i in range(count)]
        return [int(v) for v in values] if self.kind == "int" else values

    def corners(self) -> list[Any]:
        """The values every setting check sees before a trial runs: the bounds, or every choice."""
        if self.kind == "choices":
            return list(self.choices)
        cast = int if self.kind == "int" else float
        return [cast(self.low), cast(self.high)]

    def describe(self) -> str:
        if self.kind == "choices":
            return f"{flag(self.name)} in {{{', '.join(map(str, self.choices))}}}"
        extra = ", log" if self.log else ""
        extra += f", step {self.step:g}" if self.step is not None else ""
        return f"{flag(self.name)} in [{self.low:g}, {self.high:g}{extra}]"


@dataclass(frozen=True, kw_only=True)
class Space:
    """A checked ``SPACE.toml``: ``fixed`` settings (TrainConfig's field names) and the ``search`` space."""

    fixed: dict[str, Any]
    search: tuple[Dimension, ...]
    path: str = ""

    def config(self, params: Mapping[str, Any], **owned: Any) -> TrainConfig:
        """A trial's settings: the fixed ones, the trial's ``params`` and the sweep's own (``out``, ...)."""
        return TrainConfig(**{**self.fixed, **params, **owned})

    def grid(self) -> dict[str, list[Any]]:
        """The grid sampler's space; a :class:`SpaceError` naming a continuous range."""
        continuous = [d.name for d in self.search if d.grid() is None]
        if continuous:
            raise SpaceError(
                f"--sampler grid needs a finite space, and {', '.join(map(flag, continuous))} in "
                f"{self.path!r} is a continuous range: give it a step (e.g. {{ low, high, step }}) or choices"
            )
        return {d.name: d.grid() or [] for d in self.search}

    def grid_size(self) -> int:
        return math.prod(len(values) for values in self.grid().values())

    def as_dict(self) -> dict[str, Any]:
        """What the sweep keeps in ``DIR/sweep.json``, to tell a continued study's space from another."""
        return {"fixed": self.fixed, "search": {d.name: _plain(d) for d in self.search}}


def _plain(d: Dimension) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(d).items() if k != "name"} | {"choices": list(d.choices)}


def read_space(path: str, out: str) -> Space:
    """``SPACE.toml`` read and checked: unknown settings, ill-typed values, bad ranges, the sweep's own
    settings and settings ``gpipe train`` would refuse (each range's bounds and each choice, with the
    fixed settings) are each a :class:`SpaceError` naming the entry and a fix."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SpaceError(f"cannot read the sweep's space {path!r}: {exc}") from None
    unknown = sorted(set(data) - {"fixed", "search"})
    if unknown:
        raise SpaceError(
            f"{path!r} has the table(s) {', '.join(map(repr, unknown))}; a space has [fixed] (settings every trial "
            "shares) and [search] (the settings to tune)"
        )
    for table in ("fixed", "search"):
        if not isinstance(data.get(table, {}), dict):
            raise SpaceError(f"[{table}] in {path!r} must be a table of settings")
    fixed = {_name(key, path, "fixed"): value for key, value in data.get("fixed", {}).items()}
    fixed = {name: typed(flag(name), value, _KINDS[name], where=path) for name, value in fixed.items()}
    search = tuple(_dimension(_name(key, path, "search"), value, path) for key, value in data.get("search", {}).items())
    if not search:
        raise SpaceError(f"{path!r} has nothing to search: add a [search] table, e.g. lr = {{ low = 1e-4, high = 1e-1, "
                         "log = true }")  # fmt: skip
    both = sorted(set(fixed) & {d.name for d in search})
    if both:
        raise SpaceError(f"{', '.join(map(flag, both))} in {path!r} is both fixed and searched; keep one")
    space = Space(fixed=fixed, search=search, path=path)
    _check_settings(space, out)
    return space


def _name(key: str, path: str, table: str) -> str:
    name = key.replace("-", "_")
    if name in OWNED:
        raise SpaceError(f"{key} in [{table}] of {path!r}: the sweep sets it for each trial (its run folder "
                         "DIR/trial-NNN, resumed when a trial is re-run); remove it")  # fmt: skip
    if name not in _KINDS:
        close = difflib.get_close_matches(name, _KINDS, n=3)
        hint = f"did you mean {' or '.join(repr(flag(c)) for c in close)}?" if close else "see gpipe train -h"
        raise SpaceError(f"unknown setting {key!r} in [{table}] of {path!r}; {hint}")
    return name


def _dimension(name: str, spec: Any, path: str) -> Dimension:
    kind = _KINDS[name]
    where = f"{flag(name)} in [search] of {path!r}"
    if not isinstance(spec, dict):
        raise SpaceError(f"{where} is {spec!r}; a searched setting is a range {{ low = ..., high = ... }} or "
                         f"{{ choices = [...] }} (a single value goes under [fixed])")  # fmt: skip
    if "choices" in spec:
        if set(spec) != {"choices"}:
            raise SpaceError(f"{where} mixes choices with {', '.join(sorted(set(spec) - {'choices'}))}; give one")
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise SpaceError(f"{where}: choices must be a non-empty list (got {choices!r})")
        values = tuple(typed(f"{flag(name)}'s choice", c, kind, where=path) for c in choices)
        if len(set(values)) != len(values):
            raise SpaceError(f"{where} lists a choice twice: {list(values)}")
        return Dimension(name=name, kind="choices", choices=values)
    if kind in ("str", "bool"):
        raise SpaceError(f"{where}: a {'string' if kind == 'str' else 'boolean'} setting takes choices, not a "
                         f"range: {flag(name)} = {{ choices = [...] }}")  # fmt: skip
    extra = sorted(set(spec) - _RANGE_KEYS)
    missing = sorted({"low", "high"} - set(spec))
    if extra or missing:
        what = f"unknown key(s) {', '.join(extra)}" if extra else f"no {' and no '.join(missing)}"
        raise SpaceError(f"{where} has {what}; a range is {{ low, high }} with log = true or step = S if wanted")
    low, high = (typed(f"{flag(name)}'s {k}", spec[k], kind, where=path) for k in ("low", "high"))
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SpaceError(f"{where}: log must be true or false (got {log!r})")
    step = None if "step" not in spec else typed(f"{flag(name)}'s step", spec["step"], kind, where=path)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise SpaceError(f"{where}: low must be below high, both finite (got low {low}, high {high})")
    if log and low <= 0:
        raise SpaceError(f"{where}: a log range needs low > 0 (got {low})")
    if step is not None and not 0 < step <= high - low:
        raise SpaceError(f"{where}: step must be positive and at most high - low (got {step})")
    if step is not None and log and not (kind == "int" and step == 1):
        raise SpaceError(f"{where}: a log range takes no step (Optuna samples a log range continuously)")
    return Dimension(name=name, kind=kind, low=low, high=high, log=log, step=step)


def _check_settings(space: Space, out: str) -> None:
    """Every value a trial may take, with the fixed settings, as ``gpipe train`` checks it (each bound or
    choice of a setting with the first value of the others): a refusal names the value."""
    first = {d.name: d.corners()[0] for d in space.search}
    trial = str(Path(out) / "trial-000")
    for d, value in itertools.chain.from_iterable(((d, v) for v in d.corners()) for d in space.search):
        try:
            space.config({**first, d.name: value}, out=trial).check()
        except ConfigError as exc:
            raise SpaceError(f"{space.path!r}: with {flag(d.name)} = {value!r}, gpipe train refuses: {exc}") from None
    if not space.config(first, out=trial).eval_every:
        raise SpaceError(
            f"{space.path!r} sets eval-every = 0: a sweep ranks and prunes trials on their evaluations; "
            "give eval-every > 0"
        )
