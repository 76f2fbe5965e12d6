"""Greedy and beam-search decoding: plain model, one-process pipelines and torch.distributed alike."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from gpipe import Pipeline
from gpipe.cache import Cache, LayerCache, layer_cache, using
from gpipe.data import EOS, PAD
from gpipe.decode import Chunk, beam_search, decode_batches, greedy
from gpipe.models.transformer import Output, transformer, transformer_lm
from tests.dist_harness import POOL, Pool

VOCAB = 20


def model_of(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = transformer(1, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0)
    # sharpen the logits: a random model's near-uniform predictions make eos rare and ties likely
    output = model[-1]
    assert isinstance(output, Output)
    with torch.no_grad():
        output.proj.weight.mul_(8.0)
    return model.eval()


def data(seed: int, batch: int = 5) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(3, VOCAB, (batch, 6), generator=g)
    source[0, 4:] = PAD  # a padded source sentence
    start = torch.randint(3, 7, (batch,), generator=g)
    return source, start


def pipeline_of(model: nn.Sequential, k: int, schedule: str = "gpipe") -> Pipeline:
    virtual = 2 if schedule == "zb-v" else 1
    balance = {1: [5], 2: [2, 3], 4: [1, 1, 1, 2]}[k * virtual]
    pipe = Pipeline(
        copy.deepcopy(model), balance, chunks=2, devices=["cpu"] * k, cpu_threads=1, schedule=schedule,
        virtual=virtual,
    )  # fmt: skip
    return pipe.eval()


def log_prob(model: nn.Module, source: Tensor, start: Tensor, tokens: Tensor) -> Tensor:
    """Each sentence's log-probability of ``tokens`` up to its first eos (all of them without)."""
    target_in = torch.cat([start.unsqueeze(1), tokens[:, :-1]], dim=1)
    with torch.no_grad():
        log_probs = F.log_softmax(model((source, target_in)).float(), dim=-1)
    picked = log_probs.gather(2, tokens.unsqueeze(2)).squeeze(2)
    ended = (tokens == EOS).long().cumsum(1)
    counted = (ended == 0) | ((ended == 1) & (tokens == EOS))
    return (picked * counted).sum(1)


def check_padded(out: Tensor) -> None:
    """After a sentence's eos only pad."""
    for row in out.tolist():
        if EOS in row:
            assert all(t == PAD for t in row[row.index(EOS) + 1 :]), row


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_one_is_greedy(seed: int, alpha: float) -> None:
    model = model_of(seed)
    source, start = data(seed)
    expected = greedy(model, source, start, max_len=10)
    assert expected.size(1) <= 10
    check_padded(expected)
    assert torch.equal(beam_search(model, source, start, beam=1, max_len=10, length_penalty=alpha), expected)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_pipeline_decodes_as_the_plain_model(k: int) -> None:
    model = model_of(3)
    source, start = data(3)
    pipe = pipeline_of(model, k)
    assert torch.equal(greedy(pipe, source, start, max_len=8), greedy(model, source, start, max_len=8))
    assert torch.equal(
        beam_search(pipe, source, start, beam=3, max_len=8), beam_search(model, source, start, beam=3, max_len=8)
    )


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("seed", [4, 5])
def test_cached_decoding_chooses_the_uncached_tokens(k: int, seed: int) -> None:
    """The stages' caches change nothing: every token is the uncached decoding's (which runs the
    whole prefix through the plain model at every step), greedy and beam, with groups in flight."""
    model = model_of(seed)
    source, start = data(seed, batch=7)
    pipe = pipeline_of(model, k)
    assert torch.equal(greedy(pipe, source, start, max_len=9), greedy(model, source, start, max_len=9, cache=False))
    for beam in (1, 2, 4):
        for alpha in (0.0, 0.6):
            expected = beam_search(model, source, start, beam=beam, max_len=9, length_penalty=alpha, cache=False)
            got = beam_search(pipe, source, start, beam=beam, max_len=9, length_penalty=alpha)
            assert torch.equal(got, expected), (beam, alpha)
    assert pipe.last_decode is not None and pipe.last_decode.steps > 0


