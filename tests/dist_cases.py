"""What each rank runs in the multi-process tests: the same script as in one process."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils import _pytree as pytree

from gpipe import AutoSchedule, Pipeline, load_checkpoint, save_checkpoint
from gpipe.distributed import init_from_env
from gpipe.schedule import StageCosts
from gpipe.skip import pop, skippable, stash
from tests.helpers import even


def mlp(dropout: float = 0.0, layers: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(6, 6), nn.Dropout(dropout) if dropout else nn.Tanh()]
    return nn.Sequential(*mods)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=g), torch.randn(16, 6, generator=g)


VIRTUAL = {"interleaved-1f1b": 2, "zb-v": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}
"""Stages per worker a schedule runs with here (1 for the others)."""


def build(schedule: Any, workers: int, chunks: int, dropout: float = 0.0, **kwargs: Any) -> Pipeline:
    """``schedule``: a name, or a :class:`gpipe.AutoSchedule`."""
    model = mlp(dropout)
    virtual = VIRTUAL.get(schedule, 1) if isinstance(schedule, str) else 1
    return Pipeline(
        model,
        even(len(model), workers * virtual),
        chunks=chunks,
        schedule=schedule,
        loss_fn=F.mse_loss,
        virtual=virtual,
        **kwargs,
    )


def grads_of(pipe: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}


def step(schedule: str, chunks: int, dropout: float = 0.0, steps: int = 1) -> dict[str, Any]:
    """One step (or a few) of ``schedule`` on this rank's stages; loss and this rank's gradients."""
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(5)
    pipe = build(schedule, world, chunks, dropout)
    x, y = data()
    losses = [pipe.step(x, y) for _ in range(steps)]
    evaluation = pipe(x)
    return {"losses": losses, "grads": grads_of(pipe), "eval": evaluation}


def auto_steps(chunks: int, steps: int) -> dict[str, Any]:
    """``schedule='auto'``: the schedule of each of ``steps`` steps (planned from the costs gathered
    over the ranks) and of the next; then one step of a plan from given costs (F=1, I=1, W=2): its
    schedule, loss and this rank's gradients."""
    world = int(os.environ["WORLD_SIZE"])
    x, y = data()
    pipe = build("auto", world, chunks)
    ran, losses = [], []
    for _ in range(steps):
        pipe.zero_grad()
        losses.append(pipe.step(x, y))
        assert pipe.last_trace is not None
        ran.append(actions_of(pipe.last_trace.schedule))
    auto = {
        "ran": ran,
        "next": actions_of(pipe.schedule_for(chunks)),
        "replans": pipe.engine.planner.replans,  # type: ignore[attr-defined]
        "losses": losses,
        "grads": grads_of(pipe),
    }
    torch.manual_seed(5)
    fixed = build(AutoSchedule(costs=StageCosts.uniform(world, F=1, I=1, W=2)), world, chunks)
    loss = fixed.step(x, y)
    return {
        "auto": auto,
        "fixed": {"schedule": actions_of(fixed.schedule_for(chunks)), "loss": loss, "grads": grads_of(fixed)},
    }


def actions_of(schedule: Any) -> list[list[str]]:
    """A schedule's actions per worker, as text (what torch.load reads back without pickling)."""
    return [[str(a) for a in acts] for acts in schedule.actions]


def raise_on(rank: int) -> None:
    """Rank ``rank`` raises in its forward; the others must stop, naming it."""

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom on purpose")

    world = int(os.environ["WORLD_SIZE"])
    model = mlp()
    layers = list(model)
    stage_of_rank = even(len(layers), world)
    first = sum(stage_of_rank[:rank])
    layers[first] = Boom()
    pipe = Pipeline(nn.Sequential(*layers), stage_of_rank, chunks=4, loss_fn=F.mse_loss)
    x, y = data()
    pipe.step(x, y)


def die_on(rank: int, after: float) -> None:
    """Rank ``rank`` is killed (SIGKILL) mid-step."""

    class Die(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(after)
            os.kill(os.getpid(), 9)
            return x

    class Slow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)
            return x

    world = int(os.environ["WORLD_SIZE"])
    layers: list[nn.Module] = [nn.Linear(6, 6) if i % 2 == 0 else Slow() for i in range(2 * world)]
    if int(os.environ["RANK"]) == rank:
        layers[2 * rank + 1] = Die()
    pipe = Pipeline(nn.Sequential(*layers), [2] * world, chunks=4, loss_fn=F.mse_loss)
    x, y = data()
    for _ in range(100):
        pipe.step(x, y)


