"""Sharded pipeline stages (issue 26): what ``Pipeline(..., data_parallel=d, fsdp=True)`` saves in
memory per rank, which collectives a step issues, and what it costs in step time, against the same
pipeline replicated (``fsdp=False``).

Reproduce (from the repository root; about 75 s here)::

    .venv/bin/python benchmarks/fsdp.py --out benchmarks/results/fsdp
    .venv/bin/python benchmarks/fsdp.py --quick        # 2 rounds, a batch of 16 x 16, runs/fsdp; about 1 min

Everything runs on CPU over gloo: this script starts the ranks itself, as torchrun would (one
subprocess per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, ``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)`` and ``cpu_threads=1``: one thread per rank), each launch bounded by
``--timeout`` seconds, after which every rank still running is killed and the launch reported as
failed. Each rank writes its results to a JSON file (the hidden ``--rank-main`` flag runs one rank).

Model: gpipe's ``transformer(4, 1024, 4, dim=256, vocab=8000, max_len=64, dropout=0.0)`` (11 layers,
13.55M parameters), input a tuple (source, target tokens), loss cross entropy of the logits (B, T, V)
against the target tokens; a global batch of ``--sentences`` sentences of ``--tokens`` random tokens
(32 x 32), ``chunks=4`` micro-batches per replica. pp=2 stages (balance: the 11 layers split evenly
over the stages, 6 + 5; zb-v: 4 stages, 2 per rank, 3 + 3 + 3 + 2), Adam.

1. ``layouts`` (memory and collectives): for d = 2 (4 ranks) and d = 4 (8 ranks), in one launch per
   d, pipelines built one after the other in the same ranks: pp2 x dp d replicated (1F1B), pp2 x fsdp
   d (1F1B), pp2 x fsdp d (zb-v, ``virtual=2``). Each takes two steps (``pipe.step`` then
   ``optimizer.step()``). Memory per rank after the second step: the bytes of the tensors the rank
   holds, counted exactly from them (a ``DTensor``: its local shard, ``to_local()``): parameters
   (``pipe.parameters()``), their gradients, and Adam's two moments (``exp_avg``, ``exp_avg_sq``;
   its scalar step counters are left out). The "storage" column counts the distinct storages behind
   those tensors instead (FSDP keeps a shard inside a buffer padded to an equal size on every rank:
   what the process really keeps). Transient memory inside a step (activations, the gathered
   parameters between U and R, the replicated layout's flattened gradients) is not counted. Ratio:
   sharded / replicated per rank (the same stage on the same rank); the target is <= 1.1 / d.
   Collectives of the second step, per rank, counted by wrapping ``torch.distributed``'s
   ``all_gather_single`` and ``reduce_scatter_single`` (what FSDP calls) and ``all_reduce`` (the
   replicated layout's gradients and every layout's loss), with the bytes each moves (gathered
   output, scattered input, reduced tensor). Expected with fsdp: one all-gather and one
   reduce-scatter per stage the rank holds, not per stage and micro-batch.
2. ``time``: pp2 x fsdp2 against pp2 x dp2 replicated, both built in the same 4 ranks (from the same
   seed: the same weights and work; their first losses are recorded), 1F1B, taking turns step by
   step, the order reversed every other round, the first round a warm-up, then ``--reps`` rounds.
   A step's time: ``dist.barrier()``, then one ``pipe.step`` + ``optimizer.step()`` on every rank,
   the max over the ranks. Ratio fsdp / replicated per round, median [min-max]. With each step, the
   share of the machine's CPUs other processes used meanwhile (``/proc/stat`` busy time less the
   ranks' CPU time) and the ranks' CPU time in cores; the "quiet" ratio keeps the rounds where
   others used < 10% during both steps. Four ranks share this machine's cores, so both layouts run
   oversubscribed alike. If two Pipelines cannot be built in one set of ranks, each
   layout is timed in a launch of its own instead (no turns), and the report says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import gpipe
from gpipe.models.transformer import transformer

VOCAB = 8000
PP = 2
CHUNKS = 4
MOMENTS = ("exp_avg", "exp_avg_sq")
QUIET = 0.1  # others' CPU share below which a round of the step-time section counts as quiet


# -- model, data, layouts -----------------------------------------------------------------------------


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return transformer(4, 1024, 4, dim=256, vocab=VOCAB, max_len=64, dropout=0.0)


def data(sentences: int, tokens: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(1)
    src, tgt, target = (torch.randint(3, VOCAB, (sentences, tokens), generator=g) for _ in range(3))
    return (src, tgt), target


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def even(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if k < extra else 0) for k in range(stages)]


def build(dp: int, fsdp: bool, schedule: str) -> gpipe.Pipeline:
    layers = model()
    virtual = 2 if schedule == "zb-v" else 1
    return gpipe.Pipeline(
        layers, even(len(layers), PP * virtual), chunks=CHUNKS, schedule=schedule, loss_fn=lm_loss, virtual=virtual,
        data_parallel=dp, fsdp=fsdp, cpu_threads=1, timeout=120.0,
    )  # fmt: skip


# -- what a rank holds, and the collectives of a step ----------------------------------------------------


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def held(pipe: gpipe.Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """Bytes of this rank's parameters, gradients and Adam moments (local shards), as elements and
    as the distinct storages behind them."""
    params = list(pipe.parameters())
    kinds = {
        "parameters": [_local(p) for p in params],
        "gradients": [_local(p.grad) for p in params if p.grad is not None],
        "optimizer": [_local(v) for s in optimizer.state.values() for k, v in s.items() if k in MOMENTS],
    }
    out: dict[str, dict[str, int]] = {"bytes": {}, "storage": {}}
    for kind, tensors in kinds.items():
        out["bytes"][kind] = sum(t.numel() * t.element_size() for t in tensors)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        out["storage"][kind] = sum(storages.values())
    for key in out:
        out[key]["total"] = sum(out[key].values())
    return out


# name: (position, keyword) of the argument whose bytes move
WATCHED = {
    "all_gather_single": (0, "output_tensor"),
    "reduce_scatter_single": (1, "input"),
    "all_reduce": (0, "tensor"),
}


@contextmanager
def counting() -> Iterator[dict[str, dict[str, int]]]:
    """Calls of the watched ``torch.distributed`` collectives and the bytes they move (FSDP and gpipe
    look them up on the module at call time)."""
    counts = {name: {"calls": 0, "bytes": 0} for name in WATCHED}
    originals = {name: getattr(dist, name) for name in WATCHED}

    def wrap(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            position, keyword = WATCHED[name]
            t = args[position] if len(args) > position else kwargs[keyword]
            counts[name]["calls"] += 1
            counts[name]["bytes"] += t.numel() * t.element_size()
            return originals[name](*args, **kwargs)

        return call

    for name in WATCHED:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _machine_busy() -> float:
    """Seconds the machine's CPUs were busy since boot (all processes)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _world_sum(value: float, op: Any = None) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return float(t.item())


