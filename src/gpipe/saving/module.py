"""A checkpoint back into the plain, unpipelined model the pipeline was cut from: :func:`load_module`."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from gpipe.saving.dcp import _dcp_load
from gpipe.saving.folders import MANIFEST, CheckpointError, _checkpoint_folder, _read_manifest
from gpipe.saving.keys import MODEL
from gpipe.saving.loader import _check_reads, _read_metadata, _shape, _template

__all__ = ["load_module"]


def load_module(module: nn.Module, directory: str | os.PathLike[str]) -> int:
    """Load the newest checkpoint of ``directory`` (or a ``step-*`` folder) into the plain,
    unpipelined model the pipeline was cut from; returns its step. The entries map to the module's
    own names: an ``nn.Sequential``'s by layer index (``model.12.weight`` is ``12.weight``); a
    module given to :func:`gpipe.to_sequential` (a Hugging Face model, say) by the qualified names
    its layers kept (``model.3.transformer.h.2.attn.c_attn.weight`` is
    ``transformer.h.2.attn.c_attn.weight``; a tied parameter, held by two layers, is both of its
    names). Every entry of the module must be in the checkpoint and every model entry of the
    checkpoint in the module, with its shape: else :class:`CheckpointError`, naming them, and the
    module is left unchanged. The optimizer's state is not read. The files read are first checked
    against the manifest's checksums, as :func:`~gpipe.saving.load` does."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    target = _checkpoint_folder(directory)
    manifest = _read_manifest(target / MANIFEST)
    metadata, _ = _read_metadata(target, manifest)
    saved = {key[len(MODEL) :]: md for key, md in metadata.state_dict_metadata.items() if key.startswith(MODEL)}
    expected = module.state_dict()
    if isinstance(module, nn.Sequential) and set(saved) == set(expected):
        sources = {name: [name] for name in expected}  # indices are the Sequential's own names
    else:
        sources = {}
        for key in saved:
            sources.setdefault(key.partition(".")[2], []).append(key)
    missing = sorted(set(expected) - set(sources))
    unexpected = sorted(set(sources) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(target)!r} does not match the {type(module).__name__}: it lacks {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} and holds {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
            "(load_module takes the nn.Sequential, or the module given to to_sequential, the pipeline was cut from)"
        )
    template: dict[str, Any] = {}
    for name, keys in sources.items():
        for key in keys:
            md = saved[key]
            value = expected[name]
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(value.shape):
                raise CheckpointError(
                    f"checkpoint {str(target)!r}: {MODEL}{key} is saved as {_shape(md)}, the module's {name!r} is "
                    f"{_shape(value)}"
                )
            template[MODEL + key] = _template(md)
    _check_reads(target, manifest, metadata, template)
    _dcp_load(template, target, metadata)
    state = {}
    for name, keys in sources.items():
        first = template[MODEL + keys[0]]
        for other in keys[1:]:  # a parameter several layers hold: one value
            if not torch.equal(first, template[MODEL + other]):
                raise CheckpointError(
                    f"checkpoint {str(target)!r}: layers hold different values of {name!r} ({MODEL}{keys[0]}, "
                    f"{MODEL}{other})"
                )
        state[name] = first
    module.load_state_dict(state)
    return int(manifest["step"])
