"""Hugging Face mixtures of experts split over ranks (``--model hf --expert-parallel N``).

transformers keeps a Mixtral- or Qwen3-MoE-shaped model's experts as one module of stacked weights
(``gate_up_proj`` (E, 2I, D), ``down_proj`` (E, D, I), ``act_fn``), called by its block as
``experts(hidden_states, top_k_index, top_k_weights)`` after the router chose. :func:`prepare_split`
gives each such module ``gpipe_split_experts`` (:mod:`gpipe.distributed.experts`): once split, a rank
keeps E/N of the stacks, and the module's forward sends each token's assignments to the ranks holding
their experts and the results back (two all-to-alls), then combines them as transformers does.

Nothing is dropped: a model of transformers routes every assignment (no capacity), so the numbers of
rows each rank sends vary, and are exchanged first (one small all-to-all, read on the host: the
module's own forward reads the host per layer too, finding the experts hit). The router, its
auxiliary loss and everything else run as before. The result is transformers' up to the order of the
sums over a token's experts.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.distributed.experts import ExpertGroup, exchange, split_stacked
from gpipe.shards import local

__all__ = ["prepare_split", "splittable"]

STACKED = ("gate_up_proj", "down_proj")


def splittable(module: nn.Module) -> bool:
    """Whether ``module`` holds experts as transformers' Mixtral and Qwen3-MoE do (stacked weights)."""
    count = getattr(module, "num_experts", None)
    params = dict(module.named_parameters(recurse=False))
    return (
        isinstance(count, int)
        and all(name in params and params[name].dim() == 3 and params[name].size(0) == count for name in STACKED)
        and callable(getattr(module, "act_fn", None))
    )


def prepare_split(model: nn.Module) -> int:
    """Make every experts module of ``model`` splittable over an expert-parallel group; how many there
    are. Refuses, in one line, experts held otherwise (a module list of experts, say)."""
    found = 0
    for name, module in model.named_modules():
        if splittable(module):
            module.gpipe_split_experts = types.MethodType(_split, module)
            found += 1
        elif name.rsplit(".", 1)[-1] == "experts" and isinstance(module, nn.ModuleList):
            raise ValueError(
                f"{name}: this model keeps its experts as a list of modules, which --expert-parallel does not split "
                "(it splits transformers' stacked experts: Mixtral, Qwen3-MoE); leave --expert-parallel out"
            )
    return found


def _split(self: Any, experts: ExpertGroup) -> None:
    split_stacked(self, STACKED, experts)
    self.gpipe_spread = experts
    self.forward = types.MethodType(_spread_forward, self)


def _spread_forward(self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts forward with the experts split over ``self.gpipe_spread``."""
    from torch.distributed import _functional_collectives as funcol

    group: ExpertGroup = self.gpipe_spread
    n, k = group.size, top_k_index.size(-1)
    share = self.num_experts // n
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the assignments by expert, so by the rank holding it
    chosen = flat[order]
    counts = torch.bincount(chosen // share, minlength=n)
    received = funcol.wait_tensor(funcol.all_to_all_single(counts, [1] * n, [1] * n, group.group))  # type: ignore[no-untyped-call]
    send, receive = counts.tolist(), received.tolist()
    rows = exchange(hidden_states[order // k], group, send, receive)
    which = funcol.wait_tensor(  # type: ignore[no-untyped-call]
        funcol.all_to_all_single((chosen % share).contiguous(), receive, send, group.group)
    )
    gate_up, down = local(self.gate_up_proj), local(self.down_proj)
    out = torch.zeros_like(rows)
    for j in range(share):
        (picked,) = torch.nonzero(which == j, as_tuple=True)
        if picked.numel():
            gate, up = nn.functional.linear(rows[picked], gate_up[j]).chunk(2, dim=-1)
            out = out.index_put((picked,), nn.functional.linear(self.act_fn(gate) * up, down[j]))
    back = exchange(out, group, receive, send)
    weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
    return torch.zeros_like(hidden_states).index_add(0, order // k, weighted.to(hidden_states.dtype))
