"""The engine's own cost on its hot path: ``gpipe.Pipeline`` at K=1 (one stage, ``devices=['cpu']``,
so nothing is pipelined) against the same model trained by a plain PyTorch loop over the same
micro-batches — ``torch.chunk`` into M pieces and ``(loss_fn(model(x_m), y_m) * n_m / N).backward()``
for each (gradient accumulation), in train mode. The Pipeline runs with ``checkpoint='never'`` (the
plain loop keeps its activations too), so both do the same work; both sides use one intra-op thread
(the section sets ``torch.set_num_threads(1)``, the Pipeline gets ``cpu_threads=1``). Variants take
turns within every repetition; ratios are Pipeline / plain per repetition, median [min-max].

(a) A Transformer LM (token cross-entropy) at several M, dropout 0 and 0.1. Target: ≤ 1.02x at the
    largest M with dropout.
(b) Host overhead: 24 layers ``nn.Linear(8, 8)`` whose kernels cost next to nothing, so a step is
    Python and dispatcher time — what bounds a GPU; reported per (layer, micro-batch). Target: ≤ 1.2x.
(c) ``torch.compile``'d layers: every layer of a small LM wrapped in ``torch.compile``, the same
    ``nn.Sequential`` of compiled layers inside the Pipeline and in the plain loop. Whether a layer
    call ran compiled is read off its output (``grad_fn`` of a compiled region is
    ``CompiledFunctionBackward``), counted by forward hooks on the layers in one extra step.
    Target: ≤ 1.05x, with every layer call compiled.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from gpipe.bench.common import Bench, Section, intra_op_threads, spread, take_turns, timed, token_loss
from gpipe.models import transformer_lm
from gpipe.pipeline import Pipeline

__all__ = ["TARGETS", "TITLE", "Sizes", "compiled", "host", "lm", "measure", "misses", "render", "run", "sizes"]

TITLE = "Engine overhead (K=1)"
TARGETS = {"lm": 1.02, "host": 1.2, "compiled": 1.05}
VOCAB = 256


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What each comparison runs: (a) the LM, (b) the tiny layers, (c) the compiled LM."""

    lm_layers: int
    lm_hidden: int
    lm_dim: int
    batch: int
    seq: int
    chunks: tuple[int, ...]
    dropouts: tuple[float, ...]
    tiny_layers: int
    tiny_width: int
    tiny_batch: int
    tiny_chunks: int
    tiny_steps: int  # steps per timed sample
    compiled_layers: int
    compiled_hidden: int
    compiled_dim: int
    compiled_batch: int
    compiled_seq: int
    compiled_chunks: int
    compiled_dropout: float
    repeats: int


def sizes(bench: Bench) -> Sizes:
    """Full: (a) and (c) on T(8, 1024, 4), dim 256, M = 1, 8, 32. Quick: 2 blocks (the same widths,
    batch and micro-batch sizes) and M = 1, 32 only."""
    layers = 2 if bench.quick else 8
    return Sizes(
        lm_layers=layers, lm_hidden=1024, lm_dim=256, batch=64, seq=32, chunks=(1, 32) if bench.quick else (1, 8, 32),
        dropouts=(0.0, 0.1), tiny_layers=24, tiny_width=8, tiny_batch=32, tiny_chunks=8,
        tiny_steps=10 if bench.quick else 30, compiled_layers=layers, compiled_hidden=1024, compiled_dim=256,
        compiled_batch=64, compiled_seq=32, compiled_chunks=8, compiled_dropout=0.1, repeats=bench.repeats,
    )  # fmt: skip


def _plain_step(model: nn.Module, loss_fn: Callable[[Any, Tensor], Tensor], x: Tensor, y: Tensor, chunks: int) -> None:
    """The reference: gradient accumulation over ``torch.chunk`` micro-batches, nothing else."""
    model.zero_grad()
    total = x.size(0)
    for x_m, y_m in zip(torch.chunk(x, chunks), torch.chunk(y, chunks)):
        torch.autograd.backward([loss_fn(model(x_m), y_m) * (x_m.size(0) / total)])