# -- ranks --------------------------------------------------------------------------------------------


def rank_layouts(spec: dict[str, Any]) -> dict[str, Any]:
    dp, (inputs, target) = spec["dp"], data(spec["sentences"], spec["tokens"])
    runs = {}
    for name, fsdp, schedule in (
        ("replicated 1f1b", False, "1f1b"),
        ("fsdp 1f1b", True, "1f1b"),
        ("fsdp zb-v", True, "zb-v"),
    ):
        pipe = build(dp, fsdp, schedule)
        optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            with counting() as counted:
                losses.append(float(pipe.step(inputs, target)))
            optimizer.step()
        runs[name] = {
            "stages": sorted(int(s) for s in pipe.partitions),
            "dp_rank": pipe.dp_rank,
            "losses": losses,
            "collectives": counted,
            "held": held(pipe, optimizer),
        }
        del pipe, optimizer
        gc.collect()
        dist.barrier()
    return runs


def rank_time(spec: dict[str, Any]) -> dict[str, Any]:
    (inputs, target), pipes = data(spec["sentences"], spec["tokens"]), {}
    for name in spec["variants"]:
        pipe = build(2, name == "fsdp", "1f1b")
        pipes[name] = (pipe, torch.optim.Adam(pipe.parameters(), lr=1e-3))
    times: dict[str, dict[str, list[float]]] = {k: {"s": [], "others": [], "ranks_cpu": []} for k in pipes}
    first: dict[str, float] = {}
    for r in range(spec["reps"] + 1):  # the first round warms up
        for name in list(pipes) if r % 2 == 0 else list(reversed(pipes)):
            pipe, optimizer = pipes[name]
            optimizer.zero_grad()
            dist.barrier()
            busy, cpu = _machine_busy(), _world_sum(time.process_time())
            start = time.perf_counter()
            loss = pipe.step(inputs, target)
            optimizer.step()
            seconds = _world_sum(time.perf_counter() - start, dist.ReduceOp.MAX)
            own = _world_sum(time.process_time()) - cpu
            others = (_machine_busy() - busy) - own
            first.setdefault(name, float(loss))
            if r > 0:
                times[name]["s"].append(seconds)
                times[name]["others"].append(max(0.0, others) / (seconds * (os.cpu_count() or 1)))
                times[name]["ranks_cpu"].append(own / seconds)
    return {"times": times, "first_loss": first}


