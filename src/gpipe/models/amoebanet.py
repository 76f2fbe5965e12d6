"""The paper's AmoebaNet-D(L, D) image classifier as a sequence of layers, ready to be partitioned.

AmoebaNet-D is the architecture found by regularized evolution (Real et al., 2019): a stem, then
three stacks of normal cells separated by reduction cells. ``L`` is the number of normal cells (split
over the three stacks), ``D`` the number of filters of the first stack; every reduction cell halves
the resolution and doubles the filters. Every cell consumes the outputs of the two cells before it,
so the layers pass the pair ``(previous-but-one, previous)`` along, and a cell returns
``(previous, its own output)``::

    images (B, 3, H, W) ─ Stem ─> (s, s) ─ 2 stem reduction cells (D/4, D/2) ─>
    ─ L/3 normal cells (D) ─ reduction (2D) ─ L/3 normal (2D) ─ reduction (4D) ─ L/3 normal (4D) ─
    ─ Classifier ─> logits (B, classes)

A cell first brings both inputs to its width C (a 1x1 convolution, or a factorized reduction when the
older input still has twice the resolution), then builds five nodes, each the sum of two operations
applied to earlier states (the genotype below), and concatenates the nodes 4, 5 and 6: 3C channels.

``reference_cells=True`` builds the cells as the TPU reference implementation of AmoebaNet-D does
(tensorflow/tpu, ``models/official/amoeba_net``), which differs in two places: a normal cell also
concatenates its own input (the previous cell's output brought to width C) with nodes 4, 5 and 6,
4C channels, and the reduction cell's 3x3 convolution is a bottleneck at C/4 like the 1x7/7x1 pair.
With them the paper's Table 1 parameter counts are met (``configs/``: within 1% but (72, 512), 2.4%
over); the default cells are gpipe's original ones, 4-10% under those counts (docs/models.md).

The model has L + 6 layers (L + 4 with ``stem_cells=0``, for small images), all constructible on the
meta device. Batch norm is plain ``nn.BatchNorm2d``; pass ``deferred_batch_norm=True`` to the pipeline
for the paper's per-mini-batch running statistics.

``norm="none"`` takes batch norm out (each an ``nn.Identity`` under its name: the convolutions, which
have no bias, are then left without one); ``init_scheme="fixup"`` (with it) trains the model without
it (:mod:`gpipe.models.fixup`, whose docstring gives the rules): each operation with weights of a
cell is a residual branch beside the parameter-free ones (skip, pooling), which carry the signal. Its
last convolution starts at zero and the others at He et al.'s initialization times
``L ** (-1 / (2m - 2))`` (L: the model's weighted operations, m: the operation's convolutions), it
ends in a scalar multiplier; every convolution adds a scalar bias to its input, those of the main path
(stem, preprocessing, factorized reductions) start at He's; the classifier starts at zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe.health import mark_blocks
from gpipe.models.fixup import FixupConv2d, FixupLinear, Multiplier, check_settings, fixup_scale, without_norms

__all__ = ["NORMAL", "REDUCTION", "REFERENCE_NORMAL_CONCAT", "amoebanet_d", "smallest_feature_map"]

States = tuple[Tensor, Tensor]

# The genotype of AmoebaNet-D: per node, two (operation, input state) pairs. States 0 and 1 are the
# cell's two (preprocessed) inputs, state n ≥ 2 the n-th node; the cell outputs nodes 4, 5 and 6.
NORMAL: tuple[tuple[str, int], ...] = (
    ("max_pool_3x3", 0), ("conv_1x1", 0),
    ("skip", 2), ("max_pool_3x3", 2),
    ("skip", 0), ("conv_7x1_1x7", 1),
    ("conv_1x1", 1), ("conv_7x1_1x7", 1),
    ("avg_pool_3x3", 0), ("conv_1x1", 3),
)  # fmt: skip
REDUCTION: tuple[tuple[str, int], ...] = (
    ("max_pool_2x2", 1), ("max_pool_3x3", 1),
    ("conv_3x3", 0), ("skip", 2),
    ("conv_7x1_1x7", 2), ("max_pool_3x3", 2),
    ("avg_pool_3x3", 2), ("conv_1x1", 3),
    ("skip", 3), ("max_pool_2x2", 0),
)  # fmt: skip
CONCAT = (4, 5, 6)
REFERENCE_NORMAL_CONCAT = (1, 4, 5, 6)  # (reference_cells: a normal cell's output also holds its input's state 1)


def _relu_conv_bn(c_in: int, c_out: int, kernel: int | tuple[int, int], stride: int | tuple[int, int] = 1,
                  padding: int | tuple[int, int] = 0) -> list[nn.Module]:  # fmt: skip
    return [nn.ReLU(), nn.Conv2d(c_in, c_out, kernel, stride, padding, bias=False), nn.BatchNorm2d(c_out)]


class FactorizedReduce(nn.Module):
    """Halve the resolution without losing every other pixel: two strided 1x1 convolutions, one on
    the input shifted by a pixel, concatenated."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.even = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.odd = nn.Conv2d(c_in, c_out - c_out // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(x)
        shifted = F.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        out: Tensor = self.bn(torch.cat([self.even(x), self.odd(shifted)], dim=1))
        return out


