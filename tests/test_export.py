"""`gpipe train --model hf` on text reads it with a real tokenizer (a SentencePiece vocabulary trained on
the text, or a local tokenizer.json), every checkpoint keeps the model's config.json and that tokenizer,
and `gpipe export` writes a folder transformers loads that gives the pipelined model's logits."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe.balance import balance_by_flops
from gpipe.cli import main
from gpipe.data import BOS, EOS, PAD
from gpipe.data.text import TextLines
from gpipe.data.vocab import Vocab
from gpipe.pipeline import Pipeline
from gpipe.saving import load
from gpipe.train import TrainConfig, train
from gpipe.train.setup import make_data, make_model

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ("the", "a", "cat", "dog", "cow", "sat", "ran", "on", "under", "mat", "hill", "small", "big", "über", "naïve",
         "café", "quickly", "slowly")  # fmt: skip
FLAGS: dict[str, Any] = {"model": "hf", "steps": 2, "batch": 8, "chunks": 2, "eval_every": 2, "progress": False,
                         "tensorboard": "off"}  # fmt: skip


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Plain text, a document a line (no tab: not pairs)."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + f", {i}." for i in range(200)]
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _tokenizer_json(folder: Path, text: Path, specials: list[str], config: dict[str, str] | None) -> Path:
    """A BPE tokenizer.json trained on ``text`` (``specials`` first, ids 0, 1, ...), with a
    tokenizer_config.json beside it naming ``config``'s special tokens, if given."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=150, special_tokens=specials)
    tok.train([str(text)], trainer)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def gpt2_run(text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in GPT-2 on the text, with the SentencePiece vocabulary the run trains."""
    out = tmp_path_factory.mktemp("gpt2")
    train(TrainConfig(out=str(out), data=str(text), partitions=2, **FLAGS))
    return out


@pytest.fixture(scope="module")
def llama_run(text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama on the text, read with a tokenizer.json given as --tokenizer."""
    root = tmp_path_factory.mktemp("llama")
    file = _tokenizer_json(root / "tok", text, ["<pad>", "<s>", "</s>", "<unk>"],
                           {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})  # fmt: skip
    size = tokenizers.Tokenizer.from_file(str(file)).get_vocab_size()
    transformers.LlamaConfig(vocab_size=size, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=64, num_hidden_layers=2, max_position_embeddings=128, bos_token_id=1,
                             eos_token_id=2).save_pretrained(root / "config")  # fmt: skip
    out = root / "run"
    train(TrainConfig(out=str(out), data=str(text), hf_config=str(root / "config"), tokenizer=str(file),
                      partitions=3, **FLAGS))  # fmt: skip
    return out


def _newest(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def _pipelined_logits(run: Path, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out inputs of the run's data and the logits of the run's model, pipelined in two stages,
    at its newest checkpoint."""
    settings = json.loads((_newest(run) / "run.json").read_text())["config"]
    cfg = TrainConfig(**{k: v for k, v in settings.items() if k in TrainConfig.__dataclass_fields__})
    data = make_data(cfg)
    model = make_model(cfg, data)
    inputs = data.batch(rows, 0, split="eval").inputs
    pipe = Pipeline(model, balance_by_flops(2, model, inputs), chunks=1, devices=["cpu", "cpu"],
                    loss_fn=lambda output, target: output.logits.sum())  # fmt: skip
    load(pipe, _newest(run))
    pipe.eval()
    with torch.no_grad():
        return inputs, pipe(inputs).logits


@pytest.mark.parametrize("name", ["gpt2_run", "llama_run"])
def test_the_export_loads_in_transformers_with_the_pipelined_models_logits(
    name: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run: Path = request.getfixturevalue(name)
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "exported step 2" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    inputs, expected = _pipelined_logits(run)
    with torch.no_grad():
        logits = model(inputs).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    fresh = transformers.AutoModelForCausalLM.from_config(model.config)  # (the weights are the checkpoint's)
    with torch.no_grad():
        assert not torch.allclose(fresh(inputs).logits, expected, atol=1e-3)


def test_text_is_read_with_the_sentencepiece_vocabulary_the_run_trains(gpt2_run: Path, text: Path) -> None:
    vocab = Vocab(gpt2_run / "vocab.model")
    settings = json.loads((_newest(gpt2_run) / "run.json").read_text())["config"]
    data = make_data(TrainConfig(**{k: v for k, v in settings.items() if k in TrainConfig.__dataclass_fields__}))
    assert isinstance(data, TextLines) and data.vocab == vocab.size
    lines = set(text.read_text(encoding="utf-8").splitlines())
    for row in data.splits["train"][:20].tolist():
        ids = [i for i in row if i != PAD]
        assert ids[0] == BOS and ids[-1] == EOS  # (no line is cut: the longest sets the length)
        assert vocab.decode(ids) in lines
    assert (_newest(gpt2_run) / "vocab.model").read_bytes() == (gpt2_run / "vocab.model").read_bytes()
    config = json.loads((_newest(gpt2_run) / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["eos_token_id"]) == ("gpt2", vocab.size, EOS)


def test_resume_reads_the_runs_vocabulary_and_keeps_config_and_tokenizer(
    gpt2_run: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(gpt2_run, run, ignore=shutil.ignore_patterns(".lock"))
    train(TrainConfig(out=str(run), data=str(text), partitions=2, resume=True, **{**FLAGS, "steps": 3}))
    step2, step3 = run / "checkpoints" / "step-00000002", _newest(run)
    assert step3.name == "step-00000003"
    for name in ("config.json", "vocab.model"):
        assert (step3 / name).read_bytes() == (step2 / name).read_bytes()
    tokenizer = _tokenizer_json(tmp_path / "t", text, ["<pad>", "<s>", "</s>"], {"eos_token": "</s>"})
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--tokenizer", str(tokenizer)]) == 2
    assert "--resume: --tokenizer " in capsys.readouterr().err  # (a run cannot change its tokens midway)


def test_the_exported_tokenizer_gives_the_runs_ids(gpt2_run: Path, llama_run: Path, text: Path, tmp_path: Path) -> None:
    lines = text.read_text(encoding="utf-8").splitlines()
    lines += ["  spaces  and\ttabs ", "\uff26\uff35\uff2c\uff2c width and \u2713 unknown"]
    assert main(["export", "--checkpoint", str(gpt2_run), "--out", str(tmp_path / "gpt2")]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "gpt2")
    vocab = Vocab(gpt2_run / "vocab.model")
    for line in lines:
        assert exported(line, add_special_tokens=False)["input_ids"] == vocab.encode(line), line
        assert exported(line)["input_ids"][0] == BOS  # a prompt starts as training's documents do
    assert (exported.bos_token_id, exported.eos_token_id) == (BOS, EOS)
    assert (tmp_path / "gpt2" / "vocab.model").read_bytes() == (gpt2_run / "vocab.model").read_bytes()

    assert main(["export", "--checkpoint", str(llama_run), "--out", str(tmp_path / "llama")]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "llama")
    given = transformers.PreTrainedTokenizerFast(tokenizer_file=str(llama_run.parent / "tok" / "tokenizer.json"))
    for line in lines:
        assert exported(line, add_special_tokens=False)["input_ids"] == given(line)["input_ids"], line
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    assert exported.eos_token_id == model.generation_config.eos_token_id == 2
    prompt = exported(lines[0], return_tensors="pt")["input_ids"]
    assert model.generate(prompt, max_new_tokens=3, do_sample=False).shape[1] <= prompt.shape[1] + 3


def test_overwrite_replaces_a_folder_and_nothing_else(
    gpt2_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("earlier")
    assert main(["export", "--checkpoint", str(gpt2_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {str(out)!r} is not empty (it holds old.txt); give a new or empty folder, or add --overwrite" in err
    assert (out / "old.txt").exists()
    assert main(["export", "--checkpoint", str(gpt2_run), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left behind


@pytest.fixture(scope="module")
def transformer_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("transformer")
    train(TrainConfig(out=str(out), steps=1, batch=4, partitions=1, chunks=1, progress=False, tensorboard="off"))
    return out


def test_a_tokenizer_config_must_name_eos_and_may_name_bos(text: Path, tmp_path: Path) -> None:
    """As --tokenizer's help says: every document ends with the eos_token, and starts with the
    bos_token only where the tokenizer_config.json names one."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    for config, first in [({"eos_token": "</s>"}, None), ({"bos_token": "<s>", "eos_token": "</s>"}, 1)]:
        file = _tokenizer_json(tmp_path / str(len(config)), text, specials, config)
        data = make_data(TrainConfig(out=str(tmp_path / "run"), data=str(text), tokenizer=str(file), **FLAGS))
        assert isinstance(data, TextLines) and (data.bos, data.eos) == (first, 2)
        rows = torch.cat(list(data.splits.values()))
        assert ((rows[:, 0] == 1) == (first is not None)).all()  # (the text itself never gives id 1, <s>)
        assert all(2 in row.tolist() or PAD not in row.tolist() for row in rows)  # each ends with </s>, or is cut


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "--checkpoint '{tmp}/none': no such folder"),
        ("empty", "--checkpoint '{tmp}/empty' holds no checkpoint of gpipe train"),
        ("transformer", "is of a --model transformer run: gpipe export writes transformers models, of runs of "
                        "gpipe train --model hf"),
        ("file", "--out '{tmp}/file' is a file; name a folder"),
        ("the run", "--out '{run}' holds the checkpoint being exported; give another folder"),
        ("inside", "is inside the checkpoint being exported; give a folder outside it"),
        ("another run", "--out '{other}' holds a run of gpipe train, which --overwrite does not delete"),
        ("no config", "holds no config.json: a checkpoint of a gpipe train older than gpipe export"),
    ],
)  # fmt: skip
def test_bad_checkpoints_and_outs_are_one_line_errors(
    case: str, message: str, gpt2_run: Path, transformer_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint, out = str(gpt2_run), str(tmp_path / "hf")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    if case == "missing":
        checkpoint = str(tmp_path / "none")
    elif case == "empty":
        checkpoint = str(tmp_path / "empty")
    elif case == "transformer":
        checkpoint = str(transformer_run)
    elif case == "file":
        out = str(tmp_path / "file")
    elif case == "the run":
        out = str(gpt2_run)
    elif case == "inside":
        out = str(_newest(gpt2_run) / "hf")
    elif case == "another run":
        out = str(transformer_run)
    else:
        copy = tmp_path / "copy"
        shutil.copytree(_newest(gpt2_run), copy)
        (copy / "config.json").unlink()
        checkpoint = str(copy)
    before = sorted(p.name for p in Path(out).iterdir()) if Path(out).is_dir() else None
    assert main(["export", "--checkpoint", checkpoint, "--out", out, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message.format(tmp=tmp_path, run=gpt2_run, other=transformer_run) in err, err
    assert (sorted(p.name for p in Path(out).iterdir()) if Path(out).is_dir() else None) == before


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("not hf", "--tokenizer is for --model hf on --data TEXT, a text file (model: 'transformer'"),
        ("no data", "--tokenizer is for --model hf on --data TEXT, a text file (model: 'hf', data: '')"),
        ("missing", "--tokenizer '{tmp}/none.json': no such file or folder"),
        ("vocab size", "--vocab-size 100 sizes the vocabulary trained on the text, and --tokenizer"),
        ("pairs", "--tokenizer is for text, a document a line; --data '{tmp}/pairs.tsv' holds source<TAB>target"),
        ("no eos", "does not say which token ends a document (its special tokens: '<pad>', '<s>', '</s>', '<unk>')"),
        ("not a token", "eos_token '<end>' is not a token of"),
        ("id 0 in text", "which is gpipe's padding, left out of the loss; give a tokenizer whose id 0 is a special"),
        ("eos of the config", "eos_token_id 5 is not the tokenizer's end of a document, id 2; set eos_token_id to 2"),
    ],
)  # fmt: skip
def test_bad_tokenizers_are_one_line_errors(
    case: str, message: str, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    argv = ["--model", "hf", "--data", str(text)]
    if case == "not hf":
        argv = ["--tokenizer", str(text)]
    elif case == "no data":
        argv = ["--model", "hf", "--tokenizer", str(text)]
    elif case == "missing":
        argv += ["--tokenizer", str(tmp_path / "none.json")]
    elif case == "vocab size":
        argv += ["--tokenizer", str(_tokenizer_json(tmp_path / "t", text, specials, {"eos_token": "</s>"})),
                 "--vocab-size", "100"]  # fmt: skip
    elif case == "pairs":
        (tmp_path / "pairs.tsv").write_text("a b\tc d\ne f\tg h\n")
        file = _tokenizer_json(tmp_path / "t", text, specials, {"eos_token": "</s>"})
        argv = ["--model", "hf", "--data", str(tmp_path / "pairs.tsv"), "--tokenizer", str(file)]
    elif case == "no eos":
        argv += ["--tokenizer", str(_tokenizer_json(tmp_path / "t", text, specials, None))]
    elif case == "not a token":
        argv += ["--tokenizer", str(_tokenizer_json(tmp_path / "t", text, specials, {"eos_token": "<end>"}))]
    elif case == "id 0 in text":  # id 0 is a letter, found in the text, not a special token
        argv += ["--tokenizer", str(_tokenizer_json(tmp_path / "t", text, ["</s>"], {"eos_token": "</s>"}))]
        tokenizer = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        first = min(vocab, key=vocab.get)
        vocab[first], vocab["</s>"] = vocab["</s>"], vocab[first]  # </s> is no longer 0; a letter is
        tokenizer["added_tokens"][0]["id"] = vocab["</s>"]
        (tmp_path / "t" / "tokenizer.json").write_text(json.dumps(tokenizer))
    else:
        transformers.LlamaConfig(vocab_size=8000, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=64, num_hidden_layers=2, max_position_embeddings=128,
                                 bos_token_id=1, eos_token_id=5).save_pretrained(tmp_path / "config")  # fmt: skip
        argv += ["--hf-config", str(tmp_path / "config")]
    assert main(["train", "--out", str(tmp_path / "out"), "--steps", "1", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err, err
    assert "Traceback" not in err
