"""`gpipe train --model hf`: a Hugging Face causal LM learns, whatever K, resumes, takes a config
file, refuses bad configs, and runs alike under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe.cli import main
from gpipe.data import PAD, SyntheticTranslation
from gpipe.data.text import CausalPairs
from gpipe.train import TrainConfig, parse, train
from tests.dist_harness import free_port

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
# A quick curve of the built-in GPT-2 on the built-in corpus: small batches, a short warm-up.
FLAGS: dict[str, Any] = {"model": "hf", "batch": 16, "lr": 2e-3, "warmup": 10, "eval_every": 60}


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def quick(out: Path, **kwargs: Any) -> TrainConfig:
    return TrainConfig(out=str(out), progress=False, **{**FLAGS, **kwargs})


@pytest.fixture(scope="module")
def curve(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[float]]:
    """120 steps on two stages (the default K=2, M=4, 1F1B): the run other tests compare with."""
    out = tmp_path_factory.mktemp("curve")
    return train(quick(out, steps=120)), losses(out)


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small config.json files, as save_pretrained writes them."""
    root = tmp_path_factory.mktemp("configs")
    small = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    transformers.LlamaConfig(**small, num_hidden_layers=3, num_key_value_heads=1, max_position_embeddings=32,
                             bos_token_id=1, eos_token_id=2).save_pretrained(root / "llama")  # fmt: skip
    gpt2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "bos_token_id": 1, "eos_token_id": 2}
    transformers.GPT2Config(**gpt2, vocab_size=40, n_positions=32).save_pretrained(root / "small-vocab")
    transformers.GPT2Config(**gpt2, vocab_size=64, n_positions=8).save_pretrained(root / "short")
    transformers.BertConfig(**small, num_hidden_layers=2).save_pretrained(root / "bert")
    transformers.T5Config(vocab_size=64, d_model=32, d_ff=32, d_kv=16, num_layers=1, num_heads=2).save_pretrained(
        root / "t5"
    )
    return root


def test_the_built_in_gpt2_learns_the_built_in_corpus(curve: tuple[dict[str, Any], list[float]]) -> None:
    result, curve_losses = curve
    first, last = sum(curve_losses[:5]) / 5, sum(curve_losses[-5:]) / 5
    assert last < first - 0.25, curve_losses
    assert result["eval_loss"] < result["baseline"] - 0.1, (result["eval_loss"], result["baseline"])


def test_one_stage_starts_as_two(tmp_path: Path, curve: tuple[dict[str, Any], list[float]]) -> None:
    train(quick(tmp_path, steps=2, partitions=1, chunks=1))
    assert losses(tmp_path) == pytest.approx(curve[1][:2], rel=1e-5)


def test_resume_continues_from_the_saved_step(tmp_path: Path, curve: tuple[dict[str, Any], list[float]]) -> None:
    train(quick(tmp_path, steps=2))
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000002"
    train(quick(tmp_path, steps=4, resume=True))
    assert losses(tmp_path) == pytest.approx(curve[1][:4], rel=1e-5)


def test_a_config_file_is_used(tmp_path: Path, configs: Path) -> None:
    config = configs / "llama" / "config.json"
    cfg = parse(["--model", "hf", "--hf-config", str(config), "--partitions", "5", "--steps", "2", "--batch", "8",
                 "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    assert cfg.model_layers()[0] == 5  # 3 decoder layers, the embeddings, the head
    result = train(cfg)
    assert result["step"] == 2
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert manifest["num_layers"] == 5


def test_a_text_file(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("".join(f"the {w} sat on the mat number {i}\n" for i, w in enumerate(["cat", "dog", "cow"] * 4)))
    result = train(quick(tmp_path / "out", data=str(text), steps=2, batch=8, eval_every=2))
    assert result["step"] == 2 and result["eval_loss"] == result["eval_loss"]  # (not NaN)


def test_pairs_become_one_sequence_with_the_loss_on_the_target() -> None:
    pairs = SyntheticTranslation()
    pair, causal = pairs.batch(4, 3), CausalPairs(pairs).batch(4, 3)
    assert torch.equal(causal.inputs, torch.cat([pair.source, pair.target_in], dim=1))
    assert (causal.target[:, : pairs.length] == PAD).all()
    assert torch.equal(causal.target[:, pairs.length :], pair.target_out)
    assert causal.count == pair.tokens


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "hf", "--layers", "8"], "--layers 8 sizes the built-in models, not --model hf"),
        (["--model", "hf", "--dim", "256"], "--dim 256 sizes the built-in models"),
        (["--hf-config", "{configs}/llama"], "--hf-config is for --model hf"),
        (["--model", "hf", "--hf-config", "{configs}/none.json"], "'{configs}/none.json': no such file"),
        (["--model", "hf", "--partitions", "7"], "--partitions 7 exceeds the model's 6 layers"),
        (["--model", "hf", "--hf-config", "{configs}/llama", "--dropout", "0.1"], "--dropout 0.1 applies to"),
        (["--model", "hf", "--hf-config", "{configs}/small-vocab"],
         "vocab_size 40 is smaller than the data's vocabulary of 55 tokens; set vocab_size to 55 or more"),
        (["--model", "hf", "--hf-config", "{configs}/short"],
         "8 positions (max_position_embeddings) are fewer than the data's sequence length of 18"),
        (["--model", "hf", "--hf-config", "{configs}/bert"], "the 'bert' model of the config sees later tokens"),
        (["--model", "hf", "--hf-config", "{configs}/t5"], "is a 't5' config, which is not a causal language model"),
    ],
)  # fmt: skip
def test_bad_flags_and_configs(
    tmp_path: Path, configs: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(configs=configs) for a in argv]
    assert main(["train", "--out", str(tmp_path / "x"), "--no-progress", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message.format(configs=configs) in err, err
    assert "Traceback" not in err


def test_torchrun_equals_one_process(tmp_path: Path, curve: tuple[dict[str, Any], list[float]]) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
        "-m", "gpipe", "train", *flags, "--steps=3", "--no-progress", f"--out={tmp_path}",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert losses(tmp_path) == pytest.approx(curve[1][:3], rel=1e-5)
