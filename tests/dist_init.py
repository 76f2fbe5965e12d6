"""The torchrun case of tests/test_init.py: ``--init`` pretrained folders read per rank."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpipe.balance import balance_by_flops
from gpipe.distributed import init_from_env
from gpipe.models import hf, pretrained
from gpipe.pipeline import Pipeline
from gpipe.train import TrainConfig
from gpipe.train.setup import make_data, make_model


def pretrained_logits(runs: list[tuple[str, int, int, bool, int]], text: str) -> dict[str, Any]:
    """Per run (folder, dp, tp, fsdp, lora rank): the tensors this rank read (name, elements), the
    logits of a batch (on the last stage's ranks; None on the others) and this rank's stage, with 2
    stages x ``dp`` replicas (sharded with ``fsdp``) x ``tp`` tensor-parallel ranks; with LoRA, the
    names of the parameters that have a gradient after a step."""
    init_from_env()
    reads: list[list[tuple[str, int]]] = []
    original = pretrained.Source.read

    def recorded(self: pretrained.Source, wanted: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in original(self, wanted):
            reads[-1].append((name, value.numel()))
            yield name, value

    pretrained.Source.read = recorded  # type: ignore[method-assign]
    logits, stages = [], []
    ids = torch.randint(4, 30, (4, 12), generator=torch.Generator().manual_seed(0))
    trained: list[list[str]] = []
    adapters: list[dict[str, torch.Tensor]] = []
    try:  # (put back after: another case may follow in this process, tests/dist_entry.py's cases)
        for folder, dp, tp, fsdp, rank in runs:
            reads.append([])
            cfg = TrainConfig(model="hf", init=folder, data=text, partitions=2, data_parallel=dp, tensor_parallel=tp,
                              fsdp=fsdp, batch=8, chunks=2, lora=rank)  # fmt: skip
            cfg.check()
            layers = make_model(cfg, make_data(cfg))
            loss = functools.partial(hf.logits_loss, _cross_entropy)
            pipe = Pipeline(layers, balance_by_flops(2, layers, ids[:2]), chunks=2, data_parallel=dp, fsdp=fsdp,
                            tensor_parallel=tp, loss_fn=loss)  # fmt: skip
            adapters.append({n: _whole(p) for n, p in pipe.named_parameters() if ".lora_" in n})
            pipe.eval()
            out = pipe(ids)
            logits.append(None if out is None else out.logits)
            stages.append(pipe.engine.placement.local_stages[0])
            pipe.train()
            pipe.step(ids, ids.roll(-1, 1))
            trained.append(sorted(n for n, p in pipe.named_parameters() if p.grad is not None))
    finally:
        pretrained.Source.read = original  # type: ignore[method-assign]
    return {"logits": logits, "read": reads, "stage": stages, "trained": trained, "adapters": adapters}


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (gathered over its mesh where it is a DTensor)."""
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def packed_step(folder: str, data: str, schedule: str) -> dict[str, Any]:
    """One step of ``gpipe train --model hf --data CHATS.jsonl --pack`` on 2 ranks (``schedule``): its
    loss, and this rank's gradients by name (tests/test_instruct.py compares them with one process)."""
    from gpipe.train.setup import make_losses, make_pipeline

    init_from_env()
    cfg = TrainConfig(**PACKED, init=folder, data=data, schedule=schedule)
    cfg.check()
    chats = make_data(cfg)
    pipe = make_pipeline(cfg, make_model(cfg, chats), chats, make_losses(cfg, chats), distributed=True)
    batch = chats.batch(cfg.batch, 3)
    loss = float(pipe.step(batch.inputs, batch.target))
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}}


PACKED: dict[str, Any] = {"model": "hf", "partitions": 2, "batch": 6, "chunks": 2, "max_length": 96, "pack": True,
                          "label_smoothing": 0.0, "progress": False, "tensorboard": "off"}  # fmt: skip
"""The settings of :func:`packed_step` (and of the one process it is compared with)."""
