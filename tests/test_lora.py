"""LoRA adapters with peft (gpipe.models.lora): added to a transformers model on the meta device before
it is traced, materialized by the pipeline with peft's initialization, trained through the schedules with
the base weights frozen (the gradients of a plain, unpipelined run), generating with caches in the stages,
and written back as peft writes them: an adapter folder PeftModel loads, or the merged model."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

from gpipe import Pipeline, to_sequential
from gpipe.saving import save

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

from gpipe.models import hf, lora  # noqa: E402  (after the skips: it needs transformers)

LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 64, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
# A model and its adapters: GPT-2's fused attention (Conv1D, fan_in_fan_out), a Llama's projections
# and its LM head (traced between the blocks: its adapters are initialized by name).
CASES: dict[str, tuple[Callable[[], Any], list[str]]] = {
    "llama": (lambda: transformers.LlamaConfig(**LLAMA), ["q_proj", "v_proj", "o_proj", "lm_head"]),
    "gpt2": (lambda: transformers.GPT2Config(**GPT2), []),  # peft's default: c_attn
}

TIED = {"transformer.wte.weight", "lm_head.weight"}  # GPT-2's, held by the first and last layers

torch.manual_seed(0)
X = torch.randint(3, 64, (4, 8))
Y = torch.randint(3, 64, (4, 8))


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.flatten(0, 1), target.flatten())


LOSS = functools.partial(hf.logits_loss, _ce)


@pytest.fixture(scope="module", params=sorted(CASES))
def traced(request: pytest.FixtureRequest) -> tuple[Any, Any, nn.Sequential]:
    """(the model's config, the adapters' LoraConfig, the pipeline layers with adapters on the meta
    device): traced once, deep-copied by every pipeline."""
    make, given = CASES[request.param]
    config = make()
    model = hf.build(config)
    lora_config = lora.add_adapters(model, rank=4, targets=lora.targets_for(config, given, model=model), alpha=8)
    layers = hf.pipeline_layers(model, X[:2])
    assert not hasattr(layers, "cannot_generate")  # cached_layers traced it, with the adapters
    lora.with_adapter_init(layers)
    return config, lora_config, layers


def _copy(layers: nn.Sequential) -> nn.Sequential:
    """A deep copy of traced layers: the initialization each brings (``gpipe_init``: the adapters'
    after the model's) comes along (gpipe.sequential.layers.bring_init)."""
    copied = copy.deepcopy(layers)
    for layer, original in zip(copied, layers, strict=True):
        assert isinstance(layer.__dict__["gpipe_init"].value, type(original.__dict__["gpipe_init"].value))
    return copied


def _steps(pipe: Pipeline, steps: int, *, lr: float) -> tuple[torch.optim.Optimizer, list[float]]:
    """``steps`` steps of Adam over the trainable parameters (the adapters); the optimizer and the losses."""
    optimizer = torch.optim.Adam([p for p in pipe.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(float(pipe.step(X, Y)))
        optimizer.step()
    return optimizer, losses


def _pipe(layers: nn.Sequential, schedule: str = "1f1b", balance: list[int] | None = None) -> Pipeline:
    virtual = 2 if schedule == "zb-v" else 1  # (two stages per worker)
    return Pipeline(_copy(layers), balance or [2, 2], devices=["cpu"] * 2, chunks=2, loss_fn=LOSS,
                    schedule=schedule, virtual=virtual)  # fmt: skip


def _named(pipe: Pipeline) -> dict[str, nn.Parameter]:
    """The pipeline's parameters by their qualified names in the model (``partitions.S.L.`` dropped)."""
    return {n.split(".", 3)[3]: p for n, p in pipe.named_parameters()}


def _plain(config: Any, lora_config: Any, weights: dict[str, torch.Tensor]) -> nn.Module:
    """The unpipelined model with the same adapters (peft on a real model) and ``weights``."""
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    peft.inject_adapter_in_model(copy.deepcopy(lora_config), model)
    _load(model, weights)
    return model


def _load(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    own = dict(model.named_parameters())
    assert set(own) <= set(weights), sorted(set(own) - set(weights))
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(weights[name])


def _base_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's weights among those of a model with adapters."""
    return {n.replace(".base_layer.", "."): t for n, t in weights.items() if not lora._is_lora(n)}


def test_adapters_are_on_the_meta_device_and_only_they_train(traced: tuple[Any, Any, nn.Sequential]) -> None:
    _, lora_config, layers = traced
    params = {n: p for layer in layers for n, p in layer.named_parameters()}
    adapters = {n for n in params if ".lora_A.default." in n or ".lora_B.default." in n}
    assert adapters and all(p.is_meta for p in params.values())
    assert {n for n, p in params.items() if p.requires_grad} == adapters
    assert lora_config.r == 4 and lora_config.lora_alpha == 8


def test_the_pipeline_materializes_peft_init_and_starts_as_the_base_model(
    traced: tuple[Any, Any, nn.Sequential],
) -> None:
    config, _, layers = traced
    pipe = _pipe(layers)
    weights = _named(pipe)
    for name, p in weights.items():
        assert not torch.isnan(p).any(), name
        if ".lora_B." in name:
            assert not p.any(), name  # peft: B zero
        elif ".lora_A." in name:  # peft: kaiming_uniform_(a=sqrt(5)), bound 1 / sqrt(fan_in)
            assert p.any() and p.abs().max() <= 1 / p.shape[1] ** 0.5, name
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _load(base, _base_weights({n: p.detach() for n, p in weights.items()}))
    with torch.no_grad():
        torch.testing.assert_close(pipe(X).logits, base(X).logits, rtol=0, atol=1e-5)
    again = _named(_pipe(layers))  # seeded per layer: the same weights every time
    assert all(torch.equal(again[n], p) for n, p in weights.items())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_gradients_are_those_of_the_plain_model(traced: tuple[Any, Any, nn.Sequential], schedule: str) -> None:
    config, lora_config, layers = traced
    pipe = _pipe(layers, schedule, balance=[1, 3])  # (stage 0, the embeddings, has nothing to train)
    weights = _named(pipe)
    with torch.no_grad():  # B nonzero, or A's gradients would be zero
        for name, p in weights.items():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    plain = _plain(config, lora_config, {n: p.detach() for n, p in weights.items()})
    loss = pipe.step(X, Y)
    expected = _ce(plain(X).logits, Y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for name, p in weights.items():
        if lora._is_lora(name):
            assert p.grad is not None and grads[name] is not None, name
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-5)
        else:
            assert p.grad is None and grads.get(name) is None, name  # (the plain model lists a tied one once)


def test_a_frozen_tied_weight_gets_no_gradient() -> None:
    model = hf.build(transformers.GPT2Config(**GPT2))  # the LM head's weight is the token embedding's
    lora.add_adapters(model, rank=2, targets=["c_attn"])
    pipe = Pipeline(hf.pipeline_layers(model, X[:2]), [1, 3], devices=["cpu"] * 2, chunks=2, loss_fn=LOSS)
    pipe.step(X, Y)
    assert [n for n, p in _named(pipe).items() if n in TIED and p.grad is not None] == []


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
def test_steps_change_the_adapters_only(traced: tuple[Any, Any, nn.Sequential], schedule: str) -> None:
    _, _, layers = traced
    balance = [1, 1, 1, 1] if schedule == "zb-v" else [2, 2]
    pipe = _pipe(layers, schedule, balance)
    before = {n: p.detach().clone() for n, p in _named(pipe).items()}
    _, losses = _steps(pipe, 3, lr=1e-2)
    assert losses[-1] < losses[0]
    for name, p in _named(pipe).items():
        assert torch.equal(p, before[name]) != lora._is_lora(name), name


def test_the_trained_pipeline_generates_as_the_plain_model(traced: tuple[Any, Any, nn.Sequential]) -> None:
    config, lora_config, layers = traced
    pipe = _pipe(layers)
    _steps(pipe, 3, lr=5e-2)
    plain = _plain(config, lora_config, {n: p.detach() for n, p in _named(pipe).items()}).eval()
    pipe.eval()
    ends = {"eos_token_id": 2, "pad_token_id": 0}
    tokens = pipe.generate(X[:2, :4], max_new_tokens=6, **ends)  # (keys and values cached in the stages)
    assert torch.equal(tokens, plain.generate(X[:2, :4], max_new_tokens=6, do_sample=False, **ends))


def test_to_sequential_traces_a_model_with_adapters() -> None:
    config = transformers.LlamaConfig(**LLAMA)
    model = hf.build(config)
    lora.add_adapters(model, rank=2, targets=["q_proj", "v_proj"])
    layers = to_sequential(model, X[:2])
    params = {n: p for layer in layers for n, p in layer.named_parameters()}
    assert {n for n, p in params.items() if p.requires_grad} == {n for n in params if lora._is_lora(n)}
    assert "model.layers.1.self_attn.v_proj.lora_A.default.weight" in params


def _trained(traced: tuple[Any, Any, nn.Sequential], folder: Path) -> tuple[Pipeline, Path]:
    """A pipeline trained two steps, saved as step 2 into ``folder`` / "ckpt"; and a folder of its
    base model, as save_pretrained writes it."""
    config, _, layers = traced
    pipe = _pipe(layers)
    optimizer, _ = _steps(pipe, 2, lr=1e-2)
    save(pipe, folder / "ckpt", 2, optimizer=optimizer)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _load(base, _base_weights({n: p.detach() for n, p in _named(pipe).items()}))
    base.save_pretrained(folder / "base")
    return pipe, folder / "base"


def test_the_adapter_loads_in_peft_with_the_pipelines_logits(
    traced: tuple[Any, Any, nn.Sequential], tmp_path: Path
) -> None:
    config, lora_config, _ = traced
    pipe, base = _trained(traced, tmp_path)
    said = lora.write_adapter(config, lora_config, tmp_path / "ckpt", tmp_path / "adapter", merge=False, base=str(base))
    assert "step 2" in said and "\n" not in said
    written = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert written == {"adapter_config.json", "adapter_model.safetensors", "README.md"}  # (peft's model card)
    held = safetensors_torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert held and all(".lora_A." in k or ".lora_B." in k for k in held)  # the adapters alone, no base weight
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        base
    )
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    )
    result = model.load_adapter(tmp_path / "adapter", adapter_name="again")
    assert not [k for k in result.missing_keys if ".again." in k] and not result.unexpected_keys
    pipe.eval()
    model.eval()
    with torch.no_grad():
        expected = pipe(X).logits
        torch.testing.assert_close(model(X).logits, expected, rtol=1e-5, atol=1e-5)
        with model.disable_adapter():  # trained: not the base model's any more
            assert not torch.allclose(model(X).logits, expected, atol=1e-3)


def test_the_merged_model_loads_in_transformers_with_the_pipelines_logits(
    traced: tuple[Any, Any, nn.Sequential], tmp_path: Path
) -> None:
    config, lora_config, _ = traced
    pipe, base = _trained(traced, tmp_path)
    lora.write_adapter(config, lora_config, tmp_path / "ckpt", tmp_path / "merged", merge=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    plain = transformers.AutoModelForCausalLM.from_pretrained(base)
    assert set(model.state_dict()) == set(plain.state_dict())  # no adapter left, nothing missing
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(X).logits, pipe(X).logits, rtol=1e-5, atol=1e-5)


def test_write_adapter_refuses_a_folder_that_holds_something(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        lora.write_adapter(None, None, tmp_path, tmp_path / "out", merge=False)  # type: ignore[arg-type]


def test_lora_json_round_trips(tmp_path: Path) -> None:
    written = peft.LoraConfig(r=16, lora_alpha=32.0, lora_dropout=0.05, target_modules=["v_proj", "q_proj"])
    (tmp_path / lora.LORA).write_text(lora.lora_json(written))
    read = lora.read_lora(tmp_path)  # the folder, or the file
    assert lora.lora_json(lora.read_lora(tmp_path / lora.LORA)) == lora.lora_json(written)
    assert (read.r, read.lora_alpha, read.lora_dropout, read.fan_in_fan_out) == (16, 32.0, 0.05, False)
    assert set(read.target_modules) == {"q_proj", "v_proj"}
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    conv1d = lora.add_adapters(gpt2, rank=2, targets=["c_attn"], dropout=0.1)
    (tmp_path / "gpt2.json").write_text(lora.lora_json(conv1d))
    assert lora.read_lora(tmp_path / "gpt2.json").fan_in_fan_out is True
    (tmp_path / "bad.json").write_text('{"rank": 0}')
    with pytest.raises(ValueError, match=r"bad\.json"):
        lora.read_lora(tmp_path / "bad.json")


def test_defaults_come_from_peft() -> None:
    assert lora.DEFAULT_TARGETS["gpt2"] == ["c_attn"]
    assert lora.targets_for(transformers.LlamaConfig(**LLAMA), []) == lora.DEFAULT_TARGETS["llama"]
    assert lora.targets_for(transformers.LlamaConfig(**LLAMA), ["k_proj"]) == ["k_proj"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0, "targets": ["q_proj"]}, "rank 0 must be a positive integer"),
        ({"rank": -2, "targets": ["q_proj"]}, "rank -2 must be a positive integer"),
        ({"rank": 2, "targets": ["q_prj"]}, "LoRA target 'q_prj' names no module of the LlamaForCausalLM; its linear"),
        ({"rank": 2, "targets": ["embed_tokens"]}, "'model.embed_tokens', of type Embedding, which is not a linear"),
        ({"rank": 2, "targets": []}, "give a list of module names"),
        ({"rank": 2, "targets": ["q_proj"], "alpha": 0}, "alpha 0 must be a positive number"),
        ({"rank": 2, "targets": ["q_proj"], "dropout": 1.0}, r"dropout 1.0 must be in \[0, 1\)"),
    ],
)
def test_add_adapters_refuses(kwargs: dict[str, Any], message: str) -> None:
    model = hf.build(transformers.LlamaConfig(**LLAMA))
    with pytest.raises(ValueError, match=message):
        lora.add_adapters(model, **kwargs)
    assert all(p.requires_grad for p in model.parameters())  # left as it was


