"""``gpipe.to_sequential``: any PyTorch module as a sequence of pipeline layers.

A pipeline needs its model as a sequence of layers, each passing the next what it needs. Models as
people write them are not sequences: a Hugging Face GPT-2 builds position ids and a causal mask
before its blocks and hands both to every block; BERT threads a padding mask; T5 runs an encoder,
then a decoder whose every block reads the encoder's output; they take keyword arguments and return
``ModelOutput`` objects. :func:`to_sequential` turns such a module into an ``nn.Sequential``
without glue code:

1. **Trace** the module with :func:`torch.export.export` on an example input (non-strict, the
   training IR, every dimension of every input tensor dynamic). Why export and not ``torch.fx``
   symbolic tracing: the Python-level fx tracer cannot run Hugging Face models (their argument
   decorators assign into proxies, their mask builders branch on values), while export runs the
   real Python code on fake tensors and records what it does — control flow resolved, data
   structures flattened, parameters named. The code inside alike blocks (one class, parameters of
   the same names and shapes, no hooks) is traced once per kind of call: the other calls are
   answered with what that call returned, checked after the export, as the layers keep nothing of
   a block's inside (:mod:`~gpipe.sequential.reuse`; a 24-block Llama then traces like a two-block one).
2. **Keep the blocks as modules.** The repeated blocks (every element of the outermost
   ``ModuleList``/``Sequential`` of same-typed blocks: GPT-2's ``transformer.h.*``, ResNet's
   ``layer1.0`` ... ``layer4.2``) — or the modules named in ``split_points`` — and any batch norm
   outside them are exported with their call signatures preserved, and their traced operators are
   replaced by calls of the *original* modules with the traced arguments. So the blocks are the
   user's own objects: training mode, dropout, batch-norm statistics, hooks and ``torch.compile``
   behave as in the model, and parameters are shared, not copied.
3. **Cut** the graph before every block: one layer per block (the code between two blocks goes
   with the block before it), one for the code before the first block and one for the code after
   the last. A layer passes the next, as a tuple, exactly the values a later layer still reads
   (the hidden state, masks, position ids, the encoder's output); the first layer takes the
   module's input, packed as one value, and the last returns the module's output structure.
   Values a block computes for the code after the blocks without returning them — the router
   logits a mixture-of-experts model's hooks collect for its load-balancing loss, the attention
   weights of ``output_attentions=True`` — are caught where a module inside the block returns
   them, and travel on as the block's extra outputs.

The code between blocks (the *glue*) runs as the traced operators, with three adjustments: its
dropout follows the layer's training mode (it is traced in training mode; an ``nn.Dropout`` module
there is called as itself), tensors it creates go to the layer's device (the trace's device is not
baked in), and the traced device/dtype assertions are dropped. What the glue does by branching on
``self.training`` or on tensor values is fixed at tracing time, as in any export.

Applied in order to the example input, the layers give the module's output — bitwise in eval mode,
where the model's code takes the same path under ``torch.export`` as in eager mode (Hugging Face's
mask builders do not: see docs/sequential.md).
Parameters and buffers keep their qualified names in each layer's ``state_dict`` (layer 3 of a
GPT-2 holds ``transformer.h.2.attn.c_attn.weight``). A parameter used by two layers (GPT-2's token
embedding and its tied LM head) is the same object in both: :class:`gpipe.Pipeline` and
:class:`gpipe.GPipe` find such parameters and tie the copies when the layers land on different
stages.

Part of the library: imports torch and :mod:`gpipe.microbatch`, never the applications. The
export in :mod:`~gpipe.sequential.export`, the coarse graph in :mod:`~gpipe.sequential.glue`, the
values caught inside the blocks in :mod:`~gpipe.sequential.taps`, the alike blocks traced once in
:mod:`~gpipe.sequential.reuse`, the layers' ends in :mod:`~gpipe.sequential.layers`, the cut in
:mod:`~gpipe.sequential.cut`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram
from torch.nn.modules.batchnorm import _NormBase
from torch.utils import _pytree as pytree

from gpipe.microbatch import as_dicts, batch_size, scatter
from gpipe.sequential.cut import _cut
from gpipe.sequential.export import (
    ToSequentialError,
    _check_split_points,
    _device_of,
    _drawing_outside,
    _export,
    _has_tensor,
    pack,
    repeated_blocks,
    unpack,
)
from gpipe.sequential.glue import _Coarse
from gpipe.sequential.reuse import StandIns, alike_blocks
from gpipe.sequential.taps import _Recorder

__all__ = ["ToSequentialError", "as_layers", "pack", "repeated_blocks", "to_sequential", "unpack"]


def to_sequential(
    module: nn.Module, *example_args: Any, split_points: Sequence[str] | None = None, **example_kwargs: Any
) -> nn.Sequential:
    """``module`` as an ``nn.Sequential`` of pipeline layers, traced on ``module(*example_args,
    **example_kwargs)`` (see the module docstring for what that means and what it keeps).

    The first layer takes the example's inputs packed as one value — the tensor for ``module(x)``,
    a tuple for ``module(x, y)``, a dict for ``module(**batch)`` — and checks what it is given
    against them (structure, non-tensor values, shapes the trace depends on, sizes it fixed).
    Keyword arguments without tensors (``use_cache=False``, ``return_loss=True``) are settings:
    fixed at tracing; a dict input may carry them with the traced values, or leave them out. Trace
    on an example shaped as what the first layer will get, one micro-batch, where the model's code
    uses a size as a number (CLIP's loss: ``arange(len(logits))``).
    The last layer returns what the module returns (a tensor, a tuple, a ``ModelOutput``).

    ``split_points``: qualified names of the modules where layers start, instead of the repeated
    blocks (:func:`repeated_blocks`): the layers are the code before the first, then from each to
    the next, the last running to the end. (Modules not named are traced into operators, like the
    rest of the code between them.) An ``nn.Sequential`` is returned as it is.
    """
    if isinstance(module, nn.Sequential):
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"to_sequential takes an nn.Module, not {type(module).__name__}")
    blocks = _check_split_points(module, split_points) if split_points is not None else repeated_blocks(module)
    if not blocks:
        raise ToSequentialError(
            f"{type(module).__name__} has no repeated blocks or children with parameters to cut at; "
            "name the cut points with split_points=[...]"
        )
    kwargs = {k: as_dicts(v) for k, v in example_kwargs.items()}
    args = tuple(as_dicts(a) for a in example_args)
    if "use_cache" in inspect.signature(module.forward).parameters and "use_cache" not in kwargs:
        kwargs["use_cache"] = False  # a training pipeline has no use for a key/value cache
    settings = {k: v for k, v in kwargs.items() if not _has_tensor(v)}
    packed = pack(args, {k: v for k, v in kwargs.items() if k not in settings})
    inside = tuple(b + "." for b in blocks)
    norms = [
        name
        for name, m in module.named_modules(remove_duplicate=False)
        if isinstance(m, _NormBase) and m.track_running_stats and not name.startswith(inside) and name not in blocks
    ]
    device = _device_of(module, packed)
    if device.type == "meta":  # a model built on the meta device traces on meta inputs
        args, kwargs, packed = pytree.tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs, packed))
    alike = alike_blocks(module, blocks)
    try:
        ep, coarse, stand_ins = _trace(module, args, kwargs, blocks, norms, device, alike)
        faithful = stand_ins.faithful(coarse.read_inside)
    except Exception:  # (perhaps a stand-in's doing: traced again without them, which raises if it fails too)
        if not alike:
            raise
        faithful = False
    if not faithful:
        ep, coarse, _ = _trace(module, args, kwargs, blocks, norms, device, [])  # (every block traced)
    return _cut(module, ep, coarse, args, kwargs, packed, tail=split_points is None)


def _trace(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    blocks: list[str],
    norms: list[str],
    device: torch.device,
    alike: list[list[str]],
) -> tuple[ExportedProgram, _Coarse, StandIns]:
    """The export, and its coarse graph: the calls of ``alike`` blocks answered by stand-ins where
    they can be (:mod:`~gpipe.sequential.reuse`); modules drawing random numbers in the glue kept too."""
    stand_ins = StandIns(module, alike)
    with _Recorder(module, blocks + norms) as recorder:  # (what the modules inside them return)
        ep = _export(module, args, kwargs, blocks + norms, stand_ins)
    drawing = _drawing_outside(ep, set(blocks + norms))
    if drawing:  # modules drawing random numbers in the glue (stochastic depth) run as themselves
        norms = norms + drawing
        stand_ins = StandIns(module, alike)
        with _Recorder(module, blocks + norms) as recorder:
            ep = _export(module, args, kwargs, blocks + norms, stand_ins)
    return ep, _Coarse(module, ep, blocks, norms, device, recorder), stand_ins


def as_layers(module: Any, sample: Any, microbatches: int = 1) -> Any:
    """What a front end makes of the model it is given: an ``nn.Sequential`` (or a list of layer
    factories) as it is, any other module traced into layers on ``sample``'s first micro-batch of
    ``microbatches``: the first layer gets micro-batches, and a size the model's code fixes (CLIP's
    loss uses ``len(logits)``) is then the micro-batch's. (On the whole sample where a micro-batch
    would have one sample: export would take a dimension of size 1 for a fixed one.)"""
    if isinstance(module, (list, tuple)) and all(callable(f) for f in module):
        return module  # layer factories
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"module must be nn.Sequential, another nn.Module (traced on sample=...) or a list of layer factories "
            f"(module: {type(module).__name__})"
        )
    if isinstance(module, nn.Sequential):
        return module
    if sample is None:
        raise ValueError(
            f"{type(module).__name__} is not an nn.Sequential: pass sample=<an input mini-batch> to trace it into "
            "pipeline layers (gpipe.to_sequential), or give an nn.Sequential of layers"
        )
    sample = as_dicts(sample)
    parts = scatter(sample, microbatches) if microbatches > 1 and _has_tensor(sample) else []
    if parts and batch_size(parts[0]) > 1:
        sample = parts[0].value
    args, kwargs = unpack(module, sample)
    return to_sequential(module, *args, **kwargs)
