"""Host reads of tensor values from gpipe's own code, counted: each one, on a GPU, waits for the device.

:func:`counting` wraps ``Tensor.item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__float__``,
``__int__`` and ``__index__`` and counts each call that gpipe's own code makes (the calling line, in
gpipe's package, outside its data and saving code, which read host tensors by design). Reads inside
PyTorch are not counted: an optimizer's step counters, for one, are host tensors by PyTorch's design.
A ``.cpu()`` of a CPU tensor counts: on a GPU it would be a copy that waits."""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import gpipe

PACKAGE = str(Path(gpipe.__file__).resolve().parent)
EXCLUDED = tuple(f"{PACKAGE}/{d}/" for d in ("data", "saving"))
METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


def _where() -> str | None:
    """gpipe's line that made the call (its caller's frame), else None."""
    frame = sys._getframe(2)
    name = frame.f_code.co_filename
    if name.startswith(PACKAGE) and not name.startswith(EXCLUDED):
        return f"{name[len(PACKAGE) + 1 :]}:{frame.f_lineno}"
    return None


@contextmanager
def counting() -> Iterator[collections.Counter[str]]:
    """Count the host reads of gpipe's code (by file:line) while the block runs."""
    counts: collections.Counter[str] = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in METHODS}

    def wrap(name: str, original: Any) -> Any:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            where = _where()
            if where is not None:
                counts[where] += 1
            return original(self, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
