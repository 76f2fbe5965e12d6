"""`gpipe sweep` (Optuna's study in DIR/study.db: continued, an interrupted trial re-run, pruned and
failed trials recorded, a bad space refused before any trial) and `gpipe runs` (the trials side by side,
and TensorBoard's HParams)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

optuna = pytest.importorskip("optuna")

from gpipe.cli import main  # noqa: E402
from gpipe.sweep import study as study_module  # noqa: E402
from gpipe.train import TrainConfig, parse, train  # noqa: E402
from tests.dist_harness import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Small trials of the synthetic default: an evaluation (and a checkpoint) every 2 steps
FIXED = """
[fixed]
steps = {steps}
eval-every = 2
checkpoint-every = 2
progress = false
eval-sentences = 20
eval-batches = 1
health-every = 0
"""
SPACE = (
    FIXED.format(steps=6)
    + """
[search]
lr = { low = 1e-4, high = 3e-2, log = true }
warmup = { low = 1, high = 8 }
"""
)


def study_of(out: Path) -> Any:
    return optuna.load_study(study_name="gpipe-sweep", storage=f"sqlite:///{out / 'study.db'}")


def sweep(*args: str) -> tuple[int, str]:
    """``gpipe sweep ARGS`` in this process: its status and what it wrote to standard error."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["sweep", *args])
    return status, err.getvalue()


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def timeless(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.endswith("_per_s") and k != "elapsed_s"}


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    """A 3-trial sweep whose trial 1 is interrupted at step 4 (Ctrl-C), run again with --trials 3 (trial 1
    resumed, trial 2), then with --trials 4: the folder and the three commands' logs."""
    root = tmp_path_factory.mktemp("sweep")
    (root / "space.toml").write_text(SPACE)
    out = root / "out"
    real = study_module.train

    def interrupted(cfg: TrainConfig, *, on_eval: Any) -> dict[str, Any]:
        def hook(step: int, row: dict[str, Any]) -> bool:
            if cfg.out.endswith("trial-001") and step == 4:
                raise KeyboardInterrupt
            return bool(on_eval(step, row))

        return real(cfg, on_eval=hook)

    command = [str(root / "space.toml"), "--out", str(out), "--trials"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(study_module, "train", interrupted)
        first = sweep(*command, "3")
    assert first[0] == 130  # (Ctrl-C)
    second, third = sweep(*command, "3"), sweep(*command, "4")
    assert second[0] == third[0] == 0, (second, third)
    yield out, [first[1], second[1], third[1]]


def test_a_sweep_continued_has_exactly_the_trials_asked_for_and_an_interrupted_one_resumed(
    swept: tuple[Path, list[str]], tmp_path: Path
) -> None:
    out, logs = swept
    trials = study_of(out).trials
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert sorted(p.name for p in out.glob("trial-*")) == [f"trial-{n:03d}" for n in range(4)]
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    assert "trial 1 was interrupted: it is run again (resume)" in logs[1]
    assert "trial 0 " not in logs[1] and "trial 3 " not in logs[1]  # (trial 0 is done; 3 waits for --trials 4)
    assert len({t.params["lr"] for t in trials}) == 4  # (the sampler continued, not drawn again from its seed)
    # the interrupted trial, resumed from its checkpoint of step 4: the uninterrupted run's metrics exactly
    resumed = rows(out / "trial-001" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    alone = TrainConfig(out=str(tmp_path / "alone"), steps=6, eval_every=2, checkpoint_every=2, progress=False,
                        eval_sentences=20, eval_batches=1, health_every=0, **trials[1].params)  # fmt: skip
    train(alone)
    assert list(map(timeless, resumed)) == list(map(timeless, rows(tmp_path / "alone" / "metrics.jsonl")))
    assert resumed[-1]["elapsed_s"] > resumed[3]["elapsed_s"] > 0  # (the wall time counted on across the resume)
    # a trial's value is its best BLEU; results.md has a row per trial; best.toml is gpipe train's --config
    best = study_of(out).best_trial
    assert best.value == max(r["bleu"] for r in rows(out / f"trial-{best.number:03d}" / "metrics.jsonl") if "bleu" in r)
    results = (out / "results.md").read_text()
    for t in trials:
        assert f"| {t.number} | {t.state.name.lower()} | {t.params['lr']:.4g} | {t.params['warmup']} |" in results
    cfg = parse(["--config", str(out / "best.toml"), "--out", str(tmp_path / "best")])
    assert (cfg.lr, cfg.warmup, cfg.steps, cfg.eval_sentences) == (best.params["lr"], best.params["warmup"], 6, 20)
    record = json.loads((out / "trial-002" / "trial.json").read_text())
    assert record["params"] == trials[2].params
    assert record["state"] == {"COMPLETE": "complete", "PRUNED": "pruned"}[trials[2].state.name]


def test_gpipe_runs_lists_each_trial_with_its_settings_and_metrics(
    swept: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = swept
    trials = {t.number: t for t in study_of(out).trials}
    assert main(["runs", str(out), "--csv", "--sort", "best"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert table[0]["run"] == str(out / f"trial-{study_of(out).best_trial.number:03d}")
    assert sorted(r["run"] for r in table) == [str(out / f"trial-{n:03d}") for n in range(4)]
    assert set(table[0]) == {"run", "lr", "warmup", "steps", "loss", "metric", "best", "time", "status"}
    for r in table:
        t = trials[int(r["run"][-3:])]
        logged = rows(Path(r["run"]) / "metrics.jsonl")
        assert (float(r["lr"]), int(r["warmup"])) == (t.params["lr"], t.params["warmup"])
        assert int(r["steps"]) == logged[-1]["step"] and float(r["loss"]) == logged[-1]["loss"]
        assert r["metric"] == "bleu" and float(r["best"]) == max(x["bleu"] for x in logged if "bleu" in x)
        assert r["status"] == {"COMPLETE": "finished", "PRUNED": "pruned"}[t.state.name]
        assert float(r["time"]) == logged[-1]["elapsed_s"]
    assert main(["runs", str(out / "trial-000"), str(out), "--sort", "lr"]) == 0  # (a run named twice: once)
    text = capsys.readouterr().out.splitlines()
    assert len(text) == 2 + 4 and text[0].split()[:4] == ["|", "run", "|", "lr"]
    lrs = [float(line.split("|")[2]) for line in text[2:]]
    assert lrs == sorted(lrs)
    # TensorBoard's HParams tab: each trial's settings as a session, its metrics the scalars it logs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(out / "trial-000" / "tensorboard"))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert start.session_start_info.hparams["lr"].number_value == trials[0].params["lr"]
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"loss", "eval_loss", "bleu"}
    assert {"loss", "eval_loss", "bleu"} <= set(events.Tags()["scalars"])


def test_a_pruned_trial_is_recorded_as_pruned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a grid of two learning rates, the good one first (the grid's order for seed 1): the second is worse
    # than the first at its first evaluation, and the median pruner stops it there
    (tmp_path / "space.toml").write_text(FIXED.format(steps=8) + "[search]\nlr = { choices = [0.02, 1e-7] }\n")
    out = tmp_path / "out"
    status, err = sweep(str(tmp_path / "space.toml"), "--out", str(out), "--trials", "2", "--sampler", "grid",
                        "--metric", "eval_loss", "--startup-trials", "1", "--seed", "1")  # fmt: skip
    assert status == 0, err
    first, second = study_of(out).trials
    assert first.params["lr"] == 0.02, "Optuna's grid order for seed 1 changed: pick the seed that puts 0.02 first"
    assert (first.state.name, second.state.name) == ("COMPLETE", "PRUNED")
    assert "trial 1: pruned" in err
    assert json.loads((out / "trial-001" / "trial.json").read_text())["state"] == "pruned"
    assert "| 1 | pruned | 1e-07 | 2 |" in (out / "results.md").read_text()  # (stopped at its first evaluation)
    assert (out / "trial-001" / "checkpoints" / "step-00000002").is_dir()  # (gpipe train --resume goes on)
    assert main(["runs", str(out)]) == 0
    listed = capsys.readouterr().out
    assert "| 2/8 " in listed and "pruned" in listed and "finished" in listed
    # --prune-after 8, the last step: the pruner is not asked before it, nor at the last evaluation (nothing to save)
    again = tmp_path / "again"
    flags = ["--sampler", "grid", "--metric", "eval_loss", "--startup-trials", "1", "--seed", "1", "--prune-after", "8"]
    status, err = sweep(str(tmp_path / "space.toml"), "--out", str(again), "--trials", "2", *flags)
    assert status == 0, err
    assert [t.state.name for t in study_of(again).trials] == ["COMPLETE", "COMPLETE"]


def test_a_failed_trial_is_recorded_with_its_error_and_the_sweep_goes_on(tmp_path: Path) -> None:
    # each value passes with the others' first ones; dim 60 with 8 heads does not: that trial fails
    space = FIXED.format(steps=2) + "[search]\ndim = { choices = [64, 60] }\nheads = { choices = [4, 8] }\n"
    (tmp_path / "space.toml").write_text(space)
    out = tmp_path / "out"
    status, err = sweep(str(tmp_path / "space.toml"), "--out", str(out), "--trials", "4", "--sampler", "grid")
    assert status == 0, err
    trials = study_of(out).trials
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert len(trials) == 4 and [t.params for t in failed] == [{"dim": 60, "heads": 8}]
    assert "--dim must be a multiple of --heads" in failed[0].user_attrs["error"]
    results = (out / "results.md").read_text()
    assert f"- trial {failed[0].number}: --dim must be a multiple of --heads" in results
    assert sum(t.state.name == "COMPLETE" for t in trials) == 3


BAD = {
    "unknown": (
        "[search]\nlrr = { low = 0.1, high = 0.2 }\n",
        "unknown setting 'lrr' in [search]",
        "did you mean 'lr'",
    ),
    "ill-typed": ('[fixed]\nsteps = "ten"\n[search]\nlr = { low = 0.1, high = 0.2 }\n', "steps", "must be an integer"),
    "string range": ("[search]\nschedule = { low = 1, high = 2 }\n", "schedule in [search]", "takes choices"),
    "int range": ("[search]\nwarmup = { low = 1.5, high = 8 }\n", "warmup's low", "must be an integer"),
    "empty range": ("[search]\nlr = { low = 0.1, high = 0.01 }\n", "lr in [search]", "low must be below high"),
    "owned": ('[fixed]\nout = "x"\n[search]\nlr = { low = 0.1, high = 0.2 }\n', "out in [fixed]", "the sweep sets"),
    "refused bound": ("[search]\nlr = { low = -1.0, high = 0.1 }\n", "with lr = -1.0, gpipe train refuses", "--lr"),
    "refused choice": ('[search]\nschedule = { choices = ["1f1b", "nonsense"] }\n', "'nonsense'", "schedule"),
    "nothing": ("[fixed]\nsteps = 4\n", "nothing to search", "[search]"),
    "no evaluations": ("[fixed]\neval-every = 0\n[search]\nlr = { low = 0.1, high = 0.2 }\n", "eval-every = 0", ""),
    "table": ("[serach]\nlr = 0.1\n", "the table(s) 'serach'", "[search]"),
    "grid": ("[search]\nlr = { low = 0.1, high = 0.2 }\n", "continuous range", "--sampler grid"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_space_is_refused_before_any_trial(case: str, tmp_path: Path) -> None:
    text, *said = BAD[case]
    (tmp_path / "space.toml").write_text(text)
    flags = ["--sampler", "grid"] if case == "grid" else []
    status, err = sweep(str(tmp_path / "space.toml"), "--out", str(tmp_path / "out"), "--trials", "2", *flags)
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(s in err for s in said), err
    assert not (tmp_path / "out").exists()  # (no trial, no study)


def test_a_sweep_under_torchrun_runs_each_trial_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "space.toml").write_text(FIXED.format(steps=4) + "partitions = 2\n[search]\nlr = { low = 1e-3, "
                                         "high = 3e-2, log = true }\n")  # fmt: skip
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
               "-m", "gpipe", "sweep", str(tmp_path / "space.toml"), "--out", str(out), "--trials", "2"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = study_of(out).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    for t in trials:
        run = json.loads(next((out / f"trial-{t.number:03d}" / "checkpoints").glob("step-*/run.json")).read_text())
        assert run["config"]["partitions"] == 2 and run["config"]["lr"] == t.params["lr"]
    assert done.stdout.count("sweep ") == 1  # (rank 0 alone reports)
