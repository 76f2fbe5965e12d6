"""``gpipe.to_sequential`` on the models people bring: Hugging Face GPT-2, BERT and T5, torchvision
ResNet-50 and ViT, each built from a small config with random weights — no glue code.

Every model: the layers give the module's output bitwise (eval mode); pipelined under every
schedule, K in {1, 2, 4}, checkpoint 'never' and 'always', the gradients are those of the plain
model run on the same micro-batches; with dropout on, training is bitwise the same for every K.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import gpipe
from gpipe.sequential import ToSequentialError, repeated_blocks, to_sequential
from tests import dist_cases, vision
from tests.dist_harness import POOL, Pool
from tests.helpers import assert_close_norm, even, intra_op_threads

transformers = pytest.importorskip("transformers")

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
VOCAB = 97


@dataclass
class Case:
    """A model, a mini-batch for it (packed as the pipeline takes it), its target and loss."""

    build: Callable[[float], nn.Module]  # dropout probability -> a fresh model (seeded)
    inputs: Any
    target: Tensor
    loss: Callable[[Any, Tensor], Tensor]


def _ids(rows: int, cols: int, seed: int) -> Tensor:
    return torch.randint(1, VOCAB, (rows, cols), generator=torch.Generator().manual_seed(seed))


def _token_loss(output: Any, target: Tensor) -> Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def _class_loss(output: Any, target: Tensor) -> Tensor:
    logits = output if isinstance(output, Tensor) else output.logits
    return F.cross_entropy(logits, target)


def gpt2(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=6, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=6, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def t5(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, dropout_rate=dropout,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def resnet50(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return vision.torchvision().models.resnet50(num_classes=5)  # type: ignore[no-any-return]


def vit(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return vision.torchvision().models.VisionTransformer(  # type: ignore[no-any-return]
        image_size=16, patch_size=4, num_layers=6, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=5,
        dropout=dropout, attention_dropout=dropout,
    )  # fmt: skip


def _padded() -> dict[str, Tensor]:
    ids = _ids(8, 12, 1)
    mask = torch.ones_like(ids)
    for row, length in enumerate([12, 9, 5, 12, 7, 12, 3, 10]):
        mask[row, length:] = 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}


def _seq2seq() -> dict[str, Tensor]:
    source = _padded()
    return {"input_ids": source["input_ids"], "attention_mask": source["attention_mask"],
            "decoder_input_ids": _ids(8, 7, 2)}  # fmt: skip


def _images(size: int) -> Tensor:
    return torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(3))


CASES = {
    "gpt2": Case(gpt2, _ids(8, 12, 1), _ids(8, 12, 4), _token_loss),
    "bert": Case(bert, _padded(), torch.arange(8) % 3, _class_loss),
    "t5": Case(t5, _seq2seq(), _ids(8, 7, 5), _token_loss),
    "resnet50": Case(resnet50, _images(64), torch.arange(8) % 5, _class_loss),
    "vit": Case(vit, _images(16), torch.arange(8) % 5, _class_loss),
}


def _call(model: nn.Module, inputs: Any) -> Any:
    """The plain model's call (without the key/value cache, as to_sequential traces it)."""
    settings = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    return model(**inputs, **settings) if isinstance(inputs, dict) else model(inputs, **settings)


_CONVERTED: dict[tuple[str, float], tuple[nn.Module, nn.Sequential]] = {}


def converted(name: str, dropout: float = 0.0) -> tuple[nn.Module, nn.Sequential]:
    """A fresh plain model and its layers (traced once per model; copies handed out)."""
    key = (name, dropout)
    if key not in _CONVERTED:
        case = CASES[name]
        model = case.build(dropout)
        plain = copy.deepcopy(model)
        args, kwargs = ((), case.inputs) if isinstance(case.inputs, dict) else ((case.inputs,), {})
        _CONVERTED[key] = (plain, to_sequential(model, *args, **kwargs))
    plain, layers = _CONVERTED[key]
    return copy.deepcopy(plain), copy.deepcopy(layers)


def plain_grads(name: str, model: nn.Module, chunks: int) -> dict[str, Tensor]:
    """The plain model run on the pipeline's micro-batches, each loss weighted by its share."""
    case = CASES[name]
    parts = gpipe.microbatch.scatter(case.inputs, chunks)
    targets = case.target.chunk(chunks)
    for part, target in zip(parts, targets):
        (case.loss(_call(model, part.value), target) * (len(target) / len(case.target))).backward()
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def qualified(name: str) -> str:
    """A pipeline parameter's name in the plain model: 'partitions.<stage>.<layer>.<name>'."""
    return name.split(".", 3)[3]


