"""Training health of a :class:`gpipe.Pipeline`'s step: the global gradient norm before clipping,
the norm of the gradient of the loss with respect to every layer's output, and the ratio Bapna et
al. (2018) debug deep models with, r = ‖∇_{h_1} L‖ / ‖∇_{h_N} L‖ between the outputs h_1 and h_N
of the model's first and last block (large early in training, then flat when the lower layers
train; growing on, or vanishing, when they do not).

::

    with gpipe.health.Recorder(pipe) as health:   # around one step
        loss = pipe.step(inputs, target)
    found = health.result()                        # every rank: one all-reduce
    found.grad_norm, found.ratio, found.output_grads[3], found.metrics()

**Which blocks.** ``Recorder(pipe, blocks=(first, last))`` names the two global layer indices, or
the model says it: :func:`mark_blocks` sets ``model.health_blocks``, which :class:`gpipe.Pipeline`
keeps from the ``nn.Sequential`` it is given (gpipe's models set it: the Transformer's first and
last encoder layers, the decoder-only and Hugging Face models' first and last decoder blocks,
AmoebaNet-D's first and last cells). Without either, the first and the last layer whose output got
a gradient.

**How the output gradients are seen.** While a recorder is entered, every local stage runs its
functions through a watch (``Stage.watch``, as :func:`gpipe.nonfinite.locate`'s; a stage without
one pays a ``None`` check). Function i of a stage (its layers, then the loss) gets, in place of each
floating tensor of its input that needs a gradient, a view of it with a tensor hook: the gradient
that reaches the view is the gradient of the loss with respect to that part of layer i - 1's output
(global index ``stage.first + i - 1``), through the layers after it only — a view per consumer, so
a tensor a layer hands on unchanged (a decoder's memory, a cell's previous state) or twice (a stem's
``(x, x)``) counts once per place, as it does between stages, where every input is a leaf of its
own. Views are free, and change no value, no gradient and no random number. The hooks fire in
backward only: a forward that drops its activations (``gpipe.is_checkpointing()``) is not watched,
its recomputation is, so under re-materialization (whole stages or :class:`gpipe.Selective`) each
(layer, micro-batch) is seen once, in the real backward; a split backward sees it in I (W computes
weight gradients only and reaches no view). A layer that changes its input in place leaves its
predecessor's entry out (autograd moves the change to the view's base and drops the view's node);
a warning names it.

**The same numbers at any K, under torchrun.** Each (layer, micro-batch, input position) gives
one squared norm, accumulated in float64 in a fixed tree whose shape depends on the tensor's size only
(never on the thread count, which on CPU changes how a plain ``sum`` splits); the sum over a layer's
positions and micro-batches is ``math.fsum``'s, exactly rounded, so no order (the schedule's, the
hooks' threads') changes a bit. The global norm comes from per-parameter norms (:func:`grad_norms`,
or the ones the caller computed to clip: the gradients are read once), squared (exactly, in float64)
and summed per global layer, then over layers, with ``math.fsum``. Across ranks one all-reduce (SUM)
of a float64 vector indexed by global layer (and, for the output gradients, by data-parallel
replica), zero where a rank holds nothing: each entry has one writer and adding zeros is exact, so
the ranks' sum is the one-process value, bitwise. Tied parameters count once (the first member of
each tie: every copy holds the summed gradient); data-parallel replicas other than the first, and
tensor-parallel ranks other than the first, add zeros to the global norm (their gradients are the
first's; ``fsdp=True``'s per-parameter norms are already whole on every replica). The output
gradients of every replica add up (each its own micro-batches): over replicas the sum is exactly
rounded per replica and then across them, deterministic but not the one-process value of the same
global batch (neither is the loss: the replicas' gradients are summed in another order). Under
tensor parallelism the layers' outputs are whole on every tp rank, and the first tp rank's count;
a layer output that is a sharded ``DTensor`` would count its local part only.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpipe.checkpoint import is_checkpointing
from gpipe.distributed.devices import comm_device
from gpipe.distributed.failure import collective
from gpipe.shards import local

if TYPE_CHECKING:
    from gpipe.pipeline import Pipeline
    from gpipe.runtime.stage import Stage

__all__ = ["BLOCKS", "Health", "Recorder", "blocks_of", "global_grad_norm", "grad_norms", "mark_blocks"]

BLOCKS = "health_blocks"
"""The attribute of a model's ``nn.Sequential`` naming (first, last) block: :func:`mark_blocks`."""

_CHUNK = 16384
"""The width of one level of :func:`_square_sum`'s tree: a row reduced by one thread, in order (under
ATen's grain, 32768 elements, below which a reduction is not split)."""