def _pipe_step(pipe: Pipeline, x: Tensor, y: Tensor) -> None:
    pipe.zero_grad()
    pipe.step(x, y)


def _pipeline(model: nn.Sequential, chunks: int, loss_fn: Callable[[Any, Tensor], Tensor]) -> Pipeline:
    return Pipeline(model, [len(model)], chunks=chunks, loss_fn=loss_fn, checkpoint="never", devices=["cpu"],
                    cpu_threads=1)  # fmt: skip


def _ratios(times: dict[str, list[float]]) -> list[float]:
    return [p / q for p, q in zip(times["pipeline"], times["plain"])]


def _tokens(batch: int, seq: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g), torch.randint(3, VOCAB, (batch, seq), generator=g)


def lm(s: Sizes) -> dict[str, dict[str, list[float]]]:
    """(a) Step times of the Pipeline and the plain loop on the LM, per ``dropout=D,M=M``."""
    x, y = _tokens(s.batch, s.seq, 0)
    result = {}
    for dropout in s.dropouts:
        torch.manual_seed(0)
        base = transformer_lm(s.lm_layers, s.lm_hidden, 4, dim=s.lm_dim, vocab=VOCAB, max_len=s.seq, dropout=dropout)
        for m in s.chunks:
            plain = copy.deepcopy(base).train()
            pipe = _pipeline(copy.deepcopy(base), m, token_loss).train()
            steps: dict[str, Callable[[], object]] = {
                "pipeline": functools.partial(_pipe_step, pipe, x, y),
                "plain": functools.partial(_plain_step, plain, token_loss, x, y, m),
            }
            times = take_turns(steps, s.repeats)
            result[f"dropout={dropout:g},M={m}"] = {**times, "ratio": _ratios(times)}
    return result


def host(s: Sizes) -> dict[str, list[float]]:
    """(b) Microseconds per (layer, micro-batch) of a step of tiny layers, Pipeline and plain."""
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(s.tiny_width, s.tiny_width) for _ in range(s.tiny_layers)])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(s.tiny_batch, s.tiny_width, generator=g), torch.randn(s.tiny_batch, s.tiny_width, generator=g)
    plain, pipe = copy.deepcopy(base), _pipeline(copy.deepcopy(base), s.tiny_chunks, F.mse_loss)

    def repeated(step: Callable[[], None]) -> Callable[[], None]:
        def steps() -> None:
            for _ in range(s.tiny_steps):
                step()

        return steps

    pipe_step = functools.partial(_pipe_step, pipe, x, y)
    plain_step = functools.partial(_plain_step, plain, F.mse_loss, x, y, s.tiny_chunks)
    times = take_turns({"pipeline": repeated(pipe_step), "plain": repeated(plain_step)}, s.repeats * 3)
    per_call = 1e6 / (s.tiny_steps * s.tiny_layers * s.tiny_chunks)
    us = {k: [t * per_call for t in v] for k, v in times.items()}
    return {"pipeline_us": us["pipeline"], "plain_us": us["plain"], "ratio": _ratios(times),
            "extra_us": [p - q for p, q in zip(us["pipeline"], us["plain"])]}  # fmt: skip


def _compile_problem() -> str | None:
    """Why ``torch.compile`` cannot run here, or None."""
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported

        if not is_dynamo_supported():
            return "torch.compile (dynamo) is not supported on this Python/platform"
        torch.compile(lambda t: t * 2 + 1)(torch.ones(3))
    except Exception as exc:
        return f"torch.compile failed on a one-line function: {type(exc).__name__}: {_first_line(exc)}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compiled_calls(model: nn.Sequential, step: Callable[[], None]) -> tuple[int, int]:
    """Run ``step`` once and count the calls of ``model``'s layers whose output came out of a
    compiled region, and all the calls that produced a differentiable output."""
    calls = [0, 0]

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        fn = next((t.grad_fn for t in tree_leaves(out) if isinstance(t, Tensor) and t.grad_fn is not None), None)
        if fn is not None:
            calls[0] += "CompiledFunction" in type(fn).__name__
            calls[1] += 1

    handles = [layer.register_forward_hook(hook) for layer in model]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return calls[0], calls[1]


