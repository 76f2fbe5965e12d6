"""A sparsely-gated mixture of experts (Shazeer et al. 2017), gated as GShard (Lepikhin et al. 2020)
does, for the paper's Transformer: :class:`MoEFeedForward` takes the place of a layer's feed-forward
block (``transformer(..., experts=E)``).

Gating, per micro-batch (GShard's *group*): a linear gate scores each token against the E experts
(in float32, whatever autocast says); the softmax's top ``top_k`` experts are the token's choices,
their weights normalized to sum to 1 (top-1: the gate's probability itself). In training, a choice
after the first is kept with probability 2 x its weight (GShard's random routing of the second
expert; seeded per step, layer and micro-batch, as dropout is). Padding tokens are never routed.

Capacity: each expert takes at most ``C = ceil(capacity_factor * top_k * N / E)`` tokens of a
micro-batch of N positions (GShard's 2N/E for its top-2, times the factor; N from the shape, padding
included: no host read). First choices come first, in the order of the tokens (row by row), then
second choices; an assignment past an expert's capacity is dropped, and a token whose every
choice is dropped is carried by the residual alone. Which tokens drop depends on the micro-batch
only, so the same tokens drop at any number of stages and under any schedule. With a key/value cache
current (decoding) no token is dropped: a step's few tokens route as they do in the whole sequence.

Dispatch and combine move rows by index into an (E, C, D) buffer and back, with no (N, E, C) matrix:
every kept assignment has its own slot, so the sums are exact and the same on every run (the dropped
ones all go to one row past the buffer, which no expert computes and which gives back zeros).

The auxiliary load-balancing loss (GShard): ``E * sum_e(mean gate_e * fraction routed first to
e)`` over the routed tokens, 1 when balanced, is added to the training objective with weight
``loss_weight`` through :func:`gpipe.auxiliary.with_auxiliary_loss` (the micro-batches' row-weighted
mean, whatever the cut). In evaluation mode every call adds its routing figures to ``routing``
(:func:`routing_metrics` reads them): the auxiliary loss, the tokens routed and dropped, and the
busiest expert's load over the mean.

Part of the library: imports torch, :mod:`gpipe.auxiliary`, :mod:`gpipe.cache` and
:mod:`gpipe.distributed` (:func:`routing_metrics` reads a pipeline's figures).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe.auxiliary import with_auxiliary_loss
from gpipe.cache import decoding as _decoding
from gpipe.distributed.devices import comm_device
from gpipe.distributed.experts import ExpertGroup, exchange, split_stacked
from gpipe.distributed.failure import collective
from gpipe.shards import local

__all__ = ["Experts", "MoEFeedForward", "Routing", "active_parameters", "check_moe", "route", "routing_metrics"]

ROUTING = ("aux_loss", "routed", "dropped", "busiest", "calls")
"""What ``MoEFeedForward.routing`` sums over its evaluation calls, in order."""


class Experts(nn.Module):
    """E feed-forward experts (Linear-ReLU-Linear, as the dense layer's), their weights stacked:
    ``inner_weight`` (E, dim, hidden), ``inner_bias`` (E, hidden), ``outer_weight`` (E, hidden, dim),
    ``outer_bias`` (E, dim). Called on an (E, C, dim) buffer, expert e on row e."""

    def __init__(self, experts: int, dim: int, hidden: int, init_scale: float, fixup: bool = False) -> None:
        super().__init__()
        self.inner_weight = nn.Parameter(torch.empty(experts, dim, hidden))
        self.inner_bias = nn.Parameter(torch.empty(experts, hidden))
        self.outer_weight = nn.Parameter(torch.empty(experts, hidden, dim))
        self.outer_bias = nn.Parameter(torch.empty(experts, dim))
        self.init_scale, self.fixup = init_scale, fixup
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initializes a layer of its sizes (uniform in +-1/sqrt(fan in)),
        the weights then scaled by ``init_scale`` (the dense feed-forward's 1/L); with ``fixup``, the
        outer weights and biases then zero (:mod:`gpipe.models.fixup`: the branch's last layer)."""
        with torch.no_grad():
            for weight, bias in ((self.inner_weight, self.inner_bias), (self.outer_weight, self.outer_bias)):
                bound = 1 / math.sqrt(weight.size(1))
                weight.uniform_(-bound, bound).mul_(self.init_scale)
                bias.uniform_(-bound, bound)
            if self.fixup:
                self.outer_weight.zero_()
                self.outer_bias.zero_()

    @property
    def count(self) -> int:
        return self.inner_weight.size(0)

    def forward(self, x: Tensor) -> Tensor:  # (E, C, dim) -> (E, C, dim); split: this rank's experts
        inner_w, inner_b, outer_w, outer_b = (
            local(p) for p in (self.inner_weight, self.inner_bias, self.outer_weight, self.outer_bias)
        )
        h = torch.relu(torch.baddbmm(inner_b.unsqueeze(1), x, inner_w))
        out: Tensor = torch.baddbmm(outer_b.unsqueeze(1), h, outer_w)
        return out

    def split(self, experts: ExpertGroup) -> None:
        """Keep this rank's slice of the experts (:func:`gpipe.distributed.experts.split_stacked`)."""
        split_stacked(self, [name for name, _ in self.named_parameters(recurse=False)], experts)


class Routing:
    """Where a micro-batch's tokens go: ``slots`` (N, k), each assignment's row of the (E*C) buffer
    (a dropped one: a zero row past it, its own); ``weights`` (N, k), the gate's weight of each
    (0 where dropped); ``aux`` the load-balancing loss; ``routed``, ``dropped``, ``busiest`` (tensors,
    read only by :func:`routing_metrics`)."""

    def __init__(
        self, slots: Tensor, weights: Tensor, capacity: int, aux: Tensor, routed: Tensor, dropped: Tensor,
        busiest: Tensor,
    ) -> None:  # fmt: skip
        self.slots, self.weights, self.capacity = slots, weights, capacity
        self.aux, self.routed, self.dropped, self.busiest = aux, routed, dropped, busiest


def route(
    logits: Tensor, *, top_k: int, capacity: int | None, routed: Tensor | None = None, sample: bool = False
) -> Routing:
    """GShard's gating of ``logits`` (N, E) (see the module's docstring): ``capacity`` per expert
    (None: every assignment kept, C = N), ``routed`` (N,) True for the tokens to route (None: all),
    ``sample``: the random routing of the choices after the first."""
    n, e = logits.shape
    gates = torch.softmax(logits.float(), dim=-1)  # (N, E)
    top, chosen = gates.topk(top_k, dim=-1)  # (N, k) each
    weights = top / top.sum(-1, keepdim=True) if top_k > 1 else top
    keep = torch.ones_like(weights, dtype=torch.bool) if routed is None else routed[:, None].expand(n, top_k).clone()
    if sample and top_k > 1:
        draws = torch.rand(n, top_k - 1, device=logits.device)
        keep[:, 1:] &= 2 * weights[:, 1:].detach() > draws
    one_hot = F.one_hot(chosen, e) * keep[..., None]  # (N, k, E)
    tokens = keep[:, 0].sum().clamp(min=1).to(gates.dtype)
    share_gate = (gates * keep[:, :1]).sum(0) / tokens  # mean gate per expert over the routed tokens
    share_first = one_hot[:, 0].sum(0).to(gates.dtype) / tokens  # fraction routed first to each expert
    aux = e * (share_gate * share_first.detach()).sum()
    load = one_hot.sum((0, 1)).to(gates.dtype)  # assignments per expert, before capacity
    busiest = load.max() / load.mean().clamp(min=1e-9)
    # Position of each assignment in its expert: first choices (token order) before second choices.
    order = one_hot.transpose(0, 1).reshape(top_k * n, e)  # choice-major
    position = (order.cumsum(0) - 1).view(top_k, n, e).transpose(0, 1)  # (N, k, E)
    position = (position * one_hot).sum(-1)  # (N, k)
    c = n if capacity is None else min(capacity, n)  # (no expert takes more than the N tokens there are)
    kept = keep & (position < c)
    slot = chosen * c + position
    spare = e * c + torch.arange(n * top_k, device=logits.device).view(n, top_k)  # a dropped one's own zero row
    slots = torch.where(kept, slot, spare)
    dropped = (keep[:, 0] & ~kept.any(-1)).sum().to(gates.dtype)
    return Routing(slots, weights * kept, c, aux, keep[:, 0].sum().to(gates.dtype), dropped, busiest)


class MoEFeedForward(nn.Module):
    """A feed-forward block of ``experts`` experts, ``top_k`` of which take each token (see the
    module's docstring). Called as the dense block is, with the positions' padding: ``ff(x, pad)``,
    ``x`` (B, T, dim), ``pad`` (B, T) True for padding, or None. ``fixup``: Fixup's initialization,
    the experts' outer layers zero (:mod:`gpipe.models.fixup`)."""

    gpipe_auxiliary_loss = True  # (a pipeline's stage weights it by the micro-batch's share)
    routing: Tensor

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        loss_weight: float = 0.01,
        dropout: float = 0.0,
        init_scale: float = 1.0,
        fixup: bool = False,
    ) -> None:
        super().__init__()
        check_moe(experts, top_k, capacity_factor, loss_weight)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, dim, hidden, init_scale, fixup)
        # On the experts' outputs, where the tokens live: the same numbers wherever the experts are.
        self.dropout = nn.Dropout(dropout)
        self.top_k, self.capacity_factor, self.loss_weight = top_k, capacity_factor, loss_weight
        self.register_buffer("routing", torch.zeros(len(ROUTING)), persistent=False)
        self.spread: ExpertGroup | None = None  # the expert-parallel group its experts are split over

    def reset_parameters(self) -> None:
        """The routing figures counted again (the gate and the experts reset their own parameters)."""
        self.routing.zero_()

    def gpipe_split_experts(self, experts: ExpertGroup) -> None:
        """Split this layer's experts over an expert-parallel group (:mod:`gpipe.distributed.experts`):
        each rank keeps its slice, and the tokens go to them by all-to-all."""
        self.experts.split(experts)
        self.spread = experts

    def capacity(self, positions: int) -> int:
        return math.ceil(self.capacity_factor * self.top_k * positions / self.experts.count)

    def forward(self, x: Tensor, pad: Tensor | None = None) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        n = flat.size(0)
        kind = flat.device.type
        with contextlib.ExitStack() as stack:
            if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))  # (the gate in float32)
            logits = F.linear(flat.float(), self.gate.weight.float())
        decoding = _decoding()
        routing = route(
            logits,
            top_k=self.top_k,
            capacity=None if decoding else self.capacity(n),
            routed=None if pad is None else ~pad.reshape(-1),
            sample=self.training,
        )
        e, c, k = self.experts.count, routing.capacity, self.top_k
        # Row e*c of the buffer takes the dropped assignments: never computed, and zero on the way back.
        slots = torch.where(routing.slots < e * c, routing.slots, e * c)
        buffer = flat.new_zeros(e * c + 1, shape[-1]).index_put((slots.reshape(-1),), flat.repeat_interleave(k, 0))
        rows = buffer[: e * c]
        done = self.dropout(self.experts(rows.view(e, c, -1)) if self.spread is None else self._spread(rows, c))
        out_rows = torch.cat([done.reshape(e * c, -1).to(flat.dtype), flat.new_zeros(1, shape[-1])])
        picked = out_rows[slots]  # (N, k, D)
        out = (picked * routing.weights.unsqueeze(-1).to(picked.dtype)).sum(1).view(shape)
        if not self.training and not decoding:
            figures = torch.stack([routing.aux.detach(), routing.routed, routing.dropped, routing.busiest.detach(),
                                   routing.aux.new_ones(())])  # fmt: skip
            self.routing.add_(figures.to(self.routing.device))
        return with_auxiliary_loss(out, self.loss_weight * routing.aux) if self.loss_weight else out

    def _spread(self, rows: Tensor, capacity: int) -> Tensor:
        """The experts of the (E*C, D) dispatch buffer ``rows`` computed where they live: each rank's
        slice of the experts sent there (one all-to-all), computed on the rows of every replica of
        the group, and sent back (another); (E, C, D) in expert order."""
        group = self.spread
        assert group is not None
        share, n = self.experts.count // group.size, group.size
        capacities = group.capacities(capacity)
        mine = [share * c for c in capacities]  # the rows each replica sends to each rank
        received = exchange(rows, group, [share * capacity] * n, mine)
        parts = [part.view(share, c, -1) for part, c in zip(torch.split(received, mine), capacities)]
        done = self.experts(torch.cat(parts, dim=1))  # (share, all the replicas' C, D)
        pieces = zip(torch.split(done, capacities, dim=1), capacities)
        back = torch.cat([part.reshape(share * c, -1) for part, c in pieces])
        return exchange(back, group, mine, [share * capacity] * n).view(self.experts.count, capacity, -1)


