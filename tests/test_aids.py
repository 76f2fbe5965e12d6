"""The talk's training aids of the Transformer: layers shared across depth (``share_layers``,
``--share-layers``) and learned learning rates (:class:`gpipe.hypergradient.LearnedRates`,
``--lr-hypergradient``): the same bits at any partition count and schedule, the plain model's step,
resumed exactly; bad settings refused. (Fixup: ``tests/test_fixup.py``.)"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe import Pipeline
from gpipe.cli import main
from gpipe.hypergradient import UPDATE, LearnedRates
from gpipe.models import parameter_count, transformer
from gpipe.models.sharing import share_layers
from gpipe.train import ConfigError, parse
from tests.helpers import intra_op_threads

VOCAB = 20
# Layers: source embedding, 4 encoder layers, target embedding, 4 decoder layers, output (11). The cuts
# fall inside the groups of two shared layers (2, 6) and between them.
BALANCES = {1: [11], 2: [3, 8], 4: [2, 3, 3, 3]}


def model_of(seed: int = 0, share: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    return transformer(4, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0, share_layers=share)


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def batch(seed: int = 0, rows: int = 8) -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(1, VOCAB, (rows, 7), generator=g), torch.randint(1, VOCAB, (rows, 5), generator=g)
    return (src, tgt), torch.randint(1, VOCAB, (rows, 5), generator=g)


def test_shared_layers_hold_one_set_of_weights_and_count_it_once() -> None:
    model, plain = model_of(share=2), model_of(share=1)
    assert model[1].attn.in_proj_weight is model[2].attn.in_proj_weight
    assert model[1].ff.inner.weight is not model[3].ff.inner.weight  # (the next group: its own)
    assert model[6].cross_attn.out_proj.weight is model[7].cross_attn.out_proj.weight
    layer = sum(p.numel() for p in plain[1].parameters()), sum(p.numel() for p in plain[6].parameters())
    assert parameter_count(plain) - parameter_count(model) == 2 * layer[0] + 2 * layer[1]
    with pytest.raises(ValueError, match=r"share_layers=3 must divide the 4 layers"):
        model_of(share=3)
    with pytest.raises(ValueError, match=r"with experts=4 is not supported"):
        transformer(2, 32, 2, dim=16, vocab=VOCAB, experts=4, share_layers=2)
    with pytest.raises(ValueError, match=r"differ in their parameters"):
        share_layers([nn.Linear(2, 2), nn.Linear(2, 2, bias=False)], 2)


def run(model: nn.Sequential, k: int, schedule: str, steps: int, beta: float = 0.0, scope: str = "layer",
        meta: bool = False) -> tuple[list[Tensor], list[Tensor], list[float]]:  # fmt: skip
    """``steps`` Adam steps of ``model`` at K = ``k`` (learned rates at ``beta``): the losses, the
    parameters (every copy) and the learned factors."""
    pipe = Pipeline(copy.deepcopy(model), BALANCES[k], chunks=2, schedule=schedule, devices=["cpu"] * k,
                    loss_fn=loss_fn, cpu_threads=1, init_seed=0 if meta else None)  # fmt: skip
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    rates = LearnedRates(pipe, optimizer, beta=beta, scope=scope)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        losses.append(pipe.step(*batch(step)))
        rates.step()
    return losses, [p.detach().clone() for p in pipe.parameters()], rates.factors


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_shared_layers_and_learned_rates_train_alike_at_every_partition_count(schedule: str) -> None:
    """Adam steps with shared layers and per-layer learned rates: the same losses, weights and factors,
    bitwise, at K = 1, 2 and 4; the shared copies stay equal; the factors move."""
    model = model_of()
    with intra_op_threads(1):
        results = {k: run(model, k, schedule, steps=3, beta=0.1) for k in BALANCES}
    losses, params, factors = results[1]
    owners = [0, 1, 3, 5, 6, 8, 10]  # (layers 2, 4, 7 and 9 hold copies of 1's, 3's, 6's and 8's weights)
    assert len({factors[at] for at in owners}) == len(owners) and 1.0 not in [factors[at] for at in owners]
    for k, (other_losses, other_params, other_factors) in results.items():
        assert [float(x) for x in other_losses] == [float(x) for x in losses], k
        assert other_factors == factors, k
        assert len(other_params) == len(params) and all(torch.equal(a, b) for a, b in zip(other_params, params)), k
    # The copies of the shared layers' weights (1 and 2, 3 and 4 ...) are equal.
    pipe = Pipeline(copy.deepcopy(model), BALANCES[2], chunks=2, devices=["cpu"] * 2, loss_fn=loss_fn)
    assert len(pipe.engine.ties) == 2 * len(list(model[1].parameters())) + 2 * len(list(model[6].parameters()))


def test_a_shared_model_steps_as_the_plain_model() -> None:
    """One pipelined step of the shared model against the plain one (a single tensor used at two depths:
    autograd adds its contributions in another order, so to rounding)."""
    model = model_of()
    plain = copy.deepcopy(model)
    (src, tgt), target = batch()
    with intra_op_threads(1):
        for s, t, y in zip(src.chunk(2), tgt.chunk(2), target.chunk(2)):
            (loss_fn(plain((s, t)), y) / 2).backward()
        pipe = Pipeline(copy.deepcopy(model), BALANCES[2], chunks=2, devices=["cpu"] * 2, loss_fn=loss_fn,
                        cpu_threads=1)  # fmt: skip
        pipe.step((src, tgt), target)
    # The pipeline's parameters are the layers' in order, a copy per layer: the plain model's, duplicates named.
    named = list(plain.named_parameters(remove_duplicate=False))
    assert len(named) == len(list(pipe.parameters()))
    for (name, expected), p in zip(named, pipe.parameters()):
        torch.testing.assert_close(p.grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_learned_rates_scale_the_update_and_keep_it() -> None:
    """A factor f makes the update f times the optimizer's (SGD: exactly the rate f·lr); the update is
    kept in the optimizer's state; the first step learns nothing; a global scope has one factor."""
    model = model_of(share=1)
    (src, tgt), target = batch()
    for beta in (0.0, 0.5):
        pipe = Pipeline(copy.deepcopy(model), BALANCES[2], chunks=2, devices=["cpu"] * 2, loss_fn=loss_fn)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        rates = LearnedRates(pipe, optimizer, beta=beta, scope="global")
        for _ in range(2):
            optimizer.zero_grad()
            pipe.step((src, tgt), target)
            rates.step()
            assert rates.factors == [1.0] or beta  # (beta 0, and any beta's first step: nothing learned)
    (f,) = rates.factors
    assert 1.0 < f <= 1.5  # (the same batch twice: the gradient still points where the step went)
    assert rates.metrics(0.1) == {"lr/model": pytest.approx(0.1 * f)}
    p = next(iter(pipe.parameters()))
    kept = optimizer.state[p][UPDATE]
    assert kept.shape == p.shape and kept.abs().sum() > 0
    with pytest.raises(ValueError, match=r"beta must be a finite number in \[0, 1\) \(beta: nan\)"):
        LearnedRates(pipe, optimizer, beta=float("nan"))
    with pytest.raises(ValueError, match=r"scope must be one of layer, global \(scope: 'model'\)"):
        LearnedRates(pipe, optimizer, beta=0.1, scope="model")


