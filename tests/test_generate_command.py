"""`gpipe generate` continues prompts with a checkpoint of `gpipe train --model hf` on text, through
the run's own tokenizer: greedy and beam search give transformers' generate's tokens from the
checkpoint's weights whatever --partitions, seeded sampling the same text whatever --partitions, and
bad input is one line. `gpipe train --model hf` reports the held-out perplexity and a sample."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional

from gpipe.cli import main
from gpipe.data import PAD, SyntheticTranslation
from gpipe.data.text import CausalPairs, TextLines
from gpipe.data.vocab import Vocab
from gpipe.evaluation import SAMPLE_TOKENS
from gpipe.generate import Generator, Options
from gpipe.train import TrainConfig, train
from gpipe.train.metrics import eval_postfix
from gpipe.train.setup import make_data
from tests.dist_harness import ROOT, free_port

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

WORDS = ("the", "a", "cat", "dog", "cow", "sat", "ran", "on", "under", "mat", "hill", "small", "big")
PROMPTS = ["the cat sat", "a big dog ran on the", "small cow", "the dog sat under a big"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: these models are tiny, and threads waiting on each other cost more than
    they compute (much more on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in GPT-2 trained a little on a text file (its SentencePiece vocabulary trained on
    it), on two stages, evaluated at its last step."""
    root = tmp_path_factory.mktemp("lm")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "." for _ in range(200)]
    (root / "text.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    train(TrainConfig(out=str(root / "run"), model="hf", data=str(root / "text.txt"), steps=6, batch=8, chunks=2,
                      eval_every=3, partitions=2, lr=3e-3, warmup=3, progress=False, tensorboard="auto"))  # fmt: skip
    return root / "run"


