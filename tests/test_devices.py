"""`--devices` and a rank's devices (gpipe.distributed.devices): where the stages run in one process and
under torchrun, the backend and device a process group starts with, the refusals. CUDA is mocked: the
placement is decided from what torch reports, which is what these tests change."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from gpipe.cli import main
from gpipe.distributed import choose_devices, comm_device, init_from_env
from gpipe.distributed import devices as devices_module
from gpipe.train import ConfigError, TrainConfig, parse

TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


@pytest.fixture(autouse=True)
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts outside torchrun, whatever launched pytest."""
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def two_gpus() -> Iterator[None]:
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.device_count", return_value=2),
    ):
        yield


@pytest.fixture
def no_gpu() -> Iterator[None]:
    with mock.patch("torch.cuda.is_available", return_value=False):
        yield


def torchrun(monkeypatch: pytest.MonkeyPatch, *, local_rank: int, local_world: int, world: int | None = None) -> None:
    world = local_world if world is None else world
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))


def cuda(*indices: int) -> list[torch.device]:
    return [torch.device("cuda", i) for i in indices]


@pytest.mark.usefixtures("two_gpus")
def test_auto_and_cuda_place_the_stages_round_robin_on_the_visible_gpus() -> None:
    assert choose_devices("auto", 4) == cuda(0, 1, 0, 1)
    assert choose_devices("cuda", 3) == cuda(0, 1, 0)
    assert choose_devices("auto", 1) == cuda(0)
    assert choose_devices("cpu", 3) == [torch.device("cpu")] * 3


@pytest.mark.usefixtures("two_gpus")
def test_a_list_is_one_device_for_all_or_one_per_worker() -> None:
    assert choose_devices("cuda:1", 3) == cuda(1, 1, 1)
    assert choose_devices("cuda:1,cuda:0", 2) == cuda(1, 0)
    assert choose_devices(" cuda:0, cpu ", 2) == [torch.device("cuda", 0), torch.device("cpu")]
    with pytest.raises(ValueError, match=r"lists 3 devices for 2 pipeline workers \(--partitions 2\)"):
        choose_devices("cuda:0,cuda:1,cuda:0", 2)
    with pytest.raises(ValueError, match=r"cuda:2 is not one of the 2 CUDA devices visible here.*cuda:0 to cuda:1"):
        choose_devices("cuda:0,cuda:2", 2)
    for bad in ("gpu", "cuda:x", "meta", "cuda:0,,cuda:1", ""):
        with pytest.raises(ValueError, match="--devices"):
            choose_devices(bad, 2)


@pytest.mark.usefixtures("no_gpu")
def test_auto_without_cuda_is_the_cpu_and_cuda_is_refused() -> None:
    assert choose_devices("auto", 3) == [torch.device("cpu")] * 3
    with pytest.raises(ValueError, match="--devices cuda needs CUDA, but torch sees no CUDA device here"):
        choose_devices("cuda", 2)
    with pytest.raises(ValueError, match="cuda:0 needs CUDA"):
        choose_devices("cuda:0", 2)


@pytest.mark.usefixtures("two_gpus")
def test_under_torchrun_a_rank_takes_its_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    torchrun(monkeypatch, local_rank=1, local_world=2)
    assert devices_module.local_device("auto") == torch.device("cuda", 1)
    assert devices_module.local_device("cuda") == torch.device("cuda", 1)
    assert devices_module.local_device("cpu") == torch.device("cpu")
    assert choose_devices("auto", 2) is None  # (each rank its own: rank_device, the group's)
    assert choose_devices("cpu", 2) == [torch.device("cpu")] * 2  # (one per rank, as the engine takes them)
    with pytest.raises(ValueError, match=r"under torchrun.*CUDA_VISIBLE_DEVICES"):
        choose_devices("cuda:0,cuda:1", 2)


@pytest.mark.usefixtures("two_gpus")
def test_more_local_ranks_than_gpus_is_refused_naming_both_and_the_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    torchrun(monkeypatch, local_rank=0, local_world=4, world=8)
    for spec in ("auto", "cuda"):
        with pytest.raises(ValueError) as refused:
            choose_devices(spec, 2)
        message = str(refused.value)
        assert "4 ranks on this machine (LOCAL_WORLD_SIZE) but 2 CUDA devices" in message, message
        assert "--nproc-per-node 2" in message and "CUDA_VISIBLE_DEVICES" in message and "--devices cpu" in message
    assert choose_devices("cpu", 2) == [torch.device("cpu")] * 8  # the fix the message names works


def captured_init(monkeypatch: pytest.MonkeyPatch, devices: str = "auto") -> tuple[dict[str, Any], list[Any]]:
    """init_from_env's call of init_process_group (intercepted) and its set_device calls."""
    calls: dict[str, Any] = {}
    set_to: list[Any] = []

    def init_process_group(backend: str, **kwargs: Any) -> None:
        calls.update(kwargs, backend=backend)

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    monkeypatch.setattr("atexit.register", lambda f: f)
    assert init_from_env(5.0, devices=devices)
    return calls, set_to