Watch = Callable[["Stage", int, int, Callable[[Any], Any]], Callable[[Any], Any]]


def mark_blocks(model: nn.Sequential, first: int, last: int) -> nn.Sequential:
    """Say which layers of ``model`` are its first and last block (global indices), between whose
    outputs :class:`Health`'s ratio is taken; returns ``model``."""
    setattr(model, BLOCKS, _checked_blocks((first, last), len(model)))
    return model


def blocks_of(model: Any) -> tuple[int, int] | None:
    """The (first, last) block :func:`mark_blocks` gave ``model`` (a model, or a :class:`gpipe.Pipeline`
    built from it), or None."""
    found = getattr(model, BLOCKS, None)
    return None if found is None else (int(found[0]), int(found[1]))


def _checked_blocks(blocks: Any, layers: int) -> tuple[int, int]:
    ok = isinstance(blocks, (tuple, list)) and len(blocks) == 2 and all(isinstance(b, int) for b in blocks)
    if not ok or not 0 <= blocks[0] <= blocks[1] < layers:
        raise ValueError(
            f"health blocks must be (first, last) global layer indices with 0 <= first <= last < {layers}, the "
            f"model's layers (blocks: {blocks!r}); give e.g. (1, {max(layers - 2, 1)}), or None for the first and "
            "last layer whose output gets a gradient"
        )
    return int(blocks[0]), int(blocks[1])


def _square_sum(t: Tensor) -> Tensor:
    """The sum of ``t``'s squares in float64 (a 0-dim tensor on its device), in a tree fixed by its
    size: rows of ``_CHUNK`` elements, each row's norm taken by one thread in one kernel (torch splits a
    reduction with several outputs over them, never inside one) and squared, the rest likewise, then
    the row sums alike until one short row is left, which torch sums serially. A plain ``sum`` of a
    large tensor splits by the thread count."""
    v = local(t.detach()).reshape(-1)
    if v.numel() <= _CHUNK:
        whole: Tensor = torch.linalg.vector_norm(v, dtype=torch.float64)
        return whole.square()
    head = v.numel() - v.numel() % _CHUNK
    squares: Tensor = torch.linalg.vector_norm(v[:head].view(-1, _CHUNK), dim=1, dtype=torch.float64)
    if head < v.numel():
        squares = torch.cat([squares, torch.linalg.vector_norm(v[head:], dtype=torch.float64).reshape(1)])
    squares = squares.square()
    while squares.numel() > _CHUNK:  # (over 268M elements)
        head = squares.numel() - squares.numel() % _CHUNK
        rows = squares[:head].view(-1, _CHUNK).sum(dim=1)
        squares = torch.cat([rows, squares[head:].sum().reshape(1)]) if head < squares.numel() else rows
    return squares.sum()


