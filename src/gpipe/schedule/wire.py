"""A schedule's traffic between workers, as NCCL carries it, checked before a step runs.

Under torch.distributed each worker is a rank, and what crosses from one rank to another travels on a
*link*: one per (source worker, destination worker, activations|gradients), an NCCL communicator and
stream of its own. NCCL's point-to-point operations complete only when both sides posted them, a
stream's operations complete in the order they were issued, and sends are matched to receives by
order alone. So gpipe's transport (:mod:`gpipe.distributed.wire`) sends each message as its action
produces it (a send never holds the sender up) and receives a link's messages in the *sender's* order,
receiving ahead of need when a later message comes first.

:func:`links` gives each link's messages in that order; :func:`check_wire` runs the schedule under
those rules — each worker's actions in order, an action waiting for its inputs, a message receivable
once it and every message before it on its link were sent — and raises :class:`ScheduleError` naming
the actions that would wait forever, or returns what each link carries and how many messages its
receiver holds ahead of need at most.

Plain data, like the rest of :mod:`gpipe.schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpipe.schedule.ir import STAGE_WIDE, Action, ActionKind, Schedule, ScheduleError, dependencies

__all__ = ["Link", "LinkTraffic", "check_wire", "links", "message_of"]

Link = tuple[int, int, str]
"""(source worker, destination worker, ``'act'`` | ``'grad'``)."""
Key = tuple[str, int, int]
"""``('act', m, s)``: stage s's input of micro-batch m; ``('grad', m, s)``: the gradient of its output."""


def message_of(action: Action, schedule: Schedule) -> tuple[Link, Key] | None:
    """The message ``action`` sends to another worker (its link and key), if any."""
    worker_of, last = schedule.placement, schedule.num_stages - 1
    m, s = action.microbatch, action.stage
    if action.kind is ActionKind.FORWARD and s < last:
        key, dst, kind = ("act", m, s + 1), worker_of[s + 1], "act"
    elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and s > 0:
        key, dst, kind = ("grad", m, s - 1), worker_of[s - 1], "grad"
    else:
        return None
    src = worker_of[s]
    return None if src == dst else ((src, dst, kind), key)


def links(schedule: Schedule) -> dict[Link, tuple[Key, ...]]:
    """Each link's messages, in the order they travel (the sender's order of actions)."""
    out: dict[Link, list[Key]] = {}
    for actions in schedule.actions:
        for a in actions:
            sent = message_of(a, schedule)
            if sent is not None:
                out.setdefault(sent[0], []).append(sent[1])
    return {link: tuple(keys) for link, keys in out.items()}


@dataclass(frozen=True)
class LinkTraffic:
    """What one link carries in a step: ``messages`` in order; ``ahead``: the most messages its
    receiver holds received before the action that needs them (0 when it needs them in the sender's
    order)."""

    messages: tuple[Key, ...]
    ahead: int


def _input(d: Action, schedule: Schedule) -> Key:
    """The key under which dependency ``d``'s result reaches the action that depends on it."""
    if d.kind is ActionKind.FORWARD:
        return ("act", d.microbatch, d.stage + 1)
    return ("grad", d.microbatch, d.stage - 1)


def check_wire(schedule: Schedule) -> dict[Link, LinkTraffic]:
    """Run ``schedule`` under NCCL's point-to-point rules (see the module's docstring); raise
    :class:`ScheduleError` if some action would wait forever, else return each link's traffic."""
    if schedule.feedback:
        raise ScheduleError(
            f"{schedule.name}: a decode schedule's messages are self-describing and open-ended; "
            "check_wire checks training schedules"
        )
    traffic = links(schedule)
    position = {key: (link, i) for link, keys in traffic.items() for i, key in enumerate(keys)}
    present = set(schedule)
    worker_of = schedule.placement
    done: set[Action] = set()
    sent = dict.fromkeys(traffic, 0)  # per link: how many of its messages were sent (a prefix)
    received = dict.fromkeys(traffic, 0)  # per link: how many its receiver received (a prefix)
    consumed: dict[Link, set[int]] = {link: set() for link in traffic}
    ahead = dict.fromkeys(traffic, 0)
    pointer = [0] * schedule.num_workers
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for w, actions in enumerate(schedule.actions):
            while pointer[w] < len(actions):
                action = actions[pointer[w]]
                deps = () if action.kind in STAGE_WIDE else dependencies(action, schedule, present)
                remote: list[tuple[Link, int]] = []
                ready = True
                for d in deps:
                    if worker_of[d.stage] == w:
                        ready = ready and d in done
                        continue
                    link, i = position[_input(d, schedule)]
                    ready = ready and i < sent[link]
                    remote.append((link, i))
                if not ready:
                    break
                for link, i in remote:  # received in the sender's order, up to the one needed
                    received[link] = max(received[link], i + 1)
                    consumed[link].add(i)
                    ahead[link] = max(ahead[link], received[link] - len(consumed[link]))
                done.add(action)
                sending = message_of(action, schedule)
                if sending is not None:
                    sent[sending[0]] += 1
                pointer[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"worker {w} at {actions[pointer[w]]}" for w, actions in enumerate(schedule.actions)
                     if pointer[w] < len(actions)]  # fmt: skip
            raise ScheduleError(
                f"{schedule.name}: under NCCL's point-to-point semantics these would wait forever: {', '.join(stuck)}"
            )
    return {link: LinkTraffic(keys, ahead[link]) for link, keys in traffic.items()}