@pytest.mark.parametrize("beam", [1, 4, 5])
def test_pad_is_never_chosen_so_cached_and_uncached_agree_for_every_seed(beam: int) -> None:
    """Plain T(3) models, whose random logits make PAD likely enough: a hypothesis holding PAD would be
    masked as padding when the uncached decoding runs the prefix again, and kept by the cached one."""
    for seed in range(20):
        torch.manual_seed(seed)
        model = transformer(3, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0).eval()
        source, start = data(seed, batch=4)
        got = beam_search(model, source, start, beam=beam, max_len=8)
        expected = beam_search(model, source, start, beam=beam, max_len=8, cache=False)
        assert torch.equal(got, expected), (seed, got, expected)
        for row in got.tolist():  # PAD only after eos
            assert PAD not in row[: row.index(EOS) if EOS in row else len(row)], (seed, row)


def test_an_inference_pipeline_needs_no_loss_and_refuses_to_train() -> None:
    pipe = pipeline_of(model_of(0), 2)  # built without loss_fn
    source, start = data(0)
    assert greedy(pipe, source, start, max_len=4).size(0) == source.size(0)
    with pytest.raises(TypeError, match=r"built without loss_fn .* Pipeline\(\.\.\., loss_fn=\.\.\.\) to train"):
        pipe.train().step((source, start.unsqueeze(1)), start)


def test_a_v_shaped_pipeline_decodes_with_its_first_and_last_stage_on_one_worker() -> None:
    model = model_of(6)
    source, start = data(6, batch=6)
    pipe = pipeline_of(model, 2, schedule="zb-v")  # stages 0 and 3 on worker 0
    assert pipe.engine.placement.worker_of == (0, 1, 1, 0)
    assert torch.equal(greedy(pipe, source, start, max_len=8), greedy(model, source, start, max_len=8, cache=False))
    assert torch.equal(
        beam_search(pipe, source, start, beam=3, max_len=8),
        beam_search(model, source, start, beam=3, max_len=8, cache=False),
    )
    with pytest.raises(ValueError, match="groups"):
        greedy(pipe, source, start, max_len=8, groups=2)  # 4 stages: 2 groups would deadlock on worker 0
    # one sentence: the placement's 3 groups in flight all the same, two of them empty
    assert torch.equal(
        greedy(pipe, source[:1], start[:1], max_len=8), greedy(model, source[:1], start[:1], max_len=8, cache=False)
    )


def test_a_stream_of_batches_refills_the_groups() -> None:
    """More batches than groups: a group that finishes starts the next batch (its caches cleared),
    each batch with its own length limit."""
    model = model_of(7)
    pipe = pipeline_of(model, 2)
    batches = []
    for i, size in enumerate((3, 1, 4, 2, 5)):
        source, start = data(20 + i, batch=size)
        batches.append(Chunk(source, start, 4 + i))
    for beam in (1, 3):
        got = decode_batches(pipe, batches, beam=beam)
        assert len(got) == len(batches)
        for chunk, tokens in zip(batches, got):
            expected = beam_search(model, chunk.source, chunk.start, beam=beam, max_len=chunk.max_len, cache=False)
            assert torch.equal(tokens, expected)


def test_finished_sentences_leave_the_rows() -> None:
    """A step computes only the sentences not yet finished: the rows the output layer sees at step t
    are the sentences without an eos before t."""
    model = model_of(8)
    source, start = data(8, batch=8)
    seen: list[int] = []
    model[-1].register_forward_hook(lambda module, inputs, output: seen.append(output.size(0)))
    out = greedy(model, source, start, max_len=10)
    finished_at = [row.index(EOS) if EOS in row else len(row) for row in out.tolist()]
    assert len(set(finished_at)) > 1  # (the test needs sentences that end at different steps)
    assert seen == [sum(1 for f in finished_at if f >= t) for t in range(len(seen))]


