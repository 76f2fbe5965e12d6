"""Parameter sharing across depth (Dehghani et al. 2018, Universal Transformers; Jean et al. 2018):
one set of layer weights applied at several depths, ``transformer(..., share_layers=N)`` and
``gpipe train --share-layers N``.

:func:`share_layers` makes every N consecutive layers hold the first one's parameters, the same
objects. A plain model then computes with one tensor at N depths, and its gradient is the sum of the
N depths' contributions. Pipelined, gpipe's tied weights (:mod:`gpipe.tied`) take it from there: the
engine finds the shared parameters itself, gives each layer a copy (on one stage too), starts the
copies equal, sums their gradients after every step and hands the sum to each, so the copies stay
bitwise equal and the step is the plain model's, at any partition count, whichever stages the layers
of a group land on.

The model counts each shared tensor once (:func:`gpipe.models.parameter_count`: ``parameters()``
does not repeat an object), the pipeline counts its copies.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["share_layers", "unshared_parameters"]


def share_layers(layers: Sequence[nn.Module], every: int) -> None:
    """Every ``every`` consecutive modules of ``layers`` (a multiple of ``every`` of them, of one
    structure) hold the first one's parameters: each later module's parameters are replaced by the
    first's objects. ``every`` 1 shares nothing."""
    if every < 1 or len(layers) % every:
        raise ValueError(
            f"share_layers={every} must divide the {len(layers)} layers it groups (every {every} consecutive "
            "layers share one set of weights): give a divisor"
        )
    for start in range(0, len(layers), every):
        first = layers[start]
        params = dict(first.named_parameters())
        for layer in layers[start + 1 : start + every]:
            own = dict(layer.named_parameters())
            if own.keys() != params.keys() or any(own[k].shape != p.shape for k, p in params.items()):
                raise ValueError(
                    f"share_layers={every}: layers {start} and {layers.index(layer)} of the group differ in their "
                    f"parameters ({sorted(own.keys() ^ params.keys()) or 'their shapes'}); only layers alike share"
                )
            for name, p in params.items():
                owner, _, leaf = name.rpartition(".")
                setattr(layer.get_submodule(owner) if owner else layer, leaf, p)


def unshared_parameters(model: nn.Module) -> int:
    """The parameters ``model`` would have without sharing: a shared tensor counted at every place."""
    return sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
