"""``gpipe.to_sequential`` on the Hugging Face models that broke it (issue 24, items 1-4), each from a
tiny config with random weights.

- Values the blocks compute for the code after them travel as the blocks' extra outputs: Mixtral's
  and Qwen3-MoE's router logits for the load-balancing loss, Llama's ``output_hidden_states`` and
  ``output_attentions``. The loss is a sum over micro-batches of each micro-batch's loss, so the
  auxiliary loss of a pipelined step is each micro-batch's own (the balance of the experts over its
  tokens), as in gradient accumulation: "exact" means equal to the plain model run on the same
  micro-batches and accumulated the same way, which is what these tests compare, loss and every
  gradient, for K = 1 and 2.
- A size the model's code fixes (CLIP's loss: ``arange(len(logits))``) is checked by the first
  layer, which says to trace on a micro-batch; the front ends do so.
- Settings in the input dict (CLIP's ``return_loss=True``) are accepted with their traced values.
- Sizes passed to a block (BEiT's ``resolution=pixel_values.shape[2:]``) are fixed at tracing and
  checked; BEiT's layers match its output bitwise on the path its code takes under torch.export.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import gpipe
from gpipe.sequential import ToSequentialError, to_sequential
from tests.helpers import assert_close_norm, intra_op_threads

transformers = pytest.importorskip("transformers")

VOCAB = 97
TINY = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}


def _ids(rows: int, cols: int, seed: int) -> Tensor:
    return torch.randint(1, VOCAB, (rows, cols), generator=torch.Generator().manual_seed(seed))


def mixtral() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        **TINY, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def qwen3_moe() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        **TINY, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=True, router_aux_loss_coef=0.5,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **TINY, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, attn_implementation="eager"
    )
    return transformers.LlamaForCausalLM(config)


def clip() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config={**TINY, "vocab_size": VOCAB, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1},
        vision_config={**TINY, "image_size": 16, "patch_size": 8},
        projection_dim=16,
    )
    return transformers.CLIPModel(config)


def beit() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BeitConfig(
        **TINY, image_size=16, patch_size=4, num_labels=3, use_relative_position_bias=True, drop_path_rate=0.0
    )
    model = transformers.BeitForImageClassification(config)
    with torch.no_grad():  # (zeros by default: a bias that changes nothing would hide a wrong one)
        for layer in model.beit.layers:
            layer.relative_position_bias.relative_position_bias_table.normal_()
    return model


def _run(layers: nn.Sequential, value: Any) -> Any:
    for layer in layers:
        value = layer(value)
    return value


def _assert_equal_outputs(got: Any, want: Any) -> None:
    assert list(got.keys()) == list(want.keys())
    for key in want:
        a, b = pytree.tree_leaves(got[key]), pytree.tree_leaves(want[key])
        assert len(a) == len(b), key
        assert all(torch.equal(x, y) for x, y in zip(a, b)), key


_TRACED: dict[str, tuple[nn.Module, nn.Sequential]] = {}


def traced(name: str, build: Callable[[], nn.Module], **example: Any) -> tuple[nn.Module, nn.Sequential]:
    """A fresh plain model and its layers (traced once per model; copies handed out)."""
    if name not in _TRACED:
        model = build()
        plain = copy.deepcopy(model)
        _TRACED[name] = (plain, to_sequential(model, **example))
    plain, layers = _TRACED[name]
    return copy.deepcopy(plain), copy.deepcopy(layers)


# -- item 2: values the blocks compute for the code after them --------------------------------------
MOE = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}
TOKENS = {"input_ids": _ids(8, 6, 1), "labels": _ids(8, 6, 2)}


def _moe(name: str) -> tuple[nn.Module, nn.Sequential]:
    return traced(name, MOE[name], **TOKENS)


@pytest.mark.parametrize("name", list(MOE))
def test_moe_layers_give_the_router_logits_and_aux_loss_bitwise(name: str) -> None:
    model, layers = _moe(name)
    model.eval()
    layers.eval()
    with torch.no_grad():
        got, want = _run(layers, TOKENS), model(**TOKENS, use_cache=False)
    assert len(want.router_logits) == 2 and want.aux_loss is not None
    _assert_equal_outputs(got, want)


def _plain_step(model: nn.Module, inputs: dict[str, Tensor], chunks: int, loss: Callable[[Any], Tensor]) -> Tensor:
    """The plain model on the pipeline's micro-batches, each loss weighted by its share, accumulated."""
    total = torch.zeros(())
    rows = len(next(iter(inputs.values())))
    settings = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    for part in gpipe.microbatch.scatter(inputs, chunks):
        value = loss(model(**part.value, **settings)) * (gpipe.microbatch.batch_size(part) / rows)
        value.backward()
        total += value.detach()
    return total