def test_other_refusals() -> None:
    with pytest.raises(ValueError, match="model_type 'phi3' has no default LoRA targets; name the linear layers"):
        lora.targets_for(transformers.Phi3Config(), [])
    with pytest.raises(ValueError, match="LoRA target 'nope' names no module"):
        lora.targets_for(transformers.LlamaConfig(**LLAMA), ["nope"])
    gpt2 = hf.build(transformers.GPT2Config(**GPT2))
    with pytest.raises(ValueError, match=r"mix GPT-2's Conv1D layers and nn\.Linear ones"):
        lora.add_adapters(gpt2, rank=2, targets=["c_attn", "lm_head"])
    lora.add_adapters(gpt2, rank=2, targets=["c_attn"])
    with pytest.raises(ValueError, match="has LoRA adapters already"):
        lora.add_adapters(gpt2, rank=2, targets=["c_proj"])


def test_with_adapter_init_wraps_once_and_runs_after_the_layers_own() -> None:
    model = hf.build(transformers.LlamaConfig(**LLAMA))
    lora.add_adapters(model, rank=2, targets=["q_proj"])
    layers = hf.pipeline_layers(model, X[:2])
    own = layers[1].__dict__["gpipe_init"].value
    lora.with_adapter_init(layers)
    lora.with_adapter_init(layers)
    wrapper = layers[1].__dict__["gpipe_init"].value
    assert wrapper.init is own and "gpipe_init" not in dict(layers[1].named_children())
    layer = _copy(layers)[1].to_empty(device="cpu")
    wrapper(layer)  # HF's _init_weights would leave B normal(0, 0.02); peft's init makes it zero
    assert not layer.get_submodule("model.layers.0.self_attn.q_proj.lora_B.default").weight.any()
