"""Balancing: the exact partitioner, per-layer costs, balance='auto'."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpipe import GPipe, Pipeline
from gpipe.balance import (
    balance_by_flops,
    balance_by_params,
    balance_by_size,
    balance_by_time,
    blockpartition,
    layer_costs,
    layer_memory,
    layer_params,
    layer_times,
    layerwise_sandbox,
    lightest,
    profiling_device,
    solve,
)
from tests.helpers import assert_all_close, intra_op_threads, step


def cells(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    out, i = [], 0
    for b in balance:
        out.append(sum(costs[i : i + b]))
        i += b
    return out


def brute_force(
    costs: Sequence[float], k: int, memory: Sequence[float] | None = None, cap: float | None = None
) -> tuple[float, float] | None:
    """(largest cell, spread) of the best split, trying every split."""
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        bounds = (0, *cuts, len(costs))
        balance = [b - a for a, b in itertools.pairwise(bounds)]
        if memory is not None and cap is not None and max(cells(memory, balance)) > cap:
            continue
        c = cells(costs, balance)
        key = (max(c), max(c) - min(c))
        best = key if best is None or key < best else best
    return best


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(1, 5))
def test_partitioner_equals_brute_force(costs: list[int], k: int) -> None:
    if k > len(costs):
        with pytest.raises(ValueError, match="more partitions than layers"):
            solve(costs, k)
        return
    balance = solve(costs, k)
    assert len(balance) == k and sum(balance) == len(costs) and min(balance) >= 1
    c = cells(costs, balance)
    assert (max(c), max(c) - min(c)) == brute_force(costs, k)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 9)), min_size=2, max_size=10),
    st.integers(1, 4),
    st.integers(5, 30),
)
def test_partitioner_with_memory_cap_equals_brute_force(layers: list[tuple[int, int]], k: int, cap: int) -> None:
    costs, memory = [c for c, _ in layers], [m for _, m in layers]
    if k > len(costs):
        return
    expected = brute_force(costs, k, memory, cap)
    if expected is None:
        with pytest.raises(ValueError, match="memory cap"):
            solve(costs, k, memory=memory, memory_cap=cap)
        return
    balance = solve(costs, k, memory=memory, memory_cap=cap)
    assert max(cells(memory, balance)) <= cap
    c = cells(costs, balance)
    assert (max(c), max(c) - min(c)) == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 9)), min_size=2, max_size=10),
    st.integers(1, 4),
    st.sampled_from([0.0, 0.1, 0.5]),
)
def test_lightest_is_the_lightest_split_within_the_slack_then_the_fastest(
    layers: list[tuple[int, int]], k: int, slack: float
) -> None:
    costs, memory = [c for c, _ in layers], [m for _, m in layers]
    if k > len(costs):
        return
    fastest = max(cells(costs, solve(costs, k)))
    splits = [[b - a for a, b in itertools.pairwise((0, *cuts, len(costs)))]
              for cuts in itertools.combinations(range(1, len(costs)), k - 1)]  # fmt: skip
    allowed = [b for b in splits if max(cells(costs, b)) <= fastest * (1 + slack)]
    lightest_memory = min(max(cells(memory, b)) for b in allowed)
    balance = lightest(costs, k, memory, slack=slack)
    assert max(cells(memory, balance)) == lightest_memory and max(cells(costs, balance)) <= fastest * (1 + slack)
    fastest_of_the_lightest = brute_force(costs, k, memory, lightest_memory)
    assert fastest_of_the_lightest is not None and max(cells(costs, balance)) == fastest_of_the_lightest[0]


def test_an_embedding_counts_in_a_balance_by_memory_too() -> None:
    """A language model's embedding does no floating-point work but holds as many parameters as its
    head: by FLOPs alone the first stage takes it beside as many blocks as the others get."""
    torch.manual_seed(0)
    vocab, dim = 1024, 64
    blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim)) for _ in range(12)]
    model = nn.Sequential(nn.Embedding(vocab, dim), *blocks, nn.Linear(dim, vocab))
    sample = torch.randint(0, vocab, (8, 16))
    params = layer_params(model)
    by_flops = balance_by_flops(4, model, sample, chunks=4)
    balanced = balance_by_flops(4, model, sample, chunks=4, state_bytes=16)
    assert by_flops[0] > balanced[0]  # (the embedding's stage gets fewer blocks)
    assert max(cells(params, balanced)) < max(cells(params, by_flops)) == cells(params, by_flops)[0]
    with pytest.raises(ValueError, match=r"memory_cap needs state_bytes"):
        balance_by_flops(4, model, sample, memory_cap=1e9)
    with pytest.raises(ValueError, match=r"no split into 4 cells keeps every cell within the memory cap 1000"):
        balance_by_flops(4, model, sample, state_bytes=16, memory_cap=1000)


class Repeated(nn.Module):
    """A layer whose work depends on an attribute, not on its weights: ``times`` products."""

    def __init__(self, dim: int, times: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.times = times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = self.linear(x)
        return x


def test_layers_alike_on_the_meta_device_are_counted_once_and_others_each() -> None:
    """On the meta device a layer alike to one already counted, on alike inputs, gets its costs
    without running; the costs are those of a pass that runs every layer (on the CPU). Layers of
    equal weights that differ in an attribute, or in which weights train, are each run."""
    torch.manual_seed(0)
    layers = [Repeated(16, 1), Repeated(16, 1), Repeated(16, 3), Repeated(16, 1), Repeated(16, 1)]
    layers[4].linear.weight.requires_grad_(False)  # (no weight gradient: less backward work)
    model = nn.Sequential(nn.Embedding(50, 16), *layers, nn.Linear(16, 50))
    sample = torch.randint(0, 50, (8, 6))
    on_cpu = layer_costs(model, sample, chunks=2, state_bytes=8)
    on_meta = layer_costs(model.to("meta"), sample.to("meta"), chunks=2, state_bytes=8)
    assert on_meta == on_cpu
    assert on_cpu[0][1] == on_cpu[0][2] < on_cpu[0][3] and on_cpu[0][5] < on_cpu[0][1]
    assert [p.device.type for p in model.parameters()] == ["meta"] * len(list(model.parameters()))

    run = []
    import gpipe.balance.profile as profile

    call = profile._call
    profile._call = lambda i, layer, inputs: run.append(i) or call(i, layer, inputs)  # type: ignore[assignment]
    try:
        layer_costs(model, sample.to("meta"), chunks=2, state_bytes=8)
    finally:
        profile._call = call
    assert run == [0, 1, 3, 5, 6]  # (layer 2 is layer 1's twin; 4 is not 3's; 5 trains less)


def test_a_language_models_blocks_are_counted_once_with_a_full_passs_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hugging Face Llama on the meta device, as ``gpipe train --init`` balances it: its blocks
    (traced layers, with the key/value cache's hooks) are counted once, with the costs of a pass
    that runs each one."""
    import gpipe.balance.alike
    import gpipe.balance.profile as profile
    from gpipe.models import hf
    from tests.pretrained_dirs import llama_config

    config = llama_config(64)
    config.num_hidden_layers = 6
    sample = torch.randint(0, 64, (4, 12))
    layers = hf.pipeline_layers(hf.build(config), sample)
    run: list[int] = []
    call = profile._call
    monkeypatch.setattr(profile, "_call", lambda i, layer, inputs: run.append(i) or call(i, layer, inputs))
    counted = layer_costs(layers, sample, chunks=2, state_bytes=8)
    assert len(layers) == 8 and len(run) <= 5, run  # (the embedding, the head and three blocks: the
    # first's inputs are in another order, the last hands on less; the three between are counted once)
    monkeypatch.setattr(gpipe.balance.alike, "fingerprint", lambda layer: None)
    assert layer_costs(layers, sample, chunks=2, state_bytes=8) == counted
    assert len(set(counted[0][2:-2])) == 1 and counted[0][2] > 0


