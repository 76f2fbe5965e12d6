"""``gpipe train --init``: a save_pretrained folder fine-tuned with --model hf, each stage reading its
own tensors (the pipeline's logits are ``from_pretrained``'s at K = 1, 2, 4 for a sharded bfloat16
Llama, a tied GPT-2 and a tied Gemma, in one process and under torchrun pp2, pp2 x tp2, pp2 x fsdp2,
split or sharded ranks reading their slices alone); the first step's loss is the plain model's, an
export after a step at lr 1e-12 gives the source's logits with its names and dtypes; LoRA trains the
adapters alone and exports them; a run or checkpoint of gpipe train as a warm start (weights only,
a translation run's vocabulary kept, or grown when asked); every refusal in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe.balance import balance_by_flops
from gpipe.cli import main
from gpipe.data import PAD
from gpipe.pipeline import Pipeline
from gpipe.recipe import count_tokens, label_smoothing_loss
from gpipe.saving import load_module
from gpipe.train import TrainConfig, parse, train
from gpipe.train.data import train_batch
from gpipe.train.setup import make_data, make_model
from tests import pretrained_dirs
from tests.dist_harness import POOL, Pool
from tests.host_reads import counting

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

FLAGS: dict[str, Any] = {"model": "hf", "batch": 8, "chunks": 2, "eval_every": 50, "progress": False,
                         "tensorboard": "off"}  # fmt: skip


def _folders(pool_root: Path) -> dict[str, Path]:
    return pretrained_dirs.folders(pool_root / "init-pretrained")


@pytest.fixture(scope="module")
def folders(pool: Pool) -> dict[str, Path]:
    """The pretrained folders (in the session's pool's folder: the torchrun cases below read them)."""
    return pool.written(_folders)


# pp2 (the Llama and the tied GPT-2) on 2 ranks; pp2 x tp2 (the Llama, the tied Gemma) and pp2 x fsdp2
# (the Llama, and with LoRA) on 4: (kind, dp, tp, fsdp, lora rank) by world, cases of the session's
# pool (tests/dist_harness.py: a few launches in all), which read the folders _folders writes.
LAYOUTS = {
    2: [("llama", 1, 1, False, 0), ("gpt2", 1, 1, False, 0)],
    4: [("llama", 1, 2, False, 0), ("gemma", 1, 2, False, 0), ("llama", 2, 1, True, 0), ("llama", 2, 1, True, 4)],
}
TORCHRUN = {
    world: POOL.add(
        world, f"init torchrun {world}", "dist_init:pretrained_logits", prepare=_folders, timeout=240,
        runs=[(f"{{pool}}/init-pretrained/{kind}", dp, tp, fsdp, rank) for kind, dp, tp, fsdp, rank in layouts],
        text="{pool}/init-pretrained/text.txt",
    )
    for world, layouts in LAYOUTS.items()
}  # fmt: skip


def _logits(pipe: Pipeline, ids: torch.Tensor) -> torch.Tensor:
    pipe.eval()
    out = pipe(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma"])
def test_each_stage_reads_its_share_and_the_logits_are_from_pretrained(folders: dict[str, Path], kind: str) -> None:
    reference = pretrained_dirs.reference(folders[kind])
    ids = torch.randint(4, 30, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
    for k in (1, 2, 4):
        cfg = TrainConfig(**FLAGS, init=str(folders[kind]), data=str(folders["text"]), partitions=k)
        cfg.check()
        data = make_data(cfg)
        layers = make_model(cfg, data)
        computed = sum(1 for layer in layers for _, b in layer.named_buffers() if b.is_floating_point())
        balance = balance_by_flops(k, layers, ids[:2])
        with counting() as reads:
            pipe = Pipeline(layers, balance, chunks=2, devices=["cpu"] * k)
        # what was read from the files is written once: neither filled with NaN first nor read back
        assert sum(n for line, n in reads.items() if line.startswith("runtime/partition.py")) <= computed
        torch.testing.assert_close(_logits(pipe, ids), expected, rtol=0, atol=1e-5, msg=f"K={k}")
        if kind != "llama" and k > 1:  # the tied head, on the last stage, holds the first stage's embeddings
            parts = list(pipe.partitions.values())
            wte = next(p for n, p in parts[0].named_parameters() if n.endswith(("wte.weight", "embed_tokens.weight")))
            head = next(p for n, p in parts[-1].named_parameters() if n.endswith("lm_head.weight"))
            assert wte is not head and torch.equal(wte, head)


def test_first_step_loss_export_and_generate(folders: dict[str, Path], tmp_path: Path) -> None:
    """One step at lr 1e-12: its loss is the plain model's on the same batch; the export has the
    source's tensor names and bfloat16, and gives its logits; gpipe generate reads the checkpoint."""
    out = tmp_path / "run"
    cfg = TrainConfig(**FLAGS, init=str(folders["llama"]), data=str(folders["text"]), partitions=2, steps=1,
                      lr=1e-12, out=str(out))  # fmt: skip
    train(cfg)
    loss = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    reference = pretrained_dirs.reference(folders["llama"])
    batch = train_batch(make_data(cfg), cfg, 0, 1)
    with torch.no_grad():
        logits = reference(batch.inputs).logits
    plain = label_smoothing_loss(logits, batch.target, smoothing=cfg.label_smoothing, ignore_index=PAD,
                                 reduction="sum") / count_tokens(PAD)(batch.target)  # fmt: skip
    assert loss == pytest.approx(float(plain), rel=1e-5)

    assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "hf")]) == 0
    from safetensors import safe_open

    source = json.loads((folders["llama"] / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(source)
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    exported = pretrained_dirs.reference(tmp_path / "hf")
    ids = torch.randint(4, 30, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)

    (tmp_path / "prompts.txt").write_text("the cat\na dog sat\n")
    argv = ["generate", "--checkpoint", str(out), "--input", str(tmp_path / "prompts.txt"), "--output",
            str(tmp_path / "out.txt"), "--max-new-tokens", "3"]  # fmt: skip
    assert main(argv) == 0
    assert len((tmp_path / "out.txt").read_text().splitlines()) == 2


def test_a_tied_gpt2_keeps_its_tie_through_training_and_export(folders: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(TrainConfig(**FLAGS, init=str(folders["gpt2"]), data=str(folders["text"]), partitions=2, steps=2,
                      lr=1e-3, out=str(out)))  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(folders["gpt2"])))
    load_module(model, out / "checkpoints")  # (refuses layers holding different values of one tied tensor)
    assert model.lm_head.weight is model.transformer.wte.weight
    source = pretrained_dirs.reference(folders["gpt2"])
    assert not torch.equal(model.transformer.wte.weight, source.transformer.wte.weight)  # (it trained)


def _model_entries(step: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's layers' entries (``model.<layer>.<name>``), through one torch.save file."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step, step.parent / "whole.pt")
    entries = torch.load(step.parent / "whole.pt", weights_only=False)
    return {k: v for k, v in entries.items() if k.startswith("model.")}


@pytest.mark.parametrize(
    ("model", "size"),
    [
        ("transformer", ["--layers", "1", "--dim", "32", "--hidden", "64"]),
        ("amoebanet", ["--layers", "1", "--filters", "8"]),
    ],
)
def test_a_warm_start_takes_the_runs_model_and_weights_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, size: list[str]
) -> None:
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    common = ["--steps", "2", "--batch", "8", "--chunks", "2", "--eval-every", "50", "--no-progress",
              "--tensorboard", "off"]  # fmt: skip
    assert main(["train", "--model", model, *size, "--out", str(base), *common]) == 0
    assert main(["train", "--init", str(base), "--lr", "1e-12", "--out", str(tuned), *common]) == 0
    assert "starting from the weights of" in capsys.readouterr().err
    cfg = parse(["--init", str(base), "--out", str(tmp_path / "x")])
    assert cfg.model == model and cfg.layers == 1  # the run's model, not the defaults
    rows = [json.loads(line) for line in (tuned / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # steps from 1, the schedule's warm-up afresh
    assert rows[0]["lr"] == pytest.approx(1e-12 / 30)
    before = _model_entries(base / "checkpoints" / "step-00000002")
    after = _model_entries(tuned / "checkpoints" / "step-00000002")
    assert set(before) == set(after)
    for name, value in before.items():  # (batch norm's running statistics move on: the steps ran)
        if "running_" not in name and "num_batches" not in name:
            torch.testing.assert_close(after[name], value, rtol=0, atol=1e-9, msg=name)
    assert main(["train", "--init", str(base), "--layers", "2", "--out", str(tmp_path / "y"), *common]) == 2
    assert "--layers 2 differs from the --init run's 1" in capsys.readouterr().err


def _broken(folders: dict[str, Path], tmp_path: Path, how: str) -> Path:
    """A copy of the Llama folder, broken as ``how`` says."""
    folder = tmp_path / "broken"
    shutil.copytree(folders["llama"], folder)
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    if how == "shard":
        (folder / weight_map["model.norm.weight"]).unlink()
    elif how == "index":
        weight_map["model.norm.weight"] = "model-99999-of-99999.safetensors"
        index.write_text(json.dumps({"weight_map": weight_map}))
    elif how == "shape":
        from safetensors.torch import load_file, save_file

        file = folder / weight_map["model.norm.weight"]
        tensors = load_file(str(file))
        tensors["model.norm.weight"] = torch.ones(7, dtype=torch.bfloat16)
        save_file(tensors, str(file), metadata={"format": "pt"})
    elif how == "remote":
        config = json.loads((folder / "config.json").read_text())
        config |= {"model_type": "my-own-llama", "auto_map": {"AutoModelForCausalLM": "modeling.MyLlama"}}
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "json":
        (folder / "config.json").write_text('{"model_type": "llama",')
    elif how == "other":
        shutil.copyfile(folders["gpt2"] / "config.json", folder / "config.json")
    elif how == "bin":
        for file in folder.glob("model*"):
            file.unlink()
        torch.save({}, folder / "pytorch_model.bin")
    elif how == "tokenizer":
        (folder / "tokenizer.json").unlink()
    return folder


@pytest.mark.parametrize(
    ("how", "flags", "message"),
    [
        ("shard", [], "names the shard 'model-0000"),
        ("index", [], "names the shard 'model-99999-of-99999.safetensors', which is not in"),
        ("shape", [], "holds 'model.norm.weight' of shape [7], the model's 'model.norm.weight' is [32]"),
        ("remote", [], "cannot read the config.json of --init '{folder}' as a transformers config"),
        ("json", [], "cannot read the config.json of --init '{folder}' as a transformers config"),
        ("other", [], "lacks"),
        ("bin", [], "holds pytorch_model.bin weights, which gpipe does not read"),
        ("tokenizer", [], "brings no tokenizer (tokenizer.json, tokenizer.model)"),
        ("", ["--resume"], "give one of them"),
        ("", ["--hf-config", "{folder}"], "brings its own config.json"),
        ("", ["--model", "transformer"], "fine-tune it with --model hf"),
        ("", ["--dropout", "0.1"], "with --init the config's own dropout settings apply"),
    ],
)
def test_bad_pretrained_folders_and_flags_are_refused_before_training(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, flags: list[str],
    message: str,
) -> None:  # fmt: skip
    folder = _broken(folders, tmp_path, how) if how else folders["llama"]
    out = tmp_path / "run"
    argv = [
        "train",
        "--model",
        "hf",
        "--init",
        str(folder),
        "--data",
        str(folders["text"]),
        "--out",
        str(out),
        "--steps",
        "1",
        "--no-progress",
        "--tensorboard",
        "off",
        *(f.format(folder=folder) for f in flags),
    ]
    if "--model" in flags:
        argv.remove("hf")
        argv.remove("--model")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(folder=folder) in err, err
    assert "--hf-config" in flags or "--hf-config" not in err, err  # (the flags the user gave, only)
    assert len(err.strip().splitlines()) == 1, err
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()  # nothing trained


@pytest.mark.parametrize("world", [2, 4])
def test_torchrun_ranks_read_their_stage_and_give_from_pretrained_logits(
    folders: dict[str, Path], pool: Pool, world: int
) -> None:
    """pp2 (the Llama and the tied GPT-2), then pp2 x tp2 (the Llama, the tied Gemma) and pp2 x fsdp2
    (the Llama, and with LoRA) in one launch of 4: each rank reads the tensors of its own stage only,
    and the last stage's logits are from_pretrained's (split or sharded: each its slices of the files
    alone; a tie's copies each read theirs); with LoRA (sharded) a step gives the adapters alone
    gradients."""
    layouts = LAYOUTS[world]
    ranks = pool(TORCHRUN[world])
    ids = torch.randint(4, 30, (4, 12), generator=torch.Generator().manual_seed(0))
    for i, (kind, dp, tp, _, rank) in enumerate(layouts):
        with torch.no_grad():
            expected = pretrained_dirs.reference(folders[kind])(ids).logits
        outputs = [r["logits"][i] for r in ranks if r["logits"][i] is not None]
        got = torch.cat(outputs) if dp > 1 else outputs[0]  # (replicas: each its share, in rank order)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=f"{kind} {layouts[i]}")
        first, last = ("model.embed_tokens.weight", "model.norm.weight") if kind != "gpt2" else (
            "transformer.wte.weight", "transformer.ln_f.weight")  # fmt: skip
        sizes = {n: t.numel() for n, t in pretrained_dirs.reference(folders[kind]).state_dict().items()}
        read_by_stage: dict[int, int] = {}
        for r in ranks:
            names, on_first = {n for n, _ in r["read"][i]}, r["stage"][i] == 0
            assert (first in names, last in names) == (on_first, not on_first), (layouts[i], r["stage"][i])
            read, whole = sum(n for _, n in r["read"][i]), sum(sizes[n.replace(".base_layer.", ".")] for n in names)
            assert (read < whole) == (dp > 1 or tp > 1), (layouts[i], read, whole)  # (split or sharded: slices)
            read_by_stage[r["stage"][i]] = read_by_stage.get(r["stage"][i], 0) + read
            trained = r["trained"][i]
            assert trained and all((".lora_" in n) == bool(rank) for n in trained), (layouts[i], trained)
        if dp > 1:  # the replicas' shards are the stage, once
            assert sum(read_by_stage.values()) == sum(sizes.values()), (layouts[i], read_by_stage)
        if rank:  # the adapters start as in one process with two stages (sharded: each rank its shard of them)
            cfg = TrainConfig(**FLAGS, init=str(folders[kind]), data=str(folders["text"]), partitions=2, lora=rank)
            layers = make_model(cfg, make_data(cfg))
            one = Pipeline(layers, balance_by_flops(2, layers, ids[:2]), chunks=2, devices=["cpu"] * 2)
            expected_adapters = {n: p for n, p in one.named_parameters() if ".lora_" in n}
            got_adapters = {n: v for r in ranks for n, v in r["adapters"][i].items()}
            assert got_adapters.keys() == expected_adapters.keys()
            for name, value in got_adapters.items():
                assert torch.equal(value, expected_adapters[name]), name


def test_lora_trains_the_adapters_alone_and_exports_them(folders: dict[str, Path], tmp_path: Path) -> None:
    """--lora 4: the optimizer holds the adapters' state alone, the base weights stay the source's;
    the exported PEFT folder (on the base model) and the merged model give the in-training logits."""
    peft = pytest.importorskip("peft")
    from torch.distributed.checkpoint import FileSystemReader

    from gpipe.saving import load

    out = tmp_path / "run"
    cfg = TrainConfig(**FLAGS, init=str(folders["llama"]), data=str(folders["text"]), partitions=2, steps=3, lr=0.05,
                      lora=4, out=str(out))  # fmt: skip
    train(cfg)
    step = out / "checkpoints" / "step-00000003"
    entries = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    states = {k for k in entries if k.startswith("optimizer.state.")}
    assert states and all(".lora_" in k for k in states)
    resumed = TrainConfig(**{**vars(cfg), "resume": True})
    layers = make_model(resumed, make_data(resumed))
    ids = torch.randint(4, 30, (3, 10), generator=torch.Generator().manual_seed(2))
    pipe = Pipeline(layers, balance_by_flops(2, layers, ids[:2]), chunks=1, devices=["cpu"] * 2)
    load(pipe, step)
    ours = _logits(pipe, ids)
    with torch.no_grad():
        assert (ours - pretrained_dirs.reference(folders["llama"])(ids).logits).abs().max() > 1e-3  # (it trained)

    assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "adapter")]) == 0
    assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    adapted = peft.PeftModel.from_pretrained(pretrained_dirs.reference(folders["llama"]), str(tmp_path / "adapter"))
    merged = pretrained_dirs.reference(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(adapted.eval()(ids).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(ids).logits, ours, rtol=0, atol=0.05)  # (in bfloat16, as the source)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118


def test_a_translation_warm_start_keeps_its_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """New language pairs fine-tune a translation run when their target languages have a tag in its
    vocabulary (the data is read with it); a pair into another language is refused, naming it."""
    from gpipe.data.prepared import file_digest

    assert main(["corpus", "--out", str(tmp_path / "corpus")]) == 0
    common = ["--steps", "1", "--batch", "16", "--eval-every", "50", "--no-progress", "--tensorboard", "off"]
    assert main(["train", "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "base"), *common]) == 0
    first = sorted((tmp_path / "corpus").glob("*.tsv"))[0]
    lines = first.read_text().splitlines()[:300]
    for name in ("new", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "new" / f"zz-{first.stem.split('-')[1]}.tsv").write_text("\n".join(lines) + "\n")  # into a known one
    (tmp_path / "other" / "xs-zz.tsv").write_text("\n".join(lines) + "\n")  # into zz: no <2zz>
    argv = ["train", "--init", str(tmp_path / "base"), *common]
    assert main([*argv, "--data", str(tmp_path / "new"), "--out", str(tmp_path / "tuned")]) == 0
    kept = tmp_path / "base" / "checkpoints" / "step-00000001" / "vocab.model"
    assert file_digest(tmp_path / "tuned" / "prepared" / "vocab.model") == file_digest(kept)
    capsys.readouterr()
    assert main([*argv, "--data", str(tmp_path / "other"), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "has pairs into zz (xs-zz), and the vocabulary of the --init run" in err, err
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()

    # Asked: the vocabulary grown by the tag <2zz>, the embeddings by its row, the others the run's.
    grown = tmp_path / "grown"
    assert main(["vocab", "--data", str(tmp_path / "other"), "--extend", str(kept), "--out", str(grown)]) == 0
    out = tmp_path / "grown-run"
    assert main([*argv, "--data", str(tmp_path / "other"), "--vocab", f"{grown}.model", "--lr", "1e-12", "--out",
                 str(out)]) == 0  # fmt: skip
    assert "its vocabulary of" in capsys.readouterr().err
    before = _model_entries(kept.parent)
    after = _model_entries(out / "checkpoints" / "step-00000001")
    rows = json.loads((kept.parent / "run.json").read_text())["vocab"]
    grew = [k for k, v in before.items() if v.dim() and v.shape[0] == rows and after[k].shape[0] == rows + 1]
    assert grew  # (the embeddings and the output projection)
    for name, value in before.items():
        kept_part = after[name][:rows] if name in grew else after[name]
        torch.testing.assert_close(kept_part, value, rtol=0, atol=1e-9, msg=name)


def test_growing_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gpipe vocab --extend keeps BASE's pieces (no --size), needs pairs, and a SentencePiece BASE;
    grown rows load weights only."""
    from gpipe.saving import CheckpointError, load

    (tmp_path / "pairs").mkdir()
    (tmp_path / "pairs" / "en-zz.tsv").write_text("a b\tc d\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.model").write_text("not a model")
    cases = [
        (["--data", str(tmp_path / "pairs"), "--extend", str(tmp_path / "junk.model"), "--size", "9"],
         "--extend keeps BASE's pieces and adds tags: leave --size and --sample out"),
        (["--data", str(tmp_path / "empty"), "--extend", str(tmp_path / "junk.model")], "no language pair files in"),
        (["--data", str(tmp_path / "pairs"), "--extend", str(tmp_path / "junk.model")], "is not a SentencePiece model"),
    ]  # fmt: skip
    for flags, message in cases:
        assert main(["vocab", *flags, "--out", str(tmp_path / "grown")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "grown.model").exists()
    pipe = Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), [1], chunks=1, devices=["cpu"])
    with pytest.raises(CheckpointError, match="grow_rows loads weights only"):
        load(pipe, tmp_path, optimizer=torch.optim.SGD(pipe.parameters(), lr=1.0), grow_rows=True)


def test_a_resumed_init_run_needs_its_checkpoint_alone(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume of an --init run reads its config, tokenizer and weights from its own checkpoint
    (the pretrained folder may be gone); --init given with --resume is refused."""
    source = tmp_path / "llama"
    shutil.copytree(folders["llama"], source)
    out = tmp_path / "run"
    argv = ["train", "--model", "hf", "--init", str(source), "--data", str(folders["text"]), "--out", str(out),
            "--batch", "8", "--chunks", "2", "--eval-every", "50", "--no-progress", "--tensorboard", "off"]  # fmt: skip
    assert main([*argv, "--steps", "1", "--lora", "2"]) == 0
    shutil.rmtree(source)
    assert main(["train", "--out", str(out), "--resume", "--steps", "2", "--no-progress"]) == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (out / "checkpoints" / "step-00000002" / "lora.json").is_file()  # (the run's adapters, resumed)
    capsys.readouterr()
    assert main([*argv, "--resume", "--steps", "3"]) == 2
    assert "give one of them" in capsys.readouterr().err
    newest = out / "checkpoints" / "step-00000002"
    (newest / "config.json").write_text('{"model_type": "llama",')  # (damaged: the message names --resume's)
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read the config.json of --resume's checkpoint {str(newest)!r}"), err
    assert "--init" not in err and "give a config.json that transformers reads" in err and err.count("\n") == 1, err
