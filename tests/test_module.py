"""GPipe behaves like the Sequential it wraps, with torchgpipe's attributes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe import GPipe, MovingPartitionError


def test_sequential_like_and_attributes() -> None:
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)]
    gp = GPipe(nn.Sequential(*layers), [3, 2], devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    assert len(gp) == 5
    assert list(gp) == layers
    assert gp[0] is layers[0] and gp[-1] is layers[-1] and gp[3] is layers[3]
    with pytest.raises(IndexError):
        gp[5]
    assert gp.balance == [3, 2]
    assert gp.devices == [torch.device("cpu"), torch.device("cpu")]
    assert gp.chunks == 4 and gp.checkpoint == "always"
    assert len(gp.partitions) == 2 and list(gp.partitions[1]) == layers[3:]


def test_default_devices_on_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU default only applies without CUDA")
    gp = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1])
    assert gp.devices == [torch.device("cpu")] * 2


def test_parameters_and_optimizer_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    gp = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    opt = torch.optim.SGD(gp.parameters(), lr=0.1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.mse_loss(gp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9


def test_constructor_coerces_as_torchgpipe() -> None:
    class Mode:
        def __str__(self) -> str:
            return "always"

    gp = GPipe(nn.Sequential(nn.Linear(1, 1)), (1,), devices=("cpu",), chunks=42.0, checkpoint=Mode())  # type: ignore[arg-type]
    assert gp.chunks == 42 and type(gp.chunks) is int
    assert gp.checkpoint == "always" and type(gp.checkpoint) is str
    assert gp.balance == [1] and gp.devices == [torch.device("cpu")]
    assert isinstance(gp.partitions, nn.ModuleList) and isinstance(gp.partitions[0], nn.Sequential)
    assert GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks="8").chunks == 8  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunks: 'many'"):
        GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks="many")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"chunks: None"):
        GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunks: True"):
        GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=True)


def test_empty_module_is_the_identity() -> None:
    gp = GPipe(nn.Sequential(), [])
    assert len(gp) == 0 and list(gp) == [] and gp.balance == [] and gp.devices == [] and len(gp.partitions) == 0
    x = torch.tensor(42.0, requires_grad=True)
    assert gp(x) is x
    assert gp((x,)) == (x,)
    with pytest.raises(TypeError, match="got int"):
        gp(42)
    with pytest.raises(ValueError, match="sum of balance: 1"):
        GPipe(nn.Sequential(), [1])
    with pytest.raises(ValueError, match=r"balance is required.*gpipe\.balance"):
        GPipe(nn.Sequential())


@pytest.mark.parametrize(
    "move",
    [
        lambda gp: gp.to(0),
        lambda gp: gp.to("cuda"),
        lambda gp: gp.to("cuda:1", torch.float64),
        lambda gp: gp.to(torch.device("cuda")),
        lambda gp: gp.to(device=0),
        lambda gp: gp.to(device="cpu"),
        lambda gp: gp.to(torch.zeros(1)),
        lambda gp: gp.to(tensor=torch.zeros(1)),
        lambda gp: gp.cuda(),
        lambda gp: gp.cuda(0),
        lambda gp: gp.cpu(),
    ],
)
def test_moving_raises_moving_partition_error_without_the_device_too(move: object) -> None:
    gp = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu", "cpu"])
    with pytest.raises(MovingPartitionError, match="devices="):
        move(gp)  # type: ignore[operator]
    assert issubclass(MovingPartitionError, TypeError)


def test_dtype_casts_are_allowed() -> None:
    gp = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu", "cpu"])
    assert gp.to(torch.float64, True) is gp  # (non_blocking, positionally)
    assert gp.to(dtype=torch.float16).half().to(device=None, dtype=torch.float32) is gp
    assert all(p.dtype == torch.float32 for p in gp.parameters())


def test_a_fraction_of_a_chunk_is_refused() -> None:
    """torchgpipe cuts chunks=2.5 to 2 micro-batches without a word; GPipe says it (issue 24, item 13)."""
    with pytest.raises(ValueError, match=r"whole number of micro-batches \(chunks: 2.5\)"):
        GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=2.5)  # type: ignore[arg-type]