def block_partition_heuristic(costs: Sequence[float], k: int) -> list[int]:
    """A local search of the kind torchgpipe's block partitioning does: start from an even split
    by count and keep moving a boundary of the largest block while that lowers the largest block."""
    base, extra = divmod(len(costs), k)
    balance = [base + (1 if i < extra else 0) for i in range(k)]
    while True:
        c = cells(costs, balance)
        p = c.index(max(c))
        moves = []
        for q in (p - 1, p + 1):
            if 0 <= q < k and balance[p] > 1:
                moved = list(balance)
                moved[p] -= 1
                moved[q] += 1
                moves.append(moved)
        better = [m for m in moves if max(cells(costs, m)) < max(c)]
        if not better:
            return balance
        balance = min(better, key=lambda m: max(cells(costs, m)))


def test_heuristic_is_not_optimal_where_the_exact_split_is() -> None:
    costs = [4, 7, 7, 3, 6, 9, 6, 2]
    heuristic = block_partition_heuristic(costs, 3)
    exact = solve(costs, 3)
    assert heuristic == [3, 3, 2] and cells(costs, heuristic) == [18, 18, 8]
    assert exact == [2, 3, 3] and cells(costs, exact) == [11, 16, 17]
    assert max(cells(costs, exact)) < max(cells(costs, heuristic))


