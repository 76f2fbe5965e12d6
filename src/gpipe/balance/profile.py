"""Per-layer costs, measured on a sample without leaving a trace on the model.

Every measurement runs in a *sandbox*: the parameters' gradients, the buffers (batch-norm running
statistics, say), the modules' training flags and the random number generators are saved before and
restored after, so profiling leaves the model exactly as it was. Layers run in training mode (what
a pipeline spends its time on), one after the other on the output of the previous one, as in the
model; a layer not on the profiling device is profiled as a copy moved there.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.memory import ActivationMeter
from gpipe.microbatch import Batch, scatter

__all__ = [
    "as_leaves",
    "backward_through",
    "each_layer",
    "layer_costs",
    "layer_flops",
    "layer_memory",
    "layer_params",
    "layer_state",
    "layer_times",
    "layerwise_sandbox",
    "profiling_device",
]


def profiling_device(device: torch.device | str | int | None, module: nn.Module) -> torch.device:
    """Where to profile: ``device``; ``None``: where ``module`` is (its first parameter, else the
    CPU). The current CUDA device for an unindexed ``'cuda'`` — or the CPU on a machine without
    CUDA, so that ``balance_by_time``'s default (torchgpipe's ``'cuda'``) works everywhere."""
    if device is None:
        return next(module.parameters(), torch.empty(0)).device
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return dev


@contextmanager
def sandbox(module: nn.Module, device: torch.device | None = None) -> Iterator[None]:
    """Run anything on ``module`` (and on ``device``) and leave its gradients, buffers, training
    flags and the RNGs as they were."""
    grads = {p: p.grad for p in module.parameters()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    modes = {m: m.training for m in module.modules()}
    cuda = [t.device for t in (*module.parameters(), *module.buffers()) if t.device.type == "cuda"]
    if device is not None and device.type == "cuda":
        cuda.append(device)
    indices = sorted({d.index if d.index is not None else torch.cuda.current_device() for d in cuda})
    with torch.random.fork_rng(devices=indices):
        try:
            for p in grads:
                p.grad = None
            yield
        finally:
            for p, g in grads.items():
                p.grad = g
            for m, training in modes.items():
                m.training = training
            with torch.no_grad():
                for name, b in module.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])


def layerwise_sandbox(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """Each layer of ``module`` as a copy on ``device``, in training mode; ``module`` is untouched
    (torchgpipe's helper; the profilers here copy only the layers not on the device)."""
    for layer in module:
        yield copy.deepcopy(layer).to(device).train()


def _on(layer: nn.Module, device: torch.device) -> bool:
    return all(t.device == device for t in (*layer.parameters(), *layer.buffers()))


def as_leaves(batch: Batch) -> Batch:
    """Fresh inputs for a layer: detached copies, requiring grad where they can (as a stage's input
    does), and not leaves themselves, so that layers working in place run as they do in a pipeline
    (and leave ``batch`` untouched for the next run)."""

    def fresh(t: Tensor) -> Tensor:
        if t.is_floating_point() or t.is_complex():
            return t.detach().requires_grad_().clone()
        return t.detach().clone()

    return batch.map(fresh)


def backward_through(outputs: Batch) -> None:
    outs = [t for t in outputs.tensors() if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_micro_batch(sample: Any, chunks: int, device: torch.device) -> Batch:
    return scatter(sample, chunks)[0].map(lambda t: t.to(device))


@contextmanager
def _training_layers(module: nn.Sequential, device: torch.device | None) -> Iterator[list[nn.Module]]:
    """``module``'s layers in training mode, in a sandbox; each one not on ``device`` as a copy
    moved there (``None``: as they are)."""
    with sandbox(module, device):
        module.train()
        yield [layer if device is None or _on(layer, device) else copy.deepcopy(layer).to(device) for layer in module]


def each_layer(
    module: nn.Sequential, batch: Batch, device: torch.device | None = None
) -> Iterator[tuple[nn.Module, Batch]]:
    """Every layer (in training mode, on ``device``) with its input, the previous layers' output on
    ``batch``, in a sandbox."""
    with _training_layers(module, device) as layers:
        for i, layer in enumerate(layers):
            yield layer, batch
            with torch.no_grad():  # (on a copy: a layer working in place leaves the caller's input be)
                batch = _call(i, layer, batch.map(Tensor.clone))


def layer_times(
    module: nn.Sequential,
    sample: Any,
    *,
    chunks: int = 1,
    repeats: int = 3,
    timeout: float = 0.0,
    device: torch.device | str | int | None = None,
) -> list[float]:
    """Each layer's forward + backward time in seconds on the first micro-batch of ``sample``, in
    training mode on ``device`` (default: where the module is).

    Profiling runs passes over all the layers, each layer on the previous one's output: at least
    ``repeats`` passes, and more until ``timeout`` seconds have passed. A layer's time is its median
    over the passes; the first pass, a warm-up, counts only when it is the only one."""
    dev = profiling_device(device, module)
    runs: list[list[float]] = [[] for _ in module]
    with _training_layers(module, dev) as layers:
        first = _first_micro_batch(sample, chunks, dev)
        start, passes = time.perf_counter(), 0
        while passes < max(repeats, 1) or time.perf_counter() - start < timeout:
            batch = first
            for i, layer in enumerate(layers):
                inputs = as_leaves(batch)
                _sync(dev)
                tick = time.perf_counter()
                outputs = _call(i, layer, inputs)
                backward_through(outputs)
                _sync(dev)
                runs[i].append(time.perf_counter() - tick)
                batch = outputs.map(Tensor.detach)
            passes += 1
    return [statistics.median(r[1:] or r) for r in runs]


def _call(index: int, layer: nn.Module, inputs: Batch) -> Batch:
    """``layer`` on ``inputs``. An error names the layer and the shapes it was given: that is what a
    sample which does not fit the model looks like (torch's own words alone, such as "mat1 and mat2
    shapes cannot be multiplied", do not say where)."""
    try:
        return Batch.of(layer(inputs.value))
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        shapes = ", ".join(str(tuple(t.shape)) for t in inputs.tensors()) or "no tensors"
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"layer {index} ({type(layer).__name__}) fails on the sample's micro-batch (shapes: {shapes}): "
            f"{message} — pass a sample the model takes as its input (a mini-batch; it is split into chunks)"
        ) from exc


def layer_memory(
    module: nn.Sequential,
    sample: Any,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: torch.device | str | int | None = None,
) -> list[float]:
    """Each layer's memory in bytes: what its forward (in training mode) keeps for backward on one
    micro-batch of ``sample`` (on CUDA, the allocator's peak; elsewhere, the bytes of the tensors
    autograd saves), plus ``param_scale`` times its parameters' bytes (2.0: the weights and their
    gradients; add the optimizer's state, e.g. 4.0 for Adam). Measured on ``device`` (default:
    where the module is)."""
    dev = profiling_device(device, module)
    batch = _first_micro_batch(sample, chunks, dev)
    sizes = []
    for i, (layer, inputs) in enumerate(each_layer(module, batch, dev)):
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        sizes.append(_activation_bytes(i, layer, as_leaves(inputs), dev) + param_scale * params)
    return sizes


def _activation_bytes(index: int, layer: nn.Module, inputs: Batch, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        outputs = _call(index, layer, inputs)
        peak = torch.cuda.max_memory_allocated(device) - base
        del outputs
        return float(peak)
    meter = ActivationMeter({0: 0}, 1, layer.parameters())  # what a stage's meter counts, for one layer
    with meter.recording(0, 0):
        outputs = _call(index, layer, inputs)
    meter.hold(0, 0, outputs.tensors())  # what it hands on, unless it also saved it
    return float(meter.peak[0])


def layer_costs(
    module: nn.Sequential, sample: Any, *, chunks: int = 1, backward: bool = True, state_bytes: float = 16.0
) -> tuple[list[float], list[float]]:
    """Each layer's floating-point operations and memory in bytes, in one pass over the layers on the
    first micro-batch of ``sample``, from shapes alone: nothing is computed on the meta device (a
    model too big for this machine). Each layer runs once, forward and (with ``backward``) backward,
    and its output is the next layer's input.

    - FLOPs: forward and backward, counted by ``torch.utils.flop_counter``: matrix products,
      convolutions and attention, the operations that dominate.
    - Memory: ``state_bytes`` per parameter (its weight, gradient and optimizer state: float32 with
      Adam 16, with Adafactor's factored moments about 8) plus its output's floating-point bytes
      (what the recomputation of a micro-batch holds, layer by layer).

    On the meta device, a layer alike to one already run (:func:`gpipe.balance.alike.fingerprint`)
    on inputs alike is not run again: it gets that layer's costs and output (a language model's
    blocks are counted once)."""
    from torch.utils.flop_counter import FlopCounterMode

    from gpipe.balance.alike import fingerprint, inputs_key

    dev = next(module.parameters(), torch.empty(0)).device
    batch = _first_micro_batch(sample, chunks, dev)
    flops: list[float] = []
    memory: list[float] = []
    seen: dict[Any, tuple[float, float, Batch]] = {}
    with _training_layers(module, None) as layers:
        for i, layer in enumerate(layers):
            key = None
            if dev.type == "meta":
                found, given = fingerprint(layer), inputs_key(batch.value)
                key = None if found is None or given is None else (found, given)
            if key is not None and key in seen:
                counted, held, batch = seen[key]
            else:
                with FlopCounterMode(display=False) as counter:
                    outputs = _call(i, layer, as_leaves(batch))
                    if backward:
                        backward_through(outputs)
                counted = float(counter.get_total_flops())
                held = float(sum(t.numel() * t.element_size() for t in outputs.tensors() if t.is_floating_point()))
                batch = outputs.map(Tensor.detach)
                if key is not None:
                    seen[key] = (counted, held, batch)
            flops.append(counted)
            memory.append(state_bytes * sum(p.numel() for p in layer.parameters()) + held)
    return flops, memory


def layer_flops(module: nn.Sequential, sample: Any, *, chunks: int = 1, backward: bool = True) -> list[float]:
    """Each layer's floating-point operations (forward and, with ``backward``, backward) on the first
    micro-batch of ``sample``, counted from shapes alone: :func:`layer_costs`' first list."""
    return layer_costs(module, sample, chunks=chunks, backward=backward)[0]


def layer_state(module: nn.Sequential, sample: Any, *, chunks: int = 1, state_bytes: float = 16.0) -> list[float]:
    """Each layer's memory in bytes, from shapes alone (on the meta device too): ``state_bytes`` per
    parameter plus its output's floating-point bytes on the first micro-batch of ``sample``:
    :func:`layer_costs`' second list."""
    return layer_costs(module, sample, chunks=chunks, backward=False, state_bytes=state_bytes)[1]


def layer_params(module: nn.Sequential) -> list[float]:
    """Each layer's number of parameters."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in module]
