"""Transparent attention (``transformer(..., transparent=True)``, ``gpipe train --transparent``): the
pipelined model's losses and gradients are the plain model's bitwise, at any partition count and
schedule; cached decoding chooses the uncached tokens; training logs the learned weights."""

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
from gpipe.data import PAD
from gpipe.decode import beam_search, greedy
from gpipe.models import transformer, transformer_lm
from gpipe.models.transformer import Output
from gpipe.models.transparent import (
    TransparentDecoderLayer,
    TransparentEncoderLayer,
    TransparentTargetEmbedding,
    transparent_weights,
)
from gpipe.train import ConfigError, TrainConfig, parse, train
from gpipe.train.resume import resume_point, saved_settings
from gpipe.translate import Translator
from tests.helpers import intra_op_threads

VOCAB = 20


def model_of(seed: int = 0, layers: int = 3, **kwargs: object) -> nn.Sequential:
    torch.manual_seed(seed)
    return transformer(layers, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0, **kwargs)  # type: ignore[arg-type]


def target_embedding(model: nn.Sequential) -> TransparentTargetEmbedding:
    (found,) = [layer for layer in model if isinstance(layer, TransparentTargetEmbedding)]
    return found


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def batch(seed: int = 0, rows: int = 8) -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(1, VOCAB, (rows, 7), generator=g), torch.randint(1, VOCAB, (rows, 5), generator=g)
    src[0, 5:] = PAD
    return (src, tgt), torch.randint(1, VOCAB, (rows, 5), generator=g)


def plain_step(
    model: nn.Sequential, inputs: tuple[Tensor, Tensor], target: Tensor, chunks: int
) -> tuple[Tensor, list[Tensor]]:
    """What a pipeline's step computes, on the plain model: each micro-batch's loss scaled by its share
    of the mini-batch, backward per micro-batch (gradients accumulated), the losses summed."""
    model = copy.deepcopy(model)
    losses = []
    with intra_op_threads(1):
        for src, tgt, y in zip(inputs[0].chunk(chunks), inputs[1].chunk(chunks), target.chunk(chunks)):
            loss = loss_fn(model((src, tgt)), y) * (len(y) / len(target))
            loss.backward()
            losses.append(loss.detach())
    return torch.stack(losses).sum(), [p.grad for p in model.parameters()]  # type: ignore[misc]


# Layers: source embedding, 3 encoder layers, target embedding, 3 decoder layers, output (9). The
# boundaries fall inside the encoder (carrying 2 and 4 of its outputs), at the mix and inside the decoder.
BALANCES = {1: [9], 2: [3, 6], 4: [2, 2, 2, 3]}


@pytest.mark.parametrize(
    ("schedule", "checkpoint"),
    [("gpipe", "except_last"), ("1f1b", "never"), ("1f1b", "always"), ("zb-h1", "except_last")],
)
def test_losses_and_gradients_are_the_plain_models_bitwise_at_every_partition_count(
    schedule: str, checkpoint: str
) -> None:
    model = model_of(transparent=True)
    inputs, target = batch()
    # Two micro-batches: any schedule adds their gradients in an order that gives the same floats.
    loss, grads = plain_step(model, inputs, target, chunks=2)
    for k, balance in BALANCES.items():
        pipe = Pipeline(copy.deepcopy(model), balance, chunks=2, schedule=schedule, checkpoint=checkpoint,
                        devices=["cpu"] * k, loss_fn=loss_fn, cpu_threads=1)  # fmt: skip
        assert torch.equal(pipe.step(inputs, target), loss), (k, schedule, checkpoint)
        got = [p.grad for p in pipe.parameters()]
        assert len(got) == len(grads)
        for (name, _), g, expected in zip(pipe.named_parameters(), got, grads):
            assert g is not None and torch.equal(g, expected), (k, schedule, checkpoint, name)
    logits = target_embedding(model).logits
    assert [n for n, p in model.named_parameters() if p is logits] == ["4.logits"]  # in one layer only


def test_the_weights_start_uniform_and_all_on_the_last_layer_are_the_plain_model() -> None:
    model = model_of(layers=2, transparent=True).eval()
    weights = transparent_weights(model)
    assert list(weights) == [f"transparent/dec{j}/{s}" for j in (1, 2) for s in ("emb", "enc1", "enc2")]
    assert set(weights.values()) == {round(1 / 3, 4)}
    # The plain model's layers are built alike; its memory is the last encoder layer's output, normalized.
    plain = model_of(layers=2).eval()
    with torch.no_grad():
        target_embedding(model).logits.copy_(torch.tensor([[-1e4, -1e4, 0.0]] * 2))
    assert transparent_weights(model)["transparent/dec1/enc2"] == 1.0
    (src, tgt), _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(model((src, tgt)), plain((src, tgt)), rtol=0, atol=0)


def test_the_weights_learn() -> None:
    model = model_of(transparent=True)
    inputs, target = batch()
    pipe = Pipeline(model, BALANCES[2], chunks=2, devices=["cpu"] * 2, loss_fn=loss_fn, cpu_threads=1)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.1)
    before = transparent_weights(pipe)
    pipe.step(inputs, target)
    optimizer.step()
    after = transparent_weights(pipe)
    assert after.keys() == before.keys() and after != before
    for j in (1, 2, 3):  # each decoder layer's weights: a softmax over the 4 sources
        assert sum(after[f"transparent/dec{j}/{s}"] for s in ("emb", "enc1", "enc2", "enc3")) == pytest.approx(
            1, abs=1e-3
        )


