"""The rendezvous semantics themselves (tests/rendezvous.py): what they refuse would hang or read
garbage on NCCL, what they allow completes. The pipeline's own runs under them are every test that
reads the session's pool (``pytest -m rendezvous``)."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from gpipe.distributed import init_from_env
from tests import rendezvous
from tests.dist_harness import POOL, Pool


def _outcome(call: Any) -> str:
    try:
        call()
    except Exception as exc:  # (the waits raise what the emulated operation met)
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def semantics() -> dict[str, Any]:
    """One rank's view of four exchanges with the other rank, each on a group of its own."""
    init_from_env()
    assert rendezvous.installed(), "tests/dist_entry.py installs the semantics in every rank"
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    out: dict[str, Any] = {}

    # Matched: the sender's order is the receiver's; the values arrive.
    group = dist.new_group([0, 1])
    if me == 0:
        works = [dist.isend(torch.full((3,), float(i)), peer, group=group) for i in range(3)]
    else:
        got = [torch.empty(3) for _ in range(3)]
        works = [dist.irecv(t, peer, group=group) for t in got]
    for w in works:
        w.wait()
    out["matched"] = [t.tolist() for t in got] if me == 1 else None

    # Facing sends on one communicator: each rank's send waits for a receive queued behind the other's.
    rendezvous._STATE.deadlock = 2.0  # type: ignore[union-attr]
    group = dist.new_group([0, 1])
    send = dist.isend(torch.ones(2), peer, group=group)
    recv = dist.irecv(torch.empty(2), peer, group=group)
    out["facing"] = _outcome(lambda: (send.wait(), recv.wait()))

    # Receives posted in another order than the sends: sizes differ.
    group = dist.new_group([0, 1])
    if me == 0:
        works = [dist.isend(torch.ones(n), peer, group=group) for n in (2, 5)]
    else:
        works = [dist.irecv(torch.empty(n), peer, group=group) for n in (5, 2)]
    out["reordered"] = _outcome(lambda: [w.wait() for w in works])
    rendezvous._STATE.deadlock = 30.0  # type: ignore[union-attr]

    # An operation issued by a second thread.
    errors: list[str] = []
    thread = threading.Thread(target=lambda: errors.append(_outcome(lambda: dist.isend(torch.ones(1), peer))))
    thread.start()
    thread.join()
    out["thread"] = errors[0]
    return out


CASE = POOL.add(2, "rendezvous semantics", "test_rendezvous:semantics", timeout=60)


def test_what_nccl_would_refuse_is_refused(pool: Pool) -> None:
    ranks = pool(CASE)
    assert ranks[1]["matched"] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
    for r in ranks:
        assert "on NCCL this would hang" in r["facing"], r["facing"]
        assert "issued by thread" in r["thread"], r["thread"]
    # the sender finds the receive of another size; the receiver's wait fails with it (or as it left)
    assert "orders of operations differ" in ranks[0]["reordered"], ranks[0]["reordered"]
    assert ranks[1]["reordered"] != "ok"
