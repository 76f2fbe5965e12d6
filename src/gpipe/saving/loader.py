"""The load of a checkpoint into a pipeline: :func:`load`, with the checks of DCP's index against
the model's layers and the optimizer's parameters, before anything is changed."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gpipe.saving.checksums import _check, _listed
from gpipe.saving.dcp import _brief, _dcp_io, _dcp_load
from gpipe.saving.folders import MANIFEST, METADATA, CheckpointError, _checkpoint_folder, _read_manifest
from gpipe.saving.keys import GROUPS, MODEL, STATE, _engine, _layers, _optimizer_kind, _optimizer_params

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["_check_reads", "_read_metadata", "_shape", "_template", "load"]


def _read_metadata(target: Path, manifest: Mapping[str, Any]) -> tuple[Metadata, dict[str, Path]]:
    """DCP's index of checkpoint ``target``, checked (against its checksum first, if the manifest
    lists one), and the data file of each entry."""
    from torch.distributed.checkpoint.metadata import Metadata

    num_layers = manifest["num_layers"]
    path = target / METADATA
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, though {target / MANIFEST} says the checkpoint is complete")
    _check(target, manifest, [METADATA])
    _, reader = _dcp_io()
    try:
        metadata = reader(target, None).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable (truncated or corrupt?): {_brief(e)}") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: not DCP's index of a checkpoint (a {type(metadata).__name__})")
    for key in metadata.state_dict_metadata:
        if not isinstance(key, str) or not key.startswith((MODEL, STATE, GROUPS)):
            raise CheckpointError(f"{path}: holds {key!r:.80}, not an entry of a gpipe checkpoint")
        if key.startswith(MODEL):
            index, _, rest = key[len(MODEL) :].partition(".")
            if not index.isdigit() or not rest:
                raise CheckpointError(f"{path}: holds {key!r:.80}, not a 'model.<layer>.<name>' entry")
            if int(index) >= num_layers:
                raise CheckpointError(f"{path}: holds {key!r:.80} of layer {index}, of a model of {num_layers} layers")
    files: dict[str, Path] = {}
    for index, where in (metadata.storage_data or {}).items():
        name = getattr(where, "relative_path", None)
        if not isinstance(name, str) or not name or name != Path(name).name or name.startswith("."):
            raise CheckpointError(
                f"{path}: places {getattr(index, 'fqn', index)!r:.80} in {name!r:.80}, not a file of it"
            )
        files.setdefault(getattr(index, "fqn", ""), target / name)
    return metadata, files


def _check_reads(target: Path, manifest: Mapping[str, Any], metadata: Metadata, keys: Iterable[str]) -> None:
    """Check, against the manifest's checksums, the files this process is about to read: the data
    files that hold the entries ``keys`` and the small files beside them (``extra``'s), DCP's index
    being checked already. Not the data files of other ranks' entries: under torch.distributed each
    rank checks the files it reads, so that a load stays local (no collective: a rank may load
    alone), the stages' ranks share the work (each reads its own layers' files), and each file is
    read just before DCP reads it again, from the page cache. Data-parallel replicas check the same
    files. :func:`verify` checks them all."""
    wanted = set(keys)
    storage = (metadata.storage_data or {}).items()
    data = {getattr(where, "relative_path", None) for _, where in storage}
    read = {getattr(where, "relative_path", "") for index, where in storage if getattr(index, "fqn", None) in wanted}
    listing = _listed(manifest, target / MANIFEST) or {}
    _check(target, manifest, read | {name for name in listing if name not in data and name != METADATA})


def _same(a: Any, b: Any) -> bool:
    """Whether two hyper-parameter values are identical (tensors bitwise)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _template(md: Any, like: Any = None) -> Any:
    """Where DCP reads an entry of metadata ``md``: a tensor of its shape and dtype, or None (a pickle).
    Where the model holds a shard of it (``like``, a ``DTensor`` of that shape: a stage sharded with
    ``fsdp=True``), a ``DTensor`` sharded alike, so that this rank reads its shard only."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(md, TensorStorageMetadata):
        return None
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(md.size):
        return torch.empty_like(like, dtype=md.properties.dtype)
    return torch.empty(md.size, dtype=md.properties.dtype)


class _OptimizerLoad:
    """What to read of a checkpoint for ``optimizer``, and its state dict once read."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata, target: Path) -> None:
        self.packed = optimizer.state_dict()
        self.target = target
        self.groups = _optimizer_params(model, optimizer, self.packed)
        saved = metadata.state_dict_metadata
        local = {name for members in self.groups for _, names in members for name in names}
        self.keys: dict[str, list[str]] = {name: [] for name in local}
        for key in saved:
            if not key.startswith(STATE):
                continue
            rest = key[len(STATE) :]
            for at in (i for i, c in enumerate(rest) if c == "."):  # the parameter's name ends at a dot
                if rest[:at] in local:
                    self.keys[rest[:at]].append(rest[at + 1 :])
                    break
        self.template: dict[str, Any] = {}
        self.chosen: list[list[tuple[int, str]]] = []
        params = [p for group in optimizer.param_groups for p in group["params"]]  # by the state's index
        for members in self.groups:
            chosen = []
            for index, names in members:
                name = next((n for n in names if f"{GROUPS}{n}" in saved), None)
                if name is None:
                    raise CheckpointError(
                        f"checkpoint {str(target)!r} holds no optimizer state of parameter {names[0]!r}: "
                        "the optimizer saved did not hold it"
                    )
                chosen.append((index, name))
                self.template[f"{GROUPS}{name}"] = None
                for key in self.keys[name]:
                    self.template[f"{STATE}{name}.{key}"] = _template(saved[f"{STATE}{name}.{key}"], params[index])
            self.chosen.append(chosen)

    def state_dict(self, read: Mapping[str, Any]) -> dict[str, Any]:
        state: dict[Any, Any] = {}
        groups = []
        for g, (chosen, packed) in enumerate(zip(self.chosen, self.packed["param_groups"])):
            hyper: dict[str, Any] | None = None
            first = ""
            for index, name in chosen:
                value = read[f"{GROUPS}{name}"]
                if not isinstance(value, dict):
                    raise CheckpointError(
                        f"checkpoint {str(self.target)!r}: {GROUPS}{name} should be a dict of hyper-parameters, "
                        f"got a {type(value).__name__}"
                    )
                if hyper is None:
                    hyper, first = value, name
                elif not _same(value, hyper):
                    raise CheckpointError(
                        f"checkpoint {str(self.target)!r}: the optimizer's param group {g} holds parameters "
                        f"saved with other hyper-parameters ({first!r}: {hyper}; {name!r}: {value}); group the "
                        "parameters as when the checkpoint was saved"
                    )
                if self.keys[name]:
                    state[index] = {key: read[f"{STATE}{name}.{key}"] for key in self.keys[name]}
            group = dict(packed) if hyper is None else {**hyper, "params": packed["params"]}
            if "param_names" in packed:
                group["param_names"] = packed["param_names"]
            groups.append(group)
        return {"state": state, "param_groups": groups}


