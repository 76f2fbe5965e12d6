"""`gpipe train --precision bf16`: the step and the evaluations under autocast in bfloat16, the weights,
their gradients, the optimizer's state and the loss in float32; a resumed run keeps its precision (a
flag that changes it is named), and a bad value is refused in one line."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from gpipe import Pipeline
from gpipe.cli import main
from gpipe.data import PAD
from gpipe.models import transformer
from gpipe.recipe import count_tokens, label_smoothing_loss
from gpipe.train import TrainConfig, parse, train

QUICK = ["--batch", "16", "--checkpoint-every", "2", "--eval-every", "2", "--eval-batches", "1", "--no-progress"]
STEPS = 20


def _floats(value: Any) -> list[torch.dtype]:
    values = value if isinstance(value, tuple) else (value,)
    return [v.dtype for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A bf16 run of the built-in transformer (2 stages), watched by a global forward hook: what each
    stage (a partition: an nn.Sequential the stage runs its hooks around) hands on, and each Linear."""
    out = tmp_path_factory.mktemp("bf16") / "run"
    stages: dict[int, nn.Module] = {}
    handed: list[tuple[bool, list[torch.dtype]]] = []  # (a value between stages, not the logits; its float dtypes)
    linear: set[torch.dtype] = set()

    def watch(module: nn.Module, args: Any, output: Any) -> None:
        real = [v for v in (output if isinstance(output, tuple) else (output,)) if isinstance(v, torch.Tensor)]
        if not real or any(v.is_meta for v in real):  # (the balance's count of FLOPs on 'meta')
            return
        if isinstance(module, nn.Sequential):
            stages[id(module)] = module
            handed.append((isinstance(output, tuple), _floats(output)))  # the transformer's stages pass tuples
        elif isinstance(module, nn.Linear):
            linear.update(_floats(output))

    log = io.StringIO()
    handle = torch.nn.modules.module.register_module_forward_hook(watch)
    try:
        with contextlib.redirect_stderr(log):
            result = train(TrainConfig(out=str(out), steps=STEPS, batch=16, eval_every=STEPS, eval_batches=1,
                                       checkpoint_every=STEPS, precision="bf16", partitions=2))  # fmt: skip
    finally:
        handle.remove()
    return {"out": out, "result": result, "stages": list(stages.values()), "handed": handed, "linear": linear,
            "log": log.getvalue()}  # fmt: skip


def test_bf16_run_learns_in_bf16_with_float32_weights_and_loss(bf16_run: dict[str, Any]) -> None:
    out, result = bf16_run["out"], bf16_run["result"]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == STEPS
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.3, losses  # (~0.5 on any CPU: bf16's rounding moves it by far less)
    assert result["eval_loss"] < first - 0.3, (result, losses)

    # The computation is in bf16 (every Linear), and the logits reach the loss in bf16: nothing in train
    # casts them back to float32 first (the loss does, see below).
    assert bf16_run["linear"] == {torch.bfloat16}
    logits = [dtypes for between, dtypes in bf16_run["handed"] if not between]
    assert logits and all(dtypes == [torch.bfloat16] for dtypes in logits), logits
    # What crosses the boundary: the residual stream (in a decoding step after the first, no float at all).
    between = [dtypes for between, dtypes in bf16_run["handed"] if between and dtypes]
    assert between and all(dtypes == [torch.bfloat16] for dtypes in between), between

    # The master weights and their gradients stay float32, and so does what the checkpoint holds (the
    # weights and the optimizer's state).
    stages = bf16_run["stages"]
    assert len(stages) == 2
    params = [p for stage in stages for p in stage.parameters()]
    assert params and {p.dtype for p in params} == {torch.float32}
    assert {p.grad.dtype for p in params if p.grad is not None} == {torch.float32}
    checkpoint = out / "checkpoints" / f"step-{STEPS:08d}"
    tensors = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    dtypes = {key: meta.properties.dtype for key, meta in tensors.items() if hasattr(meta, "properties")}
    assert any(k.startswith("model.") for k in dtypes) and any(k.endswith(".exp_avg") for k in dtypes)
    assert set(dtypes.values()) == {torch.float32}, dtypes
    assert json.loads((checkpoint / "run.json").read_text())["config"]["precision"] == "bf16"
    # The progress lines say the precision.
    assert f"gpipe train bf16: {STEPS}/{STEPS} steps" in bf16_run["log"], bf16_run["log"]