def compiled(s: Sizes) -> dict[str, Any]:
    """(c) The same ``nn.Sequential`` of compiled layers stepped by the Pipeline and by the plain
    loop: step times, compile status and graphs, or ``{"unavailable": why}``.

    The plain loop warms up (compiles) first; its steps are also timed alone before the Pipeline
    first runs, in case the Pipeline's step stops the layers running compiled for the plain loop too.
    """
    problem = _compile_problem()
    if problem:
        return {"unavailable": problem}
    x, y = _tokens(s.compiled_batch, s.compiled_seq, 2)
    torch.manual_seed(0)
    base = transformer_lm(s.compiled_layers, s.compiled_hidden, 4, dim=s.compiled_dim, vocab=VOCAB,
                          max_len=s.compiled_seq, dropout=s.compiled_dropout)  # fmt: skip
    model = nn.Sequential(*[cast(nn.Module, torch.compile(layer)) for layer in base]).train()
    m = s.compiled_chunks
    plain_step = functools.partial(_plain_step, model, token_loss, x, y, m)
    result: dict[str, Any] = {}
    try:
        graphs, start = _graphs(), time.perf_counter()
        plain_step()
        result["warmup_s"] = {"plain": time.perf_counter() - start}
        plain_step()
        result["graphs"] = {"plain": _graphs() - graphs}
        result["calls_before"] = {"plain": _compiled_calls(model, plain_step)}
        result["plain_alone"] = [timed(plain_step) for _ in range(s.repeats)]
    except Exception as exc:
        return {"unavailable": f"the compiled LM failed in the plain loop: {type(exc).__name__}: {_first_line(exc)}"}
    pipe = _pipeline(model, m, token_loss).train()
    pipe_step = functools.partial(_pipe_step, pipe, x, y)
    try:
        graphs, start = _graphs(), time.perf_counter()
        pipe_step()
        result["warmup_s"]["pipeline"] = time.perf_counter() - start
        pipe_step()
        result["graphs"]["pipeline"] = _graphs() - graphs
    except Exception as exc:
        result["failed"] = f"the Pipeline failed on the compiled layers: {type(exc).__name__}: {_first_line(exc)}"
        return result
    try:
        times = take_turns({"pipeline": pipe_step, "plain": plain_step}, s.repeats * 2)
        result["calls"] = {"pipeline": _compiled_calls(model, pipe_step), "plain": _compiled_calls(model, plain_step)}
    except Exception as exc:
        result["failed"] = f"a compiled step failed: {type(exc).__name__}: {_first_line(exc)}"
        return result
    result.update(times, ratio=_ratios(times))
    return result


def measure(s: Sizes) -> dict[str, Any]:
    """All three comparisons, on one intra-op thread."""
    with intra_op_threads(1):
        return {"sizes": asdict(s), "lm": lm(s), "host": host(s), "compiled": compiled(s)}


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def lm_target_key(data: dict[str, Any]) -> str:
    """The (a) row the target is stated for: the largest M with the largest dropout."""
    s = data["sizes"]
    return f"dropout={max(s['dropouts']):g},M={max(s['chunks'])}"


def compiled_status(c: dict[str, Any]) -> str | None:
    """What went wrong with (c), in words, or None when every layer call ran compiled on both sides."""
    if "unavailable" in c:
        return f"not run: {c['unavailable']}"
    if "failed" in c:
        return f"not run: {c['failed']}"
    (pc, pn), (qc, qn) = c["calls"]["pipeline"], c["calls"]["plain"]
    before_c, before_n = c["calls_before"]["plain"]
    if before_n == 0 or before_c < before_n:
        return f"the plain loop's layer calls did not all run compiled ({before_c} of {before_n} did)"
    if pn == 0:
        return "no layer call inside the Pipeline was seen (the forward hooks did not fire), compile status unknown"
    if pc < pn:
        text = (
            f"only {pc} of the {pn} layer calls of a Pipeline step ran compiled (dynamo compiled "
            f"{c['graphs']['pipeline']} graphs for the Pipeline): the layers run eagerly inside the Pipeline"
        )
        if qc < qn:
            text += (
                ", and after the Pipeline's first step the plain loop's calls of the same layers ran eagerly "
                f"too ({qc} of {qn} compiled)"
            )
        return text
    if qc < qn:
        return f"after the Pipeline's first step only {qc} of the plain loop's {qn} layer calls ran compiled"
    return None