def test_the_caches_live_per_layer_and_reorder_by_row() -> None:
    torch.manual_seed(0)
    lm = transformer_lm(2, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0).eval()
    tokens = torch.randint(0, VOCAB, (3, 6))
    cache = Cache()
    with torch.no_grad():
        full = lm(tokens)
        with using(cache):
            first = lm(tokens[:, :4])
            block = cache.of(lm[1])
            assert block.tensors["self.k"].shape == (3, 2, 4, 8)  # (rows, heads, positions, head dim)
            cache.reorder(torch.tensor([2, 0, 1]))
            later = lm(tokens[[2, 0, 1], 4:])
    assert layer_cache(lm[1]) is None  # no decoding outside using()
    assert torch.allclose(torch.cat([first[[2, 0, 1]], later], 1), full[[2, 0, 1]], atol=1e-5)
    assert cache.nbytes == sum(c.nbytes for c in (cache.of(layer) for layer in lm))
    assert isinstance(cache.of(lm[1]), LayerCache) and len(cache) == len(lm)


def test_cached_transformer_layers_compute_what_the_whole_sequence_does() -> None:
    for head_dim in (None, 4):
        torch.manual_seed(1)
        model = transformer(2, 32, 2, dim=16, vocab=VOCAB, max_len=16, dropout=0.0, head_dim=head_dim).eval()
        source, _ = data(1)
        target = torch.randint(3, VOCAB, (5, 7))
        target[1, 3] = PAD  # a padding token among the target's keys
        with torch.no_grad():
            full = model((source, target))
            cache = Cache()
            with using(cache):
                steps = [model((source, target[:, :3]))] + [model((None, target[:, t : t + 1])) for t in range(3, 7)]
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5), head_dim


def test_beam_finds_no_worse_than_greedy() -> None:
    for seed in range(6):
        model = model_of(10 + seed)
        source, start = data(10 + seed, batch=6)
        g = greedy(model, source, start, max_len=8)
        b = beam_search(model, source, start, beam=4, max_len=8, length_penalty=0.0)
        check_padded(b)
        lp_g, lp_b = log_prob(model, source, start, g), log_prob(model, source, start, b)
        assert bool((lp_b >= lp_g - 1e-4).all()), (seed, lp_g, lp_b)


class Rigged(nn.Module):
    """Prefers token 7 and then eos at the step the start token names (2 for start=2+3, ...)."""

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        _, target_in = inputs
        n, t = target_in.shape
        logits = torch.zeros(n, t, VOCAB)
        logits[..., 7] = 5.0
        stop = target_in[:, 0] - 3  # the step (1-based) that should produce eos
        logits[..., EOS] = torch.where(stop == t, 10.0, -10.0).unsqueeze(1).expand(n, t)
        return logits


@pytest.mark.parametrize("beam", [None, 1, 3])
def test_a_model_that_ends_at_step_two_stops_and_pads(beam: int | None) -> None:
    source = torch.full((3, 4), 9)
    start = torch.tensor([5, 7, 5])  # eos at step 2, 4, 2
    model = Rigged().eval()
    out = (
        greedy(model, source, start, max_len=10)
        if beam is None
        else beam_search(model, source, start, beam=beam, max_len=10)
    )
    assert out.tolist() == [[7, EOS, PAD, PAD], [7, 7, 7, EOS], [7, EOS, PAD, PAD]]


def test_max_len_cuts_unfinished_sentences() -> None:
    model = Rigged().eval()
    source, start = torch.full((2, 4), 9), torch.tensor([5, 15])  # the second would stop at step 12
    assert greedy(model, source, start, max_len=3).tolist() == [[7, EOS, PAD], [7, 7, 7]]
    assert beam_search(model, source, start, beam=2, max_len=3).tolist() == [[7, EOS, PAD], [7, 7, 7]]


