"""Cached decoding of Hugging Face causal LMs cut by ``to_sequential`` (issue 25, item 3):
``gpipe.generation.traced.cached_layers`` and the policies of ``gpipe.generation.policies``, on
GPT-2, Llama, Qwen2 (a full and a sliding-window layer) and Mistral (a window of 4, shorter than
the sequences) from small random configs, with left-padded prompts of different lengths.

- Every step's logits (the last position's) are the model's own cached forward's, bitwise
  (``DynamicCache(config=...)``, the cache ``generate`` makes, and ``logits_to_keep=1``), within 1e-5
  of a forward with a plain ``DynamicCache()``; they are the logits ``generate`` chooses from at
  every step, bitwise, finished rows kept as ``generate`` keeps them.
- A plain loop over the layers with Greedy, Beam (4 beams) and Sample gives ``generate``'s tokens,
  also where rows finish early at an end-of-sequence token, kept or dropped; sampling with the same
  seed.
- The caches live per layer: each block's keys and values (rows in dim 0, as ``generate``'s cache
  holds them), the first layer's mask and positions; ``Cache.reorder`` reorders them all, and the
  step after a reorder is ``generate``'s cache after ``reorder_cache``. Two stages, each with its own
  cache, the second in another thread, decode as one.
- Called without a cache the layers compute the model's forward; models not covered are refused.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gpipe.cache import Cache, using
from gpipe.generation.policies import Beam, Greedy, Policy, Sample
from gpipe.generation.traced import cached_layers
from gpipe.sequential import repeated_blocks

transformers = pytest.importorskip("transformers")

VOCAB, PAD, EOS, NEW = 100, 0, 2, 8
LAYERS = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
SPECIAL = {"vocab_size": VOCAB, "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": 1}


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, **SPECIAL)
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(**LAYERS, num_key_value_heads=2, max_position_embeddings=64, **SPECIAL)
    return transformers.LlamaForCausalLM(config)


def qwen2() -> nn.Module:  # layer 0 full attention, layer 1 a window of 4
    config = transformers.Qwen2Config(
        **LAYERS, num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, **SPECIAL,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def mistral() -> nn.Module:  # every layer a window of 4
    config = transformers.MistralConfig(
        **LAYERS, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, **SPECIAL
    )
    return transformers.MistralForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2, "mistral": mistral}
_BUILT: dict[str, tuple[nn.Module, nn.Sequential]] = {}


def built(name: str) -> tuple[nn.Module, nn.Sequential]:
    """The model (seeded, eval mode) and its cached layers, built once per test session."""
    if name not in _BUILT:
        torch.manual_seed(0)
        model = MODELS[name]().eval()
        _BUILT[name] = model, cached_layers(model)
    return _BUILT[name]


def prompts(lengths: tuple[int, ...] = (6, 3, 5), seed: int = 1) -> tuple[Tensor, Tensor]:
    """Left-padded prompts of the given lengths and their attention mask."""
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return ids.masked_fill(mask == 0, PAD), mask


def positions(mask: Tensor) -> Tensor:
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def decode(
    layers: nn.Sequential, policy: Policy, ids: Tensor, mask: Tensor, seen: list[Tensor] | None = None
) -> Tensor:
    """A plain decoding loop over the layers: one cache, the policy's rows kept after each step
    (``seen``: every step's logits)."""
    cache = Cache()
    rows = policy.start_rows
    step: Any = {"input_ids": ids[rows], "attention_mask": mask[rows]}
    while True:
        with using(cache), torch.no_grad():
            logits = layers(step)
        if seen is not None:
            seen.append(logits[:, -1])
        tokens, keep, done = policy.choose(logits)
        if done:
            return policy.sequences
        cache.reorder(keep)
        step = tokens[:, None]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_step_gives_the_models_own_cached_logits(name: str) -> None:
    model, layers = built(name)
    ids, mask = prompts()
    ours, theirs, plain = Cache(), transformers.DynamicCache(config=model.config), transformers.DynamicCache()
    step: Any = {"input_ids": ids, "attention_mask": mask}
    new, where = ids, positions(mask)
    with torch.no_grad():
        for s in range(NEW + 1):
            # generate's forward: the head on the last position only (logits_to_keep=1), as the layers' in a step
            expected = model(
                new, attention_mask=mask, position_ids=where, past_key_values=theirs, use_cache=True, logits_to_keep=1
            )
            other = model(new, attention_mask=mask, position_ids=where, past_key_values=plain, use_cache=True)
            with using(ours):
                got = layers(step)
            assert got.shape == (3, 1, VOCAB)
            assert torch.equal(got, expected.logits), f"step {s}"
            torch.testing.assert_close(got[:, -1], other.logits[:, -1], rtol=0, atol=1e-5)
            new = step = expected.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(new)], dim=-1)
            where = where[:, -1:] + 1