@pytest.mark.usefixtures("two_gpus")
def test_init_with_cuda_binds_the_local_gpu_with_gloo_beside_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    torchrun(monkeypatch, local_rank=1, local_world=2)
    calls, set_to = captured_init(monkeypatch)
    assert calls["backend"] == "cpu:gloo,cuda:nccl"
    assert calls["device_id"] == torch.device("cuda", 1) and set_to == [torch.device("cuda", 1)]
    assert calls["timeout"].total_seconds() == 5.0


@pytest.mark.usefixtures("two_gpus")
def test_init_with_devices_cpu_on_a_gpu_machine_is_gloo_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    torchrun(monkeypatch, local_rank=1, local_world=4)  # (more ranks than GPUs: the CPU runs them all)
    calls, set_to = captured_init(monkeypatch, devices="cpu")
    assert calls["backend"] == "gloo" and "device_id" not in calls and set_to == []


@pytest.mark.usefixtures("no_gpu")
def test_init_without_cuda_is_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    torchrun(monkeypatch, local_rank=0, local_world=2)
    calls, set_to = captured_init(monkeypatch)
    assert calls["backend"] == "gloo" and "device_id" not in calls and set_to == []


@pytest.mark.usefixtures("two_gpus")
def test_init_refuses_more_local_ranks_than_gpus_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    torchrun(monkeypatch, local_rank=0, local_world=3)
    with pytest.raises(ValueError, match="3 ranks on this machine"):
        captured_init(monkeypatch)


@pytest.mark.parametrize(
    ("config", "device", "expected"),
    [
        ("cpu:gloo,cuda:nccl", "cuda:1", "cuda:1"),
        ("cuda:nccl", "cuda:0", "cuda:0"),
        ("nccl", "cuda:0", "cuda:0"),
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),  # (--devices cpu beside a group that could talk NCCL)
        ("cpu:gloo,cuda:gloo", "cuda:0", "cpu"),
    ],
)
def test_a_collective_lives_on_the_gpu_under_nccl_else_on_the_cpu(
    config: str, device: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: config)
    assert comm_device(torch.device(device)) == torch.device(expected)


def test_the_tensor_parallel_count_is_reduced_on_the_ranks_communication_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """engine._split_layers all-reduces its count on comm_device(the rank's device): a CPU tensor on an
    NCCL-only group was the crash of issue #46 item 3."""
    from gpipe import engine

    asked: list[torch.device] = []
    reduced: list[torch.Tensor] = []

    def on(device: torch.device) -> torch.device:
        asked.append(device)
        return torch.device("cpu")

    monkeypatch.setattr(engine, "comm_device", on)
    monkeypatch.setattr(engine, "parallelize", lambda local, mesh, plan: 3)
    monkeypatch.setattr(torch.distributed, "all_reduce", reduced.append)
    monkeypatch.setattr(engine, "collective", lambda what: contextlib.nullcontext())
    engine._split_layers({}, mock.Mock(), "auto", torch.device("cuda", 1))
    assert asked == [torch.device("cuda", 1)] and [int(t) for t in reduced] == [3]


@pytest.mark.usefixtures("no_gpu")
def test_gpipe_train_devices_cuda_without_cuda_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag, message in (
        ("cuda", "--devices cuda needs CUDA, but torch sees no CUDA device here"),
        ("cpu,cpu,cpu", "lists 3 devices for 2 pipeline workers"),
    ):
        assert main(["train", "--devices", flag, "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.usefixtures("no_gpu")
def test_devices_is_a_setting_of_flags_and_config_files(tmp_path: Path) -> None:
    assert TrainConfig().devices == "auto"
    assert parse(["--out", str(tmp_path / "a"), "--devices", "cpu"]).devices == "cpu"
    toml = tmp_path / "settings.toml"
    toml.write_text('devices = "cpu"\npartitions = 2\n')
    assert parse(["--config", str(toml), "--out", str(tmp_path / "b")]).devices == "cpu"
    toml.write_text('devices = "cuda"\n')
    with pytest.raises(ConfigError, match="--devices cuda needs CUDA"):
        parse(["--config", str(toml), "--out", str(tmp_path / "c")])
    with pytest.raises(ConfigError, match="devices must be a string"):
        TrainConfig(devices=2, out=str(tmp_path / "d")).check()  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_gpu")
def test_a_run_resumes_and_evaluates_on_other_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--devices is how an invocation runs, not a setting of the run: a resume neither takes the run's
    (which may name GPUs this machine lacks) nor names it as changed; gpipe eval takes its own."""
    out = str(tmp_path / "run")
    quick = ["--batch", "8", "--dim", "16", "--heads", "2", "--hidden", "32", "--eval-every", "0", "--no-progress",
             "--tensorboard", "off", "--checkpoint-every", "2"]  # fmt: skip
    assert main(["train", "--out", out, "--steps", "2", "--devices", "cpu:0", *quick]) == 0
    capsys.readouterr()
    assert parse(["--out", out, "--resume", "--steps", "3"]).devices == "auto"
    assert main(["train", "--out", out, "--resume", "--steps", "3", *quick]) == 0
    err = capsys.readouterr().err
    assert "resuming" in err and "--devices" not in err, err
    assert main(["eval", "--checkpoint", out, "--devices", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --devices cuda needs CUDA") and len(err.splitlines()) == 1, err
    assert main(["eval", "--checkpoint", out, "--devices", "cpu", "--eval-batches", "1"]) == 0
    assert "step 3:" in capsys.readouterr().out
