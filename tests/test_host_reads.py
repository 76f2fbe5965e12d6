"""Host reads of tensor values per step (tests/host_reads.py): on a GPU each waits for the device, so
their number must not grow with the micro-batches, the layers or the parameters."""

from __future__ import annotations

import collections
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

from gpipe import Pipeline
from gpipe.models import transformer
from gpipe.train import TrainConfig
from gpipe.train.loop import train
from tests.host_reads import counting


def pipeline_step(microbatches: int, layers: int, padding: str) -> collections.Counter[str]:
    """The reads of a step (after one to warm up) of the translation Transformer, K=2, 1F1B, on
    padded batches."""
    torch.manual_seed(0)
    model = transformer(layers, 64, 4, dim=32, vocab=50, max_len=32, target_padding=padding)
    n = len(model)
    pipe = Pipeline(
        model, [n // 2, n - n // 2], chunks=microbatches, schedule="1f1b", devices=["cpu", "cpu"],
        loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=0),
    )  # fmt: skip
    src, tgt = torch.randint(1, 50, (4 * microbatches, 12)), torch.randint(1, 50, (4 * microbatches, 10))
    src[::2, 9:] = 0
    tgt[::3, 7:] = 0  # padding after the real tokens
    pipe.step((src, tgt), tgt)
    with counting() as counts:
        pipe.step((src, tgt), tgt)
    return counts


def test_a_pipeline_step_reads_the_host_as_often_whatever_its_size() -> None:
    small, large = pipeline_step(2, 1, "end"), pipeline_step(8, 4, "end")
    assert sum(small.values()) == sum(large.values()) <= 2, (small, large)
    # told by the values instead, the padding costs a read per decoder layer and micro-batch
    assert sum(pipeline_step(8, 4, "any").values()) >= sum(large.values()) + 8 * 4


def per_step(tmp_path: Path, microbatches: int, layers: int) -> collections.Counter[str]:
    """The reads of a step of gpipe train with the training health, the guard and the spike check on
    every step: those of a run of 4 steps less those of a run of 2, halved."""
    counts = []
    for steps in (2, 4):
        cfg = TrainConfig(
            out=str(tmp_path / f"{microbatches}-{layers}-{steps}"), progress=False, steps=steps, chunks=microbatches,
            layers=layers, batch=4 * microbatches, eval_every=0, health_every=1, skip_spikes=True,
            checkpoint_every=1000, tensorboard="off",
        )  # fmt: skip
        with counting() as c:
            train(cfg)
        counts.append(c)
    two, four = counts
    return collections.Counter({k: (four[k] - two[k]) // 2 for k in four.keys() | two.keys() if four[k] != two[k]})


def test_a_training_step_with_health_and_the_guard_reads_the_host_as_often_whatever_its_size(tmp_path: Path) -> None:
    small, large = per_step(tmp_path, 2, 1), per_step(tmp_path, 8, 3)
    assert small == large, (small, large)  # the same lines, as often: none per micro-batch, layer or parameter
    assert sum(large.values()) <= 10, large