def compiled_ratio(c: dict[str, Any]) -> list[float]:
    """Pipeline / plain for (c): against the plain loop timed alternately when it still ran compiled,
    else against its compiled steps timed before the Pipeline first ran (median of those)."""
    qc, qn = c["calls"]["plain"]
    if qn and qc == qn:
        return list(c["ratio"])
    base = statistics.median(c["plain_alone"])
    return [p / base for p in c["pipeline"]]


def render(data: dict[str, Any]) -> str:
    s = data["sizes"]
    reps = s["repeats"]
    lines = [
        "The engine's hot path at K=1 — `Pipeline(model, [L], devices=['cpu'], checkpoint='never', cpu_threads=1)`, "
        "one stage, nothing pipelined — against a plain PyTorch loop over the same micro-batches "
        "(`torch.chunk` into M, `(loss(model(x_m), y_m) * n_m / N).backward()` each, train mode): the same "
        "work, so the difference is the engine's own cost. One intra-op thread on both sides; variants take "
        "turns; step time median [min-max]; ratio = Pipeline / plain per repetition.",
        "",
        f"**(a) Transformer LM** `transformer_lm({s['lm_layers']}, {s['lm_hidden']}, 4, dim={s['lm_dim']}, "
        f"vocab={VOCAB})`, {s['batch']} sequences of {s['seq']} tokens, token cross-entropy, {reps} repetitions:",
        "",
        "| dropout | M | Pipeline step (s) | plain step (s) | Pipeline / plain |",
        "|---|---|---|---|---|",
    ]
    for key, row in data["lm"].items():
        dropout, m = (part.split("=")[1] for part in key.split(","))
        lines.append(f"| {dropout} | {m} | {spread(row['pipeline'], '.3f')} | {spread(row['plain'], '.3f')} "
                     f"| {spread(row['ratio'])} |")  # fmt: skip
    key = lm_target_key(data)
    r = statistics.median(data["lm"][key]["ratio"])
    lines += [
        "",
        f"Target ≤ {TARGETS['lm']:.2f}x at {key.replace(',', ', ')}: {r:.3f}x — {verdict(r <= TARGETS['lm'])}.",
        "",
    ]

    h = data["host"]
    r = statistics.median(h["ratio"])
    lines += [
        f"**(b) Host overhead** {s['tiny_layers']} layers `nn.Linear({s['tiny_width']}, {s['tiny_width']})`, batch "
        f"{s['tiny_batch']}, M={s['tiny_chunks']}, MSE loss: the kernels cost next to nothing, so this is the "
        "Python and dispatcher time per layer call (forward and backward) — what limits a GPU. Step time / "
        f"(layers x M), {reps * 3} repetitions of {s['tiny_steps']} steps:",
        "",
        "| | µs per (layer, micro-batch) |",
        "|---|---|",
        f"| Pipeline | {spread(h['pipeline_us'], '.1f')} |",
        f"| plain | {spread(h['plain_us'], '.1f')} |",
        f"| Pipeline - plain (the engine's own) | {spread(h['extra_us'], '.1f')} |",
        "",
        f"Pipeline / plain: {spread(h['ratio'])} — target ≤ {TARGETS['host']:.1f}x {verdict(r <= TARGETS['host'])}.",
        "",
        f"**(c) Compiled layers** `transformer_lm({s['compiled_layers']}, {s['compiled_hidden']}, 4, "
        f"dim={s['compiled_dim']}, vocab={VOCAB}, dropout={s['compiled_dropout']:g})` with every layer wrapped in "
        f"`torch.compile` (inductor), {s['compiled_batch']} sequences of {s['compiled_seq']} tokens, "
        f"M={s['compiled_chunks']}; the same `nn.Sequential` of compiled layers in the Pipeline and in the plain "
        f"loop; the plain loop compiles first; {reps * 2} repetitions.",
        "",
    ]
    c = data["compiled"]
    status = compiled_status(c)
    if "unavailable" in c or "failed" in c:
        return "\n".join([*lines, f"**Not measured** — {status}."])
    (pc, pn), (qc, qn) = c["calls"]["pipeline"], c["calls"]["plain"]
    lines += [
        "| variant | step (s) | layer calls that ran compiled, one step | graphs dynamo compiled in its warm-up | "
        "first step (s) |",
        "|---|---|---|---|---|",
        f"| Pipeline | {spread(c['pipeline'], '.3f')} | {pc} of {pn} | {c['graphs']['pipeline']} | "
        f"{c['warmup_s']['pipeline']:.1f} |",
        f"| plain | {spread(c['plain'], '.3f')} | {qc} of {qn} | {c['graphs']['plain']} | "
        f"{c['warmup_s']['plain']:.1f} |",
        f"| plain, timed before the Pipeline first ran | {spread(c['plain_alone'], '.3f')} | "
        f"{c['calls_before']['plain'][0]} of {c['calls_before']['plain'][1]} | | |",
        "",
        "(Graphs are counted by `torch._dynamo.utils.counters['stats']['unique_graphs']`; the Pipeline may "
        "reuse the plain loop's graphs, so its 0 alone does not mean eager — the layer calls column does.)",
        "",
    ]
    ratio = compiled_ratio(c)
    r = statistics.median(ratio)
    ok = status is None and r <= TARGETS["compiled"]
    against = "" if qn and qc == qn else " (against the plain loop's compiled steps timed before the Pipeline ran)"
    lines.append(f"Pipeline / plain{against}: {spread(ratio)} — target ≤ {TARGETS['compiled']:.2f}x with every "
                 f"layer call compiled {verdict(ok)}.")  # fmt: skip
    if status:
        lines += ["", f"**Compile status: {status}.**"]
    return "\n".join(lines)