def test_solver_errors() -> None:
    with pytest.raises(ValueError, match=r"layer 1: -1"):
        solve([1, -1], 1)
    with pytest.raises(ValueError, match="both memory"):
        solve([1, 1], 1, memory=[1, 1])
    with pytest.raises(ValueError, match=r"within the memory cap 1;"):
        solve([1, 1], 1, memory=[1, 1], memory_cap=1)


def test_layer_memory_counts_saved_activations_and_parameters() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    sizes = layer_memory(model, torch.randn(4, 8))
    # Linear: its input saved for the weight gradient (4x8 floats) and its output (4x16);
    # plus weights and their gradients (2 x (16x8 + 16) floats).
    assert sizes[0] == 4 * (4 * 8 + 4 * 16) + 2 * 4 * (16 * 8 + 16)
    # ReLU saves its output, which is also what it returns: counted once.
    assert sizes[1] == 4 * 4 * 16


def test_profiling_leaves_the_model_untouched() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    model(torch.randn(4, 8)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    stats = [b.clone() for b in model.buffers()]
    sample = torch.randn(16, 8)
    torch.manual_seed(3)
    expected_next = torch.rand(3)
    torch.manual_seed(3)
    layer_times(model, sample)
    layer_memory(model, sample)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(b, s) for b, s in zip(model.buffers(), stats))
    assert torch.equal(torch.rand(3), expected_next)


def uneven() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.Linear(64, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 64), nn.Linear(64, 64), nn.Tanh()
    )


def test_balance_by_time_isolates_the_heavy_layers() -> None:
    # The 1024x1024 layer does over 200 times the work of a 64x64 one. On one thread (no thread team
    # to wake, no waiting at barriers for a thread the OS parked: a loaded or oversubscribed machine
    # made a 64x64 layer take 64 ms on two), and by the median of 5 runs, the gap holds on any CPU.
    with intra_op_threads(1):
        times = layer_times(uneven(), torch.randn(64, 64), repeats=5)
        balance = balance_by_time(2, uneven(), torch.randn(64, 64))
    assert times[2] > 3 * max(times[0], times[4], times[5]), times
    assert sum(balance) == 6
    heavy_alone = cells(times, balance)
    assert max(heavy_alone) >= times[2]


def test_balance_by_size_and_params() -> None:
    # parameters: 4160, 66560, 1049600, 65600, 4160, 0; the 1024x1024 layer goes with the lighter of
    # its neighbours: [2, 4] has cells of 70720 and 1119360, [3, 3] of 1120320 and 69760.
    assert balance_by_params(2, uneven()) == [2, 4]
    assert sum(balance_by_size(3, uneven(), torch.randn(8, 64))) == 6


def test_auto_balance_in_both_front_ends() -> None:
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    model = uneven()
    out_plain, plain = step(model, x)
    gp = GPipe(uneven(), "auto", devices=["cpu", "cpu"], chunks=4, sample=x)
    assert sum(gp.balance) == 6 and len(gp.balance) == 2
    out, g = step(gp, x)
    torch.testing.assert_close(out, out_plain)
    assert_all_close(g, plain)
    pipe = Pipeline(uneven(), "auto", chunks=4, loss_fn=F.mse_loss, devices=["cpu", "cpu"], sample=x)
    torch.testing.assert_close(pipe.step(x, y), F.mse_loss(model(x), y))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"devices": ["cpu", "cpu"]}, "pass sample="), ({"sample": torch.randn(4, 64)}, "needs devices=")],
)
def test_auto_balance_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPipe(uneven(), "auto", chunks=2, **kwargs)  # type: ignore[arg-type]


# torchgpipe's signatures and semantics.


