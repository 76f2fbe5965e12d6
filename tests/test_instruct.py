"""Instruction and chat data (gpipe.data.records, chat, instruct): the loss counts the answers alone,
packed rows train as their examples one per row, bad records are refused with their file and line,
and a fine-tuned chat model answers through ``gpipe generate --chat`` as transformers does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional

from gpipe.cli import main
from gpipe.data.instruct import IGNORE, InstructionData, pack_rows
from gpipe.data.records import RecordError
from gpipe.data.tokenizer import HFTokenizer
from gpipe.train import train
from gpipe.train.config import TrainConfig
from gpipe.train.setup import make_data, make_losses, make_model, make_pipeline
from tests import chat_data
from tests.dist_harness import POOL, Pool

transformers = pytest.importorskip("transformers")

FLAGS: dict[str, Any] = {"model": "hf", "batch": 6, "chunks": 2, "max_length": 96, "label_smoothing": 0.0,
                         "progress": False, "tensorboard": "off"}  # fmt: skip


def _files(root: Path) -> dict[str, Path]:
    """The model folder and the record files, written once in ``root`` (the pool's case reads them)."""
    paths = {"model": root / "llama", "chat": root / "chat.jsonl", "completion": root / "completion.jsonl"}
    if not (root / "complete").exists():
        chat_data.model_folder(paths["model"])
        chat_data.write(paths["chat"], chat_data.chat_records(60, longest=30))
        chat_data.write(paths["completion"], chat_data.completion_records(60, longest=30))
        (root / "complete").touch()
    return paths


def _pool_files(pool_root: Path) -> dict[str, Path]:
    return _files(pool_root / "instruct")


@pytest.fixture(scope="module")
def files(pool: Pool) -> dict[str, Path]:
    return pool.written(_pool_files)


SCHEDULES = ("gpipe", "zb-h1")
TORCHRUN = {
    schedule: POOL.add(2, f"instruct packed {schedule}", "dist_init:packed_step", prepare=_pool_files, timeout=180,
                       folder="{pool}/instruct/llama", data="{pool}/instruct/chat.jsonl", schedule=schedule)
    for schedule in SCHEDULES
}  # fmt: skip


def _by_hand(folder: Path, record: dict[str, Any], tokenizer: HFTokenizer) -> tuple[list[int], list[int]]:
    """A record's tokens and labels built by hand, turn by turn, as ChatML lays them out (the test
    tokenizer splits at spaces and special tokens, so pieces tokenize as the whole does): -100 but
    on an assistant's content and its end of turn; a completion's prompt -100 after BOS."""
    fast = tokenizer.tokenizer
    ids: list[int] = []
    labels: list[int] = []

    def add(text: str, counted: bool) -> None:
        piece = fast(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        labels.extend(piece if counted else [IGNORE] * len(piece))

    if "messages" in record:
        for message in record["messages"]:
            add(f"<|im_start|>{message['role']}\n", False)
            add(message["content"], message["role"] == "assistant")
            add("<|im_end|>", message["role"] == "assistant")
    else:
        add("<s>", False)
        add(record["prompt"], False)
        add(record["completion"], True)
        add("<|im_end|>", True)
    return ids, labels


@pytest.mark.parametrize(
    ("kind", "k", "on_prompt"),
    [("chat", 1, False), ("chat", 2, True), ("completion", 2, False), ("completion", 1, True)],
)
def test_the_loss_counts_exactly_the_answers_tokens(files: dict[str, Path], kind: str, k: int, on_prompt: bool) -> None:
    """The pipeline's loss on a batch (K = 1 and 2) is the plain model's cross-entropy over the
    answers' tokens, labels -100 on the prompts, built by hand; --train-on-prompt counts every token."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(files["model"]), dtype=torch.float32).eval()
    tokenizer = HFTokenizer(files["model"])
    records = [json.loads(line) for line in files[kind].read_text().splitlines()]
    cfg = TrainConfig(**FLAGS, init=str(files["model"]), data=str(files[kind]), partitions=k,
                      train_on_prompt=on_prompt)  # fmt: skip
    cfg.check()
    data = make_data(cfg)
    assert isinstance(data, InstructionData)
    losses = make_losses(cfg, data)
    pipe = make_pipeline(cfg, make_model(cfg, data), data, losses, distributed=False)
    batch = data.batch(cfg.batch, 3)
    loss = float(pipe.step(batch.inputs, batch.target))
    found = [_by_hand(files["model"], r, tokenizer) for r in records]
    total, count = 0.0, 0
    for row in range(cfg.batch):  # each row is one example: found by its tokens among the records
        tokens = batch.inputs[row].tolist()
        ids, labels = next((i, lab) for i, lab in found if i[:-1] == tokens[: len(i) - 1])
        if on_prompt:
            labels = ids
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0, :-1]
        target = torch.tensor(labels[1:])
        total += float(functional.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum"))
        count += int((target != IGNORE).sum())
    assert batch.count == count
    assert loss == pytest.approx(total / count, rel=1e-5, abs=1e-6), (kind, on_prompt, k)


def test_packed_rows_train_as_their_examples_one_per_row(files: dict[str, Path]) -> None:
    """The first step of a packed batch and of the same examples one per row: the same loss and
    gradients (1e-5), at K = 1 and 2; the packed rows hold examples end to end, positions restarting."""
    for k in (1, 2):
        runs = {}
        for pack in (True, False):
            cfg = TrainConfig(**FLAGS, init=str(files["model"]), data=str(files["chat"]), partitions=k, pack=pack)
            cfg.check()
            data = make_data(cfg)
            assert isinstance(data, InstructionData)
            runs[pack] = (cfg, data, make_pipeline(cfg, make_model(cfg, data), data, make_losses(cfg, data),
                                                   distributed=False))  # fmt: skip
        _, packed_data, packed_pipe = runs[True]
        _, plain_data, plain_pipe = runs[False]
        rows = packed_data.rows["train"][:3]
        assert sum(len(r) for r in rows) > 6  # (several examples a row)
        packed = packed_data.make("train", rows)
        plain = plain_data.make("train", [[i] for row in rows for i in row])
        positions = packed.inputs["position_ids"][0].tolist()
        starts = [0]
        for i in rows[0][:-1]:
            starts.append(starts[-1] + len(packed_data.document("train", i)[0]) - 1)
        assert [positions[s] for s in starts] == [0] * len(starts) and positions[1] == 1
        assert packed.count == plain.count
        losses = [float(pipe.step(b.inputs, b.target)) for pipe, b in ((packed_pipe, packed), (plain_pipe, plain))]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5), k
        grads = [dict((n, p.grad) for n, p in pipe.named_parameters()) for pipe in (packed_pipe, plain_pipe)]
        assert grads[0].keys() == grads[1].keys()
        for name, grad in grads[0].items():
            torch.testing.assert_close(grad, grads[1][name], rtol=1e-5, atol=1e-5, msg=f"K={k} {name}")


def test_packing_fills_rows_deterministically_and_pads_little(files: dict[str, Path]) -> None:
    """Best-fit packing in a seeded order: the same rows for the same seed, each within its length;
    on long-tailed answers the packed batches' padding is small where one example a row wastes most."""
    lengths = [3, 9, 2, 7, 5, 5, 1, 8]
    rows = pack_rows(lengths, 10, seed=1)
    assert rows == pack_rows(lengths, 10, seed=1) and rows != pack_rows(lengths, 10, seed=2)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows) and len(rows) == 4  # (40 tokens: 4 full rows)
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([11], 10, seed=0)
    tokenizer = HFTokenizer(files["model"])
    long_tail = chat_data.write(files["model"].parent / "tail.jsonl", chat_data.chat_records(200, seed=3, longest=60))
    padding = {}
    for pack in (True, False):
        data = InstructionData(long_tail, tokenizer, length=160, seed=0, pack=pack)
        padding[pack] = sum(data.batch(8, s).padding for s in range(20)) / 20
    assert padding[True] <= 0.05 and padding[False] >= 0.5, padding


BAD = {
    "not JSON": '{"prompt": "a", "completion": ',
    "not a JSON object": '["a", "b"]',
    "no prompt": '{"question": "a", "answer": "b"}',
    "no completion": '{"prompt": "a"}',
    "the prompt is not a string": '{"prompt": ["a"], "completion": "b"}',
    "an empty answer": '{"prompt": "a", "completion": "  "}',
    "an unknown role": '{"messages": [{"role": "bot", "content": "a"}, {"role": "assistant", "content": "b"}]}',
    "no answer": '{"messages": [{"role": "user", "content": "a"}]}',
    "an answer longer than --max-length": json.dumps({"prompt": "a", "completion": " ".join(["cat"] * 200)}),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_each_bad_record_is_refused_with_its_file_and_line(files: dict[str, Path], tmp_path: Path, kind: str) -> None:
    good = [json.dumps(r) for r in chat_data.completion_records(5)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([*good[:3], BAD[kind], *good[3:]]) + "\n")
    tokenizer = HFTokenizer(files["model"])
    with pytest.raises(RecordError) as error:
        InstructionData(path, tokenizer, length=64)
    assert str(error.value).startswith(f"{path}:4: {kind}"), str(error.value)
    skipped = InstructionData(path, tokenizer, length=64, skip_bad=True)
    assert skipped.skipped == {kind: 1} and skipped.records == 5
    assert skipped.summary() is not None and f"{kind}: 1" in str(skipped.summary())


def test_commands_refuse_bad_data_in_one_line(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpipe train: a bad record, a chat without a template, instruction flags on other data."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "robot", "content": "x"}]}\n')
    base = ["train", "--model", "hf", "--init", str(files["model"]), "--steps", "1", "--out", str(tmp_path / "r")]
    assert main([*base, "--data", str(bad)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {bad}:2: an unknown role ('robot' in message 1; "
                                                           "roles: system, user, assistant)"]  # fmt: skip
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        (plain / name).write_bytes((files["model"] / name).read_bytes())
    settings = json.loads((files["model"] / "tokenizer_config.json").read_text())
    del settings["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    assert main([*base[:4], str(plain), *base[5:], "--data", str(files["chat"])]) == 2
    err = capsys.readouterr().err
    assert f"{files['chat']}:1: a chat, and the tokenizer has no chat template" in err and "--chat-template" in err
    template = tmp_path / "chatml.jinja"
    template.write_text(chat_data.CHATML)
    assert main([*base[:4], str(plain), *base[5:], "--data", str(files["chat"]), "--chat-template",
                 str(template), "--eval-every", "0", "--max-length", "64"]) == 0  # fmt: skip
    cut = InstructionData(files["chat"], HFTokenizer(files["model"]), length=64).cut
    first = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert cut > 0 and (first["records_cut"], first["records_skipped"]) == (cut, 0)
    assert f"note: {cut} of the 60 records are longer than --max-length 64 tokens" in capsys.readouterr().err
    assert main([*base, "--data", str(files["model"] / "config.json"), "--pack"]) == 2
    assert "--pack is for instruction or chat records" in capsys.readouterr().err


def test_a_lora_chat_model_answers_as_transformers_does(files: dict[str, Path], tmp_path: Path) -> None:
    """Fine-tuned with LoRA on the chat file (packed, K = 2): gpipe eval gives training's evaluation;
    exported merged, transformers' generate on the chat template's rendering gives gpipe generate
    --chat's answers, the system turn too."""
    pytest.importorskip("peft")
    out = tmp_path / "run"
    cfg = TrainConfig(**{**FLAGS, "batch": 4}, init=str(files["model"]), data=str(files["chat"]), partitions=2,
                      pack=True, lora=4, lr=0.02, steps=30, eval_every=30, out=str(out))  # fmt: skip
    train(cfg)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["padding"] <= 0.2
    assert main(["eval", "--checkpoint", str(out), "--out", str(tmp_path / "eval")]) == 0  # (the evaluation job)
    evaluated = json.loads((tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()[-1])
    assert evaluated["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "hf"), "--merge"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    questions = ["the cat sat on a mat", "where is a big dog", "cow"]
    (tmp_path / "q.txt").write_text("\n".join(questions) + "\n")
    for system in (None, "a small cat"):
        argv = ["generate", "--checkpoint", str(out), "--chat", "--input", str(tmp_path / "q.txt"),
                "--output", str(tmp_path / "a.txt"), "--max-new-tokens", "6", "--quiet"]  # fmt: skip
        assert main(argv + (["--system", system] if system else [])) == 0
        ours = (tmp_path / "a.txt").read_text().splitlines()
        for question, answer in zip(questions, ours):
            turns = [{"role": "system", "content": system}] if system else []
            chat = [*turns, {"role": "user", "content": question}]
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            with torch.no_grad():
                made = model.generate(**ids, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=0)[0, ids["input_ids"].shape[1]:]  # fmt: skip
            theirs = tokenizer.decode(made, skip_special_tokens=True)
            assert " ".join(answer.split()) == " ".join(theirs.split()), (question, system)
        assert any(answer.strip() for answer in ours)


def test_prepared_records_give_the_files_batches(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpipe prepare --data FILE.jsonl: the same records, split, rows and batches as the file read
    whole, packed or not, with --train-on-prompt too; a bad record refused with its file and line or
    counted; a prepared folder checked (--verify) and refused for a --max-length it does not fit."""
    from gpipe.data.prepare_records import PreparedRecords

    prepared = tmp_path / "chat.prepared"
    argv = ["prepare", "--data", str(files["chat"]), "--out", str(prepared), "--tokenizer", str(files["model"]),
            "--max-length", "96", "--workers", "2"]  # fmt: skip
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    tokenizer = HFTokenizer(files["model"])
    for pack, on_prompt in ((False, False), (True, True)):
        ours = PreparedRecords(prepared, length=96, seed=0, pack=pack, train_on_prompt=on_prompt)
        whole = InstructionData(files["chat"], tokenizer, length=96, seed=0, pack=pack, train_on_prompt=on_prompt)
        assert ours.rows == whole.rows and ours.baseline() == pytest.approx(whole.baseline(), rel=1e-12)
        assert ours.sample_prompt() == whole.sample_prompt()
        for split, step in (("train", 0), ("train", 7), ("eval", 1)):
            a, b = ours.batch(4, step, split=split), whole.batch(4, step, split=split)
            assert a.padding == b.padding and torch.equal(a.target, b.target)
            for x, y in zip(*(list(i.values()) if pack else [i] for i in (a.inputs, b.inputs))):
                assert torch.equal(x, y)
    assert main(["prepare", "--verify", str(prepared)]) == 0
    with pytest.raises(ValueError, match="give --max-length"):
        PreparedRecords(prepared, length=8)
    answers = prepared / "train.ans"
    answers.write_bytes(bytes(len(answers.read_bytes())))  # (every answer mark gone: the same size)
    assert main(["prepare", "--verify", str(prepared)]) == 1
    assert "train.ans" in capsys.readouterr().err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a"}\n{"prompt": "c", "completion": "d"}\n')
    out = ["--out", str(tmp_path / "bad.prepared"), "--tokenizer", str(files["model"]), "--workers", "1"]
    assert main(["prepare", "--data", str(bad), *out]) == 2
    assert f"{bad}:3: no completion" in capsys.readouterr().err
    assert main(["prepare", "--data", str(bad), *out, "--skip-bad"]) == 0
    manifest = json.loads((tmp_path / "bad.prepared" / "manifest.json").read_text())
    assert manifest["bad_records"] == {"no completion": 1} and manifest["records"] == 2


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_packed_rows_train_alike_on_two_ranks(files: dict[str, Path], pool: Pool, schedule: str) -> None:
    """Under torch.distributed, a stage a rank (GPipe's schedule and zero-bubble H1): a packed step's
    loss and gradients are one process's."""
    from tests.dist_init import PACKED

    ranks = pool(TORCHRUN[schedule])
    cfg = TrainConfig(**PACKED, init=str(files["model"]), data=str(files["chat"]), schedule=schedule)
    cfg.check()
    data = make_data(cfg)
    pipe = make_pipeline(cfg, make_model(cfg, data), data, make_losses(cfg, data), distributed=False)
    batch = data.batch(cfg.batch, 3)
    assert [r["loss"] for r in ranks] == [float(pipe.step(batch.inputs, batch.target))] * 2
    grads = {n: g for r in ranks for n, g in r["grads"].items()}
    assert grads.keys() == {n for n, p in pipe.named_parameters() if p.grad is not None}
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7, msg=name)