def run(bench: Bench, out: Path) -> Section:
    data = measure(sizes(bench))
    return Section(TITLE, render(data), [], data)


def misses(data: dict[str, Any]) -> list[str]:
    """The report's plain statements of the targets (a)-(c) missed, from the numbers measured."""
    lines = []
    key = lm_target_key(data)
    r = statistics.median(data["lm"][key]["ratio"])
    if r > TARGETS["lm"]:
        lines.append(
            f"- Engine overhead, Transformer LM at {key.replace(',', ', ')}: the Pipeline at K=1 takes "
            f"{r:.3f}x the plain micro-batched loop's step, above the {TARGETS['lm']:.2f}x target."
        )
    h = data["host"]
    r = statistics.median(h["ratio"])
    if r > TARGETS["host"]:
        lines.append(
            f"- Engine host overhead: {statistics.median(h['pipeline_us']):.1f} µs per (layer, micro-batch) in the "
            f"Pipeline against {statistics.median(h['plain_us']):.1f} µs in plain PyTorch, {r:.2f}x, above the "
            f"{TARGETS['host']:.1f}x target."
        )
    c = data["compiled"]
    status = compiled_status(c)
    if "unavailable" in c or "failed" in c:
        lines.append(f"- Compiled layers in the Pipeline: {status}.")
    else:
        r = statistics.median(compiled_ratio(c))
        if status or r > TARGETS["compiled"]:
            lines.append(f"- Compiled layers in the Pipeline: {r:.2f}x the plain loop's step (target ≤ "
                         f"{TARGETS['compiled']:.2f}x){'; ' + status if status else ''}.")  # fmt: skip
    return lines
