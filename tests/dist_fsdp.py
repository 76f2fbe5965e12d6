"""What each rank runs in tests/test_fsdp.py: pipelines whose stages are sharded over their
data-parallel group (``Pipeline(fsdp=True)``), and the plain models they are compared with."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from gpipe import Pipeline, to_sequential
from gpipe.models.transformer import transformer
from tests.helpers import even

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
BLOCK_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # Megatron's split of a 'blocks' block


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _hf_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return _lm_loss(output.logits, target)


def model_and_data(kind: str) -> tuple[nn.Sequential, Any, torch.Tensor, LossFn]:
    """A small model as layers (seeded: the same on every rank and in the test), a global batch of
    16 and its loss. ``kind``: 'mlp', 'blocks' (Linear, GELU, Linear, split by :data:`BLOCK_PLAN`),
    'transformer' (gpipe's T(2, 64, 4), heads of 8: its own attention, which tensor parallelism can
    split), 'llama' (a Hugging Face Llama config traced by to_sequential)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(6, 6), nn.Tanh())])
        return model, torch.randn(16, 6, generator=g), torch.randn(16, 6, generator=g), F.mse_loss
    if kind == "blocks":  # examples/pipeline_train.py's: each block ends with its row-split projection
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4)])
        return model, torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g), F.mse_loss
    if kind == "transformer":
        model = transformer(2, 64, 4, dim=32, vocab=50, max_len=16, dropout=0.0, head_dim=8)
        src, tgt = torch.randint(1, 50, (16, 10), generator=g), torch.randint(1, 50, (16, 9), generator=g)
        return model, (src, tgt), torch.randint(1, 50, (16, 9), generator=g), _lm_loss
    if kind == "llama":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager",
        )  # fmt: skip
        ids = torch.randint(1, 64, (16, 8), generator=g)
        layers = to_sequential(transformers.LlamaForCausalLM(config), ids[:4])
        return layers, ids, torch.randint(1, 64, (16, 8), generator=g), _hf_loss
    raise ValueError(f"unknown model kind {kind!r}")


