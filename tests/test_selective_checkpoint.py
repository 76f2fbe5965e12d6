"""Selective re-materialization (``checkpoint=gpipe.Selective(...)``): per layer and per operator,
in every kind of schedule, equal to keeping everything; flags, running statistics, memory, errors."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy

import gpipe
from gpipe import GPipe, Pipeline, Selective
from gpipe.models import transformer_lm
from gpipe.models.transformer import DecoderLayer
from gpipe.train import TrainConfig, train
from tests import dist_cases
from tests.dist_harness import POOL, Pool

aten = torch.ops.aten


def lm() -> nn.Sequential:
    """6 layers: embedding, 4 blocks, output; dropout on, so that random numbers must be replayed."""
    torch.manual_seed(0)
    return transformer_lm(4, 64, 4, dim=32, vocab=50, max_len=16, dropout=0.1, head_dim=8)


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


TOKENS = torch.randint(0, 50, (8, 16), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 50, (8, 16), generator=torch.Generator().manual_seed(2))

# schedule -> (balance, virtual): K = 2 workers.
LAYOUTS = {"gpipe": ([3, 3], 1), "1f1b": ([3, 3], 1), "zb-h1": ([3, 3], 1), "zb-v": ([2, 1, 1, 2], 2)}


def lm_step(
    checkpoint: Any, schedule: str, model: nn.Module | None = None, **kwargs: Any
) -> tuple[Tensor, list[Tensor]]:
    balance, virtual = LAYOUTS[schedule]
    pipe = Pipeline(
        copy.deepcopy(model) if model is not None else lm(), balance, chunks=4, loss_fn=lm_loss, schedule=schedule,
        virtual=virtual, checkpoint=checkpoint, devices=["cpu", "cpu"], cpu_threads=1, **kwargs,
    )  # fmt: skip
    torch.manual_seed(7)  # the step's seed: the same dropout masks in every run
    loss = pipe.step(TOKENS, TARGET)
    return loss, [p.grad for p in pipe.parameters()]


def keep_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {
    "layers": Selective(layers={1, 3, 5}),
    "ops": Selective(save_ops="matmuls"),
    "ops-set": Selective(save_ops={aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default}),
    "type+fn": Selective(layers=DecoderLayer, save_ops=keep_mm, microbatches="except_last"),
    "predicate": Selective(layers=lambda i, layer: i % 2 == 0, save_ops="matmuls"),
}
NEVER: dict[str, tuple[Tensor, list[Tensor]]] = {}


@pytest.mark.parametrize("schedule", list(LAYOUTS))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_policy_gives_the_losses_and_gradients_of_never(schedule: str, policy: str) -> None:
    """Bitwise: the recomputation runs the same kernels on the same values, dropout's masks replayed
    (a mask drawn afresh would change every gradient); in B, and in a split backward's I and W."""
    if schedule not in NEVER:
        NEVER[schedule] = lm_step("never", schedule)
    loss, grads = lm_step(POLICIES[policy], schedule)
    assert torch.equal(loss, NEVER[schedule][0])
    assert all(torch.equal(a, b) for a, b in zip(grads, NEVER[schedule][1], strict=True))


def test_without_replayed_random_numbers_the_gradients_would_differ() -> None:
    """The check above has teeth: another step seed (other masks) changes the gradients."""
    never = NEVER.get("1f1b") or lm_step("never", "1f1b")
    pipe = Pipeline(lm(), [3, 3], chunks=4, loss_fn=lm_loss, schedule="1f1b", checkpoint="never", cpu_threads=1)
    torch.manual_seed(8)
    pipe.step(TOKENS, TARGET)
    assert not all(torch.equal(p.grad, g) for p, g in zip(pipe.parameters(), never[1], strict=True))


def gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(config)  # dropout 0.1 throughout