def _compare(
    model: nn.Module, layers: nn.Sequential, k: int, checkpoint: str, inputs: Any, loss: Callable[[Any], Tensor]
) -> None:
    pipe = gpipe.Pipeline(
        layers, [2, len(layers) - 2] if k == 2 else [len(layers)], chunks=4, loss_fn=lambda out, _: loss(out),
        devices=["cpu"] * k, checkpoint=checkpoint, cpu_threads=1,
    )  # fmt: skip
    got = pipe.step(inputs, inputs["input_ids"])
    with intra_op_threads(1):
        want = _plain_step(model, inputs, 4, loss)
    assert_close_norm(got, want, 1e-6)
    grads = {n.split(".", 3)[3]: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    for n, g in expected.items():
        assert_close_norm(grads[n], g, 1e-5, atol=1e-8, msg=n)


@pytest.mark.parametrize(
    ("name", "k", "checkpoint"), [(n, k, c) for n in MOE for k, c in ((1, "never"), (2, "always"))]
)
def test_moe_training_with_the_load_balancing_loss_is_the_plain_models(name: str, k: int, checkpoint: str) -> None:
    """The model's own loss (token cross-entropy + coef x the load-balancing loss), per micro-batch."""
    model, layers = _moe(name)
    _compare(model, layers, k, checkpoint, TOKENS, lambda out: out.loss)


@pytest.mark.parametrize("name", list(MOE))
def test_the_load_balancing_loss_alone_trains_the_routers_exactly(name: str) -> None:
    """Only the auxiliary loss: its gradient reaches the routers (and what feeds them) through the
    router logits the blocks hand on, equal to the plain model's on the same micro-batches."""
    model, layers = _moe(name)
    _compare(model, layers, 2, "never", TOKENS, lambda out: out.aux_loss)
    routers = [n for n, p in model.named_parameters() if p.grad is not None and ".gate." in n]
    assert len(routers) == 2


def test_hidden_states_and_attentions_travel_to_the_output() -> None:
    """``output_hidden_states`` (collected from the blocks' inputs and outputs) and
    ``output_attentions`` (from the attention modules inside the blocks), passed through the
    forward's ``**kwargs``: the output bitwise, and gradients through them."""
    settings = {"output_hidden_states": True, "output_attentions": True}
    model, layers = traced("llama", llama, **TOKENS, **settings)
    model.eval()
    layers.eval()
    with torch.no_grad():
        got, want = _run(layers, TOKENS), model(**TOKENS, **settings, use_cache=False)
    assert len(want.hidden_states) == 3 and len(want.attentions) == 2
    _assert_equal_outputs(got, want)
    model.train()
    layers.train()

    def loss(out: Any) -> Tensor:
        return out.loss + out.hidden_states[1].square().mean() + out.attentions[0].amax(-1).mean()

    _compare(model, layers, 2, "never", TOKENS | settings, loss)  # (the settings may come along)


class _Notes:
    """What the model notes while it runs (a plain object: export checks modules' tensor attributes)."""

    def __init__(self) -> None:
        self.routed: list[Tensor] = []
        self.scratch: list[Tensor] = []


class _Expert(nn.Module):
    """A block whose router's logits the model collects by a forward hook, as Hugging Face does;
    the router runs in training only."""

    def __init__(self, notes: _Notes) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.lin = nn.Linear(4, 4)
        self.notes = notes

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            x = x + self.router(x).softmax(-1).sum(-1, keepdim=True)
        scratch = self.lin(x) * 3  # computed inside, returned by no module
        self.notes.scratch.append(scratch)
        return scratch.relu()


class _Collecting(nn.Module):
    def __init__(self, read_scratch: bool = False) -> None:
        super().__init__()
        self.notes = _Notes()
        self.blocks = nn.ModuleList([_Expert(self.notes), _Expert(self.notes)])
        self.read_scratch = read_scratch
        for block in self.blocks:
            block.router.register_forward_hook(lambda m, a, out: self.notes.routed.append(out))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        self.notes.routed.clear()
        self.notes.scratch.clear()
        for block in self.blocks:
            x = block(x)
        noted = self.notes.scratch if self.read_scratch else self.notes.routed
        return x, torch.stack([t.var() for t in noted]).sum()


def test_values_caught_inside_the_blocks_are_named_when_they_cannot_travel() -> None:
    model = _Collecting()
    layers = to_sequential(model, torch.randn(4, 4))
    x = torch.randn(6, 4)
    got, want = _run(layers, x), model(x)
    assert torch.equal(got[1], want[1])  # the routers' logits, caught in the blocks' calls
    layers.eval()  # the routers do not run: what the layers hand on is missing, and named
    with pytest.raises(RuntimeError, match=r"module 'router' did not return.*trace the model as it runs"):
        _run(layers, x)
    with pytest.raises(ToSequentialError, match=r"reads mul.*which neither blocks.0 nor any module inside it returns"):
        to_sequential(_Collecting(read_scratch=True), torch.randn(4, 4))


# -- items 1 and 4: a size the model's code fixes; settings in the input dict -----------------------
PAIRS = {
    "input_ids": _ids(4, 6, 3),
    "pixel_values": torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(4)),
    "return_loss": True,
}


