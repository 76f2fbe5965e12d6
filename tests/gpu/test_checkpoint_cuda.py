"""Re-materialization on CUDA: with dropout, ``checkpoint='always'`` recomputes the same masks, so the
step is bitwise the step of ``checkpoint='never'``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gpipe import Pipeline
from tests.gpu.common import cuda, data, mlp
from tests.helpers import even

pytestmark = cuda


def step(checkpoint: str, schedule: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = mlp(dropout=0.3)
    pipe = Pipeline(model, even(len(model), 4), devices=["cuda:0"] * 4, chunks=4, schedule=schedule,
                    loss_fn=F.mse_loss, checkpoint=checkpoint)  # fmt: skip
    x, y = data("cuda:0")
    torch.manual_seed(7)
    loss = pipe.step(x, y)
    return loss.detach().cpu(), [p.grad.detach().cpu() for p in pipe.parameters() if p.grad is not None]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_always_is_never_bitwise_with_dropout(schedule: str, deterministic: None, record: Callable[..., Any]) -> None:
    never_loss, never = step("never", schedule)
    always_loss, always = step("always", schedule)
    equal = torch.equal(never_loss, always_loss) and all(map(torch.equal, never, always))
    zeros = sum(int((g == 0).sum()) for g in never)
    record(schedule=schedule, bitwise_equal=equal, loss=float(never_loss), zero_grad_entries=zeros)
    assert len(never) == len(always) > 0
    assert equal