def _train(pipe: Pipeline, steps: int) -> list[torch.Tensor]:
    return _steps(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), steps)


def _steps(pipe: Pipeline, optimizer: torch.optim.Optimizer, steps: int) -> list[torch.Tensor]:
    x, y = data()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(pipe.step(x, y))
        optimizer.step()
    return losses


def train_and_save(directory: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps, save, then train one more: its loss is the one a resumed run must see."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pipe = build("1f1b", world, 4)
    _train(pipe, steps)
    save_checkpoint(pipe, directory, steps)
    return {"next": _train(pipe, 1)[0]}


def load_and_step(directory: str) -> dict[str, Any]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(99)  # other initial weights: only the checkpoint can make the loss match
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(6, 6), nn.Tanh())])
    pipe = Pipeline(model, even(16, world), chunks=4, schedule="1f1b", loss_fn=F.mse_loss)
    step = load_checkpoint(pipe, directory)
    return {"step": step, "next": _train(pipe, 1)[0]}


def data_parallel(schedule: str, dp: int, chunks: int) -> dict[str, Any]:
    """dp replicas of a pipeline over WORLD_SIZE / dp ranks, fed the same global mini-batch."""
    world = int(os.environ["WORLD_SIZE"])
    model = mlp()
    pipe = Pipeline(
        model, even(len(model), world // dp), chunks=chunks, schedule=schedule, loss_fn=F.mse_loss, data_parallel=dp
    )
    x, y = data()
    loss = pipe.step(x, y)
    return {"loss": loss, "grads": grads_of(pipe), "dp_rank": pipe.dp_rank}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_growth_mib(build: Any) -> tuple[Any, float]:
    """Run ``build`` and return its result and how far it raised the resident memory (MiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current resident size
    before = _rss_kib("VmRSS")
    result = build()
    return result, (_rss_kib("VmHWM") - before) / 1024


def meta_memory(width: int, layers: int) -> dict[str, Any]:
    """Build a model on the meta device and keep this rank's stage; report the memory it took,
    beside what building the whole model takes."""
    world = int(os.environ["WORLD_SIZE"])
    init_from_env()  # the process group's own memory is not the model's
    Pipeline(mlp(), even(16, world), chunks=1, loss_fn=F.mse_loss)  # nor are gloo's and the mesh's first buffers
    # What a pipeline of a tiny model costs (its process groups' buffers, mostly):
    _, overhead = _peak_growth_mib(lambda: Pipeline(mlp(), even(16, world), chunks=1, loss_fn=F.mse_loss))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    pipe, rss = _peak_growth_mib(lambda: Pipeline(model, even(layers, world), chunks=1, loss_fn=F.mse_loss))
    whole, whole_rss = _peak_growth_mib(lambda: nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]))
    del whole
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    return {
        "rss_mib": rss,
        "overhead_mib": overhead,
        "whole_rss_mib": whole_rss,
        "param_mib": params / 2**20,
        "weights": {n.split(".", 2)[2]: p.detach().clone() for n, p in pipe.named_parameters()},
    }


@skippable(stash=["down1"])
class Down1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        stash("down1", x)
        return F.max_pool2d(x, 2)


@skippable(stash=["down2"])
class Down2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        stash("down2", x)
        return F.max_pool2d(x, 2)


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


@skippable(pop=["down2"])
class Up2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(torch.cat([F.interpolate(x, scale_factor=2), pop("down2")], dim=1)))


@skippable(pop=["down1"])
class Up1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([F.interpolate(x, scale_factor=2), pop("down1")], dim=1))


def unet() -> nn.Sequential:
    """A U-Net-like model of 8 layers whose skips span up to 6 layers (3 stages of 4)."""
    torch.manual_seed(0)
    return nn.Sequential(Down1(), Down2(), Middle(), Middle(), Middle(), Up2(), Up1(), nn.Tanh())


def unet_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 2, 8, 8, generator=g), torch.randn(8, 2, 8, 8, generator=g)


def unet_step(schedule: str, chunks: int, generators: bool = False) -> dict[str, Any]:
    """One step of the U-Net: skips as plain calls, or (``generators``) torchgpipe's protocol."""
    world = int(os.environ["WORLD_SIZE"])
    model = generator_unet() if generators else unet()
    pipe = Pipeline(model, even(len(model), world), chunks=chunks, schedule=schedule, loss_fn=F.mse_loss)
    x, y = unet_data()
    return {"loss": pipe.step(x, y), "grads": grads_of(pipe)}


VOCAB, DIM = 11, 6


def tied_lm(share: bool) -> nn.Sequential:
    """Embedding, four layers, output projection; ``share``: the plain model's one weight for both."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
    if share:
        head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), head)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def lm_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (8, 5), generator=g), torch.randint(0, VOCAB, (8, 5), generator=g)


def tied_training(steps: int) -> dict[str, Any]:
    """A tied embedding/output on the first and last stage: the copies after ``steps`` SGD steps,
    and the first step's gradients."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kwargs: dict[str, Any] = {} if world > 1 else {"devices": ["cpu", "cpu"]}
    pipe = Pipeline(tied_lm(False), [3, 3], chunks=4, loss_fn=lm_loss, tied=[["0.weight", "5.weight"]], **kwargs)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
    x, y = lm_data()
    first: dict[str, torch.Tensor] = {}
    for i in range(steps):
        optimizer.zero_grad()
        pipe.step(x, y)
        if i == 0:
            first = grads_of(pipe)
        optimizer.step()
    weights = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    return {"grads": first, "weights": weights}


def trace_of_rank() -> dict[str, Any]:
    """Each rank's own trace: its worker's actions, with a timeline and a Chrome trace."""
    world = int(os.environ["WORLD_SIZE"])
    pipe = build("zb-h1", world, 4)
    x, y = data()
    pipe.step(x, y)
    trace = pipe.last_trace
    assert trace is not None
    timeline = trace.timeline()
    return {"actions": len(trace.events), "workers": timeline.schedule.num_workers, "busy": timeline.busy}


class MaskedEmbed(nn.Module):
    """Tokens -> (hidden states, a float mask built from the tokens alone: it needs no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = (tokens != 0).float().unsqueeze(-1).expand(-1, -1, 6).contiguous()
        return self.embed(tokens), mask


class MaskedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = inputs
        return torch.tanh(self.lin(h)) * mask, mask


def masked_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(MaskedEmbed(), MaskedLinear(), MaskedLinear(), MaskedLinear())


def masked_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 10, (8, 5), generator=g)
    return tokens, torch.randn(8, 5, 6, generator=g)


def masked_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out[0], target)


def masked_step(schedule: str, checkpoint: str) -> dict[str, Any]:
    """A float mask crosses every boundary: record what each gradient message carries."""
    from gpipe.distributed import wire

    sent: list[list[str]] = []
    send = wire.Channel.post

    def spy(channel: wire.Channel, value: Any, **how: bool) -> None:
        if channel.kind == "grad":
            sent.append(["none" if v is None else "tensor" for v in value])
        send(channel, value, **how)

    wire.Channel.post = spy  # type: ignore[method-assign]
    try:  # (put back: another case may follow in this process, tests/dist_entry.py's cases)
        pipe = Pipeline(masked_model(), [2, 2], chunks=4, loss_fn=masked_loss, schedule=schedule, checkpoint=checkpoint)
        x, y = masked_data()
        loss = pipe.step(x, y)
    finally:
        wire.Channel.post = send  # type: ignore[method-assign]
    return {"loss": loss, "grads": grads_of(pipe), "sent": sent}


def lost_at(rank: int, where: str, how: str, timeout: float, mark: str, dp: int = 1, steps: int = 3) -> None:
    """Rank ``rank`` is lost in the second step: it sends itself SIGKILL (``how='kill'``) or SIGSTOP
    (``'stop'``) at ``where``: ``'between'`` (after the first step, before the second starts: the
    seed broadcast), ``'step'`` (in its first action of the step), ``'loss'`` (before the loss is
    shared: the all-reduce and broadcast of the loss) or ``'grads'`` (before the data-parallel
    all-reduce of the gradients). Before that it writes the time to ``mark``; the others must stop
    within ``timeout``, naming it."""
    import signal

    world = int(os.environ["WORLD_SIZE"])
    model = mlp()
    pipe = Pipeline(
        model, even(len(model), world // dp), chunks=2, loss_fn=F.mse_loss, data_parallel=dp, timeout=timeout
    )
    victim = int(os.environ["RANK"]) == rank
    count = {"calls": 0}

    def lose() -> None:
        with open(mark, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(60)  # not reached: a stopped rank is killed by the test

    def dying(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            count["calls"] += 1
            if count["calls"] == 2:
                lose()
            return method(*args, **kwargs)

        return call

    if victim and where == "step":  # in its first action of the second step
        pipe.engine.executor._execute = dying(pipe.engine.executor._execute)  # type: ignore[method-assign]
        count["calls"] = -len(pipe.schedule_for(2).actions[int(os.environ["RANK"])]) + 1
    elif victim and where == "loss":
        pipe.engine.comm.loss = dying(pipe.engine.comm.loss)  # type: ignore[method-assign]
    elif victim and where == "grads":
        pipe.engine.comm.reduce_gradients = dying(pipe.engine.comm.reduce_gradients)  # type: ignore[method-assign]
    x, y = data()
    for i in range(steps):
        if victim and where == "between" and i == 1:
            lose()
        pipe.step(x, y)


def named_after_teardown(rank: int, timeout: float) -> dict[str, str]:
    """Rank ``rank`` is killed between two steps. The survivor catches the PipelineError, and then
    the process group is torn down (by an application's cleanup, or at exit) while a failure is
    still being named: first in a collective that fails with the transport's error just after the
    teardown, then in the report of a transfer that failed (``ChannelTransport._lost``).
    Returns what each said; the exit's watch (the store's host lingers) runs after the teardown."""
    import signal

    from gpipe.distributed import ChannelTransport, PipelineError, collective
    from gpipe.runtime.context import StepContext
    from gpipe.runtime.executor import StepRun

    model = mlp()
    pipe = Pipeline(model, even(len(model), 2), chunks=2, loss_fn=F.mse_loss, timeout=timeout)
    transport = pipe.engine.executor.transport
    assert isinstance(transport, ChannelTransport)
    x, y = data()
    pipe.step(x, y)
    if int(os.environ["RANK"]) == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        pipe.step(x, y)
    except PipelineError as e:
        lost = e
    else:
        raise AssertionError(f"rank {rank} was killed, yet the step succeeded")
    cause = lost.__cause__
    assert isinstance(cause, RuntimeError), cause  # the transport's error: the lost rank's socket closed
    said = {"step": str(lost)}
    try:
        with collective("broadcast of the step's seed from rank 0"):
            torch.distributed.destroy_process_group()
            raise cause
    except Exception as e:
        said["collective"] = f"{type(e).__name__}: {e}"
    run = StepRun(StepContext.capture(num_microbatches=2, checkpoint_stop=0, training=True, seed=0))
    try:
        transport._lost(rank, cause, run.mailbox)
        said["transfer"] = str(run.mailbox.failed)
    except Exception as e:
        said["transfer"] = f"{type(e).__name__}: {e}"
    return said


def train_and_save_at(directory: str, steps: int, step: int) -> dict[str, Any]:
    """Train ``steps`` steps and save them as checkpoint ``step``; return this rank's saved layers, and
    the files the step's folder held before (the ranks' steps wait for each other: before any saves)."""
    from gpipe.saving import layer_state

    folder = Path(directory) / f"step-{step:08d}"
    before = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pipe = build("1f1b", world, 4)
    _train(pipe, steps)
    save_checkpoint(pipe, directory, step)
    return {"state": {k: v.clone() for k, v in layer_state(pipe).items()}, "before": before}


def save_with_full_disk_on(directory: str, rank: int) -> dict[str, Any]:
    """Save step 1, then step 2 with rank ``rank``'s disk full: every rank must raise (none waits
    forever for it), and step 1 must still load."""
    import errno

    from gpipe.saving import layer_state

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pipe = build("1f1b", world, 4)
    save_checkpoint(pipe, directory, 1)
    before = {k: v.clone() for k, v in layer_state(pipe).items()}
    _train(pipe, 1)
    real_save = torch.save

    def full(obj: object, f: Any) -> None:
        if int(os.environ["RANK"]) == rank:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f)

    torch.save = full  # type: ignore[assignment]
    try:
        save_checkpoint(pipe, directory, 2)
        error: dict[str, Any] = {}
    except Exception as e:
        error = {"type": type(e).__name__, "message": str(e), "errno": getattr(e, "errno", None)}
    finally:
        torch.save = real_save
    step = load_checkpoint(pipe, directory)
    after = layer_state(pipe)
    return {"error": error, "step": step, "restored": all(torch.equal(after[k], v) for k, v in before.items())}


# Pytrees: a dict enters the pipeline and travels between ranks, a registered dataclass leaves it.


@dataclasses.dataclass
class Prediction:
    """What the last layer of the pytree model returns (registered with pytree below)."""

    logits: torch.Tensor
    mask: torch.Tensor


pytree.register_dataclass(Prediction)


class DictIn(nn.Module):
    """{"x", "mask"} -> {"h", "aux": (mask, 2)}: the structure the next layers (and ranks) receive."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {"h": torch.tanh(self.lin(batch["x"])) * batch["mask"], "aux": (batch["mask"], 2)}


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, state: dict[str, Any]) -> dict[str, Any]:
        mask, scale = state["aux"]
        return {"h": torch.tanh(self.lin(state["h"])) * mask, "aux": (mask, scale)}


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, state: dict[str, Any]) -> Prediction:
        mask, scale = state["aux"]
        return Prediction(self.lin(state["h"]) * scale, mask)


