"""LoRA adapters, with the peft library, on the Hugging Face causal LMs of ``gpipe train --model hf``.

LoRA trains a small low-rank update ``B A`` beside chosen linear layers of a model whose own weights
stay frozen. peft adds the adapters to the transformers model in place
(:func:`peft.inject_adapter_in_model`), before it is traced into pipeline layers, so that the layers
carry them under the model's own qualified names (``...q_proj.base_layer.weight``,
``...q_proj.lora_A.default.weight``): a checkpoint of the pipeline loads back into the plain model
with the same adapters (:func:`gpipe.saving.load_module`), and :func:`write_adapter` writes what peft
writes, an adapter folder or the merged model.

    model = hf.build(config)                                      # on the meta device
    adapters = add_adapters(model, rank=8, targets=targets_for(config, []))   # peft's default targets
    layers = hf.pipeline_layers(model, sample)
    with_adapter_init(layers)                                     # after each layer's own init: peft's
    ...                                                           # train; keep lora_json(adapters) as lora.json
    write_adapter(config, read_lora(run), checkpoint, "adapter", merge=False, base="base-model")

peft, like transformers, is imported only when these functions run.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from gpipe.models.hf import initialized
from gpipe.sequential.layers import bring_init

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = [
    "ADAPTER",
    "DEFAULT_TARGETS",
    "LORA",
    "add_adapters",
    "init_adapters",
    "lora_json",
    "read_lora",
    "targets_for",
    "with_adapter_init",
    "write_adapter",
]

ADAPTER = "default"  # the adapter's name in peft (``lora_A.default``): one adapter per model
LORA = "lora.json"  # beside config.json in every checkpoint of a run with adapters (:func:`lora_json`)


def _peft() -> Any:
    """The peft module, imported on first use; a :class:`ValueError` saying how to install it."""
    try:
        return importlib.import_module("peft")
    except ImportError:
        raise ValueError("LoRA adapters need the peft library: pip install peft (0.21 is tested)") from None


def _default_targets() -> dict[str, list[str]]:
    """peft's own table of the modules LoRA adapts per ``model_type`` (those given as names; a
    regular expression, such as Gemma 4's, is left out): what the field ships and keeps up to date."""
    table = importlib.import_module("peft.utils.constants").TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    return {kind: list(names) for kind, names in table.items() if isinstance(names, list | tuple)}


DEFAULT_TARGETS: dict[str, list[str]]
"""The modules adapted by default per ``model_type``: peft's table, read when first used (peft is
imported then). For most decoders it is the LoRA paper's choice, the attention's query and value
projections (``q_proj``, ``v_proj`` for Llama, Mistral, Qwen2, Gemma; GPT-2's fused ``c_attn``);
give more, such as ``k_proj`` and ``o_proj``, as targets of your own."""