def test_a_size_the_model_fixes_is_checked_by_the_first_layer() -> None:
    """CLIP's loss labels the pairs ``arange(len(logits))``: traced on 4 pairs, the layers compute a
    loss for 4. The first layer refuses a micro-batch of 2 (before: a crash in the last layer,
    "Expected input batch_size (2) to match target batch_size (4)") and says how to trace."""
    _, layers = traced("clip", clip, **PAIRS)
    micro = {k: v[:2] if isinstance(v, Tensor) else v for k, v in PAIRS.items()}
    with pytest.raises(ValueError, match=r"input\['input_ids'\].*fixed dim 0 at 4.*one micro-batch"):
        layers[0](micro)


def test_the_front_ends_trace_on_a_micro_batch() -> None:
    """``Pipeline`` and ``GPipe`` trace on the sample's first micro-batch: CLIP's per-micro-batch
    contrastive loss, as the plain model computes it on each micro-batch."""
    model = clip()
    plain = copy.deepcopy(model)
    pipe = gpipe.Pipeline(
        model, "auto", chunks=2, loss_fn=lambda out, _: out.loss, devices=["cpu"] * 2, cpu_threads=1, sample=PAIRS
    )
    loss = pipe.step(PAIRS, torch.zeros(4))
    with intra_op_threads(1):
        want = _plain_step(plain, PAIRS, 2, lambda out: out.loss)
    assert_close_norm(loss, want, 1e-6)
    for n, p in pipe.named_parameters():
        if p.grad is not None:
            assert_close_norm(p.grad, plain.get_parameter(n.split(".", 3)[3]).grad, 1e-5, atol=1e-8, msg=n)
    net = gpipe.GPipe(clip(), "auto", devices=["cpu"] * 2, chunks=2, sample=PAIRS)
    with torch.no_grad():
        losses = net(PAIRS).loss  # one per micro-batch
        plain_losses = [plain(**part.value).loss for part in gpipe.microbatch.scatter(PAIRS, 2)]
    torch.testing.assert_close(losses, torch.stack(plain_losses))


