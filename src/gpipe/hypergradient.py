"""Learned learning rates: hypergradient descent (Baydin et al. 2017, "Online learning rate adaptation
with hypergradient descent") around any optimizer of a :class:`gpipe.Pipeline`, per layer or one for
the model; ``gpipe train --lr-hypergradient BETA [--lr-hypergradient-scope layer|global]``.

::

    rates = LearnedRates(pipe, optimizer, beta=0.02)   # scope="layer"
    loss = pipe.step(x, y)
    rates.step()                                      # in place of optimizer.step()
    rates.metrics(lr)                                 # {"lr/000": lr x the layer's factor, ...}

**The rule.** The rate of a step is the schedule's times a learned factor (1 at the start). The
hypergradient of the loss with respect to the last step's rate is the dot product of the new gradient
g with the last update u (Baydin et al.'s h = ∇f(θ_{t-1}) · ∂θ_{t-1}/∂lr). gpipe takes the paper's
multiplicative, normalized form: the factor is multiplied by 1 + β·cos(g, -u), so that β has no
unit, whatever the optimizer, the schedule or the model's scale: a gradient that still points where
the last step went makes steps longer, one that turns back makes them shorter. ``scope="layer"``
learns a factor per global layer from that layer's parameters (a tied weight with its first member's
layer, whose factor all its copies take: they stay equal); ``"global"``, one from all of them.

**Optimizer-agnostic.** The optimizer (Adam, Adafactor, RMSprop, SGD, ...) steps with the schedule's
rate; its update is then scaled by the factor: θ_before - factor·(θ_before - θ_after), which is what
the rate times the factor does to an update linear in the rate (Adam's, SGD's, RMSprop's). The update
the optimizer proposed is kept per parameter (its state's ``"hypergradient_update"``, so that a
checkpoint holds it and ``--resume`` is exact), one tensor the size of the parameter.

**The same bits at any K, under torchrun.** Each parameter's three sums (g·u, g·g, u·u) are taken in
float64 in a tree fixed by its size (a sharded ``DTensor``'s over its shards by one all-reduce per
layout), read to the host once, and summed per layer with ``math.fsum``; across ranks one all-reduce
(SUM) of a float64 vector indexed by layer, zero where a rank holds nothing (data-parallel replicas
but the first, tensor-parallel ranks but the first, tie copies but the first write zeros): every rank
then knows every layer's factor, in one process's bits. A step that the caller skips (a non-finite
gradient) calls nothing: the factors and the last update stay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from gpipe.distributed.devices import comm_device
from gpipe.distributed.failure import collective
from gpipe.shards import local

if TYPE_CHECKING:
    from gpipe.pipeline import Pipeline

__all__ = ["SCOPES", "UPDATE", "LearnedRates"]

SCOPES = ("layer", "global")
UPDATE = "hypergradient_update"
"""The optimizer state's key of a parameter's last update (θ before the step - θ after, unscaled)."""

_CHUNK = 16384  # (as gpipe.health's: a reduction of this many elements runs on one thread)


class LearnedRates:
    """The learned factors of ``pipe``'s learning rates (see the module's docstring): call
    :meth:`step` in place of ``optimizer.step()``. Under torch.distributed every rank calls it alike
    (collectives: one all-reduce, and one per layout of sharded parameters)."""

    def __init__(self, pipe: Pipeline, optimizer: torch.optim.Optimizer, *, beta: float, scope: str = "layer") -> None:
        if not (isinstance(beta, (int, float)) and 0 <= beta < 1):  # (NaN fails)
            raise ValueError(
                f"beta must be a finite number in [0, 1) (beta: {beta}): each step multiplies a rate by at most "
                "1 + beta and at least 1 - beta"
            )
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)} (scope: {scope!r})")
        self.pipe, self.optimizer, self.beta, self.scope = pipe, optimizer, float(beta), scope
        self.layers = sum(pipe.balance)
        self.factors = [1.0] * (self.layers if scope == "layer" else 1)
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        first = {(i, name): tie.members[0][0] for tie in pipe.engine.ties for i, name in tie.members}
        copies = {member for tie in pipe.engine.ties for member in tie.members[1:]}
        tp_rank = pipe.engine.placement.replica % pipe.tensor_parallel
        writes = pipe.dp_rank == 0 and tp_rank == 0  # (the other replicas' and tp ranks' values are the first's)
        self.params: list[tuple[nn.Parameter, int, bool]] = []  # (parameter, its layer's factor, counted here)
        for stage in pipe.engine.stages:
            for j, layer in enumerate(stage.module):
                for name, p in layer.named_parameters():
                    if id(p) in mine:
                        at = stage.first + j
                        self.params.append((p, first.get((at, name), at), writes and (at, name) not in copies))
        self.owners = self._owners()

    def _owners(self) -> list[int]:
        """The layers that own a parameter the optimizer steps (the others' are all tie copies, which
        learn with their first member's layer, or none): their factors are the learned ones.
        Under torch.distributed one all-reduce, once."""
        owned = [0.0] * self.layers
        for _, at, counted in self.params:
            owned[at] += counted
        if dist.is_initialized() and dist.get_world_size() > 1:
            reduced = torch.tensor(owned, dtype=torch.float64, device=comm_device(self.pipe.devices[0]))
            with collective("all-reduce of the layers that learn their learning rates"):
                dist.all_reduce(reduced)
            owned = reduced.tolist()
        return [at for at, n in enumerate(owned) if n]

    def factor(self, layer: int) -> float:
        """The learned factor of global ``layer``'s rate (the model's, with ``scope="global"``)."""
        return self.factors[layer if self.scope == "layer" else 0]

    @torch.no_grad()
    def step(self) -> None:
        """Learn the factors from the gradients and the last update, then step the optimizer and
        scale its update by each parameter's factor."""
        self._learn()
        before = []
        for p, _, _ in self.params:
            if p.grad is not None:
                kept = self.optimizer.state.get(p, {}).get(UPDATE)
                kept = torch.empty_like(p) if kept is None else kept
                before.append((p, kept.copy_(p)))
        self.optimizer.step()
        factor = {id(p): self.factor(at) for p, at, _ in self.params}
        for p, kept in before:
            kept.sub_(p)  # the optimizer's update, negated
            if (f := factor[id(p)]) != 1.0:
                p.add_(kept, alpha=1.0 - f)  # θ_before - f·(θ_before - θ_after)
            state = self.optimizer.state.get(p)
            if state:  # (kept where the optimizer keeps state of its own: never before its first step)
                state[UPDATE] = kept

    def _learn(self) -> None:
        """Each factor times 1 + β·cos(g, u) of its layer (or of the model), u the kept update (the last
        step, negated), from every parameter with a gradient and a kept update."""
        if not self.beta:
            return
        found = [(p, at, counted, u) for p, at, counted in self.params
                 if p.grad is not None and (u := self.optimizer.state.get(p, {}).get(UPDATE)) is not None]  # fmt: skip
        # (a rank with nothing to learn from yet, as every rank at the first step, still joins the all-reduce)
        sums = _whole([_sums(p.grad, u) for p, _, _, u in found if p.grad is not None], [p for p, _, _, _ in found])
        per_layer: dict[int, list[list[float]]] = {}
        for (_, at, counted, _), row in zip(found, sums, strict=True):
            if counted:
                per_layer.setdefault(at, []).append(row)
        vector = [0.0] * (3 * self.layers)
        for at, rows in per_layer.items():
            for k in range(3):
                vector[3 * at + k] = math.fsum(row[k] for row in rows)
        if dist.is_initialized() and dist.get_world_size() > 1:
            reduced = torch.tensor(vector, dtype=torch.float64, device=comm_device(self.pipe.devices[0]))
            with collective("all-reduce of the learned learning rates' hypergradients"):
                dist.all_reduce(reduced)
            vector = reduced.tolist()
        if self.scope == "global":
            totals = [math.fsum(vector[k::3]) for k in range(3)]
            self.factors[0] *= 1.0 + self.beta * _cosine(*totals)
            return
        for at in range(self.layers):
            self.factors[at] *= 1.0 + self.beta * _cosine(*vector[3 * at : 3 * at + 3])

    def metrics(self, lr: float) -> dict[str, float]:
        """The learned rates at the schedule's ``lr``: ``lr/NNN`` per layer that owns parameters
        (zero-padded as the health metrics' layers; a layer whose weights are all tied to earlier ones
        learns with them), or ``lr/model``."""
        if self.scope == "global":
            return {"lr/model": lr * self.factors[0]}
        width = max(3, len(str(self.layers - 1)))
        return {f"lr/{at:0{width}d}": lr * self.factors[at] for at in self.owners}

    def state_dict(self) -> dict[str, Any]:
        """The factors (the kept updates travel in the optimizer's state)."""
        return {"scope": self.scope, "factors": list(self.factors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Factors saved by :meth:`state_dict`, of the same scope and model."""
        factors = state.get("factors")
        if state.get("scope") != self.scope or not isinstance(factors, list) or len(factors) != len(self.factors):
            raise ValueError(
                f"learned learning rates of scope {state.get('scope')!r} for {len(factors or [])} factor(s) do not fit "
                f"scope {self.scope!r} with {len(self.factors)}"
            )
        self.factors = [float(f) for f in factors]


def _cosine(dot: float, gg: float, uu: float) -> float:
    """cos(g, u) from the sums, where u is θ_before - θ_after (the last step, negated): positive when the
    gradient still points where the last step went; 0 where either is zero."""
    return dot / math.sqrt(gg * uu) if gg > 0 and uu > 0 else 0.0


def _sums(grad: Tensor, update: Tensor) -> Tensor:
    """(g·u, g·g, u·u) of a parameter's local values, in float64, each in a tree fixed by the size."""
    g, u = local(grad).reshape(-1).double(), local(update).reshape(-1).double()
    return torch.stack([_tree_sum(g * u), _tree_sum(g * g), _tree_sum(u * u)])


def _tree_sum(v: Tensor) -> Tensor:
    """``v``'s sum in rows of ``_CHUNK`` (each row on one thread), then the rows' sums alike: the same
    bits whatever the thread count."""
    while v.numel() > _CHUNK:
        head = v.numel() - v.numel() % _CHUNK
        rows = v[:head].view(-1, _CHUNK).sum(dim=1)
        v = torch.cat([rows, v[head:].sum().reshape(1)]) if head < v.numel() else rows
    return v.sum()


def _whole(sums: Sequence[Tensor], params: Sequence[Tensor]) -> list[list[float]]:
    """The (n, 3) sums of whole parameters, read to the host at once: those of ``DTensor`` shards summed
    over the mesh dimensions they are sharded on, one all-reduce per layout (every rank of the mesh
    calls alike)."""
    rows = list(sums)
    layouts: dict[tuple[Any, ...], list[int]] = {}
    for n, p in enumerate(params):
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            layouts.setdefault((id(p.device_mesh), tuple(map(str, p.placements))), []).append(n)
    for ns in layouts.values():
        p = params[ns[0]]
        assert isinstance(p, DTensor)
        placements = [Partial() if isinstance(pl, Shard) else Replicate() for pl in p.placements]
        with collective("all-reduce of sharded parameters' hypergradient sums"):
            whole = DTensor.from_local(torch.stack([rows[n] for n in ns]), p.device_mesh, placements).full_tensor()
        for n, row in zip(ns, whole, strict=True):
            rows[n] = row
    if not rows:
        return []
    read: list[list[float]] = torch.stack([r.to(rows[0].device) for r in rows]).tolist()
    return read
