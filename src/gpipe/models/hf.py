"""Hugging Face causal language models for ``gpipe train --model hf``: the config, the model built
from it, its pipeline layers and its loss.

Nothing is downloaded and no code but transformers' own runs: a config comes from a local
``config.json`` (:func:`load_config`; ``local_files_only``, ``trust_remote_code=False``) or is a
small built-in GPT-2 (:func:`default_config`), and the model is built from it with random weights
(``from_config``), seeded, so that every process and every partition count starts alike. The data
such a model reads, and the tokenizers of its text, are :mod:`gpipe.data.text` and
:mod:`gpipe.data.tokenizer`.

transformers is imported only when these functions run: ``gpipe`` itself does not need it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.data import BOS, EOS
from gpipe.data.tokenizer import _transformers
from gpipe.health import mark_blocks

__all__ = [
    "CONFIG",
    "DEFAULT",
    "build",
    "check_config",
    "config_json",
    "default_config",
    "export_dtype",
    "initialized",
    "layer_count",
    "load_config",
    "logits_loss",
    "pipeline_layers",
]

CONFIG = "config.json"  # in every checkpoint of a run: the model's config (:func:`config_json`)

DEFAULT = {"n_layer": 4, "n_embd": 128, "n_head": 4}
"""The built-in GPT-2's size; its vocabulary and positions are the data's."""


def load_config(path: str, given: str | None = None) -> Any:
    """The transformers config of ``path`` (a ``config.json``, or a folder holding one), from local
    files only; a :class:`ValueError` naming the file unless it is a causal LM's. ``given``: how the
    user named the file, for the messages (default ``--hf-config 'PATH'``)."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    name = given if given is not None else f"--hf-config {str(file)!r}"
    if not file.is_file():
        raise ValueError(
            f"--hf-config {path!r}: no such file (give a config.json, e.g. one written by "
            "GPT2Config(...).save_pretrained(folder), or the folder)"
        )
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = transformers.AutoConfig.from_pretrained(str(file), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        detail = " ".join(str(exc).split())
        raise ValueError(
            f"cannot read {name} as a transformers config: {detail.rstrip('.')}; give a config.json that "
            "transformers reads (save_pretrained writes one) of a model type it knows"
        ) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{name} is a {config.model_type!r} config, which is not a causal language "
            "model (transformers' AutoModelForCausalLM has no class for it); give a decoder's config "
            "such as gpt2, llama or qwen2"
        )
    return config


def default_config(vocab: int, positions: int, dropout: float, *, bos: int | None = BOS, eos: int | None = EOS) -> Any:
    """The built-in GPT-2: :data:`DEFAULT`'s size, the data's vocabulary and sequence length, and
    the ids of its tokens that start and end a document (``generate`` stops at ``eos``)."""
    transformers = _transformers()
    return transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        **DEFAULT,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=bos,
        eos_token_id=eos,
    )  # (no pad_token_id: padding comes after a sequence's last token, and a causal LM never sees it)


def pipeline_layers(model: nn.Module, sample: Any, *, packed: bool = False) -> nn.Sequential:
    """``model``'s pipeline layers: :func:`gpipe.generation.traced.cached_layers`' (which also
    generate, with key/value caches in the stages), or, for a model it does not cover,
    :func:`gpipe.to_sequential`'s on ``sample``, with the reason as ``cannot_generate``. Both are the
    same layers, with the same names, computing the same forward: a checkpoint loads into either.

    ``packed``: for rows of examples laid end to end (``sample`` the dict of ``input_ids`` and
    ``position_ids``): ``cached_layers(model, packed=True)``, refused for a model it does not cover."""
    from gpipe.generation.traced import cached_layers
    from gpipe.sequential import to_sequential

    if packed:
        return _marked(cached_layers(model, packed=True))
    try:
        layers = cached_layers(model)
    except ValueError as exc:
        layers = to_sequential(model, sample)
        layers.cannot_generate = str(exc)  # type: ignore[assignment]  # (a plain attribute, as cached_layers' generation)
    return _marked(layers)


def _marked(layers: nn.Sequential) -> nn.Sequential:
    if len(layers) < 3:  # (a one-block model traced into fewer layers: the ratio's blocks are the fallback's)
        return layers
    return mark_blocks(layers, 1, len(layers) - 2)  # (the gradient-norm ratio: the first and last blocks)


def layer_count(config: Any) -> int:
    """The pipeline layers :func:`gpipe.to_sequential` makes of the model: the embeddings, one per
    block, the final norm with the LM head."""
    return int(config.num_hidden_layers) + 2


def check_config(config: Any, where: str, vocab: int, positions: int, *, eos: int | None = None) -> None:
    """A :class:`ValueError` unless the config's vocabulary covers the data's token ids and its
    positions the data's sequence length (an embedding lookup out of range would fail mid-step), and
    its ``eos_token_id``, if it has one, is the data's ``eos`` (the token ``generate`` stops at)."""
    if config.vocab_size < vocab:
        raise ValueError(
            f"{where}: vocab_size {config.vocab_size} is smaller than the data's vocabulary of {vocab} tokens; "
            f"set vocab_size to {vocab} or more"
        )
    most = getattr(config, "max_position_embeddings", None)
    if isinstance(most, int) and most < positions:
        raise ValueError(
            f"{where}: {most} positions (max_position_embeddings) are fewer than the data's sequence length "
            f"of {positions} tokens; set them to {positions} or more"
        )
    ends = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    if eos is not None and config.eos_token_id is not None and eos not in ends:
        raise ValueError(
            f"{where}: eos_token_id {config.eos_token_id} is not the tokenizer's end of a document, id {eos}; set "
            f"eos_token_id to {eos} (generate stops at it)"
        )