@pytest.mark.parametrize("name", list(CASES))
def test_layers_give_the_module_output_bitwise(name: str) -> None:
    model, layers = converted(name)
    model.eval()
    layers.eval()
    value = CASES[name].inputs
    with torch.no_grad():
        expected = _call(model, value)
        for layer in layers:
            value = layer(value)
    assert type(value) is type(expected)
    for got, want in zip(torch.utils._pytree.tree_leaves(value), torch.utils._pytree.tree_leaves(expected)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(CASES))
def test_one_layer_per_block_and_the_original_names(name: str) -> None:
    model, layers = converted(name)
    blocks = repeated_blocks(model)
    assert len(layers) == len(blocks) + 2  # the code before the first block, and after the last
    names = {n for layer in layers for n in layer.state_dict()}
    assert names <= set(model.state_dict())
    aliases: dict[int, set[str]] = {}  # a shared parameter has several names (T5's embeddings)
    for n, t in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(t), set()).add(n)
    assert all(names & group for group in aliases.values())
    for block in blocks:  # the block's parameters sit in one layer, under their own names
        holders = [i for i, layer in enumerate(layers) if any(n.startswith(block + ".") for n in layer.state_dict())]
        assert len(holders) == 1


def _pipeline_grads(name: str, k: int, schedule: str, checkpoint: str) -> dict[str, Tensor]:
    case = CASES[name]
    _, layers = converted(name)
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    pipe = gpipe.Pipeline(
        layers, even(len(layers), k * virtual), chunks=4, loss_fn=case.loss, schedule=schedule,
        checkpoint=checkpoint, devices=["cpu"] * k, virtual=virtual, cpu_threads=1,
    )  # fmt: skip
    pipe.step(case.inputs, case.target)
    return {qualified(n): p.grad for n, p in pipe.named_parameters() if p.grad is not None}


_PLAIN: dict[str, tuple[nn.Module, dict[str, Tensor]]] = {}


def plain_reference(name: str) -> tuple[nn.Module, dict[str, Tensor]]:
    """A fresh plain model and its gradients on the pipeline's 4 micro-batches, computed once per
    model (every case of the matrix compares with them; the tests only read them)."""
    if name not in _PLAIN:
        model, _ = converted(name)
        with intra_op_threads(1):  # as the pipeline's workers: ResNet's batch norm on micro-batches of 2
            _PLAIN[name] = model, plain_grads(name, model, 4)  # magnifies what another summation order changes
    return _PLAIN[name]


# With one worker every schedule but the interleaved one runs the same actions: K=1 runs those
# two schedules (every schedule for GPT-2).
MATRIX = [
    (name, k, schedule, checkpoint)
    for name in CASES
    for k in (1, 2, 4)
    for schedule in SCHEDULES
    for checkpoint in ("never", "always")
    if k > 1 or name == "gpt2" or schedule in ("gpipe", "interleaved-1f1b")
]


@pytest.mark.parametrize(("name", "k", "schedule", "checkpoint"), MATRIX)
def test_gradients_are_the_plain_models(name: str, k: int, schedule: str, checkpoint: str) -> None:
    got = _pipeline_grads(name, k, schedule, checkpoint)
    model, want = plain_reference(name)
    for n, g in got.items():
        assert_close_norm(g, want[n], 1e-4, atol=1e-7, msg=n)
    trained = {id(model.get_parameter(n)) for n in got}
    assert all(id(p) in trained for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "vit"])