@pytest.fixture(scope="module")
def exported(run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The run's newest checkpoint as transformers loads it (`gpipe export`): model and tokenizer."""
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    return model, transformers.AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def generators(run: Path) -> dict[int, Generator]:
    """The run's newest checkpoint on one stage and on two."""
    return {k: Generator(run, partitions=k) for k in (1, 2)}


def ours(generator: Generator, options: Options, **kwargs: Any) -> list[str]:
    return generator.generate(generator.encode(PROMPTS, options), options, **kwargs)


def theirs(exported: tuple[Any, Any], new: int, **kwargs: Any) -> list[str]:
    """transformers' generate's continuations of PROMPTS, one prompt at a time, as text up to EOS."""
    model, tokenizer = exported
    texts = []
    for prompt in PROMPTS:
        start = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]  # (as the run read documents)
        ids = torch.tensor([start + tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, pad_token_id=model.config.eos_token_id, **kwargs)
        continuation = out[0, ids.size(1) :].tolist()
        if model.config.eos_token_id in continuation:
            continuation = continuation[: continuation.index(model.config.eos_token_id)]
        texts.append(tokenizer.decode(continuation, skip_special_tokens=True))
    return texts


@pytest.mark.parametrize("partitions", [1, 2])
def test_greedy_and_beam_search_are_generates_whatever_the_partitions(
    generators: dict[int, Generator], exported: tuple[Any, Any], partitions: int
) -> None:
    # One prompt a group (no padding), as transformers generates one prompt at a time.
    generator, one = generators[partitions], {"batch": 1, "groups": 1}
    greedy = ours(generator, Options(max_new_tokens=6), **one)
    assert greedy == theirs(exported, 6, do_sample=False)
    assert len(greedy) == len(PROMPTS) and any(greedy)
    beam = ours(generator, Options(max_new_tokens=6, beam=2), **one)
    assert beam == theirs(exported, 6, do_sample=False, num_beams=2)


def test_batched_and_sampled_text_is_the_same_whatever_the_partitions(generators: dict[int, Generator]) -> None:
    two = {"batch": 2, "groups": 2}
    greedy = [ours(generators[k], Options(max_new_tokens=5), **two) for k in (1, 2)]
    assert greedy[0] == greedy[1]
    sampled = [ours(generators[k], Options(max_new_tokens=5, sample=True, seed=1), **two) for k in (1, 2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == len(PROMPTS)
    flat = Options(max_new_tokens=5, sample=True, seed=2, top_k=0, temperature=2.0)
    assert ours(generators[2], flat, **two) != sampled[0]  # (another seed, flatter draws: other text)
    # Without max_new_tokens: 32 at most, and no more than the model's positions leave (here fewer).
    generator = generators[2]
    room = generator.positions - max(map(len, generator.encode(PROMPTS, Options())))
    assert 0 < room < 32
    assert ours(generator, Options()) == ours(generator, Options(max_new_tokens=room))


def test_the_command_reads_prompts_and_writes_continuations(
    run: Path, generators: dict[int, Generator], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "prompts.txt").write_text("".join(p + "\n" for p in PROMPTS), encoding="utf-8")
    argv = ["generate", "--checkpoint", str(run), "--input", str(tmp_path / "prompts.txt")]
    assert main([*argv, "--output", str(tmp_path / "out.txt"), "--partitions", "2", "--max-new-tokens", "4"]) == 0
    expected = ours(generators[2], Options(max_new_tokens=4), batch=16)
    assert (tmp_path / "out.txt").read_text(encoding="utf-8") == "".join(t + "\n" for t in expected)
    err = capsys.readouterr().err
    assert "generating: 4/4 prompts" in err and "generated with caches of at most stage 0:" in err, err


@pytest.mark.parametrize(
    ("flags", "prompts", "message"),
    [
        (["--max-new-tokens", "0"], PROMPTS, "--max-new-tokens must be at least 1 (got 0)"),
        ([], ["the cat", "  ", "a dog"], "line 2 of --input '{input}' is empty: give one prompt a line"),
        ([], ["the cat", "cat " * 200], "line 2 of --input '{input}': a prompt of {long} tokens leaves none of the "
                                        "model's {positions} positions for new tokens: shorten it to at most {fewer}"),
        (["--max-new-tokens", "{positions}"], ["the cat"], "line 1 of --input '{input}': a prompt of {short} tokens "
                                                           "and --max-new-tokens {positions} make {more} positions, "
                                                           "more than the model's {positions}: lower --max-new-tokens "
                                                           "to {fits}, or shorten the prompt"),
        (["--beam", "1000"], PROMPTS, "--beam 1000 exceeds the model's vocabulary of {vocab} tokens"),
        (["--sample", "--temperature", "0"], PROMPTS, "--temperature must be > 0 (got 0.0)"),
        (["--sample", "--top-p", "0"], PROMPTS, "--top-p must be in (0, 1] (got 0.0)"),
        (["--sample", "--top-p", "1.5"], PROMPTS, "--top-p must be in (0, 1] (got 1.5)"),
        (["--sample", "--top-k", "-1"], PROMPTS, "--top-k must be >= 0 (got -1)"),
        (["--sample", "--beam", "2"], PROMPTS, "--beam 2 with --sample: beam sampling is not supported"),
        (["--temperature", "0.5"], PROMPTS, "--temperature applies to --sample only: add --sample, or leave it out"),
        (["--partitions", "7"], PROMPTS, "--partitions 7 exceeds the model's 6 layers"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], prompts: list[str], message: str
) -> None:
    checkpoint = run / "checkpoints" / "step-00000006"
    config = json.loads((checkpoint / "config.json").read_text())
    vocab = Vocab(checkpoint / "vocab.model")
    short, positions = 1 + len(vocab.encode("the cat")), config["n_positions"]  # (<s> first)
    values = {"positions": positions, "vocab": config["vocab_size"], "input": tmp_path / "prompts.txt",
              "long": 1 + len(vocab.encode("cat " * 200)), "short": short, "more": short + positions,
              "fits": positions - short, "fewer": positions - 1}  # fmt: skip
    (tmp_path / "prompts.txt").write_text("".join(p + "\n" for p in prompts), encoding="utf-8")
    argv = ["generate", "--checkpoint", str(run), "--input", str(tmp_path / "prompts.txt")]
    assert main([*argv, *(f.format(**values) for f in flags)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message.format(**values) in err, err


def test_runs_that_are_not_of_text_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for model, data, expected in [
        ("transformer", "ParallelCorpus", "is of a --model transformer run: gpipe generate continues text with runs "
                                          "of gpipe train --model hf (for a translation run: gpipe translate)"),
        ("hf", "CausalPairs", "is of a run that read token ids, not text"),
    ]:  # fmt: skip
        folder = tmp_path / model
        folder.mkdir()
        (folder / "run.json").write_text(json.dumps({"config": {"model": model}, "data": data}))
        (folder / "manifest.json").write_text("{}")  # (what makes a checkpoint folder complete)
        assert main(["generate", "--checkpoint", str(folder)]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err


def test_gpipe_translate_points_a_text_run_to_gpipe_generate(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run keeps a vocab.model (its tokenizer): gpipe translate says what the run is instead."""
    assert (run / "checkpoints" / "step-00000006" / "vocab.model").is_file()
    assert main(["translate", "--checkpoint", str(run), "--to", "de"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: --checkpoint {str(run)!r} is of a causal language model (gpipe train --model hf) trained on text, "
        f"which continues text rather than translating it: continue prompts with gpipe generate --checkpoint {run}\n"
    )


def test_a_pairs_sample_prompt_is_its_source_and_the_targets_tag() -> None:
    pairs = SyntheticTranslation()
    pair = pairs.batch(1, 0, split="eval")
    causal = CausalPairs(pairs)
    assert causal.sample_prompt() == [*pair.source[0].tolist(), int(pair.target_in[0, 0])]
    assert causal.text(pair.target_out[0].tolist()) == pairs.detokenize(pair.target_out[0].tolist()) != ""


def test_training_reports_the_perplexity_and_a_sample(run: Path, exported: tuple[Any, Any]) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evaluations] == [3, 6]
    last = evaluations[-1]
    # The perplexity: exp of the token-mean cross entropy, without label smoothing, over the held-out
    # batches, from the checkpoint's weights.
    settings = json.loads((run / "checkpoints" / "step-00000006" / "run.json").read_text())["config"]
    cfg = TrainConfig(**{k: v for k, v in settings.items() if k in TrainConfig.__dataclass_fields__})
    data = make_data(cfg)
    model, _ = exported
    total, tokens = 0.0, 0
    for i in range(cfg.eval_batches):
        held = data.batch(cfg.batch, i, split="eval")
        with torch.no_grad():
            logits = model(held.inputs).logits
        total += float(
            functional.cross_entropy(logits.flatten(0, 1), held.target.flatten(), ignore_index=PAD, reduction="sum")
        )
        tokens += int((held.target != PAD).sum())
    assert last["eval_perplexity"] == pytest.approx(math.exp(total / tokens), rel=1e-4)
    assert last["eval_loss"] != pytest.approx(total / tokens, rel=1e-3)  # (label smoothing's loss is not it)
    # The sample: a held-out document's start, and the model's greedy continuation (as many tokens as
    # the model's positions leave, at most SAMPLE_TOKENS).
    assert isinstance(data, TextLines)
    prompt = data.sample_prompt()
    new = min(SAMPLE_TOKENS, model.config.n_positions - len(prompt))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             pad_token_id=model.config.eos_token_id)[0, len(prompt) :].tolist()  # fmt: skip
    if model.config.eos_token_id in out:
        out = out[: out.index(model.config.eos_token_id)]
    assert last["sample"] == f"{data.text(prompt)} → {data.text(out)}"
    assert all("sample" in r and "eval_perplexity" in r for r in evaluations)
    shown = eval_postfix(last)  # (the progress bar's)
    assert shown["eval_perplexity"] == f"{last['eval_perplexity']:.2f}"
    assert shown["sample"].startswith(repr(last["sample"])[:20])


def test_tensorboard_holds_the_perplexity_and_the_sample(run: Path) -> None:
    pytest.importorskip("tensorboard")
    evaluations = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("eval_perplexity")]
    assert scalars == [(r["step"], pytest.approx(r["eval_perplexity"], rel=1e-6)) for r in evaluations]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("sample/text_summary")]
    assert texts == [(r["step"], r["sample"]) for r in evaluations]


def test_a_model_that_cannot_generate_trains_without_a_sample_and_generate_refuses_it(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # BLOOM's forward takes no position_ids (ALiBi): cached_layers does not cover it, to_sequential does.
    transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2, bos_token_id=1,
                             eos_token_id=2).save_pretrained(tmp_path / "bloom")  # fmt: skip
    text = run.parent / "text.txt"
    train(TrainConfig(out=str(tmp_path / "run"), model="hf", hf_config=str(tmp_path / "bloom"), data=str(text),
                      tokenizer=str(run / "vocab.model"), steps=1, batch=4, eval_every=1, partitions=2, progress=False,
                      tensorboard="off"))  # fmt: skip
    assert "note: evaluations show no sample generation: BloomForCausalLM.forward takes no position_ids" in (
        capsys.readouterr().err
    )
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["eval_perplexity"] > 1 and "sample" not in row
    (tmp_path / "prompts.txt").write_text("the cat\n")
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--input", str(tmp_path / "prompts.txt")]) == 2
    err = capsys.readouterr().err
    assert "the run's model cannot generate through a pipeline: BloomForCausalLM.forward takes no position_ids" in err
    assert err.count("\n") == 1, err


def test_a_llama_read_with_a_tokenizer_json_gives_generates_text(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.test_export import _tokenizer_json

    text = run.parent / "text.txt"
    file = _tokenizer_json(tmp_path / "tok", text, ["<pad>", "<s>", "</s>", "<unk>"],
                           {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})  # fmt: skip
    size = len(json.loads(file.read_text())["model"]["vocab"])
    transformers.LlamaConfig(vocab_size=size, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=1,
                             eos_token_id=2).save_pretrained(tmp_path / "llama")  # fmt: skip
    train(TrainConfig(out=str(tmp_path / "run"), model="hf", hf_config=str(tmp_path / "llama"), data=str(text),
                      tokenizer=str(file), steps=2, batch=8, eval_every=2, partitions=2, lr=3e-3, progress=False,
                      tensorboard="off"))  # fmt: skip
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    generator = Generator(tmp_path / "run", partitions=2)
    texts = ours(generator, Options(max_new_tokens=6), batch=1, groups=1)
    assert texts == theirs((model, tokenizer), 6) and any(texts), texts
    assert "sample" in json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])


def test_torchrun_generates_what_one_process_does(run: Path, generators: dict[int, Generator], tmp_path: Path) -> None:
    """A process per stage (gloo): seeded sampling, whose tokens are drawn where the last stage runs
    and shared, writes the text of one process with two stages."""
    (tmp_path / "prompts.txt").write_text("".join(p + "\n" for p in PROMPTS), encoding="utf-8")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
        "-m", "gpipe", "generate", f"--checkpoint={run}", f"--input={tmp_path / 'prompts.txt'}",
        f"--output={tmp_path / 'out.txt'}", "--sample", "--seed=1", "--max-new-tokens=5", "--batch=2", "--groups=2",
        "--quiet",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected = ours(generators[2], Options(max_new_tokens=5, sample=True, seed=1), batch=2, groups=2)
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines() == expected
