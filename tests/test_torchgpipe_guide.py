"""torchgpipe 0.0.7's README and user guide, run with ``torchgpipe`` replaced by ``gpipe``: the
examples as the guide writes them (with CPU devices, as this machine has no GPU), each checked
against the plain model."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import gpipe as torchgpipe  # the swap a torchgpipe user makes
from gpipe import GPipe, is_recomputing
from gpipe.balance import balance_by_time
from gpipe.skip import Namespace, pop, skippable, stash


def block(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh())


def test_readme_four_partitions_eight_micro_batches() -> None:
    torch.manual_seed(0)
    a, b, c, d = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh()
    model = nn.Sequential(a, b, c, d)
    plain = copy.deepcopy(model)
    model = GPipe(model, balance=[1, 1, 1, 1], chunks=8, devices=["cpu"] * 4)
    data_loader = [torch.randn(16, 8) for _ in range(3)]
    for input in data_loader:
        in_device, out_device = model.devices[0], model.devices[-1]  # "Input and Output Device"
        output = model(input.to(in_device))
        assert output.device == out_device
        torch.testing.assert_close(output, plain(input))


def test_guide_flattening_nested_sequentials() -> None:
    torch.manual_seed(0)
    _3_layers = nn.Sequential(block(), nn.Linear(8, 8), nn.ReLU())  # len(_3_layers) == 3
    _4_layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), block(), nn.Linear(8, 4))  # len(_4_layers) == 4
    model = nn.Sequential(_3_layers, _4_layers)  # len(model) == 2

    def flatten_sequential(module: nn.Sequential) -> nn.Sequential:
        def _flatten(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
            for name, child in module.named_children():
                if isinstance(child, nn.Sequential):
                    for sub_name, sub_child in _flatten(child):
                        yield (f"{name}_{sub_name}", sub_child)
                else:
                    yield (name, child)

        return nn.Sequential(OrderedDict(_flatten(module)))

    plain = copy.deepcopy(model)
    model = flatten_sequential(model)  # len(model) == 7 (block() is a Sequential too: 9)
    assert len(model) == 9
    model = GPipe(model, balance=[3, 3, 3], chunks=4, devices=["cpu"] * 3)
    x = torch.randn(8, 8)
    torch.testing.assert_close(model(x), plain(x))


def test_guide_typical_model_parallelism() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(block(), block(), block(), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    model = GPipe(model, balance=[2, 2], chunks=1, checkpoint="never", devices=["cpu"] * 2)
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_guide_automatic_balancing() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)), nn.Linear(64, 256), nn.Linear(256, 64))
    partitions = 2  # torch.cuda.device_count() in the guide
    sample = torch.rand(128, 64)
    balance = balance_by_time(partitions, model, sample)
    assert len(balance) == partitions and sum(balance) == len(model)
    model = GPipe(model, balance, chunks=8, devices=["cpu"] * partitions)
    assert model(sample).shape == (128, 64)


class TupleLayer1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(8, 8)

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        skip = input
        return self.layer1(input), skip


class TupleLayer2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer2 = nn.Linear(8, 8)

    def forward(self, input_and_skip: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input, skip = input_and_skip
        return self.layer2(input), skip


class TupleLayer3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer3 = nn.Linear(8, 8)

    def forward(self, input_and_skip: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        input, skip = input_and_skip
        return self.layer3(input) + skip


@skippable(stash=["1to3"])
class Layer1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(8, 8)

    def forward(self, input: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("1to3", input)
        return self.layer1(input)


class Layer2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer2 = nn.Linear(8, 8)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.layer2(input)


@skippable(pop=["1to3"])
class Layer3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer3 = nn.Linear(8, 8)

    def forward(self, input: torch.Tensor):  # type: ignore[no-untyped-def]
        skip_1to3 = yield pop("1to3")
        return self.layer3(input) + skip_1to3


def _same_as_plain(model: nn.Sequential, balance: list[int]) -> None:
    plain = copy.deepcopy(model)
    net = GPipe(model, balance=balance, chunks=8, devices=["cpu"] * len(balance))
    x = torch.randn(16, 8, requires_grad=True)
    y = net(x)
    torch.testing.assert_close(y, plain(x))
    y.sum().backward()
    expected = torch.autograd.grad(plain(x).sum(), [x, *plain.parameters()])
    torch.testing.assert_close(x.grad, expected[0])
    for p, g in zip(net.parameters(), expected[1:]):
        torch.testing.assert_close(p.grad, g)


def test_guide_skip_connections_as_tuples() -> None:
    torch.manual_seed(0)
    _same_as_plain(nn.Sequential(TupleLayer1(), TupleLayer2(), TupleLayer3()), [1, 1, 1])


def test_guide_long_skip_connections() -> None:
    torch.manual_seed(0)
    _same_as_plain(nn.Sequential(Layer1(), Layer2(), Layer3()), [1, 1, 1])


@skippable(stash=["skip"])
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(8, 8)

    def forward(self, input: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", input)
        return torch.tanh(self.f(input))


@skippable(pop=["skip"])
class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(8, 8)

    def forward(self, input: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return torch.tanh(self.f(input)) + skip


def test_guide_unet_of_three_encoder_decoder_pairs() -> None:
    torch.manual_seed(0)
    ns_1f, ns_2f, ns_3f = Namespace(), Namespace(), Namespace()
    model = nn.Sequential(
        Encoder().isolate(ns_1f), Encoder().isolate(ns_2f), Encoder().isolate(ns_3f),
        nn.Linear(8, 8),  # Bottleneck
        Decoder().isolate(ns_3f), Decoder().isolate(ns_2f), Decoder().isolate(ns_1f),
        nn.Linear(8, 8),  # Segment
    )  # fmt: skip
    _same_as_plain(model, [2, 2, 2, 2])


@skippable(stash=["skip"])
class MaybeStash(nn.Module):
    def forward(self, input: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = input if input.sum() > 0 else None
        yield stash("skip", skip)
        return input * 2


@skippable(pop=["skip"])
class MaybePop(nn.Module):
    def forward(self, input: torch.Tensor):  # type: ignore[no-untyped-def]
        output = input + 1
        skip = yield pop("skip")
        if skip is not None:
            output += skip
        return output


def test_guide_conditional_skip_may_be_none() -> None:
    model = nn.Sequential(MaybeStash(), nn.Identity(), MaybePop())
    net = GPipe(copy.deepcopy(model), balance=[1, 1, 1], chunks=2, devices=["cpu"] * 3)
    x = torch.cat([torch.ones(2, 3), -torch.ones(2, 3)])  # one micro-batch stashes, the other None
    torch.testing.assert_close(net(x), torch.cat([model(x[:2]), model(x[2:])]))


def test_guide_detecting_recomputation() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.counter = 0

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if not is_recomputing():
                self.counter += 1
            return input

    counter = Counter()
    model = GPipe(nn.Sequential(nn.Linear(3, 3), counter), balance=[1, 1], chunks=4, checkpoint="always",
                  devices=["cpu"] * 2)  # fmt: skip
    model(torch.randn(8, 3)).sum().backward()
    assert counter.counter == 4  # once per micro-batch, not again in the recomputation


def test_import_swap_exposes_the_modules() -> None:
    assert torchgpipe.GPipe is GPipe
    assert torchgpipe.skip.skippable is skippable
    assert torchgpipe.balance.balance_by_time is balance_by_time
    assert torchgpipe.batchnorm.DeferredBatchNorm is torchgpipe.DeferredBatchNorm
    assert torchgpipe.is_recomputing is is_recomputing
    assert callable(torchgpipe.is_checkpointing)
    _ = F  # (imported as in the guide's snippets)