def test_settings_in_the_input_dict_are_accepted_with_their_traced_values() -> None:
    """``return_loss=True`` is in the dict CLIP was traced on: the first layer takes that dict (before:
    "structured as the example ... got ['input_ids', 'pixel_values', 'return_loss']"), and the dict
    without it; another value is refused, named."""
    model, layers = traced("clip", clip, **PAIRS)
    model.eval()
    layers.eval()
    tensors = {k: v for k, v in PAIRS.items() if isinstance(v, Tensor)}
    with torch.no_grad():
        want = model(**PAIRS)
        _assert_equal_outputs(_run(layers, PAIRS), want)
        _assert_equal_outputs(_run(layers, tensors), want)
    with pytest.raises(ValueError, match=r"'return_loss' is False, but the module was traced with return_loss=True"):
        layers[0](PAIRS | {"return_loss": False})
    with pytest.raises(TypeError, match=r"keys \['input_ids', 'pixel_values'\].*missing: \['pixel_values'\]"):
        layers[0]({"input_ids": PAIRS["input_ids"]})


# -- item 3: sizes passed to a block ----------------------------------------------------------------
IMAGES = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("split_points", [None, ["beit.layers.0.attention", "beit.layers.1.attention"]])
def test_sizes_passed_to_blocks_are_fixed_and_the_output_is_the_traced_paths(split_points: list[str] | None) -> None:
    """BEiT calls its blocks with ``resolution=pixel_values.shape[2:]``: traced (before, at the
    blocks: "Only Tensors or scalars are supported as pytree flattened inputs, got: s100").

    Not bitwise the eager model's output: under torch.export, transformers builds the all-True
    attention mask that eager mode skips (``torch.compiler.is_exporting()``), and BEiT adds it to
    its position bias: every attention logit moves by 1, which softmax cancels up to rounding. On
    that path — the eager model told it is exported — the layers give its output bitwise."""
    model = beit().eval()
    layers = to_sequential(copy.deepcopy(model), IMAGES, split_points=split_points).eval()
    with torch.no_grad():
        got = _run(layers, IMAGES).logits
        eager = model(IMAGES).logits
        with mock.patch.object(torch.compiler, "is_exporting", lambda: True):
            exported_path = model(IMAGES).logits
    assert torch.equal(got, exported_path)
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-6)
    if split_points is None:  # the size went to the blocks: fixed, and checked
        with pytest.raises(ValueError, match=r"fixed dim 2 at 16"):
            layers[0](torch.randn(4, 3, 24, 24))


def test_beit_trains_as_the_plain_model() -> None:
    model = beit()
    layers = to_sequential(copy.deepcopy(model), IMAGES)
    target = torch.arange(4) % 3
    pipe = gpipe.Pipeline(
        layers, [2, 2], chunks=2, devices=["cpu"] * 2, cpu_threads=1,
        loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out.logits, y),
    )  # fmt: skip
    pipe.step(IMAGES, target)
    with intra_op_threads(1), mock.patch.object(torch.compiler, "is_exporting", lambda: True):
        for images, y in zip(IMAGES.chunk(2), target.chunk(2)):
            (torch.nn.functional.cross_entropy(model(images).logits, y) / 2).backward()
    for n, p in pipe.named_parameters():
        assert_close_norm(p.grad, model.get_parameter(n.split(".", 3)[3]).grad, 1e-5, atol=1e-8, msg=n)


class _Sized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor, size: Any = None) -> Tensor:
        return self.lin(x)


class _PassesAnObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Sized(), _Sized()])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, size={"grid": [object()]})
        return x


def test_an_argument_export_cannot_keep_is_named() -> None:
    with pytest.raises(ToSequentialError, match=r"blocks.0 is called with size\['grid'\]\[0\] = object.*split_points"):
        to_sequential(_PassesAnObject(), torch.randn(3, 4))