def __getattr__(name: str) -> Any:
    """:data:`DEFAULT_TARGETS`, made on first use: importing this module does not import peft."""
    if name == "DEFAULT_TARGETS":
        if name not in globals():
            _peft()
            globals()[name] = _default_targets()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _linear_kinds() -> tuple[type[nn.Module], ...]:
    """The module types LoRA adapts here: ``nn.Linear`` and GPT-2's ``Conv1D`` (a linear layer with
    its weight stored transposed, which peft adapts with ``fan_in_fan_out``)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return (nn.Linear,)
    return (nn.Linear, Conv1D)


def _matched(model: nn.Module, targets: Sequence[str]) -> dict[str, nn.Module]:
    """The modules of ``model`` that ``targets`` name, by peft's rule (a module's qualified name is a
    target, or ends with ``.`` and a target); a :class:`ValueError` for a target that names none, or
    one that names a module LoRA does not adapt here, and for a mix of GPT-2's ``Conv1D`` and
    ``nn.Linear`` (peft keeps one ``fan_in_fan_out`` per adapter)."""
    if isinstance(targets, str) or not targets:
        raise ValueError(f"targets {targets!r}: give a list of module names, such as ['q_proj', 'v_proj']")
    kinds = _linear_kinds()
    modules = dict(model.named_modules())
    found: dict[str, nn.Module] = {}
    for target in targets:
        if not isinstance(target, str) or not target or any(c in target for c in "*?[]()|^$\\"):
            raise ValueError(f"LoRA target {target!r} is not a module name; give names such as 'q_proj'")
        hits = {n: m for n, m in modules.items() if n == target or n.endswith("." + target)}
        if not hits:
            leaves = sorted({n.rpartition(".")[2] for n, m in modules.items() if isinstance(m, kinds)})
            raise ValueError(
                f"LoRA target {target!r} names no module of the {type(model).__name__}; its linear layers are "
                f"{', '.join(leaves)}"
            )
        other = next((n for n, m in hits.items() if not isinstance(m, kinds)), None)
        if other is not None:
            raise ValueError(
                f"LoRA target {target!r} names {other!r}, of type {type(hits[other]).__name__}, which is not a "
                "linear layer; adapters go on nn.Linear or GPT-2's Conv1D layers: give their names"
            )
        found.update(hits)
    if len({isinstance(m, nn.Linear) for m in found.values()}) > 1:
        raise ValueError(
            f"LoRA targets {list(targets)} mix GPT-2's Conv1D layers and nn.Linear ones (peft adapts them with "
            "different fan_in_fan_out settings); give targets of one kind, such as ['c_attn']"
        )
    return found


def _meta_model(config: Any) -> nn.Module:
    """The model of ``config`` on the meta device, for its module names (no memory, no init)."""
    from gpipe.data.tokenizer import _transformers

    transformers = _transformers()
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)  # type: ignore[no-any-return]


def targets_for(config: Any, given: Sequence[str], *, model: nn.Module | None = None) -> list[str]:
    """The module names LoRA adapts in the model of ``config``: ``given``, or when it is empty the
    default of the config's ``model_type`` (:data:`DEFAULT_TARGETS`). Every name is checked against
    the model's modules (``model``, or one built from ``config`` on the meta device), so that a
    misspelt target fails here rather than training no adapter at all."""
    names = list(given)
    if not names:
        kind = getattr(config, "model_type", None)
        defaults = __getattr__("DEFAULT_TARGETS")
        if kind not in defaults:
            raise ValueError(
                f"model_type {kind!r} has no default LoRA targets; name the linear layers to adapt, such as "
                "['q_proj', 'v_proj']"
            )
        names = list(defaults[kind])
    _matched(model if model is not None else _meta_model(config), names)
    return names


def _is_lora(name: str) -> bool:
    """Whether a parameter's qualified name is an adapter's (peft's prefix ``lora_``)."""
    return any(part.startswith("lora_") for part in name.split("."))


def add_adapters(
    model: nn.Module, *, rank: int, targets: Sequence[str], alpha: float | None = None, dropout: float = 0.0
) -> LoraConfig:
    """Add a LoRA adapter of ``rank`` to each module ``targets`` names, in place, and freeze every
    other parameter (``requires_grad`` False); returns peft's config of it. ``alpha`` scales the
    update by ``alpha / rank`` (default ``rank``: a scale of 1); ``dropout`` is applied to the
    adapters' input. The model may be on the meta device (:func:`gpipe.models.hf.build`): the
    adapters are then made there too, for the pipeline to materialize with the rest
    (:func:`with_adapter_init`). Call it before tracing, so that the layers carry the adapters."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"LoRA rank {rank!r} must be a positive integer, such as 8")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0):
        raise ValueError(f"LoRA alpha {alpha!r} must be a positive number (the update is scaled by alpha / rank)")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(f"LoRA dropout {dropout!r} must be in [0, 1)")
    if any(_is_lora(n) for n, _ in model.named_parameters()):
        raise ValueError(f"the {type(model).__name__} has LoRA adapters already; add them to a model without")
    matched = _matched(model, targets)
    peft = _peft()
    conv1d = not any(isinstance(m, nn.Linear) for m in matched.values())
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=rank if alpha is None else alpha,
        lora_dropout=float(dropout),
        target_modules=list(targets),
        fan_in_fan_out=conv1d,
        bias="none",
        init_lora_weights=True,
    )
    meta = any(p.is_meta for p in model.parameters())
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=meta)
    for name, p in model.named_parameters():
        p.requires_grad_(_is_lora(name))
    return config  # type: ignore[no-any-return]


def _adapter_weights(name: str) -> str | None:
    """Which of an adapter's matrices a parameter is, by its qualified name: ``"A"`` for
    ``...lora_A.<adapter>.weight``, ``"B"`` for ``...lora_B.<adapter>.weight`` or ``.bias``."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-3] in ("lora_A", "lora_B"):
        return parts[-3][-1]
    return None


@torch.no_grad()
def init_adapters(layer: nn.Module) -> None:
    """(Re)initialize the LoRA parameters of one pipeline layer as peft does: ``lora_A`` uniform as
    an ``nn.Linear``'s default (Kaiming, ``a=sqrt(5)``), ``lora_B`` zero, so that the adapted model
    starts as the base model. A block the layer holds whole keeps peft's layers, and their own
    ``reset_lora_parameters`` runs; a traced module (an LM head) keeps its adapters' matrices only,
    initialized by name with the same formulas. Parameters split or sharded on the meta device
    (DTensors: FSDP, tensor parallelism) get the same values: the whole matrix is drawn, in the
    same order, and this rank keeps its shard. Nothing else of the layer is touched."""
    done: set[int] = set()
    lora_layer = _peft().tuners.lora.LoraLayer
    for module in layer.modules():
        if isinstance(module, lora_layer):
            params = [p for p in module.parameters() if p is not None]
            if any(isinstance(p, DTensor) for p in params):
                for adapter in module.lora_A:
                    _fill(module.lora_A[adapter].weight, "A")
                    for p in module.lora_B[adapter].parameters():
                        _fill(p, "B")
            else:
                for adapter in module.lora_A:
                    module.reset_lora_parameters(adapter, True)
            done.update(id(p) for p in params)
    for name, p in layer.named_parameters():
        which = _adapter_weights(name)
        if id(p) not in done and which is not None:
            _fill(p, which)


def _fill(p: Tensor, which: str) -> None:
    """``lora_A`` (``which`` "A"): Kaiming-uniform as peft draws it; ``lora_B``: zero. A DTensor
    gets its shard of the whole matrix so drawn."""
    whole = torch.empty(p.shape, dtype=p.dtype, device="cpu") if isinstance(p, DTensor) else p
    if which == "A":
        nn.init.kaiming_uniform_(whole, a=math.sqrt(5))
    else:
        nn.init.zeros_(whole)
    if isinstance(p, DTensor):
        local = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)