def _shape(t: Tensor | Any) -> str:
    return str(tuple(t.shape if isinstance(t, Tensor) else t.size))


def load(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    grow_rows: bool = False,
) -> int:
    """Load the newest complete checkpoint of ``directory`` (or a ``step-*`` directory itself) into
    ``model``'s layers, whatever the number of stages it was saved with, and into ``optimizer`` (over
    parameters of this process's layers) its saved state and hyper-parameters. Returns its step.

    ``grow_rows`` (weights only): an entry saved with fewer rows (dim 0) than the model's tensor,
    the other dimensions alike, fills its first rows and leaves the others as they are: a vocabulary
    grown by pieces appended after its own (the embeddings' and the output's new rows keep their
    initialization).

    Raises :class:`CheckpointError` (a ValueError) naming the file, and the layer, where the
    checkpoint is corrupt, incomplete or of another shape than the model, or lacks the optimizer
    state asked for; nothing is changed then. The files it reads are first checked against the
    sizes and checksums the manifest lists (a checkpoint saved before checksums lists none: it loads
    as before): a file of another size or digest raises :class:`CheckpointError` naming it
    (``.../__1_0.distcp: truncated: 1234 of 5678 bytes``, ``...: corrupt: its sha256 differs from
    the manifest's``). Under torch.distributed each process checks the files it reads (DCP's index,
    the data files of its layers, the small files beside them), with no collective."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if grow_rows and optimizer is not None:
        raise CheckpointError(
            "grow_rows loads weights only (the optimizer's state is of the old shapes): give no optimizer"
        )
    target = _checkpoint_folder(directory)
    manifest = _read_manifest(target / MANIFEST)
    num_layers = sum(_engine(model).balance)
    if manifest["num_layers"] != num_layers:
        raise CheckpointError(
            f"checkpoint {str(target)!r} holds {manifest['num_layers']} layers, the model has {num_layers}"
        )
    if optimizer is not None:
        saved_kind, kind = manifest.get("optimizer"), _optimizer_kind(optimizer)
        if saved_kind is None:
            raise CheckpointError(
                f"checkpoint {str(target)!r} holds no optimizer state (saved without optimizer=); "
                "load it without optimizer="
            )
        if saved_kind != kind:
            raise CheckpointError(f"checkpoint {str(target)!r} holds the state of a {saved_kind}, not of a {kind}")
    metadata, files = _read_metadata(target, manifest)
    saved = metadata.state_dict_metadata
    template: dict[str, Any] = {}
    grown: dict[str, Tensor] = {}  # entries saved with fewer rows, by key: the model's tensor
    wanted = dict(_layers(model))
    for i, layer in wanted.items():
        expected = layer.state_dict()
        prefix = f"{MODEL}{i}."
        held = {key[len(prefix) :] for key in saved if key.startswith(prefix)}
        where = next((files[prefix + k] for k in sorted(held) if prefix + k in files), target)
        missing = sorted(set(expected) - held)
        if missing:
            raise CheckpointError(f"checkpoint {str(where)!r} lacks {[f'{i}.{k}' for k in missing]} of layer {i}")
        unexpected = sorted(held - set(expected))
        if unexpected:
            raise CheckpointError(
                f"checkpoint {str(where)!r} holds {[f'{i}.{k}' for k in unexpected]}, which the model's layer {i} "
                f"({type(layer).__name__}) lacks"
            )
        for key, value in expected.items():
            md = saved[prefix + key]
            where = files.get(prefix + key, target)
            if isinstance(value, Tensor) != isinstance(md, TensorStorageMetadata):
                raise CheckpointError(
                    f"checkpoint layer {i} ({f'{i}.{key}'!r}, {type(layer).__name__}) in {str(where)!r}: saved "
                    f"{'a tensor' if isinstance(md, TensorStorageMetadata) else 'an object'}, the model's is "
                    f"{'a tensor' if isinstance(value, Tensor) else 'not'}"
                )
            if grow_rows and _grows(md, value):
                if isinstance(value, DTensor):
                    raise CheckpointError(
                        f"checkpoint layer {i} ({f'{i}.{key}'!r}): grown rows of a sharded tensor are not read; "
                        "load it into unsharded layers"
                    )
                grown[prefix + key] = value
            elif isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(value.shape):
                raise CheckpointError(
                    f"checkpoint layer {i} ({f'{i}.{key}'!r}, {type(layer).__name__}) in {str(where)!r}: "
                    f"saved shape {_shape(md)}, model's {_shape(value)}"
                )
            template[prefix + key] = _template(md, value)
    plan = None if optimizer is None else _OptimizerLoad(model, optimizer, metadata, target)
    if plan is not None:
        template.update(plan.template)
    _check_reads(target, manifest, metadata, template)
    _dcp_load(template, target, metadata)
    if plan is not None and optimizer is not None:  # first: the likelier to refuse what it is given
        optimizer.load_state_dict(plan.state_dict(template))
    for key, value in grown.items():  # the saved rows first, the model's own after them
        rows = template[key]
        template[key] = torch.cat([rows.to(value.dtype), value.detach()[len(rows) :].to(rows.device)])
    for i, layer in wanted.items():
        prefix = f"{MODEL}{i}."
        layer.load_state_dict({key: template[prefix + key] for key in layer.state_dict()})
    return int(manifest["step"])


def _grows(md: Any, value: Any) -> bool:
    """Whether the entry ``md`` is ``value`` with fewer rows: dim 0 smaller, the others alike."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(md, TensorStorageMetadata) or not isinstance(value, Tensor) or value.dim() == 0:
        return False
    saved = tuple(md.size)
    return len(saved) == value.dim() and saved[1:] == tuple(value.shape[1:]) and saved[0] < value.shape[0]