def config_json(config: Any, *, keep_dtype: bool = False) -> str:
    """``config`` as the ``config.json`` a checkpoint keeps: what ``save_pretrained`` writes. Its
    ``dtype`` is what ``gpipe export`` writes the weights in: float32, the dtype they are trained
    and saved in, or with ``keep_dtype`` the config's own (a run started from pretrained weights
    exports them in the dtype they came in)."""
    written = copy.deepcopy(config)
    if not keep_dtype or not isinstance(export_dtype(config), torch.dtype):
        written.dtype = torch.float32
    return str(written.to_json_string())


def export_dtype(config: Any) -> torch.dtype | None:
    """The floating-point dtype a config's ``dtype`` names (``torch.bfloat16`` or ``"bfloat16"``), or None."""
    value = getattr(config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def build(config: Any) -> nn.Module:
    """The model of ``config`` on the meta device, in float32 whatever the config's dtype: the
    pipeline materializes each stage's layers only, initialized by the model's own
    ``_init_weights`` seeded per layer (the same weights in every process and for every partition
    count). A :class:`ValueError` if the model is not causal (tried on a real one-block copy)."""
    transformers = _transformers()
    _check_causal(*_probe(config))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    return model  # type: ignore[no-any-return]


_PROBE_VOCAB = 256


def _probe(config: Any) -> tuple[nn.Module, Any]:
    """A real one-block copy of ``config``'s model with a small vocabulary (:func:`_small_vocabulary`:
    a check needs a block, not a 128k-row embedding and head in every process), seeded, and its config."""
    probe = copy.deepcopy(config)
    probe.num_hidden_layers = 1
    _small_vocabulary(probe)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _transformers().AutoModelForCausalLM.from_config(probe, trust_remote_code=False), probe


def _small_vocabulary(config: Any) -> None:
    """Shrink ``config``'s vocabulary to :data:`_PROBE_VOCAB` tokens for the causality probe,
    dropping the special token ids it no longer covers."""
    if not isinstance(getattr(config, "vocab_size", None), int) or config.vocab_size <= _PROBE_VOCAB:
        return
    config.vocab_size = _PROBE_VOCAB
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(config, name, None)
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, int) and i >= _PROBE_VOCAB for i in ids):
            setattr(config, name, None)


@torch.no_grad()
def check_packing(config: Any) -> None:
    """A :class:`ValueError` unless the model of ``config`` keeps examples laid end to end in a row
    apart, as ``--pack`` needs: tried on a real one-block copy (as :func:`build` tries causality),
    two examples in a row against each alone. transformers' mask builder does so for the models
    whose attention masks it builds, from where ``position_ids`` restart."""
    model, probe = _probe(config)
    model.eval()
    vocab = int(probe.vocab_size)
    a, b = torch.arange(3).view(1, 3) % vocab, (torch.arange(4).view(1, 4) * 5 + 1) % vocab
    positions = torch.cat([torch.arange(3), torch.arange(4)]).view(1, 7)
    kept = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    try:
        packed = model(torch.cat([a, b], 1), position_ids=positions, **kept).logits
        alone = torch.cat([model(a, **kept).logits, model(b, **kept).logits], 1)
    except TypeError as exc:  # (a forward without position_ids)
        raise ValueError(
            f"the {config.model_type!r} model takes no position ids, so rows cannot be packed ({exc})"
        ) from None
    if not torch.allclose(packed, alone, atol=1e-5):
        raise ValueError(
            f"the {config.model_type!r} model lets examples laid end to end in a row attend to each other (its "
            "attention is not masked where position_ids restart), so packed rows would not train as the examples "
            "alone; leave --pack out"
        )


@torch.no_grad()
def _check_causal(model: nn.Module, config: Any) -> None:
    """Refuse a model whose outputs see later tokens (BERT's LM head without ``is_decoder``, say):
    trained on next tokens it would copy them. Tried, not looked up: change the last token of a
    short sequence and compare the logits before it."""
    vocab = int(config.vocab_size)
    x = torch.full((1, 4), vocab - 1)
    y = x.clone()
    y[0, -1] = max(vocab - 2, 0)
    was_training = model.training
    model.eval()
    try:
        a, b = model(x).logits[:, :-1], model(y).logits[:, :-1]
    finally:
        model.train(was_training)
    if not torch.allclose(a, b, atol=1e-5):
        raise ValueError(
            f"the {config.model_type!r} model of the config sees later tokens (it is not causal), so it cannot "
            "be trained to predict them; give a decoder's config (gpt2, llama, ...), or set is_decoder: true "
            "where the model has it"
        )


_INITIALIZED = "_is_hf_initialized"  # transformers' flag of a tensor from_pretrained loaded


@contextlib.contextmanager
def initialized(tensors: Iterable[Tensor]) -> Iterator[None]:
    """Inside, transformers' initializers (a model's ``_init_weights``) leave ``tensors`` as they are:
    they carry the flag ``from_pretrained`` puts on what it loaded. Nested uses flag and unflag
    their own tensors only."""
    flagged = [t for t in tensors if not getattr(t, _INITIALIZED, False)]
    for t in flagged:
        setattr(t, _INITIALIZED, True)
    try:
        yield
    finally:
        for t in flagged:
            delattr(t, _INITIALIZED)


def logits_loss(loss_fn: Any, output: Any, target: Tensor, **kwargs: Any) -> Tensor:
    """``loss_fn`` on the logits of a model's output (a ``ModelOutput``, or the logits themselves)."""
    logits = output if isinstance(output, Tensor) else output.logits
    return loss_fn(logits, target, **kwargs)  # type: ignore[no-any-return]
