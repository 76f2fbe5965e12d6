"""Cutting an ``nn.Sequential`` into partitions (cells) by a balance, with the checks that make the
cut safe: every layer in exactly one partition, no module or parameter shared between partitions."""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import torch
from torch import nn

from gpipe.batchnorm import DeferredBatchNorm
from gpipe.rng import derive_seed
from gpipe.shards import local
from gpipe.skip import check_skips
from gpipe.tied import untie

__all__ = ["as_balance", "check_balance", "resolve_devices", "split_module"]

_BALANCE_HINT = (
    "give one positive layer count per partition, summing to the number of layers, "
    "e.g. balance=[2, 2] for a 4-layer model on 2 partitions, or let gpipe.balance find one "
    "(balance_by_time, balance_by_size)"
)


def as_balance(balance: Any) -> Any:
    """A balance given as a NumPy array or a tensor as a list (of Python numbers); anything else as
    it is, for :func:`check_balance` to judge."""
    if not isinstance(balance, (str, bytes)) and callable(getattr(balance, "tolist", None)):
        return balance.tolist()
    return balance


def check_balance(module: Sized, balance: Any) -> list[int]:
    """``balance`` as a list of ints (NumPy integers and arrays accepted), or an error saying how to fix it."""
    balance = as_balance(balance)
    if balance is None:
        raise ValueError(f"balance is required: {_BALANCE_HINT}")
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a sequence of ints (balance: {balance!r}); {_BALANCE_HINT}")
    if not balance:
        raise ValueError(f"balance is empty: {_BALANCE_HINT}")
    if not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in balance):
        raise TypeError(f"balance must contain ints (balance: {list(balance)!r}); {_BALANCE_HINT}")
    balance = [int(b) for b in balance]
    if any(b <= 0 for b in balance):
        raise ValueError(f"all balance entries must be positive (balance: {list(balance)})")
    if sum(balance) != len(module):
        raise ValueError(
            "module and sum of balance have different length "
            f"(module: {len(module)}, sum of balance: {sum(balance)}); {_BALANCE_HINT}"
        )
    return list(balance)


def resolve_devices(devices: Sequence[Any] | None, partitions: int) -> list[torch.device]:
    """The first ``partitions`` devices; by default every CUDA device, or ``'cpu'`` for each
    partition when there is no GPU."""
    if devices is None:
        if torch.cuda.is_available():
            devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        else:
            devices = ["cpu"] * partitions
    resolved = [torch.device(d) for d in devices]
    if len(resolved) < partitions:
        raise IndexError(
            f"too few devices to hold given partitions (devices: {len(resolved)}, partitions: {partitions}); "
            "pass devices=[...] with one device per partition (a device may repeat, e.g. ['cpu', 'cpu'])"
        )
    return resolved[:partitions]


def split_module(module: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device]) -> list[nn.Sequential]:
    """Partition ``module`` by ``balance``, each partition moved to its device. Child names are
    kept, so a partition's state-dict keys are the original ones."""
    names = list(module._modules)
    layers = list(module)
    owner: dict[int, tuple[int, str]] = {}
    params: dict[int, tuple[int, str]] = {}
    partitions: list[nn.Sequential] = []
    start = 0
    for k, count in enumerate(balance):
        children: OrderedDict[str, nn.Module] = OrderedDict()
        for name, layer in zip(names[start : start + count], layers[start : start + count]):
            _claim(owner, id(layer), k, f"layer {name!r}", "module")
            for pname, p in layer.named_parameters():
                _claim(params, id(p), k, f"parameter {name}.{pname}", "parameter")
            children[name] = layer
        partitions.append(nn.Sequential(children).to(devices[k]))
        start += count
    return partitions


def _claim(table: dict[int, tuple[int, str]], key: int, k: int, what: str, kind: str) -> None:
    if key in table and table[key][0] != k:
        other_k, other = table[key]
        raise ValueError(
            f"the same {kind} is in partitions {other_k} and {k} ({other} and {what}); "
            "a module or parameter may not be shared between partitions"
        )
    table.setdefault(key, (k, what))


def auto_balance(module: Layers, stages: int, sample: Any, chunks: int) -> list[int]:
    """``balance='auto'``: profile each layer's forward + backward time on a micro-batch of
    ``sample`` and split exactly (:func:`gpipe.balance.balance_by_time`)."""
    from gpipe.balance import balance_by_time

    if sample is None:
        raise ValueError("balance='auto' times each layer on a sample mini-batch: pass sample=... as well")
    if not isinstance(module, nn.Sequential) or any(_is_meta(layer) for layer in module):
        raise ValueError(
            "balance='auto' needs a model built on a real device to time its layers; give a balance list "
            "(or gpipe.balance.solve(costs, K) with your own costs) for meta-device models and layer factories"
        )
    return balance_by_time(stages, module, sample, chunks=chunks, device=None)  # (timed where the module is)


