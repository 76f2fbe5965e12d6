"""Fixup (``norm="none", init_scheme="fixup"``, :mod:`gpipe.models.fixup`) for the Transformer and
AmoebaNet-D: the initialization, also where a pipeline materializes a model built on the meta device;
pipelined steps equal to the plain model's bitwise at every partition count; a deep model without
normalization trains; cached decoding chooses the uncached tokens; bad settings refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe import Pipeline
from gpipe.data import PAD
from gpipe.decode import greedy
from gpipe.models import amoebanet_d, transformer, transformer_lm
from gpipe.models.fixup import FixupConv2d, Multiplier
from tests.helpers import intra_op_threads

VOCAB = 20
BALANCES = {1: [7], 2: [3, 4], 4: [2, 2, 1, 2]}  # (both test models have 7 layers)


def tiny_transformer(seed: int = 0, **kwargs: Any) -> nn.Sequential:
    torch.manual_seed(seed)
    settings: dict[str, Any] = {"norm": "none", "init_scheme": "fixup", **kwargs}
    return transformer(2, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0, **settings)


def tiny_amoebanet(seed: int = 0, **kwargs: Any) -> nn.Sequential:
    torch.manual_seed(seed)
    settings: dict[str, Any] = {"norm": "none", "init_scheme": "fixup", **kwargs}
    return amoebanet_d(3, 8, classes=5, stem_cells=0, **settings)


def materialized(build: Any, balance: list[int]) -> dict[str, Tensor]:
    """The weights of the model ``build()`` makes on the meta device, once a pipeline of ``balance``
    materialized it (seeded per layer), by the model's names."""
    with torch.device("meta"):
        model = build()
    pipe = Pipeline(model, balance, chunks=1, loss_fn=F.mse_loss, devices=["cpu"] * len(balance))
    assert not any(p.is_meta for p in pipe.parameters())
    return {n.split(".", 2)[2]: p.detach() for n, p in pipe.named_parameters()}


