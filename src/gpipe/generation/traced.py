"""Key/value-cached decoding for Hugging Face causal language models cut by :func:`gpipe.to_sequential`.

:func:`cached_layers` traces a causal LM (GPT-2, Llama, Qwen2, Mistral and models built like them)
into pipeline layers that decode with caches kept in the layers. Called as always, the layers
compute what the traced model computes (they train). Called with :func:`gpipe.cache.using` a
stage's :class:`gpipe.cache.Cache` current, the layers run one *step* of a group of sequences:

- **The step input** (the first layer's): the new tokens, ``(rows, length)``, as a tensor, or a dict
  ``{"input_ids": ..., "attention_mask": ...}`` whose mask says which of them are padding. The first
  step of a group (its cache empty) is the prefill: the prompts, left-padded, with their mask. A
  later step gives the token each row chose (``(rows, 1)``), the mask then defaults to ones.
- **The step output** (the last layer's): the logits of the last position, ``(rows, 1, vocab)``: as
  in ``generate`` (``logits_to_keep=1``), the head sees that position alone (a ``_gpipe.keep_last``
  before the head's ``linear`` in the last layer's graph), so the prefill's logits are
  ``generate``'s bitwise and no ``(rows, prompt length, vocab)`` tensor is made.
- **Positions and masks as ``generate`` makes them.** The first layer keeps per row (in the
  :class:`~gpipe.cache.LayerCache` of its entry, below) the 2-D attention mask so far and the last
  position: the
  prompt's positions are ``attention_mask.cumsum(-1) - 1`` with padding at 0, each later token's the
  one before plus 1 (transformers 5.23's ``_prepare_position_ids_for_generation`` and
  ``_update_model_kwargs_for_generation``). The traced code before the blocks turns them into the
  position embeddings (GPT-2's ``wpe``, the rotary tables), so the stage of the first layer needs
  only the new tokens.
- **The blocks use Hugging Face's own attention, cache and masks.** Every block (``GPT2Block``,
  ``LlamaDecoderLayer``) keeps its keys and values in its own ``LayerCache`` (rows in dim 0, so
  :meth:`Cache.reorder <gpipe.cache.Cache.reorder>` reorders them). A forward pre-hook on the block
  hands it, instead of what the trace passes (``past_key_values=None`` and the mask of a sequence
  without a past), a transformers cache layer holding those tensors — ``DynamicLayer``, or
  ``DynamicSlidingWindowLayer`` for a sliding-window layer, as ``DynamicCache(config=...)`` has them
  for ``generate`` — and the 4-D mask that ``create_causal_mask`` (or
  ``create_sliding_window_causal_mask``) builds from it and the 2-D mask, as the model's forward
  builds it for the layer's type. The block's attention extends the cache layer; a forward hook
  keeps the tensors again. So the logits are the model's own cached forward's, bitwise.
- **What travels between the layers** during a step: what the trace passes, and the 2-D mask so
  far, appended as the last value (booleans, ``(rows, length so far)``): a block builds its mask
  from it and its own cache, so no layer reaches into another's state, whichever stage, thread or
  rank holds it. Each layer's graph begins with a call of its module ``_gpipe.step_in`` and ends
  with ``_gpipe.step_out``, which do that (outside decoding they pass the values through, the first
  completing the input); being in the graph, they survive ``copy.deepcopy`` and pickling.

Sequences of length 1 (a decoding step; a batch of one row): :func:`torch.export` assumes the
dynamic sizes of its example are not 1 and specializes a size-1 dimension of the example, so the
model is traced on a 2 x 3 example (two dynamic sizes) and the first layer lets sizes 1 through, as
it does for every trace. The traced code that runs at such a step is the embeddings, the position
embeddings and the final norm and head — code without branches on a size; the one traced piece that
branches on a length of 1, the mask builder, still runs, but no block uses its mask: each gets the
eager builder's.
One trace thus serves training, the prefill and the decoding steps, and the layers are the ones
:func:`gpipe.to_sequential` makes, with their names, ties and partitioning.

:func:`cached_layers` checks the layers against the model's own cached forward on a short prompt
and two steps, and refuses a model it does not cover with a message naming it. transformers is
imported inside the functions only: ``import gpipe`` does not load it.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.balance.alike import inert
from gpipe.cache import Cache, LayerCache, layer_cache, using
from gpipe.generation.ends import INPUTS, PACKED_INPUTS, _add_ends, _keep_last_before_head, _positions, _step
from gpipe.sequential import repeated_blocks, to_sequential

__all__ = ["INPUTS", "PACKED_INPUTS", "cached_layers"]

_KINDS = {"full_attention": False, "sliding_attention": True}  # the layer types covered: sliding?

_COVERED = "GPT-2, Llama, Qwen2, Mistral and causal LMs built like them"


def cached_layers(model: nn.Module, *, check: bool = True, packed: bool = False) -> nn.Sequential:
    """``model`` (a transformers causal LM) traced into pipeline layers that decode with caches in
    the layers (see the module docstring): called as they are, the layers take the dict of
    :data:`INPUTS` (or ``input_ids`` alone, or without some of them: masks of ones, positions from 0,
    as the model's forward fills them in) and compute what the model computes; called with a
    :class:`gpipe.cache.Cache` current, a step of a group of sequences.

    ``check``: run a left-padded two-row prompt and two steps through the layers and through the
    model's own cached forward, and refuse the model if the logits differ (a model whose code
    between the blocks uses positions or masks in a way not covered here).

    ``packed``: trace for rows of several examples laid end to end (:data:`PACKED_INPUTS`): without
    an attention mask, so that transformers' own mask builder finds where ``position_ids`` restart
    and lets no example attend to another (``find_packed_sequence_indices``, the block-diagonal
    causal mask every attention implementation gets). The same layers, names and weights; they
    decode as the others do (a step's mask reaches the blocks through their hooks).
    """
    config = _covered(model)
    blocks = repeated_blocks(model)
    specs = [_spec(model, path, config) for path in blocks]
    ids, mask = _example(model, config)
    if packed:  # (two examples in the second row: what the positions say, the trace does not depend on)
        starts = torch.tensor([[0, 1, 2], [0, 1, 0]], device=ids.device)
        layers = to_sequential(model, input_ids=ids, position_ids=starts)
    else:
        layers = to_sequential(model, input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    for path, spec in zip(blocks, specs):
        _hook_block(model.get_submodule(path), spec)
    for i, layer in enumerate(layers):
        _add_ends(layer, i == 0, i == len(layers) - 1, packed)
    _keep_last_before_head(model, layers[-1])
    if check:
        _check(model, layers, config)
    layers.generation = _generation(model, config)  # (what Pipeline.generate reads)
    return layers


def _generation(model: nn.Module, config: Any) -> Any:
    from gpipe.generation.generate import Generation

    settings = getattr(model, "generation_config", None)
    eos = getattr(settings, "eos_token_id", None)
    pad = getattr(settings, "pad_token_id", None)
    positions = next(
        (getattr(config, n) for n in ("max_position_embeddings", "n_positions") if hasattr(config, n)), None
    )
    return Generation(type(model).__name__, int(config.vocab_size), positions, eos, pad)


# -- what is covered ----------------------------------------------------------------------------------
def _covered(model: nn.Module) -> Any:
    """The config the masks and the cache layers are built from; a ValueError naming the model
    where cached decoding does not cover it."""
    name = type(model).__name__
    can_generate = getattr(model, "can_generate", None)
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or not callable(can_generate) or config is None or not can_generate():
        raise ValueError(
            f"{name} is not a Hugging Face causal language model that generates: cached decoding of traced "
            f"models needs a transformers PreTrainedModel with a generate ({_COVERED}; an encoder such as "
            "BertForMaskedLM has none)"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{name} is an encoder-decoder model; cached decoding of traced models covers decoder-only causal LMs "
            f"({_COVERED})"
        )
    takes = inspect.signature(model.forward).parameters
    missing = [p for p in (*INPUTS, "past_key_values") if p not in takes]
    if missing:
        raise ValueError(
            f"{name}.forward takes no {', '.join(missing)}: cached decoding of traced models feeds the positions "
            f"and the padding mask in and keeps a key/value cache ({_COVERED})"
        )
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    kinds, _ = get_layer_types_and_kwargs(text)
    other = sorted({k for k in kinds if k not in _KINDS})
    if other:
        raise ValueError(
            f"{name} has layers of type {', '.join(other)}; cached decoding of traced models covers full and "
            f"sliding-window attention ({_COVERED})"
        )
    return text


@dataclass(frozen=True)
class _Block:
    """What a block's hooks need: the config its masks are built from, its place in transformers'
    cache (the attention's ``layer_idx``) and its layer's attention window (None: full)."""

    config: Any
    index: int
    window: int | None
    argument: str  # the forward's argument for the cache: past_key_values (layer_past in GPT-NeoX, Falcon)


def _spec(model: nn.Module, path: str, config: Any) -> _Block:
    from transformers.cache_utils import get_layer_types_and_kwargs

    block = model.get_submodule(path)
    name = f"{type(model).__name__}'s blocks ({type(block).__name__}, {path})"
    takes = _signature(block).parameters
    argument = next((a for a in ("past_key_values", "layer_past") if a in takes), None)
    if argument is None or "attention_mask" not in takes:
        raise ValueError(
            f"{name} take no past_key_values or attention_mask: cached decoding of traced models hands every "
            f"block its cache and mask ({_COVERED})"
        )
    found: set[int] = {i for m in block.modules() if isinstance(i := getattr(m, "layer_idx", None), int)}
    if len(found) != 1:
        raise ValueError(
            f"{name} hold {len(found)} attention layer indices ({sorted(found)}), where cached decoding of traced "
            f"models needs each block's one layer_idx, its place in the key/value cache ({_COVERED})"
        )
    index = found.pop()
    kinds, kwargs = get_layer_types_and_kwargs(config)
    window = kwargs[index].get("sliding_window") if _KINDS[kinds[index]] else None
    return _Block(config, index, window, argument)


_SIGNATURES: dict[type, inspect.Signature] = {}


def _signature(block: nn.Module) -> inspect.Signature:
    """The block's forward's signature (kept per type: a pre-hook binds every call)."""
    found = _SIGNATURES.get(type(block))
    if found is None:
        found = _SIGNATURES[type(block)] = inspect.signature(block.forward)
    return found


def _example(model: nn.Module, config: Any) -> tuple[Tensor, Tensor]:
    """The example traced: 2 rows of 3 tokens (two dynamic sizes, neither 1), the first padded."""
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    ids = torch.arange(6, device=device).view(2, 3) % int(config.vocab_size)
    return ids, torch.tensor([[0, 1, 1], [1, 1, 1]], device=device)


# -- the blocks -----------------------------------------------------------------------------------------
def _hook_block(block: nn.Module, spec: _Block) -> None:
    """Give ``block`` its cache and mask in a step: a forward pre-hook and a forward hook, replaced
    where the block has them from an earlier trace of the model (or of the model it was copied from)."""
    mine: dict[Any, Any] = {f: functools.partial(f, spec) for f in (_before_block, _after_block)}
    found = set()
    for hooks in (block._forward_pre_hooks, block._forward_hooks):
        for key, hook in hooks.items():
            func = getattr(hook, "func", None)
            if func in mine:
                hooks[key] = mine[func]
                found.add(func)
    if _before_block not in found:
        block.register_forward_pre_hook(mine[_before_block], with_kwargs=True)
    if _after_block not in found:
        block.register_forward_hook(mine[_after_block], with_kwargs=True)


@inert  # (outside a step, and so while the balance counts a layer, it returns None)
def _before_block(
    spec: _Block, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    kept = layer_cache(block)
    mask = getattr(_step, "mask", None)
    if kept is None or mask is None:
        return None  # not in a step: the block computes as traced
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    layer = _restore(spec, kept)
    cache = DynamicCache()
    cache.layers = [layer] * (spec.index + 1)  # (the block's attention updates its layer_idx)
    signature = _signature(block)
    bound = signature.bind(*args, **kwargs)
    hidden = bound.arguments[next(iter(signature.parameters))]
    build = create_causal_mask if spec.window is None else create_sliding_window_causal_mask
    bound.arguments["attention_mask"] = build(
        config=spec.config, inputs_embeds=hidden, attention_mask=mask, past_key_values=cache, position_ids=None
    )
    bound.arguments[spec.argument] = cache
    opened: dict[int, tuple[Any, LayerCache]] = getattr(_step, "open", None) or {}
    _step.open = opened
    opened[id(block)] = (layer, kept)
    return bound.args, bound.kwargs


@inert
def _after_block(spec: _Block, block: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    opened: dict[int, tuple[Any, LayerCache]] = getattr(_step, "open", None) or {}
    entry = opened.pop(id(block), None)
    if entry is None:
        return
    layer, kept = entry
    if layer.is_initialized:
        kept.set("keys", layer.keys)
        kept.set("values", layer.values)
        kept.values["seen"] = layer.get_seq_length()


def _restore(spec: _Block, kept: LayerCache) -> Any:
    """The transformers cache layer of the block's group: the kept keys and values (rows in dim 0)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layer: Any = DynamicLayer() if spec.window is None else DynamicSlidingWindowLayer(spec.window)  # type: ignore[no-untyped-call]
    keys, values = kept.get("keys"), kept.get("values")
    if keys is not None and values is not None:
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if spec.window is not None:
            layer.cumulative_length = kept.values["seen"]  # (positions seen, the window's kept fewer)
    return layer


# -- the check --------------------------------------------------------------------------------------------
def _check(model: nn.Module, layers: nn.Sequential, config: Any) -> None:
    """Refuse ``model`` if its cached layers do not give its own cached forward's logits on a
    left-padded prompt of two rows and two steps (skipped on the meta device)."""
    from transformers import DynamicCache

    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    if device.type == "meta":
        return
    vocab = int(config.vocab_size)
    ids = (torch.arange(8, device=device).view(2, 4) * 7 + 3) % vocab
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], device=device)
    positions = _positions(mask)
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            theirs, ours = DynamicCache(config=config), Cache()
            step: Any = {"input_ids": ids, "attention_mask": mask}
            last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
            for s in range(3):
                expected = model(
                    input_ids=step if s else ids, attention_mask=mask, position_ids=positions,
                    past_key_values=theirs, use_cache=True, **last,
                ).logits  # fmt: skip
                with using(ours):
                    got = layers(step)
                _compare(model, s, got[:, -1], expected[:, -1])
                step = (ids[:, -1:] + s + 1) % vocab
                mask = torch.cat([mask, torch.ones_like(step)], dim=-1)
                positions = positions[:, -1:] + 1
    finally:
        for m, training in modes.items():
            m.training = training


def _compare(model: nn.Module, step: int, got: Tensor, expected: Tensor) -> None:
    tolerance = 1e-4 if expected.dtype in (torch.float32, torch.float64) else 1e-2
    scale = max(1.0, float(expected.abs().max()))
    difference = float((got.float() - expected.float()).abs().max())
    if not difference <= tolerance * scale:
        raise ValueError(
            f"{type(model).__name__}'s cached layers do not give its own cached forward's logits (step {step}: they "
            f"differ by up to {difference:.3g}): its code around the blocks uses positions or masks in a way cached "
            f"decoding of traced models does not cover ({_COVERED})"
        )
