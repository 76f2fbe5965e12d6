"""``Pipeline.generate`` (issue 25, item 3): a Hugging Face causal LM traced with caches
(``gpipe.generation.traced.cached_layers``), cut into K stages, continues prompts as the model's own
``generate`` does — greedy and beam search token for token, for GPT-2, Llama and Qwen2 from small
random configs, with left-padded prompts — whatever K, in one process and under torch.distributed;
seeded sampling gives the same tokens whatever K and the groups; bad requests are refused in one line."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor

from gpipe import Pipeline
from tests.dist_harness import POOL, Pool
from tests.test_generation_traced import EOS, built, prompts

transformers = pytest.importorskip("transformers")

NEW = 8


def pipeline(name: str, k: int) -> tuple[Any, Pipeline]:
    model, layers = built(name)
    n = len(layers)
    balance = [n // k] * k
    balance[-1] += n - sum(balance)
    return model, Pipeline(copy.deepcopy(layers), balance, chunks=1, devices=["cpu"] * k).eval()


def hf(model: Any, ids: Tensor, mask: Tensor, **kwargs: Any) -> Tensor:
    with torch.no_grad():
        out: Tensor = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_generate_gives_the_models_own_tokens(name: str, k: int) -> None:
    model, pipe = pipeline(name, k)
    ids, mask = prompts((6, 3, 5, 4))
    for eos in (EOS, [EOS, 7, 11, 13]):  # the config's, and more that make rows finish early
        greedy = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos)
        assert torch.equal(greedy, hf(model, ids, mask, do_sample=False, eos_token_id=eos)), eos
        beams = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, num_beams=3, eos_token_id=eos)
        assert torch.equal(beams, hf(model, ids, mask, do_sample=False, num_beams=3, eos_token_id=eos)), eos
    assert pipe.last_decode is not None and pipe.last_decode.steps > 0


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_seeded_sampling_is_the_same_whatever_the_stages_and_groups(name: str) -> None:
    ids, mask = prompts((6, 3, 5, 4, 2))
    settings: dict[str, Any] = {"attention_mask": mask, "max_new_tokens": NEW, "do_sample": True, "top_k": 20}
    results = []
    for k, groups in ((1, 1), (2, None), (4, 3)):
        _, pipe = pipeline(name, k)
        results.append(pipe.generate(ids, seed=7, temperature=0.8, top_p=0.9, groups=groups, **settings))
    assert all(torch.equal(r, results[0]) for r in results[1:])
    _, pipe = pipeline(name, 2)
    other = pipe.generate(ids, seed=8, temperature=0.8, top_p=0.9, **settings)
    assert not torch.equal(other, results[0])  # (another seed draws other tokens)


def test_one_prompt_on_a_v_shaped_pipeline() -> None:
    """A V placement needs 3 groups in flight (stages 0 and 3 share worker 0): one prompt goes with
    two empty groups."""
    model, layers = built("gpt2")
    n = len(layers)
    pipe = Pipeline(copy.deepcopy(layers), [1, 1, 1, n - 3], chunks=1, devices=["cpu"] * 2, schedule="zb-v", virtual=2)
    ids, mask = prompts((5,))
    assert torch.equal(pipe.eval().generate(ids, attention_mask=mask, max_new_tokens=NEW), hf(model, ids, mask))


def test_unseeded_sampling_in_one_group_is_generates() -> None:
    model, pipe = pipeline("gpt2", 2)
    ids, mask = prompts((6, 3, 5))
    torch.manual_seed(3)
    got = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, groups=1)
    torch.manual_seed(3)
    assert torch.equal(got, hf(model, ids, mask, do_sample=True))


def test_bad_requests_are_refused_in_one_line() -> None:
    _, pipe = pipeline("gpt2", 2)
    ids, mask = prompts((6, 3))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_new_tokens": 0}, r"max_new_tokens must be an integer >= 1 \(max_new_tokens: 0\)"),
        (
            {"max_new_tokens": 60},
            r"prompts of 6 tokens and max_new_tokens 60 make 66 positions; GPT2LMHeadModel has 64",
        ),
        ({"max_new_tokens": 4, "num_beams": 101}, r"num_beams 101 exceeds the vocabulary of 100 tokens"),
        ({"max_new_tokens": 4, "do_sample": True, "temperature": 0.0}, r"temperature must be > 0"),
        ({"max_new_tokens": 4, "do_sample": True, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"max_new_tokens": 4, "do_sample": True, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"max_new_tokens": 4, "do_sample": True, "top_k": -1}, r"top_k must be a non-negative int"),
        ({"max_new_tokens": 4, "groups": 0}, r"groups must be an integer >= 1 \(groups: 0\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            pipe.generate(ids, attention_mask=mask, **kwargs)
    with pytest.raises(ValueError, match=r"every prompt needs at least one token \(empty prompts: \[1\]\)"):
        pipe.generate(ids, attention_mask=torch.stack([mask[0], torch.zeros_like(mask[1])]), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"every prompt needs at least one token"):
        pipe.generate(ids[:, :0], max_new_tokens=4)
    plain = Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), [1], chunks=1, devices=["cpu"]).eval()
    with pytest.raises(ValueError, match=r"build it from gpipe.generation.traced.cached_layers\(model\)"):
        plain.generate(ids, max_new_tokens=4)


# -- torch.distributed: two ranks, one stage each ------------------------------------------------------


# a case of the session's pool (tests/dist_harness.py: a few launches in all)
ACROSS = POOL.add(2, "generate llama", "generate_llama")


def test_every_rank_of_a_distributed_pipeline_generates_the_models_tokens(pool: Pool) -> None:
    results = pool(ACROSS)
    model, pipe = pipeline("llama", 1)
    ids, mask = prompts((6, 3, 5, 4))
    expected = {
        "greedy": hf(model, ids, mask, do_sample=False, eos_token_id=[EOS, 7, 11]),
        "beam": hf(model, ids, mask, do_sample=False, num_beams=3),
        "sample": pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, seed=5),
    }
    for got in results:
        for key, want in expected.items():
            assert torch.equal(got[key], want), key
