"""torch.compile'd layers inside a pipeline run compiled, under every schedule (the split backward
and re-materialization included), and dropout inside them stays partition-invariant."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch._dynamo.utils import counters

from gpipe import Pipeline
from tests.helpers import assert_all_close, assert_all_equal, grads


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Each test compiles afresh. A compiled layer in a pipeline meets up to four variants (with and
    without autograd, its input a leaf or not), and dynamo's recompile limit (8 per code object)
    would otherwise be reached across tests — past it, dynamo runs eagerly (and says so)."""
    torch._dynamo.reset()
    counters.clear()


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(F.gelu(self.up(x))))


def compiled(dropout: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[torch.compile(Block(dropout)) for _ in range(4)])


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize(("schedule", "virtual"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_compiled_layers_run_compiled_and_equal_plain(schedule: str, virtual: int, checkpoint: str) -> None:
    model = compiled(0.0)
    x, y = data()
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    pipe = Pipeline(copy.deepcopy(model), [1] * 4 if virtual == 2 else [2, 2], chunks=4, loss_fn=F.mse_loss,
                    schedule=schedule, checkpoint=checkpoint, devices=["cpu", "cpu"], virtual=virtual)  # fmt: skip
    before = graphs()
    pipe.step(x, y)
    assert graphs() > before, "the pipeline's workers ran the layers without compiling them"
    assert_all_close(grads(pipe), grads(plain), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_dropout_in_compiled_layers_is_partition_invariant(checkpoint: str) -> None:
    model = compiled(0.3)
    x, y = data()
    results = []
    for k in (1, 2):
        pipe = Pipeline(copy.deepcopy(model), [4 // k] * k, chunks=4, loss_fn=F.mse_loss, checkpoint=checkpoint,
                        devices=["cpu"] * k, cpu_threads=1)  # fmt: skip
        torch.manual_seed(7)
        loss = pipe.step(x, y)
        results.append((loss, grads(pipe)))
    assert torch.equal(results[0][0], results[1][0])
    assert_all_equal(results[0][1], results[1][1])
    # Not vacuous: dropout draws (the loss differs from a run without it) and steps draw afresh.
    pipe = Pipeline(copy.deepcopy(model), [2, 2], chunks=4, loss_fn=F.mse_loss, checkpoint=checkpoint,
                    devices=["cpu"] * 2, cpu_threads=1)  # fmt: skip
    torch.manual_seed(8)
    assert not torch.equal(pipe.step(x, y), results[0][0])


def test_pipeline_counts_compiled_graphs() -> None:
    """Dynamo's own counters: the compiled layers were captured when run by the pipeline's workers."""
    model = compiled(0.1)
    x, y = data()
    pipe = Pipeline(model, [2, 2], chunks=2, loss_fn=F.mse_loss, devices=["cpu", "cpu"])
    pipe.step(x, y)
    assert graphs() >= 1
    assert counters["stats"]["calls_captured"] >= 1