def test_the_loss_of_bf16_logits_is_float32() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 5, 11).to(torch.bfloat16).requires_grad_()
    target = torch.randint(1, 11, (6, 5))
    target[0, 3:] = PAD
    loss = label_smoothing_loss(logits, target, smoothing=0.1, ignore_index=PAD)  # (outside autocast too)
    assert loss.dtype == torch.float32
    expected = label_smoothing_loss(logits.detach().float(), target, smoothing=0.1, ignore_index=PAD)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    loss.backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16  # (autograd's, back through the cast)

    # A pipeline step as gpipe train runs it: under autocast, float32 loss, float32 gradients.
    model = transformer(1, 32, 2, dim=16, vocab=11, max_len=8, dropout=0.0)
    pipe = Pipeline(model, [2, 3], chunks=2, devices=["cpu", "cpu"], loss_count=count_tokens(PAD),
                    loss_fn=lambda out, t: label_smoothing_loss(out, t, ignore_index=PAD, reduction="sum"))  # fmt: skip
    tokens = torch.randint(1, 11, (4, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step_loss = pipe.step((tokens, tokens), tokens)
    assert step_loss.dtype == torch.float32
    assert {p.grad.dtype for p in pipe.parameters() if p.grad is not None} == {torch.float32}


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))
    return tmp_path / "run"


def test_resume_keeps_the_runs_precision_and_names_a_flag_that_changes_it(
    bf16_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy(bf16_run["out"], tmp_path)
    assert parse(["--out", str(out), "--resume", "--steps", str(STEPS + 1)]).precision == "bf16"  # not the default's
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", str(STEPS + 1), *QUICK]) == 0
    err = capsys.readouterr().err
    assert "resuming" in err and "--precision" not in err, err
    assert (
        json.loads((out / "checkpoints" / f"step-{STEPS + 1:08d}" / "run.json").read_text())["config"]["precision"]
        == "bf16"
    )
    # A flag that changes it is named, as every setting's that may change in the middle of a run (the
    # checkpoint holds float32 weights and optimizer state either way).
    assert main(["train", "--out", str(out), "--resume", "--steps", str(STEPS + 2), "--precision", "fp32", *QUICK]) == 0
    err = capsys.readouterr().err
    assert f"changed from the run's: --steps {STEPS + 1} -> {STEPS + 2}, --precision bf16 -> fp32" in err, err
    assert (
        json.loads((out / "checkpoints" / f"step-{STEPS + 2:08d}" / "run.json").read_text())["config"]["precision"]
        == "fp32"
    )


@pytest.mark.parametrize(
    ("argv", "config", "message"),
    [
        (["--precision", "fp16"], None, "unknown --precision 'fp16'; choose one of fp32, bf16"),
        (["--precision", "BF16"], None, "unknown --precision 'BF16'; choose one of fp32, bf16"),
        ([], 'precision = "half"\n', "unknown --precision 'half'; choose one of fp32, bf16"),
        ([], "precision = 16\n", "precision in "),
    ],
)
def test_a_bad_precision_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], config: str | None, message: str
) -> None:
    if config is not None:
        (tmp_path / "run.toml").write_text(config)
        argv = ["--config", str(tmp_path / "run.toml")]
    assert main(["train", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_precision_from_a_config_file(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text('precision = "bf16"\n')
    assert parse(["--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "out")]).precision == "bf16"
    assert parse(["--out", str(tmp_path / "out")]).precision == "fp32"
