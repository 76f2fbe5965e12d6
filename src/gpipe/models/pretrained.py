"""Pretrained weights for ``gpipe train --model hf --init DIR``: a folder ``save_pretrained`` wrote
(``config.json``, ``model.safetensors`` or shards listed by ``model.safetensors.index.json``), read
stage by stage.

The model is built on the meta device and traced into pipeline layers as for random weights
(:mod:`gpipe.models.hf`); the pipeline then materializes only the layers of its own stages, each
with the initialization the layer brings. :func:`attach` makes that initialization a
:class:`Loader`: the layer's tensors are read from the files lazily (``safetensors.safe_open``, one
tensor at a time, converted into the run's float32 by the copy), and only what the folder does not
hold (buffers the model computes, such as rotary tables) is left to the model's own
``_init_weights``, which skips what was loaded as ``from_pretrained`` does (transformers'
``_is_hf_initialized`` flag). A process therefore reads the bytes of its own stages only: under
torchrun each rank reads its stage.

:func:`plan` checks the whole folder against the model before anything is built, from the files'
headers alone (no tensor is read): every parameter must be found with its shape, every tensor of
the folder must be the model's (or one transformers ignores), every file the index names must be
there. Each problem is one :class:`ValueError` naming the file or the tensor, raised alike in every
process, so that nothing half-loaded trains.

Names: a layer's tensors keep the model's qualified names (``model.layers.3.mlp.up_proj.weight``),
which are the names ``save_pretrained`` writes. A checkpoint of the bare base model (its keys without
``model.`` / ``transformer.``, as old GPT-2 files have them) is read too. Tied input and output
embeddings (GPT-2, Gemma: the output projection is absent from the files) are read from the
embedding's tensor on both stages. LoRA's wrapped weights (``q_proj.base_layer.weight``) are the
folder's ``q_proj.weight``; the adapters themselves are not in the folder (their own initialization
makes them).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.models.hf import initialized

__all__ = ["INDEX", "SINGLE", "Loader", "Source", "attach", "is_pretrained", "plan", "tokenizer_path"]

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def is_pretrained(path: str | Path) -> bool:
    """Whether ``path`` is a folder ``save_pretrained`` wrote: a ``config.json`` and safetensors
    weights (one file, an index of shards, or ``pytorch_model.bin``, which :func:`plan` refuses
    with the fix)."""
    folder = Path(path)
    return (folder / "config.json").is_file() and any(
        (folder / name).is_file() for name in (SINGLE, INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json")
    )


def tokenizer_path(folder: str | Path) -> Path | None:
    """The tokenizer a pretrained folder brings: its ``tokenizer.json``, else a SentencePiece
    ``tokenizer.model``; None if it has neither."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def _headers(folder: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    """Each tensor of the folder: its shape and the file that holds it, from the index's weight map
    (every shard it names present and holding what it says) or the one file, each file's header read
    once; a :class:`ValueError` naming what is missing or unreadable."""
    named: dict[str, Path] | None = None
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--init: cannot read the index {str(folder / INDEX)!r}: {exc}") from None
        named = {str(key): folder / str(name) for key, name in weight_map.items()}
        shards = sorted(set(named.values()))
        for file in shards:
            if not file.is_file():
                raise ValueError(
                    f"--init: {str(folder / INDEX)!r} names the shard {file.name!r}, which is not in {str(folder)!r}; "
                    "copy the whole folder save_pretrained wrote"
                )
    elif (folder / SINGLE).is_file():
        shards = [folder / SINGLE]
    elif any((folder / n).is_file() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise ValueError(
            f"--init {str(folder)!r} holds pytorch_model.bin weights, which gpipe does not read (unpickling runs "
            "code, and a stage cannot read its share of it): convert them once with "
            "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder) (it writes model.safetensors)"
        )
    else:
        raise ValueError(
            f"--init {str(folder)!r} holds no {SINGLE} nor {INDEX}: give a folder that save_pretrained wrote, or a "
            "run or checkpoint of gpipe train"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    files: dict[str, Path] = {}
    for file in shards:
        with _opened(file) as f:
            held = set(f.keys())
            keys = held if named is None else {k for k, v in named.items() if v == file}
            if keys - held:  # the index must say what the shards hold
                raise ValueError(
                    f"--init: {str(folder / INDEX)!r} puts {sorted(keys - held)[:3]} in {str(file)!r}, which does "
                    "not hold it: a shard of another save; copy the whole folder again"
                )
            for key in keys:
                shapes[key], files[key] = tuple(f.get_slice(key).get_shape()), file
    return shapes, files


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """``safe_open(file)``, with an unreadable file as a :class:`ValueError` naming it. Closing it
    unmaps the file: the pages read leave the process."""
    from safetensors import SafetensorError, safe_open

    try:
        handle: Any = safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"--init: cannot read {str(file)!r} as safetensors: {exc}") from None
    with handle as opened:
        yield opened


@dataclass
class Source:
    """Where each tensor of a model is in a pretrained folder: ``names[model name] = folder key``,
    ``files[folder key] = file``."""

    folder: Path
    names: dict[str, str]
    files: dict[str, Path]

    def read(self, wanted: Mapping[str, Tensor]) -> Iterable[tuple[str, Tensor]]:
        """The values of the model's tensors ``wanted`` (by name; those the folder holds), one at a
        time, each file opened once and closed after its tensors (its pages leave the process
        then). Where a tensor of ``wanted`` is a DTensor (split by tensor parallelism, sharded by
        FSDP), its value is this rank's shard: the slice of the file's tensor the shard covers,
        read alone (a strided shard, FSDP's over tensor parallelism's: the tensor read, then cut)."""
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            key = self.names.get(name)
            if key is not None:
                by_file.setdefault(self.files[key], []).append(name)
        for file, names in by_file.items():
            with _opened(file) as f:
                for name in names:
                    yield name, _shard(f, self.names[name], wanted[name])


def _shard(opened: Any, key: str, like: Tensor) -> Tensor:
    """The value of ``like`` in the file ``opened``: the tensor ``key``, or the part of it this
    rank's shard of ``like`` (a DTensor) covers."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(like, DTensor):
        return opened.get_tensor(key)  # type: ignore[no-any-return]
    if all(type(p) in (Shard, Replicate) for p in like.placements):
        shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
        part: Tensor = opened.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        return part
    whole = opened.get_tensor(key)  # (cut as DTensor cuts it, without communication)
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()