def dict_model(blocks: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(DictIn(), *(DictBlock() for _ in range(blocks)), DictHead())


def dict_data() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A mini-batch of 8 as a dict (some rows masked out) and its target, a dict too."""
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(8) % 3 != 0).float().unsqueeze(1)
    return {"x": torch.randn(8, 6, generator=g), "mask": mask}, {"y": torch.randn(8, 6, generator=g)}


def dict_loss(output: Prediction, target: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((output.logits - target["y"]) ** 2 * output.mask).mean()


def dict_step(schedule: str, chunks: int, workers: int | None = None) -> dict[str, Any]:
    """One step of the dict model on this rank's stages (``workers``: in one process): loss,
    gradients, the evaluation's output."""
    k = workers or int(os.environ["WORLD_SIZE"])
    model = dict_model()
    pipe = Pipeline(model, even(len(model), k), chunks=chunks, schedule=schedule, loss_fn=dict_loss, cpu_threads=1)
    x, y = dict_data()
    loss = pipe.step(x, y)
    out = pipe(x)
    return {"loss": loss, "grads": grads_of(pipe), "eval": None if out is None else dataclasses.asdict(out)}


def gpt2_steps(steps: int = 3, world: int | None = None) -> dict[str, Any]:
    """A Hugging Face GPT-2, traced into layers by the pipeline itself, trained a few steps with
    Adam: the losses, and the tied embedding / LM head as this rank holds them (one process:
    ``world`` workers on the CPU)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=4, vocab_size=97, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(1, 97, (8, 12), generator=g), torch.randint(1, 97, (8, 12), generator=g)

    def loss_fn(output: Any, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits.flatten(0, 1), y.flatten())

    local = {} if world is None else {"devices": ["cpu"] * world, "cpu_threads": 1}
    pipe = Pipeline(model, [3, 3], chunks=4, loss_fn=loss_fn, schedule="1f1b", sample=ids, **local)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    torch.manual_seed(7)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(pipe.step(ids, target))
        optimizer.step()
    held = {n.split(".", 3)[3]: p.detach().clone() for n, p in pipe.named_parameters()}
    return {"losses": losses, "tied": {n: held[n] for n in ("transformer.wte.weight", "lm_head.weight") if n in held}}


# torchgpipe's skip protocol: generators, and one pair of classes used twice, isolated by namespaces.


@skippable(stash=["skip"])
class GenDown(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        x = torch.tanh(self.conv(x))
        yield stash("skip", x)
        return F.avg_pool2d(x, 2)


@skippable(pop=["skip"])
class GenUp(nn.Module):
    def __init__(self, c_in: int, c_skip: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in + c_skip, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        x = F.interpolate(x, scale_factor=2.0)
        return torch.tanh(self.conv(torch.cat([x, skip], dim=1)))


def generator_unet() -> nn.Sequential:
    """8 layers; the outer skip spans 6 of them, the inner one 4."""
    from gpipe.skip import Namespace

    torch.manual_seed(0)
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        GenDown(2, 4).isolate(outer), GenDown(4, 6).isolate(inner), nn.Conv2d(6, 6, 3, padding=1), nn.Tanh(),
        nn.Conv2d(6, 6, 3, padding=1), GenUp(6, 6, 4).isolate(inner), GenUp(4, 4, 2).isolate(outer),
        nn.Conv2d(2, 2, 1),
    )  # fmt: skip


# Checkpoints with the optimizer's state (torch.distributed.checkpoint), keyed by parameter name.


def train_and_save_with_optimizer(
    directory: str, steps: int, asynchronous: bool = False, dp: int = 1, damaged: str = ""
) -> dict[str, Any]:
    """Adam for ``steps`` steps, save with its state (``asynchronous``: in the background, while the
    next step runs), then one more step: its loss, and this rank's layers after it, are what a run
    resumed from the checkpoint must get. ``damaged``: then load a damaged copy there
    (:func:`load_a_damaged_copy`)."""
    from gpipe.saving import layer_state

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = mlp()
    pipe = Pipeline(model, even(len(model), world // dp), chunks=4, loss_fn=F.mse_loss, data_parallel=dp)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    _steps(pipe, optimizer, steps)
    saved = {k: v.clone() for k, v in layer_state(pipe).items()}
    if asynchronous:
        handle = save_checkpoint(pipe, directory, steps, optimizer=optimizer, asynchronous=True)
        next_loss = _steps(pipe, optimizer, 1)[0]  # changes the weights while they are written
        handle.wait()
    else:
        save_checkpoint(pipe, directory, steps, optimizer=optimizer)
        next_loss = _steps(pipe, optimizer, 1)[0]
    after = {k: v.clone() for k, v in layer_state(pipe).items()}
    out = {"saved": saved, "next": next_loss, "after": after, "dp_rank": pipe.dp_rank}
    if damaged:
        out |= load_a_damaged_copy(Path(directory) / f"step-{steps:08d}", Path(damaged), pipe, optimizer)
    return out


def load_a_damaged_copy(step: Path, damaged: Path, pipe: Pipeline, optimizer: Any) -> dict[str, Any]:
    """Rank 0 copies checkpoint ``step`` into ``damaged`` and flips a bit of rank 1's data file; every
    rank loads the copy (checking the files it reads: rank 0 does not read that one) and the ranks
    agree on the outcome, as ``gpipe train --resume`` does: this rank's error, the agreed one."""
    import shutil

    import torch.distributed as dist

    from gpipe.saving import CheckpointError
    from gpipe.train.checkpoints import _agreed, _ranks

    copy = damaged / step.name
    if dist.get_rank() == 0:
        shutil.copytree(step, copy)
        data = bytearray((copy / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 1
        (copy / "__1_0.distcp").write_bytes(bytes(data))
    dist.barrier()
    own: list[str] = []

    def load() -> None:
        try:
            load_checkpoint(pipe, copy, optimizer=optimizer)
        except CheckpointError as exc:
            own.append(str(exc))
            raise

    with _ranks() as gather:
        agreed = _agreed(gather, copy.name, load)
    return {"own": own, "agreed": agreed}


def load_with_optimizer_and_step(directory: str, workers: int = 0) -> dict[str, Any]:
    """Other weights and an Adam of another learning rate, loaded from the checkpoint, then one step
    (``workers``: that many stages in this one process; else one per rank)."""
    from gpipe.saving import layer_state

    k = workers or int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(99)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(6, 6), nn.Tanh())])
    local = {"devices": ["cpu"] * k} if workers else {}
    pipe = Pipeline(model, even(16, k), chunks=4, loss_fn=F.mse_loss, **local)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.5)
    step = load_checkpoint(pipe, directory, optimizer=optimizer)
    loaded = {k: v.clone() for k, v in layer_state(pipe).items()}
    next_loss = _steps(pipe, optimizer, 1)[0]
    return {"step": step, "loaded": loaded, "next": next_loss, "after": dict(layer_state(pipe))}