def gpt2_loss(output: Any, target: Tensor) -> Tensor:
    return lm_loss(output.logits, target)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_hugging_face_gpt2(schedule: str) -> None:
    """GPT-2 traced into layers (Conv1D's addmm, attention through scaled_dot_product_attention)."""
    model = gpt2()
    results = []
    for checkpoint in ("never", Selective(save_ops="matmuls"), Selective(layers={1, 2})):
        pipe = Pipeline(copy.deepcopy(model), [2, 2], chunks=4, loss_fn=gpt2_loss, schedule=schedule,
                        checkpoint=checkpoint, cpu_threads=1, sample=TOKENS)  # fmt: skip
        torch.manual_seed(7)
        results.append((pipe.step(TOKENS, TARGET), [p.grad for p in pipe.parameters()]))
    (loss, grads), *others = results
    for other_loss, other_grads in others:
        assert torch.equal(other_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(other_grads, grads, strict=True))


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)
    )


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_running_statistics_are_updated_once(deferred: bool, schedule: str) -> None:
    """The re-materialized BatchNorm layers (plain, or gpipe's DeferredBatchNorm) end the step with
    the statistics of 'never' (updated once per micro-batch, or once per mini-batch)."""
    x, y = torch.randn(16, 6, generator=torch.Generator().manual_seed(3)), torch.randn(16, 2)
    stats = []
    for checkpoint in ("never", Selective(layers={1, 4}), Selective(layers=nn.BatchNorm1d, save_ops="matmuls")):
        pipe = Pipeline(bn_model(), [3, 3], chunks=4, loss_fn=F.mse_loss, schedule=schedule, checkpoint=checkpoint,
                        deferred_batch_norm=deferred, cpu_threads=1)  # fmt: skip
        pipe.step(x, y)
        stats.append({n: b.clone() for n, b in pipe.named_buffers()})
    tracked = [v.item() for n, v in stats[0].items() if n.endswith("num_batches_tracked")]
    assert tracked == [1 if deferred else 4] * 2
    for other in stats[1:]:
        assert other.keys() == stats[0].keys()
        assert all(torch.equal(other[n], stats[0][n]) for n in other)


class Probe(nn.Module):
    """Records (is_checkpointing, is_recomputing) on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.calls.append((gpipe.is_checkpointing(), gpipe.is_recomputing()))
        return torch.tanh(self.lin(x))


def test_the_flags_and_gpipe_front_end() -> None:
    """Through GPipe (autograd's backward): a re-materialized layer sees is_checkpointing() in its
    forward and is_recomputing() once in backward per micro-batch; a kept one sees neither."""
    kept, dropped = Probe(), Probe()
    model = nn.Sequential(kept, dropped, nn.Linear(2, 2))
    plain = copy.deepcopy(model)
    gp = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=4, checkpoint=Selective(layers={1}), cpu_threads=1)
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(4))
    gp(x).square().sum().backward()
    assert kept.calls == [(False, False)] * 4
    assert dropped.calls == [(True, False)] * 4 + [(False, True)] * 4
    plain(x).square().sum().backward()
    assert all(torch.allclose(p.grad, q.grad) for p, q in zip(gp.parameters(), plain.parameters(), strict=True))


@pytest.mark.parametrize("generators", [False, True])
def test_skip_connections_across_re_materialized_layers(generators: bool) -> None:
    """A U-Net whose skips span re-materialized layers (stashed in one, popped in another), as
    plain calls or torchgpipe's protocol."""
    model = dist_cases.generator_unet() if generators else dist_cases.unet()
    x, y = dist_cases.unet_data()
    grads = []
    for checkpoint in ("never", Selective(layers={0, 2, 5}), Selective(save_ops="matmuls")):
        for schedule in ("1f1b", "zb-h1"):
            pipe = Pipeline(copy.deepcopy(model), [4, 4], chunks=2, loss_fn=F.mse_loss, schedule=schedule,
                            checkpoint=checkpoint, cpu_threads=1)  # fmt: skip
            pipe.step(x, y)
            grads.append([p.grad for p in pipe.parameters()])
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, grads[0], strict=True))