def plan(model: nn.Module, folder: str | Path) -> Source:
    """Map every tensor of ``model`` (a transformers model, on the meta device or not) to the
    pretrained ``folder``'s, from the files' headers; a :class:`ValueError` naming the tensor and
    the file where one is missing, of another shape, or not the model's (see the module docstring)."""
    root = Path(folder)
    shapes, files = _headers(root)
    expected = model.state_dict()
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied = _tied(model)
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    names: dict[str, str] = {}
    missing = []
    for name, value in expected.items():
        if _is_adapter(name):
            continue  # (LoRA's own initialization makes it)
        key = _find(name, shapes, prefix, tied)
        if key is None:
            if name in params:
                missing.append(name)
            continue  # (a buffer the model computes: its own initialization writes it)
        if shapes[key] != tuple(value.shape):
            raise ValueError(
                f"--init: {str(files[key])!r} holds {key!r} of shape {list(shapes[key])}, the model's {name!r} is "
                f"{list(value.shape)}: the config.json and the weights are of different models"
            )
        names[name] = key
    if missing:
        hint = _conversion_hint(model)
        raise ValueError(
            f"--init {str(root)!r} lacks {len(missing)} tensor(s) of the {type(model).__name__}: "
            f"{missing[:3]}{' ...' if len(missing) > 3 else ''}{hint}"
        )
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = sorted(k for k in set(shapes) - set(names.values()) if not any(p.search(k) for p in ignored))
    if unexpected:
        raise ValueError(
            f"--init {str(root)!r}: {str(files[unexpected[0]])!r} holds {len(unexpected)} tensor(s) the "
            f"{type(model).__name__} of its config.json lacks: {unexpected[:3]}"
            f"{' ...' if len(unexpected) > 3 else ''}; a checkpoint of another model?"
        )
    return Source(root, names, files)


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def _find(name: str, held: Mapping[str, Any], prefix: str, tied: Mapping[str, str]) -> str | None:
    """The folder's key of the model's tensor ``name``: itself, without LoRA's ``base_layer.``,
    with or without the base model's prefix, or the tensor it is tied to."""
    plain = name.replace(".base_layer.", ".")
    candidates = [plain]
    if prefix and plain.startswith(prefix + "."):
        candidates.append(plain[len(prefix) + 1 :])
    elif prefix:
        candidates.append(f"{prefix}.{plain}")
    source = tied.get(plain)
    if source is not None:
        candidates.append(source)
        if prefix and source.startswith(prefix + "."):
            candidates.append(source[len(prefix) + 1 :])
    return next((c for c in candidates if c in held), None)