class MaxPool2x2(nn.Module):
    def __init__(self, stride: int) -> None:
        super().__init__()
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        if self.stride == 1:  # keep the size: pad right and bottom with -inf
            return F.max_pool2d(F.pad(x, (0, 1, 0, 1), value=float("-inf")), 2, 1)
        return F.max_pool2d(x, 2, 2, ceil_mode=True)


def _conv_7x1_1x7(c: int, stride: int) -> nn.Module:
    """A bottleneck: 1x1 down to C/4, 1x7 and 7x1 (each carrying half the stride), 1x1 back up."""
    q = max(c // 4, 1)
    return nn.Sequential(
        *_relu_conv_bn(c, q, 1),
        *_relu_conv_bn(q, q, (1, 7), (1, stride), (0, 3)),
        *_relu_conv_bn(q, q, (7, 1), (stride, 1), (3, 0)),
        *_relu_conv_bn(q, c, 1),
    )


def _conv_3x3_bottleneck(c: int, stride: int) -> nn.Module:
    """The reference implementation's 3x3 convolution: 1x1 down to C/4, 3x3 (strided), 1x1 back up."""
    q = max(c // 4, 1)
    return nn.Sequential(*_relu_conv_bn(c, q, 1), *_relu_conv_bn(q, q, 3, stride, 1), *_relu_conv_bn(q, c, 1))


OPERATIONS: dict[str, Callable[[int, int], nn.Module]] = {
    "skip": lambda c, s: nn.Identity() if s == 1 else FactorizedReduce(c, c),
    "avg_pool_3x3": lambda c, s: nn.AvgPool2d(3, s, padding=1, count_include_pad=False),
    "max_pool_3x3": lambda c, s: nn.MaxPool2d(3, s, padding=1),
    "max_pool_2x2": lambda c, s: MaxPool2x2(s),
    "conv_1x1": lambda c, s: nn.Sequential(*_relu_conv_bn(c, c, 1, s)),
    "conv_3x3": lambda c, s: nn.Sequential(*_relu_conv_bn(c, c, 3, s, 1)),
    "conv_3x3_bottleneck": _conv_3x3_bottleneck,
    "conv_7x1_1x7": _conv_7x1_1x7,
}


class Cell(nn.Module):
    """A normal or reduction cell of width ``channels``: (s0, s1) -> (s1, the ``concat`` states
    concatenated: 3·channels by default)."""

    def __init__(
        self,
        prev_prev: int,
        prev: int,
        channels: int,
        *,
        reduction: bool,
        prev_reduction: bool,
        genotype: tuple[tuple[str, int], ...] | None = None,
        concat: tuple[int, ...] = CONCAT,
    ) -> None:
        super().__init__()
        genotype = genotype or (REDUCTION if reduction else NORMAL)
        self.reduction, self.concat = reduction, concat
        # the older input still has twice the resolution after a reduction cell
        self.pre0 = (
            FactorizedReduce(prev_prev, channels)
            if prev_reduction
            else nn.Sequential(*_relu_conv_bn(prev_prev, channels, 1))
        )
        self.pre1 = nn.Sequential(*_relu_conv_bn(prev, channels, 1))
        self.inputs = [index for _, index in genotype]
        self.ops = nn.ModuleList(
            OPERATIONS[name](channels, 2 if reduction and index < 2 else 1) for name, index in genotype
        )
        self.channels = channels

    @property
    def out_channels(self) -> int:
        return len(self.concat) * self.channels

    def forward(self, states: States) -> States:
        s0, s1 = states
        hidden = [self.pre0(s0), self.pre1(s1)]
        for i in range(0, len(self.ops), 2):
            a, b = self.inputs[i], self.inputs[i + 1]
            hidden.append(self.ops[i](hidden[a]) + self.ops[i + 1](hidden[b]))
        return s1, torch.cat([hidden[i] for i in self.concat], dim=1)


class Stem(nn.Module):
    """A strided 3x3 convolution; its output is both states the first cell consumes."""

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, images: Tensor) -> States:
        x: Tensor = self.bn(self.conv(images))
        return x, x


class Classifier(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, states: States) -> Tensor:
        x = F.adaptive_avg_pool2d(F.relu(states[1]), 1).flatten(1)
        out: Tensor = self.fc(x)
        return out


def amoebanet_d(
    layers: int = 18,
    filters: int = 256,
    *,
    classes: int = 1000,
    in_channels: int = 3,
    stem_cells: int = 2,
    reference_cells: bool = False,
    norm: str = "batch",
    init_scheme: str = "default",
) -> nn.Sequential:
    """AmoebaNet-D(L, D): ``layers`` normal cells in three stacks (the first stacks get the
    remainder), ``filters`` filters in the first stack. ``stem_cells`` reduction cells (of D/4 and
    D/2 filters) follow the stem convolution, as for ImageNet; use 0 for small images such as 32x32.
    ``reference_cells``: the TPU reference implementation's cells (normal cells 4C wide, the
    reduction's 3x3 a bottleneck), which meet the paper's parameter counts; see the module's docstring.
    ``norm``: ``'batch'`` or ``'none'`` (no batch norm); ``init_scheme``: ``'default'`` or, with
    ``norm='none'``, ``'fixup'`` (see the module's docstring). Input: images (B, in_channels, H, W);
    output: logits (B, classes)."""
    if layers < 1 or filters < 4 or classes < 1 or stem_cells not in (0, 1, 2):
        raise ValueError(
            f"AmoebaNet-D needs layers >= 1, filters >= 4, classes >= 1 and stem_cells in 0..2 "
            f"(layers: {layers}, filters: {filters}, classes: {classes}, stem_cells: {stem_cells})"
        )
    fixup = check_settings(norm, init_scheme, ("batch", "none"))
    stem = filters // 4 if stem_cells else filters
    cells: list[nn.Module] = [Stem(in_channels, stem)]
    prev_prev = prev = stem
    prev_reduction = False

    reduction_genotype = tuple(("conv_3x3_bottleneck" if op == "conv_3x3" else op, i) for op, i in REDUCTION)
    normal_concat = REFERENCE_NORMAL_CONCAT if reference_cells else CONCAT

    def add(channels: int, reduction: bool) -> None:
        nonlocal prev_prev, prev, prev_reduction
        genotype = (reduction_genotype if reduction else NORMAL) if reference_cells else None
        cell = Cell(prev_prev, prev, channels, reduction=reduction, prev_reduction=prev_reduction,
                    genotype=genotype, concat=CONCAT if reduction else normal_concat)  # fmt: skip
        cells.append(cell)
        prev_prev, prev, prev_reduction = prev, cell.out_channels, reduction

    for i in range(stem_cells):
        add(filters // 2 ** (stem_cells - i), True)
    stacks = [layers // 3 + (i < layers % 3) for i in range(3)]
    for i, count in enumerate(stacks):
        if i:
            add(filters * 2**i, True)
        for _ in range(count):
            add(filters * 2**i, False)
    cells.append(Classifier(prev, classes))
    model = nn.Sequential(*cells)
    if norm == "none":
        without_norms(model, nn.BatchNorm2d)
    if fixup:
        _fixup(model)
    return mark_blocks(model, 1, len(cells) - 2)  # (the gradient-norm ratio: first and last cells)


def _fixup(model: nn.Sequential) -> None:
    """Fixup's initialization and scalars for an AmoebaNet-D without batch norm (the module's docstring)."""
    ops = [op for cell in model if isinstance(cell, Cell) for op in cell.ops if isinstance(op, nn.Sequential)]
    for op in ops:  # the weighted operations: residual branches
        convs = [name for name, m in op.named_children() if isinstance(m, nn.Conv2d)]
        for name in convs:
            gain = fixup_scale(len(ops), len(convs)) if name != convs[-1] else 0.0
            setattr(op, name, _fixup_conv(op.get_submodule(name), gain))
        op.append(Multiplier())
    for parent in list(model.modules()):  # the main path's convolutions
        for name, child in list(parent.named_children()):
            if type(child) is nn.Conv2d:
                setattr(parent, name, _fixup_conv(child, 1.0))
    classifier = model[-1]
    assert isinstance(classifier, Classifier)
    classifier.fc = FixupLinear(classifier.fc.in_features, classifier.fc.out_features, gain=0.0)


def _fixup_conv(conv: nn.Module, gain: float) -> FixupConv2d:
    """A :class:`FixupConv2d` of ``conv``'s shape, He's initialization times ``gain``."""
    assert isinstance(conv, nn.Conv2d)
    return FixupConv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                       bias=conv.bias is not None, gain=gain, device=conv.weight.device)  # fmt: skip


def smallest_feature_map(model: nn.Module, image: tuple[int, ...]) -> int:
    """The fewest pixels per image that any batch norm of ``model`` normalizes, for images of shape
    ``image`` (C, H, W): found by running ``model`` on the meta device, so nothing is computed. A
    batch norm in training needs more than one value per channel, so a micro-batch of ``n`` images
    needs ``n`` times this to be at least 2."""
    seen: list[int] = []

    def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
        seen.append(args[0][0, 0].numel())

    if not all(p.is_meta for p in model.parameters()):
        raise ValueError("smallest_feature_map runs the model on the meta device: build it there")
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    handles = [m.register_forward_pre_hook(record) for m in norms]
    try:
        with torch.no_grad():
            model(torch.empty(2, *image, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return min(seen, default=2)