def check_chunks(chunks: Any) -> int:
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks <= 0:
        raise ValueError(f"number of chunks must be a positive integer (chunks: {chunks!r})")
    return chunks


Layers = nn.Sequential | Sequence[Callable[[], nn.Module]]


def _is_meta(layer: nn.Module) -> bool:
    return any(t.is_meta for t in (*layer.parameters(), *layer.buffers()))


def layer_seed(init_seed: int, index: int) -> int:
    """The seed layer ``index`` is initialized with: the same whatever the partitioning."""
    return derive_seed(init_seed, index, -1)


def _initialized(index: int, init_seed: int, device: torch.device, build: Callable[[], nn.Module]) -> nn.Module:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(layer_seed(init_seed, index))
        return build()


def _reset_of(module: nn.Module) -> Callable[[], None] | None:
    """A module's initializer: ``reset_parameters``, or the ``_reset_parameters`` some torch modules
    (nn.MultiheadAttention) have instead."""
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return reset  # type: ignore[no-any-return]
    return None


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def init_of(layer: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> Callable[[nn.Module], None] | None:
    """How a layer built on the meta device is initialized: ``init_fn``, else the initialization
    the layer brings (:func:`gpipe.to_sequential` gives a Hugging Face model's layers its
    ``_init_weights``), else None: each module's ``reset_parameters``."""
    if init_fn is not None:
        return init_fn
    brought = layer.__dict__.get("gpipe_init")
    return getattr(brought, "value", None)


def materialize(
    layer: nn.Module,
    index: int,
    device: torch.device,
    init_seed: int,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Give a layer built on the meta device real storage on ``device`` and initialize it, seeded
    by its global index: with ``init_fn(layer)`` (see :func:`init_of`), or with its modules'
    ``reset_parameters`` methods."""
    init = init_of(layer, init_fn)
    unresettable = [
        type(m).__name__
        for m in layer.modules()
        if _reset_of(m) is None and any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
    ]
    if unresettable and init is None:
        raise TypeError(
            f"layer {index} was built on the meta device, but {sorted(set(unresettable))} has no "
            "reset_parameters() to initialize it; pass init_fn=<a function initializing a layer in place>, "
            "or give a list of layer factories instead"
        )

    def reset() -> nn.Module:
        # Like Module.to_empty, but with torch.empty_strided: empty_like from the meta device
        # touches the new memory, which doubles the peak of a stage being materialized.
        layer._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))  # type: ignore[no-untyped-call]
        if init is not None:
            _initialized_by(init, layer, index)
            return layer
        for m in _post_order(layer):  # children first, as their constructors ran before their parents'
            reset = _reset_of(m)
            if reset is not None:
                reset()
        return layer

    return _initialized(index, init_seed, device, reset)


def reads_shards(layer: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> bool:
    """Whether the initialization ``layer`` brings fills the local shards of parameters split or
    sharded on the meta device (DTensors, as tensor parallelism and FSDP leave them) by
    itself, without the whole tensors: it says so with a true ``reads_shards`` attribute (a loader
    of pretrained weights reading each rank's slice of the files), and it gives the copies of a tied
    parameter equal values itself (they are not synced afterwards). Such a layer can be materialized
    after its stage is split and sharded (:func:`materialize_shards`), never whole."""
    return bool(getattr(init_of(layer, init_fn), "reads_shards", False))


def materialize_shards(layer: nn.Module, index: int, device: torch.device, init_seed: int) -> None:
    """Give a layer left on the meta device, whose parameters tensor parallelism or FSDP split or
    sharded there, storage for this rank's shards on ``device``, and run the initialization it
    brings (one that :func:`reads_shards`), seeded by its global index, checked as
    :func:`materialize` checks it."""
    init = init_of(layer, None)
    if init is None:
        raise TypeError(f"layer {index} brings no initialization to fill its shards")

    def reset() -> nn.Module:
        layer.to_empty(device=device)  # (a DTensor's empty_like: its local shard)
        _initialized_by(init, layer, index)
        return layer

    _initialized(index, init_seed, device, reset)


def _written_whole(layer: nn.Module, init: Callable[[nn.Module], None]) -> set[int]:
    """The tensors of ``layer`` (by ``id``) that ``init`` says it overwrites whole: the names (as
    in ``layer.state_dict()``) its ``fills(layer)`` returns, if it has one (a loader of pretrained
    weights: what it copies from the files)."""
    said = getattr(init, "fills", None)
    if not callable(said):
        return set()
    tensors = layer.state_dict(keep_vars=True)
    return {id(tensors[name]) for name in said(layer) if name in tensors}


def _initialized_by(init: Callable[[nn.Module], None], layer: nn.Module, index: int) -> None:
    """Run ``init(layer)`` on fresh storage, and fail naming what it left unwritten (filled with
    NaN first: uninitialized memory must not train silently), but for what the init says it
    overwrites whole (:func:`_written_whole`: two passes over a pretrained stage's memory spared)."""
    whole = _written_whole(layer, init)
    floats = {
        n: t
        for n, t in (*layer.named_parameters(), *layer.named_buffers())
        if t.is_floating_point() and id(t) not in whole
    }
    with torch.no_grad():
        for t in floats.values():
            local(t).fill_(float("nan"))
    init(layer)
    left = [n for n, t in floats.items() if bool(torch.isnan(local(t)).any())]
    if left:
        raise TypeError(
            f"layer {index} was materialized from the meta device, but its initialization left {left} unwritten; "
            "initialize them in init_fn=<a function initializing a layer in place>"
        )


def _build(
    module: Layers,
    balance: Sequence[int],
    stage_devices: Sequence[torch.device],
    init_seed: int,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Sequential:
    """The model with every layer on a real device built (from its factory) or materialized (from
    the meta device), seeded by its index; layers of stages on the meta device are left there."""
    device_of = [d for count, d in zip(balance, stage_devices) for _ in range(count)]
    if isinstance(module, nn.Sequential):
        for i, (name, layer) in enumerate(list(module._modules.items())):
            if layer is not None and device_of[i].type != "meta" and _is_meta(layer):
                module._modules[name] = materialize(layer, i, device_of[i], init_seed, init_fn)
        return module
    layers: list[nn.Module] = []
    for i, factory in enumerate(module):
        if device_of[i].type == "meta":
            layers.append(nn.Identity())  # a placeholder: another process holds this layer
            continue
        layer = _initialized(i, init_seed, device_of[i], factory)
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer factory {i} returned {type(layer).__name__}, not an nn.Module")
        layers.append(layer)
    return nn.Sequential(*layers)


def partition(
    module: Layers,
    balance: Sequence[int],
    stage_devices: Sequence[torch.device],
    *,
    deferred_batch_norm: bool = False,
    init_seed: int = 0,
    tied: Sequence[Sequence[str]] = (),
    init_fn: Callable[[nn.Module], None] | None = None,
) -> list[nn.Sequential]:
    """Cut ``module`` into ``len(balance)`` stages, stage ``s`` on ``stage_devices[s]`` (its
    placement's device; ``'meta'`` for a stage another process holds).

    ``module`` is an ``nn.Sequential`` (whose layers may be on the meta device: those of stages on
    a real device are materialized and initialized, seeded by layer) or a list of layer factories
    (only the layers of stages on a real device are built, each seeded by its index)."""
    factories = isinstance(module, (list, tuple)) and all(callable(f) for f in module)
    if not isinstance(module, nn.Sequential) and not factories:
        raise TypeError(
            f"module must be nn.Sequential to be partitioned (module: {type(module).__name__}); "
            "list its layers in an nn.Sequential, or give a list of layer factories"
        )
    balance = check_balance(module, balance)
    if len(stage_devices) != len(balance):
        raise ValueError(
            f"the schedule places {len(stage_devices)} stages but balance has {len(balance)} "
            f"(balance: {balance}); give one balance entry per stage"
        )
    model = _build(module, balance, stage_devices, init_seed, init_fn)
    if isinstance(module, nn.Sequential) or all(d.type != "meta" for d in stage_devices):
        check_skips(list(model))  # (layers built elsewhere, from factories, are not here to check)
    factories = not isinstance(module, nn.Sequential)
    layer_devices = [d for count, d in zip(balance, stage_devices) for _ in range(count)]
    untie(model, tied, frozenset(i for i, d in enumerate(layer_devices) if factories and d.type == "meta"))
    if deferred_batch_norm:
        DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=None)  # the stages commit per step
    return split_module(model, balance, stage_devices)