class _AdapterInit:
    """A layer's initialization followed by :func:`init_adapters`: the adapters get peft's
    initialization whatever the first gave them (Hugging Face's ``_init_weights`` treats
    ``lora_A`` and ``lora_B`` as any ``nn.Linear``: they are flagged as initialized for it, as
    loaded weights are, so that it draws nothing for them and the adapters' draws are the same
    whether the layer is whole or sharded; a loader of pretrained weights leaves them). It reads
    shards where the first does (:func:`gpipe.runtime.partition.reads_shards`)."""

    def __init__(self, init: Callable[[nn.Module], None] | None) -> None:
        self.init = init

    @property
    def reads_shards(self) -> bool:
        return bool(getattr(self.init, "reads_shards", False))

    def fills(self, layer: nn.Module) -> list[str]:
        """What the first overwrites whole (``gpipe.runtime.partition``)."""
        said = getattr(self.init, "fills", None)
        return list(said(layer)) if callable(said) else []

    def __call__(self, layer: nn.Module) -> None:
        with initialized(p for name, p in layer.named_parameters() if _is_lora(name)):
            if self.init is not None:
                self.init(layer)
            else:  # what materialize does without an init: each module's reset_parameters, children first
                for module in reversed(list(layer.modules())):
                    reset = getattr(module, "reset_parameters", None)
                    if callable(reset):
                        reset()
        init_adapters(layer)


def with_adapter_init(layers: nn.Sequential) -> None:
    """Make each layer's initialization, the one it brings for the pipeline to materialize it from
    the meta device (``gpipe_init``: Hugging Face's ``_init_weights``, or a loader of pretrained
    weights put there), run :func:`init_adapters` after it. A layer that brings none gets its modules'
    ``reset_parameters``, then the adapters'. Calling it again changes nothing. (An ``init_fn``
    given to the Pipeline replaces every layer's own, this one too.)"""
    for layer in layers:
        brought = layer.__dict__.get("gpipe_init")
        init = getattr(brought, "value", None)
        if isinstance(init, _AdapterInit):
            continue
        bring_init(layer, _AdapterInit(init))  # (not a submodule, and kept by the layer's copies)


def lora_json(lora_config: LoraConfig) -> str:
    """The adapters' settings as the ``lora.json`` a checkpoint keeps beside ``config.json``:
    ``rank``, ``alpha``, ``dropout``, ``targets`` and ``fan_in_fan_out``, what :func:`add_adapters`
    takes, so that the model with its adapters can be built again (:func:`read_lora`)."""
    targets = lora_config.target_modules
    if not isinstance(targets, list | set | tuple):
        raise ValueError(f"LoRA target_modules {targets!r} is not a list of names; lora.json keeps names only")
    settings = {
        "rank": int(lora_config.r),
        "alpha": lora_config.lora_alpha,
        "dropout": float(lora_config.lora_dropout),
        "targets": sorted(targets),
        "fan_in_fan_out": bool(lora_config.fan_in_fan_out),
    }
    return json.dumps(settings, indent=2) + "\n"


