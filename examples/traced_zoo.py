"""Does ``gpipe.to_sequential`` take my model? A sweep over Hugging Face and torchvision models
built from small configs (random weights, nothing downloaded).

    .venv/bin/python examples/traced_zoo.py              # every model below
    .venv/bin/python examples/traced_zoo.py llama swin_t # some

For each: trace, check that the layers give the model's output bitwise (eval mode), then one training
step in a two-stage ``gpipe.Pipeline`` with two micro-batches. torchvision comes from ``.venv/vision``
(see tests/vision.py). Swin's trace takes long (torch.export on its dynamic window shapes).
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gpipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def zoo() -> dict[str, tuple[Callable[[], nn.Module], Any]]:
    import transformers as hf
    from tests import vision

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 90, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    small = {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    decoder = {"input_ids": ids, "attention_mask": mask}
    images = torch.randn(4, 3, 32, 32, generator=g)
    tv = vision.torchvision().models
    return {
        "llama": (lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**small, num_key_value_heads=2)), decoder),
        "qwen2": (lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**small, num_key_value_heads=2)), decoder),
        "mistral": (lambda: hf.MistralForCausalLM(hf.MistralConfig(**small, num_key_value_heads=2)), decoder),
        "gpt_neox": (lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**small)), decoder),
        "opt": (
            lambda: hf.OPTForCausalLM(
                hf.OPTConfig(
                    hidden_size=32,
                    num_attention_heads=4,
                    ffn_dim=64,
                    num_hidden_layers=2,
                    vocab_size=100,
                    word_embed_proj_dim=32,
                )
            ),
            decoder,
        ),
        "mixtral": (  # with its router logits, for the load-balancing loss after the blocks
            lambda: hf.MixtralForCausalLM(
                hf.MixtralConfig(**small, num_key_value_heads=2, num_local_experts=4, output_router_logits=True)
            ),
            decoder,
        ),
        "roberta": (lambda: hf.RobertaModel(hf.RobertaConfig(**small)), decoder),
        "distilbert": (
            lambda: hf.DistilBertModel(
                hf.DistilBertConfig(dim=32, n_heads=4, hidden_dim=64, n_layers=2, vocab_size=100)
            ),
            decoder,
        ),
        "bart": (
            lambda: hf.BartForConditionalGeneration(
                hf.BartConfig(
                    d_model=32,
                    encoder_layers=2,
                    decoder_layers=2,
                    encoder_attention_heads=4,
                    decoder_attention_heads=4,
                    encoder_ffn_dim=64,
                    decoder_ffn_dim=64,
                    vocab_size=100,
                )
            ),
            {**decoder, "decoder_input_ids": ids[:, :6]},
        ),
        "beit": (  # sizes passed to the blocks; not bitwise (see docs/sequential.md)
            lambda: hf.BeitModel(hf.BeitConfig(**small, image_size=32, patch_size=8, use_relative_position_bias=True)),
            images,
        ),
        "resnet18": (lambda: tv.resnet18(num_classes=5), images),
        "mobilenet_v2": (lambda: tv.mobilenet_v2(num_classes=5), images),
        "efficientnet_b0": (lambda: tv.efficientnet_b0(num_classes=5), images),
        "convnext_tiny": (lambda: tv.convnext_tiny(num_classes=5), images),
        "densenet121": (lambda: tv.densenet121(num_classes=5), images),
        "swin_t": (lambda: tv.swin_t(num_classes=5), torch.randn(4, 3, 64, 64, generator=g)),
    }


def _first(out: Any) -> Tensor:
    return out if isinstance(out, Tensor) else out[0]


def check(name: str, build: Callable[[], nn.Module], inputs: Any) -> str:
    start = time.perf_counter()
    torch.manual_seed(0)
    model = build().eval()
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
    layers = gpipe.to_sequential(model, *args, **kwargs).eval()
    settings = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        expected = _first(model(*args, **kwargs, **settings))
        value = inputs
        for layer in layers:
            value = layer(value)
    bitwise = torch.equal(_first(value), expected)
    layers.train()
    half = len(layers) // 2
    pipe = gpipe.Pipeline(
        layers,
        [half, len(layers) - half],
        chunks=2,
        devices=["cpu"] * 2,
        loss_fn=lambda out, target: _first(out).float().pow(2).mean(),
    )
    loss = pipe.step(inputs, torch.zeros(4))
    return (
        f"{name}: {len(layers)} layers, bitwise {bitwise}, loss {loss.item():.4f}, {time.perf_counter() - start:.1f} s"
    )


def main() -> None:
    models = zoo()
    for name in sys.argv[1:] or list(models):
        try:
            print(check(name, *models[name]), flush=True)
        except Exception as exc:  # report and go on: this is a survey
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
