"""Pieces every benchmark section shares: the models, spreads, and a section's result."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe.distributed.devices import choose_devices
from gpipe.models import amoebanet_d, transformer

__all__ = [
    "AUTO_WARMUP",
    "GPIPE_SCHEDULES",
    "TORCH_SCHEDULES",
    "Bench",
    "Section",
    "Workload",
    "gpipe_key",
    "intra_op_threads",
    "launch",
    "mlp",
    "mlp_batch",
    "mlp_sizes",
    "spread",
    "take_turns",
    "timed",
    "token_loss",
    "workloads",
]


# torch.distributed.pipelining's schedules: (our name for the same schedule, its class, stages per rank,
# placement: "loop" puts stage s on rank s mod K, "v" stages r and 2K-1-r on rank r)
TORCH_SCHEDULES: tuple[tuple[str, str, int, str], ...] = (
    ("gpipe", "ScheduleGPipe", 1, "loop"),
    ("1f1b", "Schedule1F1B", 1, "loop"),
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2, "loop"),
    ("interleaved-zb", "ScheduleInterleavedZeroBubble", 2, "loop"),
    ("zb-v", "ScheduleZBVZeroBubble", 2, "v"),
    ("dualpipev", "ScheduleDualPipeV", 2, "v"),
)

# gpipe's: (schedule, stages per worker, re-materialization modes); 'never' is torch's work
GPIPE_SCHEDULES: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("gpipe", 1, ("never", "except_last")),
    ("1f1b", 1, ("never", "except_last")),
    ("interleaved-1f1b", 2, ("never",)),
    ("zb-h1", 1, ("never",)),
    ("zb-h2", 1, ("never",)),
    ("zb-v", 2, ("never",)),
    ("dualpipev", 2, ("never",)),
    ("auto", 1, ("never",)),
    ("auto", 2, ("never",)),
)


def gpipe_key(name: str, virtual: int, checkpoint: str) -> str:
    """A gpipe variant's name in the peers' results: 'gpipe 1f1b (never)', 'gpipe auto v=2 (never)'."""
    shown = f"{name} v={virtual}" if name == "auto" and virtual > 1 else name
    return f"gpipe {shown} ({checkpoint})"


AUTO_WARMUP = 3  # steps of 'auto' before timing: two measure the costs, the third runs the plan made from them


@dataclass
class Section:
    """A section of the report: its markdown, the figures it wrote and its raw numbers."""

    title: str
    markdown: str
    figures: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Bench:
    """How big and how long: ``quick`` (``gpipe bench``, a few minutes) or the full run; ``devices``:
    ``--devices`` of the sections that run the paper's tables (throughput, memory); the peers, overhead
    and engine sections measure the host's work against CPU peers and stay on the CPU."""

    quick: bool = True
    repeats: int = 3
    devices: str = "cpu"

    @classmethod
    def of(cls, quick: bool, devices: str = "cpu") -> Bench:
        return cls(quick=quick, repeats=3 if quick else 7, devices=devices)

    def place(self, workers: int) -> list[torch.device]:
        """The devices of ``workers`` pipeline workers in this process (:func:`gpipe.distributed.choose_devices`)."""
        placed = choose_devices(self.devices, workers)
        assert placed is not None  # (gpipe bench runs in one process; its workers are launched without torchrun)
        return placed


@dataclass(frozen=True)
class Workload:
    """A model (built afresh, seeded), a mini-batch of N, and its loss."""

    name: str
    describe: str
    build: Callable[[], nn.Sequential]
    inputs: Any
    target: Tensor
    loss_fn: Callable[[Any, Tensor], Tensor]
    unit: str

    @property
    def batch(self) -> int:
        return int(self.target.size(0))

    @property
    def items(self) -> int:
        """What the throughput counts in a mini-batch: target tokens, or images."""
        return int(self.target.numel())