def read_lora(path: str | os.PathLike[str]) -> LoraConfig:
    """peft's config of the adapters a ``lora.json`` (or the folder holding one) describes, as
    :func:`lora_json` writes it; a :class:`ValueError` naming the file when it is not one."""
    file = Path(path) / LORA if Path(path).is_dir() else Path(path)
    try:
        settings = json.loads(file.read_text())
        rank, alpha, dropout = settings["rank"], settings["alpha"], settings["dropout"]
        targets, fan_in_fan_out = settings["targets"], settings["fan_in_fan_out"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read {str(file)!r} as a lora.json of gpipe: {exc}") from None
    if (
        isinstance(rank, bool)
        or not isinstance(rank, int)
        or rank <= 0
        or not isinstance(alpha, int | float)
        or not isinstance(dropout, int | float)
        or not isinstance(targets, list)
        or not all(isinstance(t, str) for t in targets)
        or not isinstance(fan_in_fan_out, bool)
    ):
        raise ValueError(
            f"{str(file)!r} is not a lora.json of gpipe: rank, alpha, dropout, targets or fan_in_fan_out is wrong"
        )
    config = _peft().LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=list(targets),
        fan_in_fan_out=fan_in_fan_out,
        bias="none",
        init_lora_weights=True,
    )
    return config  # type: ignore[no-any-return]


def write_adapter(
    hf_config: Any,
    lora_config: LoraConfig,
    checkpoint_folder: str | os.PathLike[str],
    out_folder: str | os.PathLike[str],
    *,
    merge: bool,
    base: str | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """Write a checkpoint of a model with adapters as peft writes it, into ``out_folder`` (new or
    empty): the adapter alone (``adapter_config.json``, ``adapter_model.safetensors``, for
    ``PeftModel.from_pretrained(base model, out_folder)``; ``base``, the base model's folder or name,
    is written as its ``base_model_name_or_path``; and peft's model card, ``README.md``), or with
    ``merge`` the model with the update added into its weights, a transformers folder
    (``save_pretrained``: ``config.json``, ``model.safetensors``). The plain model of ``hf_config``
    is built in float32 on the CPU, given the same adapters, and loaded with the checkpoint by
    qualified names (:func:`gpipe.saving.load_module`, whose ``CheckpointError`` names the entries
    that differ, for a checkpoint of other adapters or none); ``dtype``: the merged model's (default
    float32). Returns what was written, in one line."""
    from gpipe.data.tokenizer import _transformers
    from gpipe.saving import load_module

    target = Path(out_folder)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"out folder {str(target)!r} is a file or not empty; give a new or empty folder")
    peft = _peft()
    model = _transformers().AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False, dtype=torch.float32)
    wrapped = peft.get_peft_model(model, copy.deepcopy(lora_config), adapter_name=ADAPTER)
    config = wrapped.peft_config[ADAPTER]
    config.base_model_name_or_path = base  # (get_peft_model writes the model's name_or_path there: none)
    step = load_module(wrapped.base_model.model, checkpoint_folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.lora-{os.getpid()}"
    try:
        if merge:
            merged = wrapped.merge_and_unload()
            if dtype is not None:  # (the base model's dtype: the merge itself is computed in float32)
                merged.to(dtype)
            merged.save_pretrained(staging)
        else:
            # (not the LM head's or embeddings' base weights, which peft saves when they are targets: frozen,
            # they are the base model's)
            wrapped.save_pretrained(staging, save_embedding_layers=False)
        if target.exists():
            target.rmdir()
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if merge:
        return (
            f"wrote step {step} of {str(checkpoint_folder)!r} with its LoRA adapters merged into the weights to "
            f"{str(target)!r}: config.json, model.safetensors"
        )
    return (
        f"wrote the LoRA adapter of step {step} of {str(checkpoint_folder)!r} (rank {config.r}, targets "
        f"{', '.join(sorted(config.target_modules))}) to {str(target)!r}: adapter_config.json, "
        f"adapter_model.safetensors, for the base model {base!r}"
    )