def plain_run(kind: str, steps: int, lr: float) -> dict[str, Any]:
    """The unpipelined reference: the same layers called in order on the whole batch, ``steps``
    Adam steps; each step's loss, and the first step's gradients by '<layer>.<parameter>'."""
    model, x, y, loss_fn = model_and_data(kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": losses, "grads": grads, "parameters": sum(p.numel() for p in model.parameters())}


@functools.cache
def plain_reference(kind: str, steps: int, lr: float) -> dict[str, Any]:
    """:func:`plain_run`'s results (and the model's parameter count), computed once per process: the
    tests that compare several runs with one reference only read it."""
    return plain_run(kind, steps, lr)


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count the all-gathers and reduce-scatters FSDP issues (it calls these two through
    ``torch.distributed`` at call time)."""
    counts = {"all_gather": 0, "reduce_scatter": 0}
    originals = dist.all_gather_single, dist.reduce_scatter_single

    def gather(*args: Any, **kwargs: Any) -> Any:
        counts["all_gather"] += 1
        return originals[0](*args, **kwargs)

    def scatter(*args: Any, **kwargs: Any) -> Any:
        counts["reduce_scatter"] += 1
        return originals[1](*args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = gather, scatter  # type: ignore[assignment]
    try:
        yield counts
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = originals  # type: ignore[assignment]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def by_layer(pipe: Pipeline, values: Callable[[nn.Parameter], torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """``values(p)`` of this rank's parameters, keyed '<global layer index>.<parameter path>' (a
    partition names its layers by their global index)."""
    found = {}
    for partition in pipe.partitions.values():
        for name, p in partition.named_parameters():
            v = values(p)
            if v is not None:
                found[name] = v
    return found


def sharded_train(
    kind: str, schedule: str, dp: int, steps: int, lr: float, fsdp: bool = True, tp: int = 1
) -> dict[str, Any]:
    """dp replicas of a pipeline over WORLD_SIZE / dp ranks (sharded with ``fsdp``; each layer split
    over ``tp`` ranks), ``steps`` Adam
    steps on the same global batch: the losses, the first step's gradients (whole, gathered over
    the replicas), the collectives of the second step, this rank's actions of the last step, its
    parameter, gradient and optimizer-state elements, and how many functional collectives (a split
    layer's all-reduces) this run left unwaited (the process's registry of them grown by: a case of
    the session's pool may follow others in its process)."""
    unwaited = torch._C._distributed_c10d._get_work_registry_size()
    world = int(os.environ["WORLD_SIZE"])
    model, x, y, loss_fn = model_and_data(kind)
    virtual = 2 if schedule in ("zb-v", "dualpipev", "interleaved-1f1b") else 1
    pipe = Pipeline(
        model, even(len(model), world // (dp * tp) * virtual), chunks=2, schedule=schedule, loss_fn=loss_fn,
        data_parallel=dp, fsdp=fsdp, virtual=virtual, tensor_parallel=tp,
        tp_plan=BLOCK_PLAN if kind == "blocks" else "auto",
    )  # fmt: skip
    optimizer = torch.optim.Adam(pipe.parameters(), lr=lr)
    losses, grads, counts = [], {}, {}
    for step in range(steps):
        optimizer.zero_grad()
        with counting() as counted:
            losses.append(pipe.step(x, y))
        if step == 0:
            grads = by_layer(pipe, lambda p: None if p.grad is None else _full(p.grad).clone())
        if step == 1:
            counts = dict(counted)
        optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    assert pipe.last_trace is not None
    return {
        "losses": losses,
        "grads": grads,
        "collectives": counts,
        "stages": len(pipe.partitions),
        "dp_rank": pipe.dp_rank,
        "actions": [
            str(a) for acts in pipe.last_trace.schedule.actions for a in acts if str(a.stage) in pipe.partitions
        ],
        "elements": {
            "parameters": sum(_local(p).numel() for p in pipe.parameters()),
            "gradients": sum(_local(p.grad).numel() for p in pipe.parameters() if p.grad is not None),
            "optimizer": sum(_local(t).numel() for t in state),
        },
        "eval": _logits(pipe(x)),
        # collectives started and never waited for (torch warns of them at exit): none
        "in_flight": torch._C._distributed_c10d._get_work_registry_size() - unwaited,
    }


def _logits(output: Any) -> Any:
    return getattr(output, "logits", output)


def load_and_step(directory: str, dp: int, fsdp: bool) -> dict[str, Any]:
    """Other weights and an Adam of another learning rate, loaded from the checkpoint at another
    layout (WORLD_SIZE / dp stages, sharded with ``fsdp``), then one step: its loss."""
    from gpipe import load_checkpoint

    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(99)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(6, 6), nn.Tanh())])
    _, x, y, loss_fn = model_and_data("mlp")
    pipe = Pipeline(model, even(len(model), world // dp), chunks=4, loss_fn=loss_fn, data_parallel=dp, fsdp=fsdp)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.5)
    step = load_checkpoint(pipe, directory, optimizer=optimizer)
    optimizer.zero_grad()
    return {"step": step, "next": pipe.step(x, y)}


def tied_train(steps: int, fsdp: bool) -> dict[str, Any]:
    """A tied embedding / output projection on the first and last of 2 stages, dropout between, 2
    replicas (sharded with ``fsdp``), ``steps`` SGD steps with momentum: the losses and the two
    copies after them (whole)."""
    from tests.dist_cases import DIM, VOCAB, lm_data, lm_loss

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Dropout(0.3), nn.Tanh(), nn.Linear(DIM, DIM),
        nn.Linear(DIM, VOCAB, bias=False),
    )  # fmt: skip
    pipe = Pipeline(
        model, [3, 3], chunks=4, loss_fn=lm_loss, tied=[["0.weight", "5.weight"]], data_parallel=2, fsdp=fsdp
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
    x, y = lm_data()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(pipe.step(x, y))
        optimizer.step()
    copies = by_layer(pipe, lambda p: _full(p.detach()).clone())
    return {"losses": losses, "copies": {n: v for n, v in copies.items() if n in ("0.weight", "5.weight")}}


def split_save(
    directory: str, steps: int, kind: str = "transformer", dp: int = 1, fsdp: bool = False, tp: int = 2, chunks: int = 2
) -> dict[str, Any]:
    """``kind`` at pp x dp x tp (WORLD_SIZE / (dp x tp) stages, sharded with ``fsdp``): Adam for
    ``steps`` steps, saved with its state, then one more step, whose loss a resumed run must see."""
    from gpipe import save_checkpoint

    world = int(os.environ["WORLD_SIZE"])
    model, x, y, loss_fn = model_and_data(kind)
    pipe = Pipeline(
        model, even(len(model), world // (dp * tp)), chunks=chunks, loss_fn=loss_fn, data_parallel=dp, fsdp=fsdp,
        tensor_parallel=tp,
    )  # fmt: skip
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()
    save_checkpoint(pipe, directory, steps, optimizer=optimizer)
    optimizer.zero_grad()
    return {"next": pipe.step(x, y)}


def load_in_one_process(directory: str, workers: int) -> dict[str, Any]:
    """Other weights, loaded from the checkpoint into ``workers`` stages in this process, then the
    next step's loss."""
    from gpipe import load_checkpoint

    model, x, y, loss_fn = model_and_data("transformer")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # other weights: only the checkpoint can make the loss match
    pipe = Pipeline(model, even(len(model), workers), chunks=2, loss_fn=loss_fn, devices=["cpu"] * workers)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.5)
    step = load_checkpoint(pipe, directory, optimizer=optimizer)
    optimizer.zero_grad()
    return {"step": step, "next": pipe.step(x, y)}


def split_load(directory: str, dp: int, fsdp: bool, tp: int) -> dict[str, Any]:
    """Other weights, loaded from the checkpoint at pp x dp x tp (WORLD_SIZE / (dp x tp) stages),
    then the next step's loss."""
    from gpipe import load_checkpoint

    world = int(os.environ["WORLD_SIZE"])
    model, x, y, loss_fn = model_and_data("transformer")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    pipe = Pipeline(
        model, even(len(model), world // (dp * tp)), chunks=2, loss_fn=loss_fn, data_parallel=dp, fsdp=fsdp,
        tensor_parallel=tp,
    )  # fmt: skip
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.5)
    step = load_checkpoint(pipe, directory, optimizer=optimizer)
    optimizer.zero_grad()
    return {"step": step, "next": pipe.step(x, y)}