def test_bad_arguments_are_named() -> None:
    model = model_of(0)
    source, start = data(0)
    with pytest.raises(ValueError, match=r"beam must be an integer >= 1 \(beam: 0\)"):
        beam_search(model, source, start, beam=0, max_len=5)
    with pytest.raises(ValueError, match=r"max_len must be an integer >= 1 \(max_len: 0\)"):
        greedy(model, source, start, max_len=0)
    with pytest.raises(ValueError, match=r"max_len.*\(max_len: 2.5\)"):
        beam_search(model, source, start, beam=2, max_len=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"length_penalty.*\(length_penalty: -1\)"):
        beam_search(model, source, start, beam=2, max_len=5, length_penalty=-1)
    with pytest.raises(ValueError, match=r"eos and pad must differ \(eos: 0, pad: 0\)"):
        beam_search(model, source, start, beam=2, max_len=5, eos=PAD)
    with pytest.raises(ValueError, match=r"eos and pad must differ \(eos: 7, pad: 7\)"):
        decode_batches(model, [Chunk(source, start, 5)], eos=7, pad=7)
    with pytest.raises(ValueError, match=r"start has 4 tokens but source 5 sentences"):
        greedy(model, source, start[:4], max_len=5)
    with pytest.raises(ValueError, match=r"source must be a \(B, S\) tensor.*\(6,\)"):
        greedy(model, source[0], start, max_len=5)
    with pytest.raises(ValueError, match=r"start must be a \(B,\) tensor.*\(5, 1\)"):
        greedy(model, source, start.unsqueeze(1), max_len=5)
    with pytest.raises(ValueError, match=r"groups must be an integer >= 1 \(groups: 0\)"):
        greedy(model, source, start, max_len=5, groups=0)
    with pytest.raises(ValueError, match=r"cache=True needs a model of gpipe's Transformer layers.*Rigged"):
        greedy(Rigged().eval(), source, start, max_len=5, cache=True)
    with pytest.raises(ValueError, match="evaluation mode"):
        greedy(model.train(), source, start, max_len=5)


def test_a_model_returning_something_else_is_named() -> None:
    source, start = data(0)
    with pytest.raises(ValueError, match=r"logits \(N, T, vocab\).*\(5, 1\).*\(5, 20\)"):
        greedy(lambda inputs: torch.zeros(5, VOCAB), source, start, max_len=5)


# -- torch.distributed: one process per stage (gloo), a case of the session's pool (tests/dist_harness.py) --


def _stream() -> list[Chunk]:
    return [Chunk(*data(30 + i, batch=2 + i), 5 + i) for i in range(4)]


def decoded() -> dict[str, Any]:
    """What each of two (or four) ranks decodes (tests.dist_entry): greedy, beam search and a stream of
    batches."""
    model = model_of(3)
    source, start = data(3)
    balance = [2, 3] if int(os.environ["WORLD_SIZE"]) == 2 else [1, 1, 1, 2]
    pipe = Pipeline(model, balance, chunks=2, loss_fn=lambda out, target: out.sum()).eval()
    assert pipe.distributed and pipe.engine.placement.local_stages == (int(os.environ["RANK"]),)
    return {
        "greedy": greedy(pipe, source, start, max_len=8),
        "beam": beam_search(pipe, source, start, beam=3, max_len=8),
        "stream": decode_batches(pipe, _stream(), beam=2, groups=3),
    }


ACROSS = {w: POOL.add(w, f"decode-{w}", "test_decode:decoded") for w in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_of_a_distributed_pipeline_decodes_alike(pool: Pool, world: int) -> None:
    ranks = pool(ACROSS[world])
    model = model_of(3)
    source, start = data(3)
    expected = {
        "greedy": greedy(model, source, start, max_len=8, cache=False),
        "beam": beam_search(model, source, start, beam=3, max_len=8, cache=False),
    }
    stream = [beam_search(model, c.source, c.start, beam=2, max_len=c.max_len, cache=False) for c in _stream()]
    for rank, got in enumerate(ranks):
        for name in expected:
            assert torch.equal(got[name], expected[name]), (rank, name)
        assert len(got["stream"]) == len(stream)
        for tokens, want in zip(got["stream"], stream):
            assert torch.equal(tokens, want), rank
