"""Fixup (Zhang et al. 2019, "Fixup Initialization: Residual Learning Without Normalization"): residual
networks trained with normalization off, for the paper's two models (``norm="none",
init_scheme="fixup"`` of :func:`gpipe.models.transformer`, :func:`gpipe.models.transformer_lm` and
:func:`gpipe.models.amoebanet_d`).

Without normalization a deep residual network's output grows with its depth at initialization, each
branch adding its own variance. Fixup keeps the signal in check by the initialization alone, with
the paper's three rules:

1. the classification layer and the last weight layer of every residual branch start at zero (its
   bias too), so that at initialization every branch adds 0 and the network is its main path; the
   other layers start as usual;
2. the other weight layers inside a branch are scaled by ``L ** (-1 / (2m - 2))``, ``L`` the number of
   residual branches of the model and ``m`` the weight layers in sequence in a branch (``m = 2``:
   ``L ** -0.5``), so that the updates of the first steps change the output by O(1) whatever the depth;
3. a scalar bias (starting at 0) before each weight layer and activation of a branch, and a scalar
   multiplier (starting at 1) at its end, which take over the biases and scales normalization had.

**Transformer** (:mod:`gpipe.models.transformer`). The branches are the attentions and feed-forward
blocks: ``L`` = 2 per encoder layer (self-attention, feed-forward) + 3 per decoder layer of the
encoder-decoder (self-attention, cross-attention, feed-forward), 2 per block of the decoder-only
model; ``m = 2`` in every branch (attention: the query, key and value projections, then the output
projection; feed-forward: inner, outer). Zero: every attention's output projection, every
feed-forward's outer projection (a mixture of experts': its experts' outer weights and biases) and the
output projection to the vocabulary. Scaled by ``L ** -0.5``: the query, key and value projections
(``nn.MultiheadAttention``'s fused ``in_proj_weight`` whole) and the feed-forward's inner projection
(a mixture of experts': its experts' inner weights; the gate keeps its initialization), replacing
``ff_init_scale``. Scalars (:class:`FixupBranch`): an attention's branch adds one bias to its
inputs (the query's, and the memory the cross-attention reads), one to the attended values before
the output projection, and multiplies by its scalar; a dense feed-forward adds a bias to its input,
one before the ReLU and one before the outer projection; a mixture of experts, one to its input
(the gate's and experts'), its multiplier at its end.

**AmoebaNet-D** (:mod:`gpipe.models.amoebanet`). A cell's node sums two operations; the parameter-free
ones (skip, pooling) carry the signal as a residual's identity does, and each operation with weights
(``conv_1x1``, ``conv_3x3``, the bottlenecks ``conv_7x1_1x7``, ``conv_3x3_bottleneck``) is a branch
beside them: ``L`` = the number of such operations in the model (5 per normal cell, 3 per reduction
cell), ``m`` = its convolutions in sequence (1, 1, 4, 3). Zero: the last convolution of every
weighted operation and the classifier's linear layer. Scaled by ``L ** (-1 / (2m - 2))``: the other
convolutions of an operation, on He et al.'s initialization (rule 1's "usual" one for a ReLU
network: without batch norm, torch's default, of variance 1/(3 fan_in), would shrink the signal by
a factor of 6 per ReLU-convolution); the convolutions of the main path (the stem, the cells'
preprocessing, the factorized reductions) keep He's. Scalars: every convolution adds a scalar bias
to its input (:class:`FixupConv2d`: the convolutions have no bias of their own, batch norm held it),
and every weighted operation ends in a :class:`Multiplier`.

The initialization lives in the ``reset_parameters`` methods of the modules holding the weights
(:class:`FixupLinear`, :class:`FixupConv2d`, :class:`FixupMultiheadAttention`, and the feed-forward's
and experts' own), so that a model built on the meta device gets it when a pipeline materializes each
stage. The Transformer's weights are drawn as the default modules draw them and then scaled, so that
a Fixup Transformer's scaled weights are the default one's (with ``ff_init_scale=1``, built from the
same seed) times the factor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "INIT_SCHEMES",
    "FixupBranch",
    "FixupConv2d",
    "FixupLinear",
    "FixupMultiheadAttention",
    "Multiplier",
    "check_settings",
    "fixup_scale",
    "without_norms",
]

INIT_SCHEMES = ("default", "fixup")


def check_settings(norm: str, init_scheme: str, norms: tuple[str, ...]) -> bool:
    """Whether ``init_scheme`` is Fixup; a ``ValueError`` naming the offending value for an unknown
    ``norm`` (``norms``: the model's, ``"none"`` last) or ``init_scheme``, or Fixup with a norm on."""
    if norm not in norms:
        raise ValueError(f"norm is one of {', '.join(map(repr, norms))} (norm: {norm!r})")
    if init_scheme not in INIT_SCHEMES:
        raise ValueError(f"init_scheme is 'default' or 'fixup' (init_scheme: {init_scheme!r})")
    if init_scheme == "fixup" and norm != "none":
        raise ValueError(
            f"init_scheme='fixup' needs norm='none' (norm: {norm!r}): Fixup replaces normalization by its "
            f"initialization, scalar biases and multipliers; give norm='none', or init_scheme='default' with {norm!r}"
        )
    return init_scheme == "fixup"


def fixup_scale(branches: int, depth: int) -> float:
    """Fixup's factor for the weight layers of a branch but its last (rule 2): ``branches ** (-1 / (2 depth
    - 2))``, ``depth`` (at least 2) the branch's weight layers in sequence."""
    return float(branches ** (-1 / (2 * depth - 2)))


def without_norms(model: nn.Module, kind: type[nn.Module]) -> None:
    """Every ``kind`` module of ``model`` replaced by ``nn.Identity`` under its own name, so that the
    other parameters keep their names."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kind):
                setattr(parent, name, nn.Identity())


class FixupBranch(nn.Module):
    """The scalars Fixup gives a residual branch: ``biases`` (starting at 0), the first added to the
    branch's input, the others where the branch's computation puts them (before its activation and
    its last weight layer); ``scale`` (starting at 1), the multiplier of its output."""

    def __init__(self, biases: int) -> None:
        super().__init__()
        self.biases = nn.Parameter(torch.empty(biases))
        self.scale = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.biases.zero_()
            self.scale.fill_(1.0)


class Multiplier(nn.Module):
    """A learned scalar multiplier starting at 1: the end of a Fixup branch."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


class FixupLinear(nn.Linear):
    """``nn.Linear`` drawn as usual, its weight then multiplied by ``gain``; ``gain=0``: weight and
    bias zero (the last layer of a Fixup branch, the classifier)."""

    def __init__(self, *args: Any, gain: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # (its reset_parameters call waits for the gain: see below)
        self.gain = gain
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not hasattr(self, "gain"):  # called by nn.Linear's constructor: this one's calls it after
            return
        super().reset_parameters()
        with torch.no_grad():
            self.weight.mul_(self.gain)
            if self.gain == 0 and self.bias is not None:
                self.bias.zero_()


class FixupMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` under Fixup: the fused query, key and value projection drawn as
    usual, then multiplied by ``gain``; the output projection zero (its bias is zero already)."""

    def __init__(self, *args: Any, gain: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gain = gain
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if not hasattr(self, "gain"):  # called by the base constructor: this one's calls it after
            return
        super()._reset_parameters()
        with torch.no_grad():
            self.in_proj_weight.mul_(self.gain)
            self.out_proj.weight.zero_()


class FixupConv2d(nn.Conv2d):
    """``nn.Conv2d`` with He et al.'s initialization (normal, fan in, for a ReLU before it) times
    ``gain`` (0: zero) and a scalar bias ``bias_in`` (starting at 0) added to its input."""

    def __init__(self, *args: Any, gain: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gain = gain
        self.bias_in = nn.Parameter(torch.empty(1, device=self.weight.device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not hasattr(self, "bias_in"):  # called by nn.Conv2d's constructor: this one's calls it after
            return
        with torch.no_grad():
            nn.init.kaiming_normal_(self.weight, nonlinearity="relu").mul_(self.gain)
            self.bias_in.zero_()
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x + self.bias_in)
