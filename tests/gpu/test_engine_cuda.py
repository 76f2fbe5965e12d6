"""The K=1 engine on one GPU against a plain loop over the same micro-batches: the same numbers;
both timed with CUDA events, and the host synchronizations of one step counted under
``torch.cuda.set_sync_debug_mode("warn")``. The times and counts are reported, not asserted."""

from __future__ import annotations

import copy
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe import Pipeline
from tests.gpu.common import cuda, data, max_diff, mlp

pytestmark = cuda

CHUNKS, WARMUP, REPEATS = 4, 3, 10


def loop_step(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    total = torch.zeros((), device=x.device)
    for xs, ys in zip(x.chunk(CHUNKS), y.chunk(CHUNKS), strict=True):
        loss = F.mse_loss(model(xs), ys) * (xs.size(0) / x.size(0))
        loss.backward()
        total = total + loss.detach()
    return total


def timed_ms(fn: Callable[[], object]) -> float:
    """The median over REPEATS calls of ``fn``'s time on the device (CUDA events), after WARMUP."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def syncs(fn: Callable[[], object]) -> int:
    """The host synchronizations PyTorch warns of while ``fn`` runs."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def test_k1_engine_matches_a_plain_loop(deterministic: None, record: Callable[..., Any]) -> None:
    device = torch.device("cuda", 0)
    model = mlp().to(device)
    plain = copy.deepcopy(model)
    pipe = Pipeline(copy.deepcopy(model), [len(model)], devices=[device], chunks=CHUNKS, loss_fn=F.mse_loss)
    x, y = data(device)

    pipe.zero_grad()
    loss = pipe.step(x, y)
    plain.zero_grad()
    plain_loss = loop_step(plain, x, y)
    grads = [p.grad for p in pipe.parameters()]
    plain_grads = [p.grad for p in plain.parameters()]
    assert all(g is not None for g in grads) and len(grads) == len(plain_grads)
    torch.testing.assert_close(loss.detach(), plain_loss, rtol=1e-6, atol=1e-7)
    for g, p in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, p, rtol=1e-6, atol=1e-7)
    bitwise = bool(torch.equal(loss.detach(), plain_loss)) and all(map(torch.equal, grads, plain_grads))

    def engine() -> None:
        pipe.zero_grad()
        pipe.step(x, y)

    def loop() -> None:
        plain.zero_grad()
        loop_step(plain, x, y)

    engine_ms, loop_ms = timed_ms(engine), timed_ms(loop)
    step_syncs, loop_syncs = syncs(engine), syncs(loop)
    trace_syncs = syncs(lambda: list(pipe.last_trace.events))
    actions = pipe.last_trace.events
    record(bitwise_equal=bitwise, max_grad_diff=max_diff(grads, plain_grads), engine_ms=engine_ms, loop_ms=loop_ms,
           overhead=engine_ms / loop_ms if loop_ms else None, step_host_syncs=step_syncs,
           loop_host_syncs=loop_syncs, trace_read_host_syncs=trace_syncs, trace_events=len(actions),
           traced_busy_ms=sum(e.end_ns - e.start_ns for e in actions) / 1e6)  # fmt: skip
    assert len(actions) == 2 * CHUNKS