def no_pad(module: nn.Module, inputs: object, logits: Tensor) -> Tensor:
    return logits.index_fill(-1, torch.tensor([PAD]), -1e4)


def sharpened(model: nn.Sequential) -> nn.Sequential:
    """The model with sharper logits (a random model's near-uniform predictions make eos rare and ties
    likely), weights that are not uniform, and no pad token chosen: a hypothesis holding one is where
    beam search with caches and without part ways, for the plain Transformer too (seeds 4, 5 and 8 of
    ``transformer(3, ...)`` here)."""
    output = model[-1]
    assert isinstance(output, Output)
    with torch.no_grad():
        output.proj.weight.mul_(8.0)
        target_embedding(model).logits.normal_(generator=torch.Generator().manual_seed(1))
    output.register_forward_hook(no_pad)
    return model.eval()


def test_cached_decoding_chooses_the_uncached_tokens_at_every_partition_count() -> None:
    model = sharpened(model_of(4, transparent=True))
    g = torch.Generator().manual_seed(4)
    source, start = torch.randint(3, VOCAB, (7, 6), generator=g), torch.randint(3, 7, (7,), generator=g)
    source[0, 4:] = PAD
    with intra_op_threads(1):  # (tiny kernels: two threads spin on a busy machine)
        # uncached: the whole prefix through the plain model at every step
        expected = greedy(model, source, start, max_len=9, cache=False)
        beams = beam_search(model, source, start, beam=3, max_len=9, length_penalty=0.6, cache=False)
        assert torch.equal(greedy(model, source, start, max_len=9), expected)  # the plain model's caches
    for k in (1, 2, 4):
        pipe = Pipeline(copy.deepcopy(model), BALANCES[k], chunks=2, devices=["cpu"] * k, cpu_threads=1).eval()
        assert torch.equal(greedy(pipe, source, start, max_len=9), expected), k
        assert pipe.last_decode is not None and pipe.last_decode.steps > 0
        assert torch.equal(beam_search(pipe, source, start, beam=3, max_len=9, length_penalty=0.6), beams), k


def test_the_wrapped_layers_keep_their_tensor_parallel_plans() -> None:
    model = transformer(1, 32, 2, dim=16, vocab=VOCAB, head_dim=8, transparent=True)
    for layer in model:
        if isinstance(layer, (TransparentEncoderLayer, TransparentDecoderLayer)):
            plan = layer.tensor_parallel_plan(2)
            assert plan and all(layer.get_submodule(name) is not None for name in plan), plan


def test_gpipe_train_logs_the_weights_and_translate_rebuilds_the_model(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    assert main(["corpus", "--out", str(corpus), "--sizes", "200,40", "--held-out", "4"]) == 0
    out = tmp_path / "run"
    cfg = TrainConfig(out=str(out), data=str(corpus), vocab_size=100, transparent=True, layers=1, hidden=32,
                      dim=16, heads=2, batch=8, chunks=2, steps=2, eval_every=1, progress=False)  # fmt: skip
    result = train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    names = ["transparent/dec1/emb", "transparent/dec1/enc1"]
    assert [sorted(k for k in row if k.startswith("transparent/")) for row in rows] == [names, names]
    assert rows[0]["transparent/dec1/emb"] + rows[0]["transparent/dec1/enc1"] == pytest.approx(1, abs=1e-3)
    assert rows[0]["transparent/dec1/emb"] != 0.5  # (learned: one step from uniform)
    assert result["transparent/dec1/emb"] == rows[-1]["transparent/dec1/emb"]
    (checkpoint,) = (out / "checkpoints").glob("step-*")
    assert json.loads((checkpoint / "run.json").read_text())["config"]["transparent"] is True
    # a warm start builds the run's model; a resumed run keeps it
    assert parse(["--init", str(out), "--data", str(corpus), "--out", str(tmp_path / "warm")]).transparent
    with pytest.raises(ConfigError, match=r"--transparent False differs from the run's True"):
        resume_point(parse(["--out", str(out), "--resume", "--no-transparent", "--steps", "3"]))
    translator = Translator(out, partitions=2)
    assert any(
        isinstance(layer, TransparentTargetEmbedding) for p in translator.pipe.partitions.values() for layer in p
    )
    assert len(translator.translate(["a b c"], to=translator.vocab.languages[0])) == 1


def test_a_run_saved_before_the_setting_is_not_transparent(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"config": {"model": "transformer", "layers": 2}}))
    assert TrainConfig(**saved_settings(tmp_path)).transparent is False
    assert saved_settings(tmp_path)["transparent"] is False  # (so that --resume --transparent is named, and refused)


@pytest.mark.parametrize("model", ["amoebanet", "hf"])
def test_train_refuses_transparent_for_other_models(tmp_path: Path, model: str) -> None:
    with pytest.raises(ConfigError, match=rf"--transparent .* --model transformer .*\(model: '{model}'\)"):
        TrainConfig(out=str(tmp_path), model=model, transparent=True).check()


def test_a_model_without_an_encoder_is_refused() -> None:
    with pytest.raises(ValueError, match="transformer_lm has no encoder"):
        transformer_lm(2, 32, 2, dim=16, vocab=VOCAB, transparent=True)
    with pytest.raises(ValueError, match=r"encoder layers: 1, decoder layers: 0"):
        from gpipe.models.transparent import transparent_attention

        transparent_attention(nn.Sequential(*[nn.Identity()] * 4), 1, 0)
    with pytest.raises(ValueError, match="no transparent attention"):
        transparent_weights(model_of(layers=1))