def _flat(value: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """``value``'s leaves and how to put it back together with others: a tensor and a flat tuple
    directly (what layers hand on, mostly), other structures through pytree (a structure pytree
    does not know is one leaf). The positions are a function of the structure alone."""
    if isinstance(value, Tensor):
        return [value], _first
    if type(value) is tuple and not any(isinstance(v, (tuple, list, dict)) for v in value):
        return list(value), tuple
    try:
        leaves, spec = tree_flatten(value)
    except Exception:  # (a structure pytree does not know: looked at as it is)
        return [value], _first
    return leaves, functools.partial(tree_unflatten, treespec=spec)


def _first(leaves: list[Any]) -> Any:
    return leaves[0]


@torch.no_grad()
def grad_norms(params: Iterable[nn.Parameter]) -> list[tuple[nn.Parameter, float]]:
    """Every parameter with a gradient, and its gradient's norm (a sharded one's, a ``DTensor`` as
    ``Pipeline(fsdp=True)``'s, reduced over its shards: every rank holding a shard calls alike)."""
    held: list[nn.Parameter] = []
    whole: list[Tensor] = []
    for p in params:
        if p.grad is None:
            continue
        norm = p.grad.norm()  # (a shard's: its part of the norm, until reduced)
        held.append(p)
        whole.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return list(zip(held, to_floats(whole), strict=True))


def global_grad_norm(pipe: Pipeline, norms: Sequence[tuple[Tensor, float]] | None = None) -> float:
    """The norm of all of ``pipe``'s gradients, as :attr:`Health.grad_norm` (see the module's docstring:
    ties once, data-parallel replicas and tensor-parallel ranks once, the same bits at any K), without
    recording a step. ``norms``: every parameter's gradient norm when the caller has them (to clip).
    Under torch.distributed a collective (one all-reduce): every rank calls it and gets the result."""
    squares = _grad_squares(pipe, norms)
    if dist.is_initialized() and dist.get_world_size() > 1:
        vector = torch.tensor(squares, dtype=torch.float64, device=comm_device(pipe.devices[0]))
        with collective("all-reduce of the gradient norm"):
            dist.all_reduce(vector)
        squares = vector.tolist()
    return math.sqrt(math.fsum(squares))


def _grad_squares(pipe: Pipeline, norms: Sequence[tuple[Tensor, float]] | None) -> list[float]:
    """The squared gradient norm per global layer (all of them) of this process's stages, each tie
    counted at its first member; zeros but on the first data-parallel replica's first tp rank."""
    squares = [0.0] * sum(pipe.balance)
    if pipe.dp_rank != 0 or pipe.engine.placement.replica % pipe.tensor_parallel != 0:
        if norms is None:  # (every rank holding a shard of a sharded gradient reduces its norm alike)
            grad_norms(pipe.parameters())
        return squares
    found = {id(p): n for p, n in (grad_norms(pipe.parameters()) if norms is None else norms)}
    copies = {member for tie in pipe.engine.ties for member in tie.members[1:]}
    for stage in pipe.engine.stages:
        for j, layer in enumerate(stage.module):
            terms = [
                found[id(p)] ** 2  # (a float32 norm's square is exact in float64)
                for name, p in layer.named_parameters()
                if id(p) in found and (stage.first + j, name) not in copies
            ]
            squares[stage.first + j] = math.fsum(terms)
    return squares


def to_floats(tensors: Sequence[Tensor]) -> list[float]:
    """The values of 0-dim ``tensors`` as floats, read once per device and dtype (each read a
    synchronization of a device), not once per tensor."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for n, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(n)
    values = [0.0] * len(tensors)
    for ns in groups.values():
        for n, v in zip(ns, torch.stack([tensors[n] for n in ns]).tolist(), strict=True):
            values[n] = float(v)
    return values


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class Health:
    """One step's health: ``grad_norm`` (the norm of all the gradients, before any clipping),
    ``output_grads`` (global layer index -> ‖∇_{h_i} L‖, the norm of the gradient of the loss with
    respect to layer i's output over the whole mini-batch; layers whose output got no gradient are
    left out), ``blocks`` (the two layers :attr:`ratio` is taken between; None when none got one)."""

    grad_norm: float
    output_grads: dict[int, float]
    blocks: tuple[int, int] | None
    layers: int
    """The model's number of layers (the width of the metrics' layer numbers)."""

    @property
    def ratio(self) -> float:
        """Bapna et al.'s r = ‖∇_{h_first} L‖ / ‖∇_{h_last} L‖ (NaN when either is missing or the
        last is 0)."""
        if self.blocks is None:
            return math.nan
        first, last = (self.output_grads.get(b, math.nan) for b in self.blocks)
        return first / last if last else math.nan

    def key(self, layer: int) -> str:
        """The metrics' name of ``layer``'s output-gradient norm: ``output_grad/`` and the index
        zero-padded to 3 digits (more for models of over 1000 layers), so that names sort by layer."""
        return f"output_grad/{layer:0{max(3, len(str(self.layers - 1)))}d}"

    def metrics(self) -> dict[str, float | None]:
        """``grad_norm``, ``grad_norm_ratio`` and ``output_grad/NNN`` per layer (None: NaN or Inf, as
        JSON has neither)."""
        row = {"grad_norm": _finite(self.grad_norm), "grad_norm_ratio": _finite(self.ratio)}
        row.update((self.key(i), _finite(v)) for i, v in sorted(self.output_grads.items()))
        return row


class Recorder:
    """Records one step of ``pipe`` (entered around ``pipe.step``), then :meth:`result`. ``blocks``:
    the (first, last) block for the ratio (default: the model's, :func:`mark_blocks`; else the first
    and last layer with an output gradient). Under torch.distributed every rank enters it and calls
    :meth:`result` alike (one all-reduce over the world)."""

    def __init__(self, pipe: Pipeline, *, blocks: tuple[int, int] | None = None) -> None:
        if not hasattr(pipe, "engine"):
            raise TypeError(
                f"a health Recorder records a gpipe.Pipeline's step (got {type(pipe).__name__}); build the model "
                "with gpipe.Pipeline (GPipe's autograd-driven forward has no stages to watch)"
            )
        self.pipe = pipe
        self.layers = sum(pipe.balance)
        found = blocks if blocks is not None else blocks_of(pipe)
        self.blocks = None if found is None else _checked_blocks(found, self.layers)
        self._tp_rank = pipe.engine.placement.replica % pipe.tensor_parallel
        self._squares: dict[tuple[int, int, int], Tensor] = {}  # (layer, micro-batch, input position) -> sum
        self._lock = threading.Lock()
        self._previous: list[tuple[Stage, Watch | None]] = []

    def __enter__(self) -> Recorder:
        if self._previous:
            raise RuntimeError("a health Recorder records one step at a time: it is entered already")
        self._squares.clear()
        if self._tp_rank == 0:  # (the other tp ranks see the same outputs)
            for stage in self.pipe.engine.stages:
                before = stage.watch
                self._previous.append((stage, before))
                stage.watch = self._watch if before is None else functools.partial(self._around, before)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for stage, before in self._previous:
            stage.watch = before
        self._previous.clear()

    def _around(self, inner: Watch, stage: Stage, m: int, i: int, f: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return self._watch(stage, m, i, inner(stage, m, i, f))

    def _watch(self, stage: Stage, m: int, i: int, f: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``f``, the stage's ``i``-th function for micro-batch ``m``, with its input's floating
        tensors that need a gradient handed in as hooked views (see the module's docstring)."""
        layer = stage.first + i - 1  # whose output the input is
        if layer < 0:  # (the model's input)
            return f

        def watched(value: Any) -> Any:
            if not torch.is_grad_enabled() or is_checkpointing():  # (no graph, or one dropped: recomputed later)
                return f(value)
            leaves, rebuild = _flat(value)
            views: list[tuple[int, Tensor, int]] = []
            for pos, t in enumerate(leaves):
                if isinstance(t, Tensor) and t.requires_grad and t.is_floating_point():
                    view = t.view_as(t)
                    view.register_hook(functools.partial(self._seen, layer, m, pos))  # type: ignore[no-untyped-call]
                    views.append((pos, view, view._version))
                    leaves[pos] = view
            if not views:
                return f(value)
            out = f(rebuild(leaves))
            if any(view._version != version for _, view, version in views):
                name = type(stage.module[i]).__name__ if i < len(stage.module) else "the loss"
                warnings.warn(
                    f"gpipe.health: layer {stage.first + i} ({name}) changes its input in place, so the gradient "
                    f"of layer {layer}'s output is not recorded; make the change out of place (e.g. inplace=False)",
                    stacklevel=2,
                )
            return out

        return watched

    def _seen(self, layer: int, m: int, pos: int, grad: Tensor) -> None:
        square = _square_sum(grad)
        with self._lock:  # (a stage's worker thread; the same value again if a pass reached it twice)
            self._squares[(layer, m, pos)] = square

    def _output_squares(self) -> dict[int, float]:
        """This process's sum of squares per global layer (over micro-batches and input positions)."""
        keys = sorted(self._squares)
        values = to_floats([self._squares[key] for key in keys])  # (one copy per device)
        per_layer: dict[int, list[float]] = {}
        for (layer, _, _), v in zip(keys, values):
            per_layer.setdefault(layer, []).append(v)
        return {layer: math.fsum(vs) for layer, vs in per_layer.items()}

    def result(self, norms: Sequence[tuple[Tensor, float]] | None = None) -> Health:
        """The recorded step's :class:`Health`. ``norms``: every parameter's gradient norm, when the
        caller has them already (``gpipe.recipe.grad_norms``' to clip, before clipping); else they are
        computed here. Under torch.distributed a collective: every rank calls it and gets the result."""
        pipe, layers = self.pipe, self.layers
        replicas, replica = pipe.data_parallel, pipe.dp_rank
        grads = _grad_squares(pipe, norms)
        outputs, seen = [0.0] * (replicas * layers), [0.0] * (replicas * layers)
        for index, square in self._output_squares().items():
            outputs[replica * layers + index] = square
            seen[replica * layers + index] = 1.0
        total = grads + outputs + seen
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = comm_device(pipe.devices[0])
            vector = torch.tensor(total, dtype=torch.float64, device=device)
            with collective("all-reduce of the training health's norms"):
                dist.all_reduce(vector)
            total = vector.tolist()
        grads, outputs, seen = total[:layers], total[layers : layers + len(outputs)], total[layers + len(outputs) :]
        output_grads = {
            index: math.sqrt(math.fsum(outputs[r * layers + index] for r in range(replicas)))
            for index in range(layers)
            if any(seen[r * layers + index] for r in range(replicas))
        }
        blocks = self.blocks
        if blocks is None and output_grads:
            blocks = (min(output_grads), max(output_grads))
        return Health(math.sqrt(math.fsum(grads)), output_grads, blocks, layers)
