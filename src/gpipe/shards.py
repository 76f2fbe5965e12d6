"""``DTensor`` shards as the rest of gpipe reads them: :func:`local`, this rank's part of a tensor
that tensor parallelism, FSDP or expert parallelism split, or the tensor itself."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["local"]


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t`` where it is a ``DTensor`` (a split or sharded parameter, its gradient,
    its optimizer state), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t
