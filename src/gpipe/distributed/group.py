"""The default process group: :func:`init_from_env` starts it from torchrun's environment, and it
is destroyed at interpreter exit.

Under ``torchrun --max-restarts N`` the group's store is one that rank 0 hosts afresh for each
start of the worker group, not the store that torchrun's agent shares with its workers: that one
outlives a restart, and the keys the lost group left there (each rank's address) make the restarted
group connect to the dead processes' ports and fail (pytorch/pytorch#135712; torchrun's
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is the agent-side cure). Rank 0 publishes its store's
address in the agent's store; the others take the address published there and retry until it
answers (a lost group's address no longer does: torchrun restarts every worker of the group).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpipe.distributed.devices import backend_for, local_device

__all__ = ["init_from_env"]

_ADDRESS_KEY = "gpipe/group-store"  # in the agent's store: rank 0's fresh store, as host:port:token
_TOKEN_KEY = "gpipe/token"  # in rank 0's fresh store: the token published with its address


def init_from_env(timeout: float = 60.0, *, devices: str = "auto") -> bool:
    """Initialize the default process group from torchrun's environment (``WORLD_SIZE`` > 1) on this
    rank's device for ``devices`` (``auto``, ``cuda`` or ``cpu``: :func:`~gpipe.distributed.devices.local_device`,
    which refuses more local ranks than GPUs): on ``cuda:LOCAL_RANK``, made the current device and bound to
    the group (``device_id``), with ``cpu:gloo,cuda:nccl``; on the CPU with gloo. Returns whether the process
    is distributed."""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return False
    device = local_device(devices)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    options: dict[str, Any] = {"timeout": timedelta(seconds=timeout)}
    if device.type == "cuda":
        options["device_id"] = device
    if _restartable():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        options.update(store=_fresh_store(rank, timeout), rank=rank, world_size=world)
    dist.init_process_group(backend_for(device), **options)
    atexit.register(_shutdown)
    return True


def _restartable() -> bool:
    """Whether torchrun's agent may restart this worker group while sharing its store with it."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
    )


def _fresh_store(rank: int, timeout: float) -> Any:
    """Rank 0: a new TCPStore on a free port, published in the agent's store; the others: a client of
    the one published there that answers with its token (see the module's docstring)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    wait = timedelta(seconds=timeout)
    agent = dist.TCPStore(host, port, is_master=False, timeout=wait)  # type: ignore[attr-defined]
    if rank == 0:
        token = secrets.token_hex(8)
        store = dist.TCPStore(host, 0, is_master=True, timeout=wait, wait_for_workers=False)  # type: ignore[attr-defined]
        store.set(_TOKEN_KEY, token)
        agent.set(_ADDRESS_KEY, f"{host}:{store.port}:{token}")
        return store
    deadline = time.monotonic() + timeout
    while True:
        at, _, rest = agent.get(_ADDRESS_KEY).decode().partition(":")
        number, _, token = rest.partition(":")
        if _answers(at, int(number)):  # (a lost group's store is refused; asked plainly first: torch's
            with contextlib.suppress(RuntimeError):  # refusals are logged with a backtrace)
                store = dist.TCPStore(at, int(number), is_master=False, timeout=timedelta(seconds=2))  # type: ignore[attr-defined]
                if store.get(_TOKEN_KEY).decode() == token:
                    return store
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank}: the store of rank 0 published in torchrun's store ({at}:{number}) did not answer "
                f"within {timeout:g} s"
            )
        time.sleep(0.2)


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _shutdown() -> None:
    """Destroy the process group gpipe created, at interpreter exit."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