def test_memory_of_a_per_op_policy_lies_between_always_and_never() -> None:
    """ActivationMeter counts what the policy keeps: the matmul and attention outputs, not the rest."""
    peaks = {}
    for name, checkpoint in (("never", "never"), ("ops", Selective(save_ops="matmuls")), ("always", "always")):
        pipe = Pipeline(lm(), [3, 3], chunks=4, loss_fn=lm_loss, schedule="gpipe", checkpoint=checkpoint,
                        measure_memory=True, cpu_threads=1)  # fmt: skip
        pipe.step(TOKENS, TARGET)
        assert pipe.last_trace is not None and pipe.last_trace.peak_activation_bytes is not None
        peaks[name] = pipe.last_trace.peak_activation_bytes
    for worker in range(2):
        assert peaks["always"][worker] < peaks["ops"][worker] < peaks["never"][worker], peaks


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ValueError, "Selective() names neither layers= nor save_ops="),
        ({"layers": {1}, "microbatches": "never"}, ValueError, "pass checkpoint='never'"),
        ({"layers": {1}, "microbatches": "sometimes"}, ValueError, "(microbatches: 'sometimes')"),
        ({"layers": "all"}, TypeError, "(layers: 'all' of type str)"),
        ({"layers": {1, "x"}}, TypeError, "(got 'x' of type str)"),
        ({"layers": {-1}}, TypeError, "(got -1 of type int)"),
        ({"layers": set()}, ValueError, "re-materializes no layer"),
        ({"save_ops": "everything"}, ValueError, "unknown Selective(save_ops=...) preset 'everything'"),
        ({"save_ops": {aten.mm}}, TypeError, "pick an overload, e.g. aten.mm.default"),
        ({"save_ops": {"mm"}}, TypeError, "(got 'mm' of type str) such as torch.ops.aten.mm.default"),
        ({"save_ops": 3}, TypeError, "(save_ops: 3 of type int)"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)) as caught:
        Selective(**kwargs)
    assert "\n" not in str(caught.value)


def test_a_kept_output_changed_in_place_is_named() -> None:
    """A ReLU(inplace=True) on a Linear's output changes what 'matmuls' keeps: one line naming the layer."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)), nn.Linear(4, 1))
    pipe = Pipeline(model, [2, 1], chunks=2, loss_fn=F.mse_loss, checkpoint=Selective(save_ops="matmuls"))
    message = (
        "layer 1 (Sequential) of stage 0 changes in place the output of an operator that Selective(save_ops=...) keeps"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        pipe.step(torch.randn(4, 4), torch.randn(4, 1))


def test_layers_beyond_the_model_and_unknown_modes_are_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("names layers [6, 9], but the model has 6 layers (0..5)")):
        Pipeline(lm(), [3, 3], chunks=2, loss_fn=lm_loss, checkpoint=Selective(layers={1, 6, 9}))
    with pytest.raises(ValueError, match=re.escape("(checkpoint: 'sometimes'); for selective re-materialization")):
        Pipeline(lm(), [3, 3], chunks=2, loss_fn=lm_loss, checkpoint="sometimes")


# a case of the session's pool (tests/dist_harness.py: a few launches in all)
ACROSS = POOL.add(2, "selective", "selective_step", schedule="zb-h1", checkpoint="selective")


def test_torchrun_equals_one_process(pool: Pool) -> None:
    """Two gloo ranks under zb-h1 with a selective policy: the loss and gradients of 'never' in one process."""
    ranks = pool(ACROSS)
    expected = dist_cases.selective_step("zb-h1", checkpoint="never", world=2)
    assert all(r["loss"] == expected["loss"] for r in ranks)
    got = {n: g for r in ranks for n, g in r["grads"].items()}
    assert got.keys() == expected["grads"].keys()
    assert all(torch.equal(got[n], expected["grads"][n]) for n in got)


def test_gpipe_train_checkpoint_matmuls_trains_as_never_does(tmp_path: Path) -> None:
    """``gpipe train --checkpoint matmuls`` (Selective(save_ops='matmuls') on all but the last
    micro-batch) takes the steps 'never' takes, to the bit (dropout on)."""
    losses = {}
    for mode in ("never", "matmuls"):
        out = tmp_path / mode
        with contextlib.redirect_stderr(io.StringIO()):
            train(TrainConfig(out=str(out), steps=3, batch=8, eval_every=3, eval_batches=1, checkpoint_every=3,
                              checkpoint=mode, dropout=0.1, partitions=2, progress=False))  # fmt: skip
        lines = (out / "metrics.jsonl").read_text().splitlines()
        losses[mode] = [json.loads(line)["loss"] for line in lines]
    assert len(losses["never"]) == 3 and losses["matmuls"] == losses["never"]