def perturbed(model: nn.Sequential, seed: int = 1) -> nn.Sequential:
    """The model away from its initialization (every weight and scalar moved), where Fixup's zeros would
    not hide a wrongly routed gradient or a scalar left out."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.1)
    return model


def check_transformer_init(fixup: dict[str, Tensor], default: dict[str, Tensor], branches: int) -> None:
    """Zero: the attentions' output projections, the feed-forwards' outer layers, the output
    projection; the query, key, value and inner projections the default's (feed-forward scale 1)
    times L^-1/2; the scalar biases 0, the multipliers 1."""
    factor = branches**-0.5
    assert not any("norm" in name for name in fixup), "norm='none' leaves no layer norm"
    zero = ("out_proj.weight", "out_proj.bias", "outer.weight", "outer.bias", "outer_weight", "outer_bias")
    scaled = ("in_proj_weight", ".q.weight", ".k.weight", ".v.weight", "inner.weight", "inner_weight")
    seen = {"zero": 0, "scaled": 0, "scalars": 0}
    for name, value in fixup.items():
        if name.endswith(zero) or name == "6.proj.weight":  # (6: the output layer)
            assert not value.any(), name
            seen["zero"] += 1
        elif name.endswith(scaled):
            assert torch.equal(value, default[name] * factor), name
            seen["scaled"] += 1
        elif ".fixup_" in name:
            assert torch.equal(value, torch.zeros_like(value) if name.endswith("biases") else torch.ones(1)), name
            seen["scalars"] += 1
        else:  # the embeddings, the other biases, the gates: as the default model's
            assert torch.equal(value, default[name]), name
    assert min(seen.values()) > 0, seen


@pytest.mark.parametrize("head_dim", [None, 8])  # nn.MultiheadAttention; gpipe's Attention
def test_the_transformers_initialization_also_where_a_pipeline_materializes_it(head_dim: int | None) -> None:
    settings: dict[str, Any] = {"head_dim": head_dim, "experts": 2}  # (the second layers' blocks: mixtures)
    with intra_op_threads(1):
        fixup = materialized(lambda: tiny_transformer(**settings), BALANCES[2])
        default = materialized(lambda: tiny_transformer(**settings, norm="layer", init_scheme="default",
                                                        ff_init_scale=1.0), BALANCES[2])  # fmt: skip
        # 2 encoder layers of 2 branches, 2 decoder layers of 3
        check_transformer_init(fixup, default, branches=10)
        one_stage = materialized(lambda: tiny_transformer(**settings), BALANCES[1])
        assert all(torch.equal(one_stage[name], value) for name, value in fixup.items())
        assert list(one_stage) == list(fixup)
        # built directly: the same rules
        built = dict(tiny_transformer(**settings).named_parameters())
        plain_model = tiny_transformer(**settings, norm="layer", init_scheme="default", ff_init_scale=1.0)
        plain = dict(plain_model.named_parameters())
        assert list(built) == list(fixup)
        check_transformer_init(built, plain, branches=10)
    assert fixup["2.fixup_ff.biases"].shape == (1,) and fixup["1.fixup_ff.biases"].shape == (3,)  # a mixture's: 1

    lm = dict(transformer_lm(3, 32, 2, dim=16, vocab=VOCAB, norm="none", init_scheme="fixup").named_parameters())
    assert not lm["4.proj.weight"].any() and lm["1.self_attn.in_proj_weight"].any()  # (L = 6 branches)
    assert "1.fixup_cross_attn.biases" not in lm


def test_the_norms_come_out_under_their_names() -> None:
    layer = tiny_transformer(init_scheme="default", transparent=True)
    plain = tiny_transformer(norm="layer", init_scheme="default", transparent=True)
    assert not any(isinstance(m, nn.LayerNorm) for m in layer.modules())
    names = {n for n, _ in layer.named_parameters()}
    assert names == {n for n, _ in plain.named_parameters() if ".norm" not in n}
    amoeba = tiny_amoebanet(init_scheme="default")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in amoeba.modules())
    batch_norm = tiny_amoebanet(norm="batch", init_scheme="default")
    assert {n for n, _ in amoeba.named_parameters()} < {n for n, _ in batch_norm.named_parameters()}


def check_amoebanet_init(weights: dict[str, Tensor], model: nn.Sequential) -> None:
    """Zero: each weighted operation's last convolution, the classifier; the others He's (times the
    factor inside an operation: checked on their spread); scalars at 0 and 1."""
    convs = {n: m for n, m in model.named_modules() if isinstance(m, FixupConv2d)}
    ops = {n.rsplit(".", 1)[0] for n in convs if ".ops." in n}
    assert len(ops) == 5 * 3 + 3 * 2  # 3 normal cells, 2 reduction cells
    ratios = []
    for name, conv in convs.items():
        w = weights[f"{name}.weight"]
        assert not weights[f"{name}.bias_in"].any()
        op = name.rsplit(".", 1)[0] if ".ops." in name else None
        siblings = [n for n in convs if op is not None and n.rsplit(".", 1)[0] == op]
        if op is not None and name == siblings[-1]:
            assert not w.any(), name
            continue
        factor = len(ops) ** (-1 / (2 * len(siblings) - 2)) if op is not None else 1.0
        assert conv.gain == pytest.approx(factor), name
        ratios.append(w.flatten() / (factor * (2 / w[0].numel()) ** 0.5))
    assert 0.85 < float(torch.cat(ratios).std()) < 1.15  # N(0, 1) once He's and the factor are taken out
    assert sum(1 for m in model.modules() if isinstance(m, Multiplier)) == len(ops)
    assert all(float(v) == 1.0 for n, v in weights.items() if n.endswith(".scale"))
    assert not weights["6.fc.weight"].any() and not weights["6.fc.bias"].any()


def test_the_amoebanets_initialization_also_where_a_pipeline_materializes_it() -> None:
    with intra_op_threads(1):
        weights = materialized(tiny_amoebanet, BALANCES[2])
        check_amoebanet_init(weights, tiny_amoebanet())
        one_stage = materialized(tiny_amoebanet, BALANCES[1])
        assert list(one_stage) == list(weights)
        assert all(torch.equal(one_stage[name], value) for name, value in weights.items())
        built = tiny_amoebanet()
        check_amoebanet_init({n: p.detach() for n, p in built.named_parameters()}, built)


def test_the_amoebanets_signal_reaches_the_classifier_and_its_gradient_the_stem() -> None:
    """At initialization the classifier is zero (its input is not: the skips and pools carry the
    signal through the cells), so the first step's gradient reaches the classifier alone; the next
    reach the stem."""
    model = tiny_amoebanet()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))
    with intra_op_threads(1):
        with torch.no_grad():
            features = model[:-1](x)[1]
        pooled = F.adaptive_avg_pool2d(F.relu(features), 1).flatten(1)
        assert float(pooled.std(0).mean()) > 1e-3  # per image, not a constant
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        stem = []
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grad = model[0].conv.weight.grad
            stem.append(float(grad.abs().max()) if grad is not None else 0.0)
            optimizer.step()
    assert stem[0] == 0.0 and stem[1] > 1e-4 and stem[2] > 1e-4, stem


def transformer_batch(rows: int = 8) -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(1, VOCAB, (rows, 7), generator=g), torch.randint(1, VOCAB, (rows, 5), generator=g)
    src[0, 5:] = PAD
    return (src, tgt), torch.randint(1, VOCAB, (rows, 5), generator=g)


def token_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def plain_step(model: nn.Sequential, inputs: Any, target: Tensor, chunks: int) -> tuple[Tensor, list[Tensor]]:
    """What a pipeline's step computes, on the plain model: each micro-batch's loss scaled by its share
    of the mini-batch, backward per micro-batch (gradients accumulated), the losses summed."""
    model = copy.deepcopy(model)
    parts = zip(*(x.chunk(chunks) for x in inputs), strict=True) if isinstance(inputs, tuple) else inputs.chunk(chunks)
    loss_fn = token_loss if isinstance(inputs, tuple) else F.cross_entropy
    losses = []
    with intra_op_threads(1):
        for part, y in zip(parts, target.chunk(chunks), strict=True):
            loss = loss_fn(model(part), y) * (len(y) / len(target))
            loss.backward()
            losses.append(loss.detach())
    return torch.stack(losses).sum(), [p.grad for p in model.parameters()]  # type: ignore[misc]


@pytest.mark.parametrize("kind", ["transformer", "transformer-heads", "amoebanet"])  # heads: gpipe's Attention
def test_pipelined_steps_are_the_plain_models_bitwise_at_every_partition_count(kind: str) -> None:
    if kind.startswith("transformer"):
        model = perturbed(tiny_transformer(head_dim=8 if kind == "transformer-heads" else None))
        inputs, target = transformer_batch()
        loss_fn = token_loss
    else:
        model = perturbed(tiny_amoebanet())
        g = torch.Generator().manual_seed(0)
        inputs, target = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)
        loss_fn = F.cross_entropy
    # Two micro-batches: any schedule adds their gradients in an order that gives the same floats.
    loss, grads = plain_step(model, inputs, target, chunks=2)
    assert all(g is not None and g.any() for g in grads)
    for schedule in ("gpipe", "1f1b"):
        for k, balance in BALANCES.items():
            pipe = Pipeline(copy.deepcopy(model), balance, chunks=2, schedule=schedule, devices=["cpu"] * k,
                            loss_fn=loss_fn, cpu_threads=1)  # fmt: skip
            assert torch.equal(pipe.step(inputs, target), loss), (kind, k, schedule)
            for (name, p), expected in zip(pipe.named_parameters(), grads, strict=True):
                assert p.grad is not None and torch.equal(p.grad, expected), (kind, k, schedule, name)


def test_a_deep_transformer_without_layer_norm_trains() -> None:
    torch.manual_seed(0)
    model = transformer_lm(8, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0, norm="none", init_scheme="fixup")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (8, 13), generator=g)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    with intra_op_threads(1):
        for _ in range(30):
            optimizer.zero_grad()
            loss = token_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(float(VOCAB))).item(), abs=1e-4)  # zero logits
    assert losses[-1] < 0.7 * losses[0], losses


def test_cached_decoding_chooses_the_uncached_tokens() -> None:
    model = perturbed(tiny_transformer(), seed=2).eval()
    with torch.no_grad():
        model[-1].proj.weight.mul_(20.0)  # (sharper logits: no near ties)
    g = torch.Generator().manual_seed(4)
    source, start = torch.randint(3, VOCAB, (5, 6), generator=g), torch.randint(3, 7, (5,), generator=g)
    source[0, 4:] = PAD
    with intra_op_threads(1):
        expected = greedy(model, source, start, max_len=8, cache=False)
        assert expected.size(1) > 2
        assert torch.equal(greedy(model, source, start, max_len=8), expected)
        pipe = Pipeline(copy.deepcopy(model), BALANCES[2], chunks=2, devices=["cpu"] * 2, cpu_threads=1).eval()
        assert torch.equal(greedy(pipe, source, start, max_len=8), expected)


@pytest.mark.parametrize(
    ("build", "settings", "message"),
    [
        (tiny_transformer, {"norm": "layer"}, r"init_scheme='fixup' needs norm='none' \(norm: 'layer'\): Fixup"),
        (tiny_amoebanet, {"norm": "batch"}, r"init_scheme='fixup' needs norm='none' \(norm: 'batch'\): Fixup"),
        (tiny_transformer, {"norm": "rms"}, r"norm is one of 'layer', 'none' \(norm: 'rms'\)"),
        (tiny_amoebanet, {"norm": "layer"}, r"norm is one of 'batch', 'none' \(norm: 'layer'\)"),
        (tiny_transformer, {"init_scheme": "t-fixup"}, r"init_scheme is 'default' or 'fixup' \(init_scheme: 't-fix"),
        (tiny_amoebanet, {"init_scheme": "He"}, r"init_scheme is 'default' or 'fixup' \(init_scheme: 'He'\)"),
        (tiny_transformer, {"ff_init_scale": 0.5}, r"sets the feed-forward .* \(ff_init_scale: 0.5\): leave"),
    ],
)
def test_bad_settings_are_refused(build: Any, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(**settings)