def test_torchgpipe_signatures() -> None:
    import inspect

    time_params = inspect.signature(balance_by_time).parameters
    assert list(time_params)[:3] == ["partitions", "module", "sample"]
    assert time_params["timeout"].default == 1.0 and time_params["device"].default == torch.device("cuda")
    size_params = inspect.signature(balance_by_size).parameters
    assert list(size_params)[:3] == ["partitions", "module", "input"]
    assert size_params["chunks"].default == 1 and size_params["param_scale"].default == 2.0
    assert size_params["device"].default == torch.device("cuda")


def test_default_cuda_device_falls_back_to_the_cpu_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("the fallback only applies without CUDA")
    assert profiling_device(torch.device("cuda"), nn.Linear(1, 1)) == torch.device("cpu")
    assert sum(balance_by_time(2, uneven(), torch.randn(4, 64), timeout=0.0)) == 6  # default device
    assert sum(balance_by_size(2, uneven(), input=torch.randn(4, 64))) == 6


class Counting(nn.Module):
    """Counts its training forwards, refusing to run in eval mode (profiling is in training mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.training, "profiled in eval mode"
        self.calls += 1
        return x * 2


def test_profiles_in_training_mode_and_restores_eval_mode() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Counting(), nn.Dropout(0.5))
    model.eval()
    balance_by_time(2, model, torch.randn(8, 4), timeout=0.0, device="cpu")
    balance_by_size(2, model, torch.randn(8, 4), device="cpu")
    assert not any(m.training for m in model.modules())


def test_timeout_keeps_profiling() -> None:
    once, longer = nn.Sequential(Counting(), Counting()), nn.Sequential(Counting(), Counting())
    balance_by_time(2, once, torch.randn(2, 2), timeout=0.0, device="cpu")
    balance_by_time(2, longer, torch.randn(2, 2), timeout=0.2, device="cpu")
    assert once[0].calls == 1  # at least one pass
    assert longer[0].calls > 10


def test_layers_working_in_place_profile() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    assert sum(balance_by_time(2, model, torch.randn(8, 4), timeout=0.0, device="cpu")) == 4
    assert sum(balance_by_size(2, model, torch.randn(8, 4), device="cpu")) == 4


def test_layers_elsewhere_are_profiled_as_copies_on_the_device() -> None:
    # The meta device stands in for a GPU: the layers run there, the model stays where it is.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    weights = [p.clone() for p in model.parameters()]
    assert len(layer_times(model, torch.randn(8, 4), device="meta")) == 3
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    copies = list(layerwise_sandbox(model.eval(), torch.device("meta")))
    assert all(c.training and all(p.is_meta for p in c.parameters()) for c in copies)
    assert not model.training


def test_parameters_with_gradients_are_fine() -> None:
    """torchgpipe refuses to profile a model whose parameters have gradients; they are restored here."""
    model = uneven()
    model(torch.randn(2, 64)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    balance_by_time(2, model, torch.randn(2, 64), timeout=0.0, device="cpu")
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))


def test_blockpartition_gives_blocks() -> None:
    assert blockpartition.solve([1, 2, 3, 4, 5, 6], partitions=2) == [[1, 2, 3, 4], [5, 6]]
    assert blockpartition.solve([4, 7, 7, 3, 6, 9, 6, 2], 3) == [[4, 7], [7, 3, 6], [9, 6, 2]]  # the exact split
    with pytest.raises(ValueError, match="partitions must be positive"):
        blockpartition.solve([1], partitions=0)


def test_a_sample_that_does_not_fit_the_model_is_named_as_such() -> None:
    """balance='auto' with a sample of the wrong width: the error names the layer and the shapes, not
    only torch's matmul message (issue 24, item 13)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ValueError, match=r"layer 0 \(Linear\) fails on the sample's micro-batch \(shapes: \(4, 5\)\)"):
        Pipeline(model, "auto", chunks=2, devices=["cpu", "cpu"], sample=torch.randn(8, 5), loss_fn=F.mse_loss)
    for measure in (balance_by_size, balance_by_flops):  # every profile of the layers says the same
        with pytest.raises(
            ValueError, match=r"layer 0 \(Linear\) fails on the sample's micro-batch \(shapes: \(8, 5\)\)"
        ):
            measure(2, model, torch.randn(8, 5))