def token_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Cross entropy over every token of (B, T, V) logits."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def workloads(bench: Bench, batch: int | None = None) -> list[Workload]:
    """The Transformer and AmoebaNet-D of the throughput tables, sized for CPUs: big enough that the
    kernels, not Python, take the time."""
    g = torch.Generator().manual_seed(0)
    batch = batch or (64 if bench.quick else 128)
    layers, seq, dim, hidden = (3, 16, 256, 1024) if bench.quick else (8, 16, 256, 1024)
    cells, filters = (6, 24) if bench.quick else (18, 24)
    vocab = 256

    def build_transformer() -> nn.Sequential:
        torch.manual_seed(0)
        return transformer(layers, hidden, 4, dim=dim, vocab=vocab, max_len=seq, dropout=0.0)

    def build_amoebanet() -> nn.Sequential:
        torch.manual_seed(0)
        return amoebanet_d(cells, filters, classes=10, stem_cells=0)

    tokens = (torch.randint(3, vocab, (batch, seq), generator=g), torch.randint(3, vocab, (batch, seq), generator=g))
    return [
        Workload(
            "transformer",
            f"T({layers}, {hidden}, 4), model dim {dim}, {2 * layers + 3} layers; {batch} pairs of {seq} tokens",
            build_transformer,
            tokens,
            torch.randint(3, vocab, (batch, seq), generator=g),
            token_loss,
            "tokens",
        ),
        Workload(
            "amoebanet",
            f"AmoebaNet-D({cells}, {filters}), {cells + 4} layers; {batch} images 3x32x32, 10 classes",
            build_amoebanet,
            torch.randn(batch, 3, 32, 32, generator=g),
            torch.randint(0, 10, (batch,), generator=g),
            F.cross_entropy,
            "images",
        ),
    ]


def mlp(blocks: int, hidden: int, ffn: int) -> nn.Sequential:
    """Blocks of Linear(hidden, ffn)-GELU-Linear(ffn, hidden), each block one layer (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden)) for _ in range(blocks)]
    )


def mlp_sizes(bench: Bench) -> dict[str, int]:
    """The MLP of the peers and overhead sections: blocks, widths, batch and micro-batches."""
    return {"blocks": 8, "hidden": 512 if bench.quick else 1024, "ffn": 2048 if bench.quick else 4096,
            "batch": 128 if bench.quick else 256, "chunks": 8}  # fmt: skip


def mlp_batch(batch: int, hidden: int) -> tuple[Tensor, Tensor]:
    """The MLP's inputs and regression targets (seeded, the same in every process)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)


def take_turns(
    steps: dict[str, Callable[[], object]], repeats: int, barrier: Callable[[], None] = lambda: None
) -> dict[str, list[float]]:
    """Warm each variant up once, then time ``repeats`` rounds of them taking turns (each round
    starts one further along, so that noise hits them alike); ``barrier`` brackets every step."""
    names = list(steps)
    for name in names:
        steps[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            barrier()
            start = time.perf_counter()
            steps[name]()
            barrier()
            times[name].append(time.perf_counter() - start)
    return times


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` intra-op threads (then the caller's again). CPU kernels split their
    sums by thread: two runs compare bitwise, or time alike, on the same count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def spread(values: Sequence[float], fmt: str = ".2f") -> str:
    """``median [min-max]``."""
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def launch(world: int, spec: dict[str, Any], timeout: float = 900.0) -> Any:
    """Run ``gpipe.bench.worker`` on ``spec`` in ``world`` fresh processes (one intra-op thread
    each; on ``spec["devices"]``, default the CPU with gloo between them) and return what rank 0
    reports. Every process is bounded by ``timeout`` and killed if it outlives it or a peer fails."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump({**spec, "result": result}, f)
        procs = []
        for rank in range(world):
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if world > 1:
                env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
            else:
                env.pop("WORLD_SIZE", None)
            procs.append(subprocess.Popen([sys.executable, "-m", "gpipe.bench.worker", spec_path], env=env))
        try:
            deadline = time.monotonic() + timeout
            codes: list[int | None] = [None] * world
            while any(c is None for c in codes):
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(
                f"benchmark worker failed: {spec.get('task')} on {world} process(es), exit codes {codes}"
            )
        with open(result) as f:
            return json.load(f)