def _tied(model: nn.Module) -> dict[str, str]:
    """The model's tied tensors, target to source (``lm_head.weight`` to the embedding's), where its
    config ties them."""
    expanded = getattr(model, "get_expanded_tied_weights_keys", None)
    if not callable(expanded):
        return {}
    try:
        found = expanded(all_submodels=True)
    except (TypeError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in (found or {}).items()}


def _conversion_hint(model: nn.Module) -> str:
    """Where transformers renames or fuses a model type's tensors on loading, say so: ``--init``
    reads tensors as they are stored."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from transformers import conversion_mapping

        mapping: Any = conversion_mapping.get_checkpoint_conversion_mapping
        converted = bool(mapping(model_type))
    except (ImportError, KeyError, TypeError, ValueError):
        converted = False
    if converted:
        return (
            f"; transformers converts {model_type!r} checkpoints as it loads them, and --init reads tensors as "
            "stored: load it once with from_pretrained and save_pretrained it into a new folder"
        )
    return "; is it a checkpoint of another model?"


class Loader:
    """A layer's initialization that reads its tensors from a pretrained folder (see
    :func:`attach`), then lets ``then`` (the model's own initialization, or None) write the rest;
    what ``then`` would overwrite is flagged as loaded, as ``from_pretrained`` flags it."""

    reads_shards = True  # (gpipe.runtime.partition.reads_shards: split or sharded, it reads its slices alone)

    def __init__(self, source: Source, then: Callable[[nn.Module], None] | None) -> None:
        self.source, self.then = source, then

    def fills(self, layer: nn.Module) -> list[str]:
        """The tensors of ``layer`` it overwrites whole, by name: those the folder holds (their
        shapes checked by :func:`plan`; a DTensor's local shard whole). The pipeline neither fills
        them with NaN first nor checks them after (``gpipe.runtime.partition``)."""
        return [name for name in layer.state_dict(keep_vars=True) if name in self.source.names]

    def __call__(self, layer: nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        tensors = layer.state_dict(keep_vars=True)
        loaded = []
        with torch.no_grad():
            for name, value in self.source.read(tensors):
                target = tensors[name]
                local = target.to_local() if isinstance(target, DTensor) else target
                local.copy_(value)  # (the run's dtype: bf16 or fp16 weights become float32)
                loaded.append(target)
        if self.then is not None:
            with initialized(loaded):  # (its initializers skip what was read)
                self.then(layer)


def attach(layers: nn.Sequential, source: Source) -> None:
    """Make each layer's initialization (what the pipeline runs when it materializes the layer from
    the meta device) read its tensors from ``source`` first."""
    from gpipe.runtime.partition import init_of
    from gpipe.sequential.layers import bring_init

    for layer in layers:
        bring_init(layer, Loader(source, init_of(layer, None)))