def active_parameters(model: nn.Module) -> int:
    """The parameters a token goes through: all of ``model``'s, less those of the experts it does not
    take in each mixture (E - top_k of them)."""
    left = 0
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            one = sum(p.numel() for p in m.experts.parameters()) // m.experts.count
            left += (m.experts.count - m.top_k) * one
    return sum(p.numel() for p in model.parameters()) - left


def check_moe(experts: int, top_k: int, capacity_factor: float, loss_weight: float) -> None:
    """The settings of a mixture of experts, refused in one line each."""
    if experts < 1 or top_k < 1 or experts < top_k:
        raise ValueError(
            f"a mixture of experts needs at least as many experts as each token takes (experts: {experts}, "
            f"top_k: {top_k}): give experts >= top_k >= 1"
        )
    if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        raise ValueError(f"the capacity factor must be a finite number > 0 (capacity_factor: {capacity_factor})")
    if not (loss_weight >= 0 and math.isfinite(loss_weight)):
        raise ValueError(f"the load-balancing loss's weight must be a finite number >= 0 (loss_weight: {loss_weight})")


def routing_metrics(model: nn.Module, *, reset: bool = True) -> dict[str, float] | None:
    """The evaluation calls' routing since the last read, over every :class:`MoEFeedForward` of
    ``model`` (a :class:`gpipe.Pipeline` too): ``moe_aux_loss`` (the mean load-balancing loss),
    ``moe_dropped`` (the fraction of the routed tokens dropped), ``moe_busiest`` (the busiest
    expert's assignments over the mean, on average); None without a mixture of experts or calls.
    One host read; under torch.distributed every rank calls it and gets the figures of all (one
    all-reduce: the ranks' sums added up; copies of a layer count alike, which the ratios ignore).
    ``reset``: start counting again."""
    from gpipe.pipeline import Pipeline

    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    distributed = isinstance(model, Pipeline) and model.distributed
    if not layers and not distributed:
        return None
    if distributed:
        assert isinstance(model, Pipeline)
        device = comm_device(model.engine.devices[0])
    else:
        device = layers[0].routing.device
    total = torch.zeros(len(ROUTING), device=device)
    for m in layers:
        total += m.routing.to(device)
        if reset:
            m.routing.zero_()
    if distributed:
        with collective("all-reduce of the mixture of experts' routing figures"):
            dist.all_reduce(total)
    return summarize(total.tolist())


def summarize(total: list[float]) -> dict[str, float] | None:
    """:func:`routing_metrics`' figures from the summed ``routing`` (ranks' sums added up)."""
    aux, routed, dropped, busiest, calls = total
    if not calls:
        return None
    return {"moe_aux_loss": aux / calls, "moe_dropped": dropped / routed if routed else 0.0,
            "moe_busiest": busiest / calls}  # fmt: skip
