"""Which device each stage runs on, and which device a rank's collectives use: decided here, once.

:func:`choose_devices` turns a command's ``--devices`` (``auto``, ``cpu``, ``cuda``, or a list such as
``cuda:0,cuda:1``) into the ``devices=`` of a :class:`~gpipe.Pipeline`. In one process ``auto`` puts
the K workers (a stage each; two in the V schedules) on the visible CUDA devices, round robin (cuda:0,
cuda:1, cuda:0, ... for K > devices), or on the CPU where there is none; ``cuda`` does the same and is
refused without CUDA; a list gives one device for all the workers, or one per worker (any other length
is refused). Under torchrun each rank runs on one device: ``auto`` and ``cuda`` give ``cuda:LOCAL_RANK``
(chosen by :func:`local_device` when the process group starts), ``cpu`` the CPU; a list is refused
there (choose the GPUs with ``CUDA_VISIBLE_DEVICES``).

:func:`local_device` is the rank's device before the group starts (what
:func:`gpipe.distributed.init_from_env` binds the group to); :func:`rank_device` is the rank's device
once the group runs, read from the group itself; :func:`comm_device` is the device a collective's
tensors must live on: the rank's CUDA device where the group talks NCCL on CUDA, the CPU otherwise
(gloo). :func:`backend_for` is the backend a group of ranks on a device starts with:
``cpu:gloo,cuda:nccl`` for CUDA (CPU tensors go over gloo, CUDA ones over NCCL), ``gloo`` for the CPU.

Part of the library: imports torch only.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEVICES", "backend_for", "choose_devices", "comm_device", "local_device", "rank_device"]

DEVICES = ("auto", "cpu", "cuda")
"""The kinds ``--devices`` takes besides a list of devices."""


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _parse(spec: str) -> list[torch.device]:
    """The devices of a list ``cuda:0,cuda:1,cpu``, each one that exists here."""
    found = []
    for entry in (e.strip() for e in spec.split(",")):
        try:
            device = torch.device(entry)
        except (RuntimeError, ValueError):
            device = None
        if device is None or device.type not in ("cpu", "cuda") or (device.type == "cuda" and device.index is None):
            raise ValueError(
                f"--devices {spec!r}: {entry!r} is not a device; give {', '.join(DEVICES)}, or a comma-separated "
                "list of cpu and cuda:N"
            )
        if device.type == "cuda" and (device.index or 0) >= _cuda_count():
            raise ValueError(
                f"--devices {spec!r}: {entry} is not one of the {_cuda_count()} CUDA devices visible here"
                f"{_visible()}; give cuda:0 to cuda:{_cuda_count() - 1}, or --devices cpu"
                if _cuda_count()
                else f"--devices {spec!r}: {entry} needs CUDA, which this machine (or this torch) does not have; "
                "give --devices cpu or auto"
            )
        found.append(torch.device("cpu") if device.type == "cpu" else device)
    return found


def _visible() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def choose_devices(spec: str, workers: int) -> list[torch.device] | None:
    """The ``devices=`` of a pipeline of ``workers`` workers (K, ``--partitions``) for ``--devices spec``
    (see the module's docstring). In one process: a device per worker. Under torchrun (``WORLD_SIZE`` > 1): None for
    ``auto`` and ``cuda`` (each rank takes its own: :func:`rank_device`), the CPU for every rank for
    ``cpu``. A bad ``spec`` raises ``ValueError`` naming it and the fix."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--devices must be {', '.join(DEVICES)}, or a list such as cuda:0,cuda:1 (got {spec!r})")
    spec = spec.strip()
    if _world() > 1:
        device = local_device(spec)
        return [device] * _world() if device.type == "cpu" else None
    count = _cuda_count()
    if spec == "cuda" and not count:
        raise ValueError(_no_cuda(spec))
    if spec in ("auto", "cuda"):
        return [torch.device("cuda", s % count) if count else torch.device("cpu") for s in range(workers)]
    if spec == "cpu":
        return [torch.device("cpu")] * workers
    listed = _parse(spec)
    if len(listed) == 1:
        return listed * workers
    if len(listed) != workers:
        raise ValueError(
            f"--devices {spec!r} lists {len(listed)} devices for {workers} pipeline workers (--partitions "
            f"{workers}): give one device for all of them, or one per worker"
        )
    return listed


def _no_cuda(spec: str) -> str:
    return (
        f"--devices {spec} needs CUDA, but torch sees no CUDA device here (torch {torch.__version__}{_visible()}); "
        "give --devices cpu or auto"
    )


def local_device(spec: str = "auto") -> torch.device:
    """This rank's device under torchrun for ``--devices spec``, before its process group starts:
    ``cuda:LOCAL_RANK`` for ``auto`` with CUDA and for ``cuda``, else the CPU. Refuses (``ValueError``) a
    list of devices, ``cuda`` without CUDA, and more ranks on this machine (``LOCAL_WORLD_SIZE``) than
    CUDA devices: a GPU each."""
    if spec not in DEVICES:
        raise ValueError(
            f"--devices {spec!r} under torchrun: each rank runs on cuda:LOCAL_RANK (auto, cuda) or the CPU (cpu); "
            "choose the GPUs with CUDA_VISIBLE_DEVICES instead of a list"
        )
    count = _cuda_count()
    if spec == "cuda" and not count:
        raise ValueError(_no_cuda(spec))
    if spec == "cpu" or not count:
        return torch.device("cpu")
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks > count:
        raise ValueError(
            f"{ranks} ranks on this machine (LOCAL_WORLD_SIZE) but {count} CUDA devices{_visible()}: one GPU per "
            f"rank; start at most {count} (torchrun --nproc-per-node {count}), make more visible with "
            "CUDA_VISIBLE_DEVICES, or give --devices cpu to run every rank on the CPU (gloo)"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def backend_for(device: torch.device) -> str:
    """The backend of a process group whose ranks run on ``device``: ``cpu:gloo,cuda:nccl`` for CUDA
    (CPU tensors over gloo: the step's seed, counts, objects, heartbeats; CUDA tensors over NCCL), else
    ``gloo``."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _nccl(group: Any = None) -> bool:
    """Whether ``group`` (default: the default group) sends CUDA tensors over NCCL."""
    config = dist.get_backend_config(group)
    return config == "nccl" or "cuda:nccl" in config.split(",")


def rank_device() -> torch.device:
    """This rank's device once the default process group runs: the device it is bound to
    (:func:`~gpipe.distributed.init_from_env` binds ``cuda:LOCAL_RANK``), else ``cuda:LOCAL_RANK`` where
    the group talks NCCL on CUDA (a group the caller started), else the CPU."""
    from torch.distributed.distributed_c10d import _get_default_group

    bound = getattr(_get_default_group(), "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    if torch.cuda.is_available() and _nccl():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def comm_device(device: torch.device | None = None, group: Any = None) -> torch.device:
    """Where the tensors of a collective of ``group`` (default: the default group) must live, for a rank
    computing on ``device`` (default: :func:`rank_device`): that CUDA device where the group talks NCCL on
    CUDA, else the CPU (gloo)."""
    device = rank_device() if device is None else torch.device(device)
    return device if device.type == "cuda" and _nccl(group) else torch.device("cpu")