@pytest.mark.parametrize("name", list(MODELS))
def test_the_logits_are_those_generate_chooses_from(name: str) -> None:
    model, layers = built(name)
    ids, mask = prompts()
    eos = _ending(model, layers, ids, mask)  # rows finish early: generate keeps them, fed the pad
    for policy in (Greedy(ids, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD),
                   Beam(ids, num_beams=4, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD)):  # fmt: skip
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, num_beams=policy.start_rows.numel() // 3,
                eos_token_id=eos, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        seen: list[Tensor] = []
        assert torch.equal(decode(layers, policy, ids, mask, seen), out.sequences)
        assert len(seen) == len(out.logits)
        for s, (got, expected) in enumerate(zip(seen, out.logits)):
            assert torch.equal(got, expected), f"{type(policy).__name__} step {s}"


def _generate(model: nn.Module, ids: Tensor, mask: Tensor, **settings: Any) -> Tensor:
    with torch.no_grad():
        out: Tensor = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **settings)
    return out


def _ending(model: nn.Module, layers: nn.Sequential, ids: Tensor, mask: Tensor) -> int:
    """An end-of-sequence token some row reaches early: row 1's third greedy token."""
    tokens = decode(layers, Greedy(ids, max_new_tokens=NEW), ids, mask)[:, ids.shape[1] :]
    return int(tokens[1, 2])


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("drop", [False, True])
def test_greedy_and_beam_search_give_generates_tokens(name: str, drop: bool) -> None:
    model, layers = built(name)
    ids, mask = prompts()
    for eos in (EOS, _ending(model, layers, ids, mask)):
        expected = _generate(model, ids, mask, do_sample=False, num_beams=1, eos_token_id=eos)
        policy: Policy = Greedy(ids, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, drop_finished=drop)
        got = decode(layers, policy, ids, mask)
        assert torch.equal(got, expected), (eos, got, expected)
        for early_stopping in (False, True):
            expected = _generate(
                model, ids, mask, do_sample=False, num_beams=4, eos_token_id=eos, early_stopping=early_stopping,
                num_return_sequences=2,
            )  # fmt: skip
            policy = Beam(
                ids, num_beams=4, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD,
                early_stopping=early_stopping, num_return_sequences=2, drop_finished=drop,
            )  # fmt: skip
            got = decode(layers, policy, ids, mask)
            assert torch.equal(got, expected), (eos, early_stopping, got, expected)
    finished = _generate(model, ids, mask, do_sample=False, num_beams=1, eos_token_id=_ending(model, layers, ids, mask))
    assert (finished[:, ids.shape[1] :] == PAD).any()  # (rows did finish early)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("drop", [False, True])