def test_gpipe_train_refuses_bad_aids_in_one_line() -> None:
    cases = {
        "--lr-hypergradient -0.1": "--lr-hypergradient must be in [0, 1)",
        "--lr-hypergradient inf": "--lr-hypergradient must be in [0, 1)",
        "--lr-hypergradient-scope global": "--lr-hypergradient-scope is for the learned learning rate",
        "--share-layers 3 --layers 4": "--share-layers 3 must divide the 4 encoder (and decoder) layers",
        "--share-layers 2 --experts 4": "--share-layers with --experts is not supported",
        "--share-layers 2 --model amoebanet": "--share-layers is for --model transformer",
        "--init-scheme fixup": "add --norm none",
        "--norm batch": "--norm 'batch' is not one of auto, none",
        "--model hf --norm none": "--norm and --init-scheme are for the paper's models",
    }
    for flags, said in cases.items():
        with pytest.raises(ConfigError) as info:
            parse(flags.split())
        assert said in str(info.value) and "\n" not in str(info.value), flags


def losses_of(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_gpipe_train_with_the_aids_is_exact_across_k_and_resumes_exactly(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``gpipe train`` with the three aids (shared layers, per-layer learned rates, Fixup without layer
    norm): a run stopped after step 2 at K = 1 (the gpipe schedule) and resumed at K = 2 (1F1B) has the
    uninterrupted K = 2 run's losses and learned rates; the first lines count the shared weights once."""
    common = ["--layers", "2", "--share-layers", "2", "--lr-hypergradient", "0.05", "--norm", "none", "--init-scheme",
              "fixup", "--steps", "4", "--batch", "8", "--chunks", "2", "--eval-every", "0", "--dropout", "0.1",
              "--checkpoint-every", "2", "--no-progress", "--tensorboard", "off"]  # fmt: skip
    assert main(["train", *common, "--partitions", "2", "--out", str(tmp_path / "full")]) == 0
    assert "note: layers shared every 2: " in capsys.readouterr().err
    full = losses_of(tmp_path / "full")
    rates = [k for k in full[0] if k.startswith("lr/")]
    assert len(rates) == 5 and len({full[-1][k] for k in rates}) > 1  # (2L + 3 layers, 2 of them shared: own 5)
    cut = ["--out", str(tmp_path / "cut")]
    assert main(["train", *common, "--partitions", "1", "--schedule", "gpipe", "--steps", "2", *cut]) == 0
    assert main(["train", *common, "--partitions", "2", "--schedule", "1f1b", *cut, "--resume"]) == 0

    def seen(rows: list[dict[str, object]]) -> list[tuple[object, ...]]:
        return [(row["loss"], *[row[k] for k in rates]) for row in rows]

    assert seen(losses_of(tmp_path / "cut")) == seen(full)