def generate_llama() -> dict[str, Any]:
    """Pipeline.generate of a small Llama on two ranks (tests/test_generate.py)."""
    from tests.test_generation_traced import EOS, built, prompts

    _, layers = built("llama")
    n = len(layers)
    pipe = Pipeline(layers, [n // 2, n - n // 2], chunks=1).eval()
    assert pipe.distributed
    ids, mask = prompts((6, 3, 5, 4))
    return {
        "greedy": pipe.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[EOS, 7, 11]),
        "beam": pipe.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3),
        "sample": pipe.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, seed=5, groups=3),
    }


def controllable_steps(chunks: int) -> dict[str, Any]:
    """A step of 'v-half' and one of 'v-min' in one launch (tests/test_schedule_controllable.py):
    each one's loss and this rank's gradients, by schedule."""
    out: dict[str, Any] = {}
    for schedule in ("v-half", "v-min"):
        ran = step(schedule, chunks)
        out[schedule] = {"loss": ran["losses"][0], "grads": ran["grads"]}
    return out


def selective_step(schedule: str, checkpoint: str, world: int | None = None) -> dict[str, Any]:
    """One step of a small Transformer LM (dropout on) under ``checkpoint``: 'never', or 'selective'
    (a gpipe.Selective policy, per layer and per operator; tests/test_selective_checkpoint.py): the
    loss and this rank's gradients (one process: ``world`` workers on the CPU)."""
    from gpipe import Selective
    from gpipe.models import transformer_lm

    torch.manual_seed(0)
    model = transformer_lm(2, 64, 4, dim=32, vocab=50, max_len=16, dropout=0.1, head_dim=8)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 50, (8, 16), generator=g), torch.randint(0, 50, (8, 16), generator=g)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    policy: Any = Selective(layers={1, 3}, save_ops="matmuls") if checkpoint == "selective" else checkpoint
    local = {} if world is None else {"devices": ["cpu"] * world, "cpu_threads": 1}
    pipe = Pipeline(model, [2, 2], chunks=4, loss_fn=loss_fn, schedule=schedule, checkpoint=policy, **local)
    torch.manual_seed(7)
    loss = pipe.step(x, y)
    return {"loss": loss, "grads": grads_of(pipe)}


