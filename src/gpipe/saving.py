"""Checkpoints of a pipeline that load into any number of stages.

Every layer's parameters and buffers are saved under its *global* index (``"12.weight"`` is the
weight of the model's layer 12, whichever stage held it), one file per stage. A checkpoint saved with
K stages therefore loads into a run with another K, or into the single-process front ends.

Layout of a checkpoint directory::

    ckpt/
      latest                      the name of the newest complete checkpoint
      step-00000100/
        layers-00000-00011.pt     one file per stage: its layers' state, by global index
        layers-00012-00023.pt
        manifest.json             written last: step, number of layers, files

Every file is written to a temporary name and renamed into place, the manifest only after every
stage's file (every rank's, under torch.distributed) is complete, and ``latest`` last of all: a crash
during a save leaves the previous checkpoint intact and loadable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.stage import Stage

__all__ = ["latest", "layer_state", "load", "save", "write_atomically"]

LATEST = "latest"
MANIFEST = "manifest.json"


def _stages(model: nn.Module) -> list[Stage]:
    executor = getattr(model, "_executor", None)
    if executor is None:
        raise TypeError(f"expected a gpipe.Pipeline or gpipe.GPipe, got {type(model).__name__}")
    return sorted(executor.stages.values(), key=lambda s: s.index)


def _layers(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    for stage in _stages(model):
        for j, layer in enumerate(stage.module):
            yield stage.first + j, layer


def layer_state(model: nn.Module) -> dict[str, Tensor]:
    """This process's layers' parameters and buffers, keyed ``"<global layer index>.<name>"``."""
    return {f"{i}.{name}": t.detach() for i, layer in _layers(model) for name, t in layer.state_dict().items()}


def write_atomically(path: Path, write: Any) -> None:
    """Call ``write(temporary_path)``, make it durable, then rename it to ``path``: readers see the
    old file or the complete new one, never a half-written one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _barrier(model: nn.Module) -> None:
    if getattr(model, "distributed", False):
        dist.barrier()


def save(model: nn.Module, directory: str | os.PathLike[str], step: int) -> Path:
    """Save ``model``'s layers as checkpoint ``step`` in ``directory``; under torch.distributed every
    rank calls it and writes its own stages. Returns the checkpoint's directory."""
    root = Path(directory)
    target = root / f"step-{step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    files = []
    for stage in _stages(model):
        last = stage.first + len(stage.module) - 1
        path = target / f"layers-{stage.first:05d}-{last:05d}.pt"
        state = {
            f"{stage.first + j}.{name}": t.detach().cpu()
            for j, layer in enumerate(stage.module)
            for name, t in layer.state_dict().items()
        }
        write_atomically(path, lambda p, state=state: torch.save(state, p))
        files.append(path.name)
    _barrier(model)
    rank0 = not getattr(model, "distributed", False) or dist.get_rank() == 0
    if rank0:
        num_layers = sum(getattr(model, "balance", []))
        manifest = {"step": step, "num_layers": num_layers, "files": sorted(p.name for p in target.glob("layers-*.pt"))}
        write_atomically(target / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1)))
        write_atomically(root / LATEST, lambda p: p.write_text(target.name))
    _barrier(model)
    return target


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``directory``, if any."""
    root = Path(directory)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    target = root / pointer.read_text().strip()
    return target if (target / MANIFEST).exists() else None


def load(model: nn.Module, directory: str | os.PathLike[str]) -> int:
    """Load the newest complete checkpoint of ``directory`` (or a ``step-*`` directory itself) into
    ``model``'s layers, whatever the number of stages it was saved with. Returns its step."""
    path = Path(directory)
    target = path if (path / MANIFEST).exists() else latest(path)
    if target is None:
        raise FileNotFoundError(f"no complete checkpoint in {str(directory)!r} (no {LATEST} or {MANIFEST})")
    manifest = json.loads((target / MANIFEST).read_text())
    num_layers = sum(getattr(model, "balance", []))
    if manifest["num_layers"] != num_layers:
        raise ValueError(
            f"checkpoint {str(target)!r} holds {manifest['num_layers']} layers, the model has {num_layers}"
        )
    wanted = {i: layer for i, layer in _layers(model)}
    found: dict[int, dict[str, Tensor]] = {}
    for name in manifest["files"]:
        first, last = (int(v) for v in name.removeprefix("layers-").removesuffix(".pt").split("-"))
        if not any(first <= i <= last for i in wanted):
            continue
        state = torch.load(target / name, map_location="cpu", weights_only=True, mmap=True)
        for key, tensor in state.items():
            index, _, rest = key.partition(".")
            if int(index) in wanted:
                found.setdefault(int(index), {})[rest] = tensor
    for i, layer in wanted.items():
        missing = set(layer.state_dict()) - set(found.get(i, {}))
        if missing:
            raise KeyError(f"checkpoint {str(target)!r} lacks {sorted(missing)} of layer {i}")
        layer.load_state_dict(found.get(i, {}))
    return int(manifest["step"])