def rank_main(spec: dict[str, Any], out: str) -> None:
    """One rank (``--rank-main``): run ``spec['task']``, write its result to ``out``.<rank>.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout"]))
    result = rank_layouts(spec) if spec["task"] == "layouts" else rank_time(spec)
    Path(f"{out}.{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(spec: dict[str, Any], world: int, args: argparse.Namespace) -> dict[str, Any]:
    """``spec`` on ``world`` gloo ranks, killed after ``args.timeout`` s: every rank's result, in rank
    order (``{"failed": ...}`` if any rank failed or ran out of time)."""
    out = Path(args.out) / f"rank-{spec['task']}"
    port, procs, began = _free_port(), [], time.perf_counter()
    print(f"launch: {world} ranks, {json.dumps(spec)}", flush=True)
    for rank in range(world):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), "--rank-main", json.dumps(spec), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline, logs, timed_out = time.monotonic() + args.timeout, [], False
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                if q.poll() is None:
                    q.kill()
            logs.append(p.communicate()[0])
    files = [Path(f"{out}.{rank}.json") for rank in range(world)]
    codes = [p.returncode for p in procs]
    seconds = time.perf_counter() - began
    if timed_out or any(c != 0 for c in codes) or not all(f.exists() for f in files):
        print(f"launch failed (return codes {codes}, timed out: {timed_out}):\n" + "\n".join(g[-2000:] for g in logs))
        for f in files:
            f.unlink(missing_ok=True)
        return {"failed": codes, "timed_out": timed_out, "log": logs[0][-2000:], "seconds": seconds}
    ranks = [json.loads(f.read_text()) for f in files]
    for f in files:
        f.unlink()
    print(f"launch: done in {seconds:.0f} s", flush=True)
    return {"ranks": ranks, "seconds": seconds}


# -- sections -----------------------------------------------------------------------------------------


def layouts(args: argparse.Namespace) -> dict[str, Any]:
    spec = {"task": "layouts", "sentences": args.sentences, "tokens": args.tokens, "timeout": args.timeout}
    return {str(dp): launch({**spec, "dp": dp}, PP * dp, args) for dp in args.dp}


def step_time(args: argparse.Namespace) -> dict[str, Any]:
    spec = {
        "task": "time",
        "sentences": args.sentences,
        "tokens": args.tokens,
        "reps": args.reps,
        "timeout": args.timeout,
    }
    both = launch({**spec, "variants": ["fsdp", "replicated"]}, 4, args)
    if "failed" not in both:
        return {"separate": False, **_timings(both["ranks"][0]), "seconds": both["seconds"]}
    print("time: two Pipelines in one set of ranks failed; one launch per layout", flush=True)
    runs = {name: launch({**spec, "variants": [name]}, 4, args) for name in ("fsdp", "replicated")}
    if any("failed" in r for r in runs.values()):
        return {"failed": {k: v.get("failed") for k, v in runs.items()}, "together": both}
    merged = {"times": {}, "first_loss": {}}
    for r in runs.values():
        for key in merged:
            merged[key].update(r["ranks"][0][key])
    return {"separate": True, "together": both, **_timings(merged)}


def _timings(rank0: dict[str, Any]) -> dict[str, Any]:
    t = rank0["times"]
    a, b = t["fsdp"], t["replicated"]
    quiet = [x / y for x, y, p, q in zip(a["s"], b["s"], a["others"], b["others"]) if max(p, q) < QUIET]
    return {**rank0, "ratio": [x / y for x, y in zip(a["s"], b["s"])], "quiet_ratio": quiet}


# -- report -------------------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 2) -> str:
    if not values:
        return "—"
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _render_memory(result: dict[str, Any]) -> list[str]:
    lines = [
        "## 1. Memory per rank after a step: parameters + gradients + Adam's two moments",
        "",
        "MiB of the tensors each rank holds (local shards), replicated (pp2 x dp d) against sharded "
        "(pp2 x fsdp d), both 1F1B; ratio = sharded / replicated on the same rank (same stage); "
        "storage: the distinct storages behind those tensors (FSDP pads a shard to an equal size).",
        "",
        "| d | rank | stage | dp rank | replicated: params / grads / Adam = total | fsdp: params / grads / Adam "
        "= total | ratio | storage ratio | target 1.1/d |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for dp, launched in result.items():
        if "failed" in launched:
            lines.append(f"| {dp} | launch failed: return codes {launched['failed']}, timed out "
                         f"{launched['timed_out']} | | | | | | | |")  # fmt: skip
            verdicts.append(f"d={dp}: not measured (the launch failed)")
            continue
        worst = 0.0
        for rank, r in enumerate(launched["ranks"]):
            rep, sh = r["replicated 1f1b"]["held"], r["fsdp 1f1b"]["held"]
            ratio = sh["bytes"]["total"] / rep["bytes"]["total"]
            sratio = sh["storage"]["total"] / rep["storage"]["total"]
            worst = max(worst, ratio, sratio)
            parts = ("parameters", "gradients", "optimizer")
            rep_s = " / ".join(mib(rep["bytes"][k]) for k in parts) + f" = {mib(rep['bytes']['total'])}"
            sh_s = " / ".join(mib(sh["bytes"][k]) for k in parts) + f" = {mib(sh['bytes']['total'])}"
            lines.append(
                f"| {dp} | {rank} | {r['fsdp 1f1b']['stages']} | {r['fsdp 1f1b']['dp_rank']} | {rep_s} | {sh_s} "
                f"| {ratio:.4f} | {sratio:.4f} | {1.1 / int(dp):.4f} |"
            )
        met = "met" if worst <= 1.1 / int(dp) else "missed"
        verdicts.append(f"d={dp}: worst rank {worst:.4f} against {1.1 / int(dp):.4f}: **target {met}**")
    return [*lines, "", *(f"- {v}" for v in verdicts)]


def _render_collectives(result: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## 2. Collectives in one step (the second), per rank",
        "",
        f"chunks={CHUNKS} micro-batches per replica. all-gathers / reduce-scatters: calls of "
        "`all_gather_single` / `reduce_scatter_single` (FSDP's); all-reduces: `all_reduce` on any group "
        "(the loss's, and the replicated layout's gradients). MiB moved: gathered output, scattered "
        "input, reduced tensor.",
        "",
        "| d | layout | rank | stages held | all-gathers | reduce-scatters | all-reduces "
        "| MiB gathered / scattered / all-reduced | as expected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dp, launched in result.items():
        if "failed" in launched:
            continue
        for name in ("fsdp 1f1b", "fsdp zb-v", "replicated 1f1b"):
            for rank, r in enumerate(launched["ranks"]):
                run, c = r[name], r[name]["collectives"]
                n = len(run["stages"])
                ag, rs = c["all_gather_single"]["calls"], c["reduce_scatter_single"]["calls"]
                expected = (ag, rs) == ((n, n) if name.startswith("fsdp") else (0, 0))
                moved = " / ".join(mib(c[k]["bytes"]) for k in WATCHED)
                lines.append(
                    f"| {dp} | {name} | {rank} | {run['stages']} | {ag} | {rs} | {c['all_reduce']['calls']} "
                    f"| {moved} | {'yes' if expected else '**no**'} |"
                )
    lines += ["", "First two losses of each layout (rank 0), as a check that they compute the same:", ""]
    for dp, launched in result.items():
        if "failed" not in launched:
            losses = ", ".join(
                f"{k} {v['losses'][0]:.6f} / {v['losses'][1]:.6f}" for k, v in launched["ranks"][0].items()
            )
            lines.append(f"- d={dp}: {losses}")
    return lines


def _render_time(t: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = ["", "## 3. Step time: pp2 x fsdp2 against pp2 x dp2 replicated, 1F1B", ""]
    if "failed" in t:
        return [*lines, f"Not measured: the launches failed (return codes {t['failed']})."]
    how = (
        "Each layout in a launch of its own (two Pipelines in one set of ranks failed), so they did not take turns."
        if t["separate"]
        else "Both pipelines built in the same 4 ranks, taking turns step by step (order reversed every other round)."
    )
    lines += [
        f"{how} Global batch {args.sentences} sentences x {args.tokens} tokens, chunks {CHUNKS}; one warm-up round, "
        f"then {len(t['ratio'])} rounds. Step = max over the ranks of `pipe.step` + `optimizer.step()`, after a "
        f"barrier. First losses: " + ", ".join(f"{k} {v:.6f}" for k, v in t["first_loss"].items()) + ".",
        "",
        "| layout | step (s), median [min-max] | others' CPU share per round | ranks' CPU (cores), median |",
        "|---|---|---|---|",
    ]
    for name, v in t["times"].items():
        share = ", ".join(f"{o:.0%}" for o in v["others"])
        lines.append(f"| {name} | {spread(v['s'], 3)} | {share} | {statistics.median(v['ranks_cpu']):.2f} |")
    per = ", ".join(f"{x:.3f}" for x in t["ratio"])
    lines += [
        "",
        f"**fsdp / replicated: {spread(t['ratio'], 3)}** (per round: {per}); in the rounds where other processes "
        f"used < {QUIET:.0%} of the machine during both steps ({len(t['quiet_ratio'])} of {len(t['ratio'])}): "
        f"{spread(t['quiet_ratio'], 3)}.",
    ]
    return lines


def render(result: dict[str, Any], header: str, args: argparse.Namespace) -> str:
    how = [p for p in (__doc__ or "").split("\n\n") if p.startswith(("Everything", "Model:"))]
    lines = [header, "", "\n\n".join(how), ""]
    lines += _render_memory(result["layouts"]) + _render_collectives(result["layouts"])
    lines += _render_time(result["time"], args)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="runs/fsdp")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds of the step-time section")
    parser.add_argument("--sentences", type=int, default=32, help="global batch")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sentence (source and target)")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel degrees of section 1")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a launch of ranks may take")
    parser.add_argument("--quick", action="store_true", help="2 rounds, a batch of 16 x 16")
    parser.add_argument("--rank-main", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(json.loads(args.rank_main[0]), args.rank_main[1])
        return
    if args.quick:
        args.reps, args.sentences, args.tokens = 2, 16, 16
    Path(args.out).mkdir(parents=True, exist_ok=True)
    began, load = time.perf_counter(), os.getloadavg()
    result = {"layouts": layouts(args), "time": step_time(args)}
    seconds, load_end = time.perf_counter() - began, os.getloadavg()
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_start": load,
        "load_average_end": load_end,
        "seconds": seconds,
    }
    header = (
        f"# Sharded pipeline stages (benchmarks/fsdp.py)\n\n"
        f"{machine['platform']}, {machine['processor']}, {machine['cpus']} CPUs, torch {machine['torch']}, "
        f"Python {machine['python']}; one thread per rank, gloo; load average (1/5/15 min) "
        f"{' / '.join(f'{x:.2f}' for x in load)} at the start, {' / '.join(f'{x:.2f}' for x in load_end)} at the "
        f"end; {seconds:.0f} s in all{' (--quick)' if args.quick else ''}."
    )
    report = render(result, header, args)
    (Path(args.out) / "report.md").write_text(report)
    (Path(args.out) / "results.json").write_text(
        json.dumps({"args": vars(args), "machine": machine, **result}, indent=1)
    )
    print(report)


if __name__ == "__main__":
    main()