class _InfAt(nn.Module):
    """Identity, but Inf in the rows whose first feature is above 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x[:, :1] > 2.0, torch.full_like(x, float("inf")), x)


def nonfinite_across_ranks() -> dict[str, Any]:
    """A two-rank pipeline whose stage 1 gives Inf in micro-batch 2 (row 9 of 16 in 4): every rank's
    check fails, and every rank locates it on rank 1."""
    from gpipe.nonfinite import all_finite, locate

    torch.manual_seed(0)
    identity = nn.Linear(6, 6)
    with torch.no_grad():
        identity.weight.copy_(torch.eye(6))
        identity.bias.zero_()
    model = nn.Sequential(nn.Identity(), identity, _InfAt(), nn.Linear(6, 6), nn.Tanh())
    pipe = Pipeline(model, [2, 3], chunks=4, loss_fn=F.mse_loss)
    x, y = data()
    x = x.clamp(-1.0, 1.0)
    x[9, 0] = 3.0
    loss = float(pipe.step(x, y))
    return {"finite": all_finite(pipe, loss), "found": str(locate(pipe, x, y))}


def aids_steps(steps: int = 3) -> dict[str, Any]:
    """A Transformer with shared layers, stepped by Adam with learned rates (per layer, then global), on
    two stages whose cut splits a group of shared layers: each run's losses, the learned factors and the
    weights of this process's layers (in one process: both stages)."""
    from gpipe.hypergradient import LearnedRates
    from gpipe.models import transformer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    out: dict[str, Any] = {}
    for scope in ("layer", "global"):
        torch.manual_seed(0)
        model = transformer(4, 32, 2, dim=16, vocab=20, max_len=16, dropout=0.1, share_layers=2)
        kwargs: dict[str, Any] = {} if world > 1 else {"devices": ["cpu", "cpu"]}
        pipe = Pipeline(model, [2, 9], chunks=2, loss_fn=lm_loss_of(20), cpu_threads=1, **kwargs)
        optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
        rates = LearnedRates(pipe, optimizer, beta=0.1, scope=scope)
        losses = []
        for i in range(steps):
            g = torch.Generator().manual_seed(i)
            src, tgt = torch.randint(1, 20, (8, 7), generator=g), torch.randint(1, 20, (8, 5), generator=g)
            torch.manual_seed(100 + i)
            optimizer.zero_grad()
            losses.append(float(pipe.step((src, tgt), torch.randint(1, 20, (8, 5), generator=g))))
            rates.step()
        out[scope] = {"losses": losses, "factors": rates.factors, "owners": rates.owners,
                      "weights": {n: p.detach().clone() for n, p in pipe.named_parameters()}}  # fmt: skip
    return out


def lm_loss_of(vocab: int) -> Any:
    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    return loss