def test_dropout_is_bitwise_the_same_for_every_partition_count(name: str) -> None:
    case = CASES[name]
    results = []
    for k in (1, 2, 4):
        _, layers = converted(name, dropout=0.2)
        pipe = gpipe.Pipeline(
            layers, even(len(layers), k), chunks=4, loss_fn=case.loss, devices=["cpu"] * k, cpu_threads=1
        )
        torch.manual_seed(11)
        with intra_op_threads(1):
            loss = pipe.step(case.inputs, case.target)
        results.append((loss, {qualified(n): p.grad for n, p in pipe.named_parameters() if p.grad is not None}))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        for n, g in grads.items():
            assert torch.equal(g, results[0][1][n]), n
    # and the dropout is real: another step seed draws other masks
    _, layers = converted(name, dropout=0.2)
    pipe = gpipe.Pipeline(layers, even(len(layers), 2), chunks=4, loss_fn=case.loss, devices=["cpu"] * 2)
    torch.manual_seed(12)
    pipe.step(case.inputs, case.target)
    other = {qualified(n): p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    assert any(not torch.equal(g, results[0][1][n]) for n, g in other.items())


def test_tied_embedding_and_head_stay_identical_over_training() -> None:
    case = CASES["gpt2"]
    _, layers = converted("gpt2")
    pipe = gpipe.Pipeline(layers, even(len(layers), 2), chunks=4, loss_fn=case.loss, devices=["cpu"] * 2)
    head = pipe.partitions["1"][-1].get_parameter("lm_head.weight")
    embedding = pipe.partitions["0"][0].get_parameter("transformer.wte.weight")
    assert head is not embedding  # a copy on each stage ...
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        pipe.step(case.inputs, case.target)
        optimizer.step()
    assert torch.equal(head, embedding)  # ... kept identical
    assert not torch.equal(embedding, converted("gpt2")[0].get_parameter("transformer.wte.weight"))


def test_any_module_goes_straight_into_the_front_ends() -> None:
    case = CASES["bert"]
    model = bert(0.0)
    plain = copy.deepcopy(model)
    pipe = gpipe.Pipeline(model, "auto", chunks=2, loss_fn=case.loss, devices=["cpu"] * 2, sample=case.inputs)
    loss = pipe.step(case.inputs, case.target)
    want = plain_grads("bert", plain, 2)
    assert_close_norm(loss, case.loss(_call(plain, case.inputs), case.target).detach(), 1e-5)
    for n, p in pipe.named_parameters():
        assert_close_norm(p.grad, want[qualified(n)], 1e-4, atol=1e-7, msg=n)
    pipe.eval()
    plain.eval()
    out = pipe(case.inputs)  # the gathered ModelOutput
    assert type(out).__name__ == "SequenceClassifierOutput"
    assert_close_norm(out.logits, _call(plain, case.inputs).logits.detach(), 1e-5)


def test_gpipe_front_end_ties_and_trains_any_module() -> None:
    case = CASES["gpt2"]
    model = gpt2(0.0)
    plain = copy.deepcopy(model)
    net = gpipe.GPipe(model, [4, 4], devices=["cpu", "cpu"], chunks=4, sample=case.inputs)
    case.loss(net(case.inputs), case.target).backward()
    want = plain_grads("gpt2", plain, 4)
    head = net.partitions[1][-1].get_parameter("lm_head.weight")
    embedding = net.partitions[0][0].get_parameter("transformer.wte.weight")
    assert head is not embedding
    assert torch.equal(head.grad, embedding.grad)
    assert_close_norm(embedding.grad, want["transformer.wte.weight"], 1e-4)


def test_batch_norm_outside_the_blocks_follows_the_mode() -> None:
    """ResNet's stem batch norm is traced in training mode, but runs as the module itself."""
    model, layers = converted("resnet50")
    images = CASES["resnet50"].inputs
    layers.train()
    model.train()
    value: Any = images
    for layer in layers:
        value = layer(value)
    expected = model(images)
    torch.testing.assert_close(value, expected)
    assert torch.equal(layers[0].get_buffer("bn1.running_mean"), model.bn1.running_mean)
    assert int(layers[0].get_buffer("bn1.num_batches_tracked")) == 1


def test_the_first_layer_checks_its_input() -> None:
    _, layers = converted("bert")
    with pytest.raises(TypeError, match="structured as the example"):
        layers[0]({"input_ids": _ids(2, 12, 0)})
    with pytest.raises(ValueError, match="does not cover"):
        layers[0](_padded() | {"token_type_ids": torch.zeros(8, 12, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="sizes named alike must agree"):  # a mask as long as the ids
        layers[0](_padded() | {"attention_mask": torch.ones(8, 11, dtype=torch.long)})
    layers[0](_padded() | {"input_ids": _ids(8, 12, 9)})  # other values: fine


def test_untraceable_module_is_named_with_the_way_out() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x: Tensor) -> Tensor:
            if x.sum() > 0:  # a branch on a value: nothing to trace
                x = x * 2
            for block in self.blocks:
                x = block(x)
            return x

    with pytest.raises(ToSequentialError, match=r"could not trace Branchy.*split_points.*nn.Sequential"):
        to_sequential(Branchy(), torch.randn(3, 4))


def test_split_points_choose_the_cuts() -> None:
    model = gpt2(0.0)
    layers = to_sequential(model, _ids(2, 8, 0), split_points=["transformer.h.2", "transformer.ln_f"])
    assert len(layers) == 3  # before h.2; h.2 up to ln_f; ln_f and the head
    assert any(n.startswith("transformer.h.1.") for n in layers[0].state_dict())
    with pytest.raises(ValueError, match="not a submodule"):
        to_sequential(gpt2(0.0), _ids(2, 8, 0), split_points=["transformer.h.9"])
    with pytest.raises(ValueError, match="nested"):
        to_sequential(gpt2(0.0), _ids(2, 8, 0), split_points=["transformer.h", "transformer.h.1"])


def test_a_sequential_is_taken_as_it_is() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    assert to_sequential(model, torch.randn(1, 2)) is model


# a case of the session's pool (tests/dist_harness.py: a few launches in all)
ACROSS = POOL.add(2, "sequential gpt2", "gpt2_steps")


def test_gpt2_under_torchrun_equals_one_process(pool: Pool) -> None:
    ranks = pool(ACROSS)
    alone = dist_cases.gpt2_steps(world=2)
    for r in ranks:
        for got, want in zip(r["losses"], alone["losses"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    embedding, head = ranks[0]["tied"]["transformer.wte.weight"], ranks[1]["tied"]["lm_head.weight"]
    assert torch.equal(embedding, head)  # the copies on the two ranks, after three Adam steps
    torch.testing.assert_close(embedding, alone["tied"]["transformer.wte.weight"], rtol=1e-5, atol=1e-6)


def test_a_model_on_the_meta_device_is_initialized_by_its_own_init_whatever_k() -> None:
    """GPT-2 built on the meta device: each stage materializes its layers with the model's own
    ``_init_weights`` (its scaled residual projections included), seeded by layer."""
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    ids = _ids(8, 12, 1)
    weights = []
    for k in (1, 2, 3):
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config)
        pipe = gpipe.Pipeline(model, even(6, k), chunks=2, loss_fn=_token_loss, sample=ids, devices=["cpu"] * k)
        weights.append({qualified(n): p.detach() for n, p in pipe.named_parameters()})
    first = weights[0]
    assert not any(p.is_meta for p in first.values())
    for other in weights[1:]:
        assert other.keys() == first.keys()
        for n, p in other.items():
            assert torch.equal(p, first[n]), n
    std = config.initializer_range
    assert abs(float(first["transformer.wte.weight"].std()) - std) < 0.1 * std
    residual = std / (2 * config.n_layer) ** 0.5  # GPT-2's scaled init of c_proj
    assert abs(float(first["transformer.h.1.mlp.c_proj.weight"].std()) - residual) < 0.1 * residual
    assert torch.equal(first["transformer.ln_f.weight"], torch.ones(32))
    assert torch.equal(first["lm_head.weight"], first["transformer.wte.weight"])


def test_init_fn_initializes_meta_layers_without_reset_parameters() -> None:
    class Scale(nn.Module):  # no reset_parameters
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4))

        def forward(self, x: Tensor) -> Tensor:
            return x * self.weight

    with torch.device("meta"):
        model = nn.Sequential(Scale(), Scale())
    with pytest.raises(TypeError, match="init_fn"):
        gpipe.Pipeline(copy.deepcopy(model), [1, 1], chunks=1, loss_fn=F.mse_loss, devices=["cpu"] * 2)

    def init(layer: nn.Module) -> None:
        nn.init.normal_(layer.weight)

    pipe = gpipe.Pipeline(model, [1, 1], chunks=1, loss_fn=F.mse_loss, devices=["cpu"] * 2, init_fn=init)
    a, b = (p for _, p in pipe.named_parameters())
    assert not a.is_meta and not torch.equal(a, b)  # seeded per layer


class _Halves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        return self.lin(x).reshape(b, n // 2, 2, c).reshape(b, n // 2 * 2, c)


class _SizesShared(nn.Module):
    """The code after the blocks reads ``n // 2`` as the blocks do: export computes it once, inside
    a block's call (as Swin's window counts), and the cut must compute it again outside."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Halves(), _Halves()])
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        b, n, c = x.shape
        return self.head(x.reshape(b, n // 2, 2, c).mean(2))


def test_sizes_computed_inside_a_block_are_computed_again_after_it() -> None:
    model = _SizesShared().eval()
    layers = to_sequential(model, torch.randn(3, 6, 4)).eval()
    for x in (torch.randn(3, 6, 4), torch.randn(5, 8, 4)):  # other sizes than traced
        value: Any = x
        for layer in layers:
            value = layer(value)
        assert torch.equal(value, model(x))


class _Depth(nn.Module):
    """Stochastic depth as torchvision writes it: random only in training, decided in Python."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        keep = torch.empty(x.shape[0], 1, device=x.device).bernoulli_(0.5)
        return x * keep / 0.5


class _Glued(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.depth = _Depth()
        self.drop = nn.Dropout(0.5, inplace=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = self.depth(block(x))
        return self.head(self.drop(x))


def test_mode_dependent_modules_in_the_glue_follow_the_mode() -> None:
    """Traced in training mode, an in-place dropout and a module drawing random numbers between the
    blocks still do nothing in eval mode, and draw in training."""
    model = _Glued()
    layers = to_sequential(model, torch.randn(8, 4))
    x = torch.randn(8, 4)
    layers.eval()
    model.eval()
    value: Any = x.clone()
    for layer in layers:
        value = layer(value)
    assert torch.equal(value, model(x))
    layers.train()
    torch.manual_seed(0)
    trained: Any = x.clone()
    for layer in layers:
        trained = layer(trained)
    assert not torch.equal(trained, value)
