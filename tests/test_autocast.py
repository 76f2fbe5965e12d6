"""An autocast context around the call reaches every stage, worker and recomputation."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from tests.helpers import assert_all_close, pipe


class DtypeProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen: list[torch.dtype] = []

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x)
        self.seen.append(y.dtype)
        return torch.relu(y)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_bf16_autocast_reaches_every_stage(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(DtypeProbe(), DtypeProbe(), DtypeProbe(), DtypeProbe())
    x = torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_out = model(x)
    plain_out.float().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    gp = pipe(model, 4, chunks=4, checkpoint=checkpoint)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gp(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    probes = [m for m in gp.modules() if isinstance(m, DtypeProbe)]
    # every call, forward and recomputation alike, ran in bf16
    assert all(p.seen and set(p.seen) == {torch.bfloat16} for p in probes)
    torch.testing.assert_close(out, plain_out)
    assert_all_close([p.grad for p in gp.parameters()], plain, rtol=2e-2, atol=2e-2)  # type: ignore[misc]


def test_no_autocast_means_float32() -> None:
    gp = pipe(nn.Sequential(DtypeProbe(), DtypeProbe()), 2, chunks=2)
    assert gp(torch.randn(4, 8)).dtype == torch.float32