def test_sampling_with_the_same_seed_gives_generates_tokens(name: str, drop: bool) -> None:
    model, layers = built(name)
    ids, mask = prompts()
    settings: dict[str, Any] = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}

    def both(eos: int) -> Tensor:
        torch.manual_seed(3)
        expected = _generate(model, ids, mask, do_sample=True, num_beams=1, eos_token_id=eos, **settings)
        torch.manual_seed(3)
        policy = Sample(ids, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, drop_finished=drop, **settings)
        got = decode(layers, policy, ids, mask)
        assert torch.equal(got, expected), (eos, got, expected)
        return expected

    drawn = both(EOS)
    expected = both(int(drawn[1, ids.shape[1] + 2]))  # row 1's third token ends it: the same draws before it
    assert (expected[:, ids.shape[1] :] == PAD).any()  # (a row did finish early, and drew on)


@pytest.mark.parametrize("name", ["gpt2", "mistral"])
def test_one_row_and_one_token_prompts(name: str) -> None:
    model, layers = built(name)
    for ids in (torch.tensor([[5, 17, 9, 33]]), torch.tensor([[41], [7]])):
        mask = torch.ones_like(ids)
        expected = _generate(model, ids, mask, do_sample=False, num_beams=1)
        policy = Greedy(ids, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(decode(layers, policy, ids, mask), expected)


@pytest.mark.parametrize("name", list(MODELS))
def test_caches_live_in_their_layers_and_reorder(name: str) -> None:
    model, layers = built(name)
    ids, mask = prompts()
    ours, theirs = Cache(), transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, position_ids=positions(mask), past_key_values=theirs, use_cache=True)
        with using(ours):
            layers({"input_ids": ids, "attention_mask": mask})
    first = ours.of(layers[0].get_submodule("_gpipe.step_in"))  # the first layer's entry keeps them
    assert torch.equal(first.tensors["mask"], mask.bool())
    assert torch.equal(first.tensors["position"], positions(mask)[:, -1:])
    blocks = [model.get_submodule(path) for path in repeated_blocks(model)]
    for i, block in enumerate(blocks):
        kept = ours.of(block)
        assert set(kept.tensors) == {"keys", "values"}
        assert kept.tensors["keys"].shape[0] == 3  # rows in dim 0
        assert torch.equal(kept.tensors["keys"], theirs.layers[i].keys)
        assert torch.equal(kept.tensors["values"], theirs.layers[i].values)
        assert kept.values["seen"] == ids.shape[1]
    before = {id(t): t for kept in (first, *(ours.of(b) for b in blocks)) for t in kept.tensors.values()}
    rows = torch.tensor([2, 0, 0, 1])
    ours.reorder(rows)
    theirs.reorder_cache(rows)
    for kept in (first, *(ours.of(b) for b in blocks)):
        for t in kept.tensors.values():
            assert t.shape[0] == 4 and id(t) not in before
    assert torch.equal(first.tensors["mask"], mask.bool()[rows])
    for i, block in enumerate(blocks):
        assert torch.equal(ours.of(block).tensors["keys"], theirs.layers[i].keys)
    token = expected.logits[rows, -1].argmax(-1, keepdim=True)
    mask = torch.cat([mask[rows], torch.ones_like(token)], dim=-1)
    with torch.no_grad():
        after = model(token, attention_mask=mask, position_ids=positions(mask)[:, -1:], past_key_values=theirs)
        with using(ours):
            got = layers(token)
    assert torch.equal(got, after.logits)
    with pytest.raises(ValueError, match="gives 3 rows where the group's cache holds 4"), using(ours):
        layers(token[:3])


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # (torch unpickling the first layer's TreeSpec)
def test_copies_of_the_layers_and_a_second_trace_decode_alike() -> None:
    model, layers = built("mistral")
    ids, mask = prompts()
    expected = _generate(model, ids, mask, do_sample=False, num_beams=4, eos_token_id=EOS)
    buffer = io.BytesIO()
    torch.save(layers, buffer)
    buffer.seek(0)
    again = cached_layers(model)  # the model traced again: its blocks' hooks replaced, not doubled
    for block in (model.get_submodule(path) for path in repeated_blocks(model)):
        assert len(block._forward_pre_hooks) == len(block._forward_hooks) == 1
    for copied in (copy.deepcopy(layers), torch.load(buffer, weights_only=False), again, layers):
        policy = Beam(ids, num_beams=4, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(decode(copied, policy, ids, mask), expected)


def test_importing_the_library_modules_loads_no_transformers() -> None:
    code = "import sys, gpipe.generation.traced, gpipe.generation.policies; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_two_stages_with_their_own_caches_in_two_threads_decode_as_one() -> None:
    model, layers = built("qwen2")
    ids, mask = prompts()
    front, back = layers[:2], layers[2:]
    caches = Cache(), Cache()
    policy = Beam(ids, num_beams=4, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    step: Any = {"input_ids": ids[policy.start_rows], "attention_mask": mask[policy.start_rows]}
    while True:
        with using(caches[0]), torch.no_grad():
            handed = front(step)
        assert isinstance(handed, tuple) and all(isinstance(v, Tensor) for v in handed)
        out: list[Tensor] = []

        def second(handed: Any = handed, out: list[Tensor] = out) -> None:
            with using(caches[1]), torch.no_grad():
                out.append(back(handed))

        worker = threading.Thread(target=second)
        worker.start()
        worker.join(timeout=60)
        tokens, keep, done = policy.choose(out[0])
        if done:
            break
        for cache in caches:
            cache.reorder(keep)
        step = tokens[:, None]
    expected = _generate(model, ids, mask, do_sample=False, num_beams=4, eos_token_id=EOS)
    assert torch.equal(policy.sequences, expected)


@pytest.mark.parametrize("name", list(MODELS))
def test_without_a_cache_the_layers_compute_the_models_forward(name: str) -> None:
    model, layers = built(name)
    ids, mask = prompts()
    with torch.no_grad():
        assert torch.equal(layers(ids).logits, model(ids).logits)
        assert torch.equal(
            layers({"input_ids": ids, "attention_mask": mask}).logits, model(ids, attention_mask=mask).logits
        )
        traced = layers({"input_ids": ids, "attention_mask": mask, "position_ids": positions(mask)})
        assert torch.equal(traced.logits, model(ids, attention_mask=mask, position_ids=positions(mask)).logits)
    layers(ids).logits.sum().backward()  # the same layers train
    assert all(p.grad is not None for p in layers.parameters())
    model.zero_grad(set_to_none=True)


def test_models_not_covered_are_refused_by_name() -> None:
    torch.manual_seed(0)
    small = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": VOCAB}
    bert = transformers.BertForMaskedLM(transformers.BertConfig(**small, intermediate_size=128))
    with pytest.raises(ValueError, match="BertForMaskedLM is not a Hugging Face causal language model that generates"):
        cached_layers(bert)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(num_layers=2, d_model=64, num_heads=4, d_ff=128, d_kv=16, vocab_size=VOCAB)
    )
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder model"):
        cached_layers(t5)
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(num_hidden_layers=2, hidden_size=64, vocab_size=VOCAB)
    )
    with pytest.raises(ValueError, match=r"MambaForCausalLM.forward takes no position_ids, past_key_values"):
        cached_layers(mamba)
    # Falcon with ALiBi builds its position bias from the 2-D mask between the blocks: the check catches it.
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(**small, alibi=True)).eval()
    with pytest.raises(ValueError, match="FalconForCausalLM's cached layers do not give its own cached forward's"):
        cached_layers(falcon)


def test_policies_refuse_bad_settings() -> None:
    ids, _ = prompts()
    with pytest.raises(ValueError, match="num_beams must be an int of 2 or more"):
        Beam(ids, num_beams=1, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        Greedy(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"prompts are token ids, a long tensor \(rows, length\)"):
        Greedy(ids.float(), max_new_tokens=NEW)
    policy = Greedy(ids, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="choose got the logits of 2 rows; 3 go on"):
        policy.choose(torch.zeros(2, 1, VOCAB))
