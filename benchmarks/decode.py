"""Decoding (issue 25): gpipe's cached greedy and beam search against Hugging Face ``generate``, and
pipelined decoding (K=2 against K=1).

Reproduce (from the repository root; transformers is in the dev extra; about 9 min here)::

    .venv/bin/python benchmarks/decode.py --out benchmarks/results/decode
    .venv/bin/python benchmarks/decode.py --quick               # small sizes, ~1 min, runs/decode
    .venv/bin/python benchmarks/decode.py --profile             # where a decode's time goes, then exit

Every variant runs in this process with the same ``torch.set_num_threads`` (``--threads``, default 1:
the machine is a shared 2-core VM, where two OpenMP threads beside another busy process stall now
and then), except where a variant says otherwise (K=1 with 2 threads, K=2 with one thread per worker).
Variants take turns within every repetition (the order reversed every other one, so that machine
noise hits all), each warmed up once first; ratios are per repetition, median [min-max]. Each
variant's row also says how much of the machine other processes used while it ran (from
``/proc/stat`` less this process's CPU time), as other work shares the VM; the "quiet" ratios keep
only the repetitions where others used < 10% during both variants.

gpipe's decodes run under ``torch.no_grad()``, as ``generate`` runs itself: ``gpipe.decode`` called
with grad mode on records autograd graphs through its caches (``StepContext.capture`` in
``runtime/decoding.py`` takes the caller's grad mode), which keeps every step's activations alive
until the decode ends (2.3 GB resident after a decode of 128 sentences, against 0.46 GB; the first
run of this benchmark was killed for memory at 512). One variant measures that mode's time.

1. ``versus_hf``: encoder-decoder, ``--sentences`` sources of ``--source-len`` random tokens, ``--tokens``
   new tokens each. gpipe: ``transformer(6, 1024, 4, dim=256, vocab=8000, dropout=0.0)`` decoded with
   ``gpipe.decode.greedy`` / ``beam_search(beam=4)``, as the plain ``nn.Sequential`` and as a
   ``Pipeline`` of one stage (``devices=['cpu']``, ``cpu_threads=--threads``), with the stages'
   caches, and without (``cache=False``: the whole prefix every step, the issue's "today"). Hugging
   Face: ``MarianMTModel`` of the same shape (d_model 256, 6 + 6 layers, 4 heads, ffn 1024, vocab
   8000, random weights; Marian ties its output projection to the embeddings, so it has 13.4M
   parameters to gpipe's 17.5M: the same compute) with ``generate`` (its key/value cache on, and
   ``use_cache=False``).

   Equal work: exactly ``--tokens`` new tokens per sentence on both sides. gpipe's ``eos`` is 8000,
   an id outside the vocabulary (no sentence ever ends); Hugging Face gets ``min_new_tokens =
   max_new_tokens`` (its eos logit is masked until the last token) and no forced eos. Checked on the
   outputs' shapes. Beam 4 on both sides keeps 4 hypotheses per sentence alive for all the steps
   (none can finish), chooses among the best 2 x 4 candidates of 4 x 8000, and reorders the
   self-attention caches every step; the encoder runs once per sentence on both sides. One
   difference: Hugging Face's first step runs 4 rows per sentence (3 of them at score -1e9) and
   computes the cross-attention keys and values of the encoder's output for every one of those
   rows, gpipe's first step one row per sentence (its beams appear after the first choice) — so
   Hugging Face does a little more work (about 10% more decoder FLOPs here). Length penalties do not
   matter (nothing finishes before the last step). ``1 sentence``: the same greedy decode of one
   sentence, where the kernels are tiny and the host's per-step work shows. ``grad mode on``: gpipe's
   greedy called without ``torch.no_grad()``.

   Uncached decoding takes ~10 s a run: ``--slow-reps`` repetitions of its own (gpipe ``cache=False``,
   Hugging Face ``use_cache=False`` and Hugging Face cached, taking turns, no warm-up); Hugging
   Face's uncached beam search (~40 s a run) is left out.

2. ``pipelining``: greedy, ``--sizes`` sentences, on ``Pipeline``'s of ``'cpu'`` workers: K=1 with one
   and with two intra-op threads, and K=2 (one thread per worker; the default groups, 2: two groups
   of sentences in flight). The K=2 balance, per size, is the two-stage split whose decode gpipe's
   simulator finds fastest from each layer's time at the first and at a later step of a cached
   greedy decode of that many sentences (forward hooks on the plain model; the encoder runs once,
   the decoder every step), not ``balance_by_time``'s, which times training passes over whole
   sequences (recorded too). A fourth variant bounds what two workers in
   one process can get here: two threads decoding half the sentences each on a one-stage
   ``Pipeline`` each, no pipeline between them. The K=2 pipeline's workers' busy time (its decode
   trace) is reported too. Then the same K=2 under torch.distributed: 2 gloo processes, one stage
   and one thread each, started as the tests start ranks (``tests/dist_harness.py``), timed on rank
   0 against K=1 (the plain model) in rank 0's process while rank 1 waits at a barrier, taking
   turns, and, up to 128 sentences, the same K=2 with 4 groups in flight. Above 128 sentences a
   third of the repetitions (at least 2), as a run takes ~10 s.

3. ``gpt2``: decoder-only, a ``GPT2LMHeadModel`` (12 blocks, dim 256, 4 heads, ffn 1024, vocab 8000,
   random weights) cut by ``gpipe.generation.traced.cached_layers`` into a one-stage ``Pipeline``,
   ``Pipeline.generate`` against the model's own ``generate``, greedy and beam 4, ``--sentences``
   prompts of ``--source-len`` tokens, exactly ``--tokens`` new tokens on both sides (eos 8000, an id
   no token matches), both under ``torch.no_grad()``; whether the greedy tokens agree is recorded.
   Skipped, with a printed note, while ``Pipeline.generate`` does not exist (:func:`gpipe_generate`
   is the gpipe side).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gpipe
from gpipe.balance import balance_by_time, solve
from gpipe.decode import beam_search, greedy
from gpipe.models.transformer import transformer

VOCAB = 8000
NEVER = VOCAB  # gpipe's eos: no id the model can choose
BOS, EOS, PAD = 1, 2, 0
BEAM = 4

Fn = Callable[[], Any]


# -- models and data --------------------------------------------------------------------------------


def gpipe_model() -> nn.Sequential:
    torch.manual_seed(0)
    return transformer(6, 1024, 4, dim=256, vocab=VOCAB, dropout=0.0).eval()


def marian() -> nn.Module:
    import transformers

    config = transformers.MarianConfig(
        vocab_size=VOCAB, d_model=256, encoder_layers=6, decoder_layers=6, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, max_position_embeddings=512,
        pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=BOS, forced_eos_token_id=None,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MarianMTModel(config).eval()


def sources(n: int, length: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    source = torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
    return source, torch.full((n,), BOS)


def pipeline(model: nn.Sequential, balance: list[int], threads: int) -> gpipe.Pipeline:
    pipe = gpipe.Pipeline(
        copy.deepcopy(model), balance, chunks=1, loss_fn=lambda o, t: o.sum(), devices=["cpu"] * len(balance),
        cpu_threads=threads,
    )  # fmt: skip
    return pipe.eval()


def gpipe_decoder(
    model: Any,
    source: Tensor,
    start: Tensor,
    tokens: int,
    beam: int,
    cache: bool = True,
    grad_mode: bool = False,
    groups: int | None = None,
) -> Fn:
    """One decode, under ``torch.no_grad()`` (as ``generate`` runs) unless ``grad_mode``; ``groups``
    in flight (greedy only; None: one per stage)."""

    def run() -> Tensor:
        with torch.set_grad_enabled(grad_mode):
            if beam == 1:
                out = greedy(model, source, start, max_len=tokens, eos=NEVER, cache=cache, groups=groups)
            else:
                out = beam_search(model, source, start, beam=beam, max_len=tokens, eos=NEVER, length_penalty=1.0)
        assert out.shape == (source.size(0), tokens), out.shape
        return out

    return run


def hf_decoder(model: nn.Module, source: Tensor, tokens: int, beam: int, cache: bool = True) -> Fn:
    mask = torch.ones_like(source)

    def run() -> Tensor:
        with torch.no_grad():
            out = model.generate(
                input_ids=source, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                num_beams=beam, do_sample=False, use_cache=cache, length_penalty=1.0,
            )  # fmt: skip
        assert out.shape == (source.size(0), tokens + 1), out.shape  # (the start token first)
        return out

    return run


# -- timing -----------------------------------------------------------------------------------------


def _machine_busy() -> float:
    """Seconds the machine's CPUs were busy since boot (all processes)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def timed(fn: Fn, own_cpu: Callable[[], float] = time.process_time) -> tuple[float, float]:
    """Seconds ``fn`` took, and the share of the machine's CPUs other processes used meanwhile."""
    busy, cpu, start = _machine_busy(), own_cpu(), time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    others = (_machine_busy() - busy) - (own_cpu() - cpu)
    return wall, max(0.0, others) / (wall * (os.cpu_count() or 1))


def take_turns(variants: dict[str, Fn], reps: int, warm: bool = True) -> dict[str, dict[str, list[float]]]:
    """Every variant once to warm up (if ``warm``), then ``reps`` rounds, each running every variant
    once: seconds and others' CPU share, per variant."""
    for fn in variants.values() if warm else ():
        fn()
    out: dict[str, dict[str, list[float]]] = {k: {"s": [], "others": []} for k in variants}
    for r in range(reps):
        for key in list(variants) if r % 2 == 0 else list(reversed(variants)):
            wall, others = timed(variants[key])
            out[key]["s"].append(wall)
            out[key]["others"].append(others)
    return out


def ratios(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den)]


def quiet(times: dict[str, dict[str, list[float]]], num: str, den: str, limit: float = 0.1) -> list[float]:
    """``num``'s time over ``den``'s in the repetitions where other processes used less than
    ``limit`` of the machine during both."""
    a, b = times[num], times[den]
    return [x / y for x, y, p, q in zip(a["s"], b["s"], a["others"], b["others"]) if max(p, q) < limit]


def spread(values: list[float], digits: int = 2) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


# -- 1. against Hugging Face ------------------------------------------------------------------------


def versus_hf(args: argparse.Namespace) -> dict[str, Any]:
    model, hf = gpipe_model(), marian()
    pipe = pipeline(model, [len(model)], args.threads)
    source, start = sources(args.sentences, args.source_len)
    one, one_start = source[:1], start[:1]
    n = args.tokens
    variants = {
        "gpipe greedy": gpipe_decoder(model, source, start, n, 1),
        "gpipe Pipeline K=1 greedy": gpipe_decoder(pipe, source, start, n, 1),
        "HF greedy": hf_decoder(hf, source, n, 1),
        "gpipe beam 4": gpipe_decoder(model, source, start, n, BEAM),
        "gpipe Pipeline K=1 beam 4": gpipe_decoder(pipe, source, start, n, BEAM),
        "HF beam 4": hf_decoder(hf, source, n, BEAM),
        "gpipe greedy, 1 sentence": gpipe_decoder(model, one, one_start, n, 1),
        "gpipe greedy, grad mode on": gpipe_decoder(model, source, start, n, 1, grad_mode=True),
        "HF greedy, 1 sentence": hf_decoder(hf, one, n, 1),
    }
    print(f"versus_hf: {args.sentences} sentences x {n} tokens, {args.reps} repetitions", flush=True)
    times = take_turns(variants, args.reps)
    slow = {
        "gpipe greedy, uncached": gpipe_decoder(model, source, start, n, 1, cache=False),
        "HF greedy, use_cache=False": hf_decoder(hf, source, n, 1, cache=False),
        "HF greedy (beside the uncached)": hf_decoder(hf, source, n, 1),
    }
    print(f"versus_hf: uncached, {args.slow_reps} repetitions (no warm-up: its shapes ran above)", flush=True)
    times.update(take_turns(slow, args.slow_reps, warm=False))
    pairs = {
        "greedy: gpipe / HF": ("gpipe greedy", "HF greedy"),
        "greedy: gpipe Pipeline K=1 / HF": ("gpipe Pipeline K=1 greedy", "HF greedy"),
        "beam 4: gpipe / HF": ("gpipe beam 4", "HF beam 4"),
        "beam 4: gpipe Pipeline K=1 / HF": ("gpipe Pipeline K=1 beam 4", "HF beam 4"),
        "greedy, 1 sentence: gpipe / HF": ("gpipe greedy, 1 sentence", "HF greedy, 1 sentence"),
        "greedy: gpipe called with grad mode on / under no_grad": ("gpipe greedy, grad mode on", "gpipe greedy"),
        "greedy uncached (today): gpipe / HF cached": ("gpipe greedy, uncached", "HF greedy (beside the uncached)"),
        "greedy uncached: HF use_cache=False / HF cached": (
            "HF greedy, use_cache=False",
            "HF greedy (beside the uncached)",
        ),
    }
    return {
        "sentences": args.sentences,
        "tokens": n,
        "source_len": args.source_len,
        "parameters": {
            "gpipe": sum(p.numel() for p in model.parameters()),
            "HF": sum(p.numel() for p in hf.parameters()),
        },
        "times": times,
        "ratios": {k: ratios(times[a]["s"], times[b]["s"]) for k, (a, b) in pairs.items()},
        "quiet": {k: quiet(times, a, b) for k, (a, b) in pairs.items()},
    }


# -- 2. pipelining ----------------------------------------------------------------------------------


def step_costs(model: nn.Sequential, source: Tensor, start: Tensor, tokens: int) -> tuple[list[float], list[float]]:
    """Each layer's seconds at the first step of a cached greedy decode of ``source`` (the encoder
    runs there) and at a later step (their mean)."""
    model = copy.deepcopy(model)
    first, later, calls, began = [0.0] * len(model), [0.0] * len(model), [0] * len(model), [0] * len(model)
    hooks = []
    for i, layer in enumerate(model):

        def pre(module: nn.Module, inputs: Any, i: int = i) -> None:
            began[i] = time.perf_counter_ns()

        def post(module: nn.Module, inputs: Any, output: Any, i: int = i) -> None:
            seconds = (time.perf_counter_ns() - began[i]) / 1e9
            if calls[i] % tokens == 0:
                first[i] += seconds
            else:
                later[i] += seconds / (tokens - 1)
            calls[i] += 1

        hooks += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    run = gpipe_decoder(model, source, start, tokens, 1)
    if source.size(0) <= 128:  # (a warm-up; larger sizes run after smaller ones)
        run()
        first[:], later[:] = [0.0] * len(model), [0.0] * len(model)
    run()
    for h in hooks:
        h.remove()
    return first, later


def simulated(first: list[float], later: list[float], balance: list[int], tokens: int, groups: int) -> float:
    """The seconds of a decode on ``balance``'s stages, one worker each, in gpipe's decode schedule
    (:func:`gpipe.schedule.decode.decode`), by gpipe's simulator: a group's step on a stage costs its
    layers' (``first`` at the first step, ``later`` after) over ``groups`` (a group has 1/groups of
    the sentences; optimistic where the per-call overhead is not small)."""
    from gpipe.schedule.decode import decode as decode_schedule
    from gpipe.schedule.ir import Action
    from gpipe.schedule.simulate import simulate

    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]

    def cost(action: Action) -> float:
        per = first if action.microbatch < groups else later
        return sum(per[bounds[action.stage] : bounds[action.stage + 1]]) / groups

    return simulate(decode_schedule(list(range(len(balance))), groups, tokens), cost).makespan


def decode_balance(first: list[float], later: list[float], tokens: int, groups: int) -> list[int]:
    """The split of the layers into two stages whose decode :func:`simulated` ends first."""
    n = len(first)
    return min(([c, n - c] for c in range(1, n)), key=lambda b: simulated(first, later, b, tokens, groups))


def two_threads(model: nn.Sequential, source: Tensor, start: Tensor, tokens: int) -> Fn:
    """Two threads decoding half the sentences each, on a ``Pipeline`` of one stage each (one
    intra-op thread): what two workers in one process can do here with no pipeline between them."""
    pipes = [pipeline(model, [len(model)], 1) for _ in range(2)]
    halves = list(zip(source.tensor_split(2), start.tensor_split(2)))
    runs = [gpipe_decoder(p, s, t, tokens, 1) for p, (s, t) in zip(pipes, halves)]

    def run() -> None:
        pool = [threading.Thread(target=r) for r in runs]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    return run


def repetitions(reps: int, size: int) -> int:
    """Repetitions for ``size`` sentences: ``reps``, a third (at least 2) above 128."""
    return reps if size <= 128 else max(2, reps // 3)


def pipelining(args: argparse.Namespace) -> dict[str, Any]:
    model = gpipe_model()
    source, _ = sources(8, args.source_len)
    by_time = list(balance_by_time(2, copy.deepcopy(model).train(), (source, source[:, : args.tokens]), device=None))
    k1, k1t2 = pipeline(model, [len(model)], 1), pipeline(model, [len(model)], 2)
    rows = []
    for size in args.sizes:
        src, st = sources(size, args.source_len, seed=size)
        first, later = step_costs(model, src, st, args.tokens)
        one = sum(first) + (args.tokens - 1) * sum(later)
        balance = decode_balance(first, later, args.tokens, 2)
        by_cost = list(solve([f + (args.tokens - 1) * x for f, x in zip(first, later)], 2))
        bounds = {
            f"{balance} (simulated best)": one / simulated(first, later, balance, args.tokens, 2),
            f"{by_cost} (total cost split)": one / simulated(first, later, by_cost, args.tokens, 2),
        }
        k2 = pipeline(model, balance, 1)
        reps = repetitions(args.reps, size)
        busy: list[dict[int, float]] = []

        def k2_run(
            k2: gpipe.Pipeline = k2, src: Tensor = src, st: Tensor = st, busy: list[dict[int, float]] = busy
        ) -> None:
            gpipe_decoder(k2, src, st, args.tokens, 1)()
            assert k2.last_decode is not None
            busy.append(k2.last_decode.busy())

        variants = {
            "K=1, 1 thread": gpipe_decoder(k1, src, st, args.tokens, 1),
            "K=1, 2 threads": gpipe_decoder(k1t2, src, st, args.tokens, 1),
            "K=2, 1 thread each": k2_run,
            "2 threads, no pipeline": two_threads(model, src, st, args.tokens),
        }
        print(f"pipelining: {size} sentences, K=2 balance {balance}, {reps} repetitions", flush=True)
        times = take_turns(variants, reps)
        s = {k: v["s"] for k, v in times.items()}
        k2_s = s["K=2, 1 thread each"]
        rows.append({
            "sentences": size,
            "groups": 2,
            "balance": balance,
            "layer_costs_s": {"first step": first, "later step": later},
            "simulated_k2_speedup": bounds,
            "times": times,
            "k2_busy": [{str(w): b / wall for w, b in d.items()} for d, wall in zip(busy[1:], k2_s)],
            "ratios": {
                "K=2 / K=1 (1 thread)": ratios(s["K=1, 1 thread"], k2_s),
                "K=2 / K=1 (2 threads)": ratios(s["K=1, 2 threads"], k2_s),
                "K=1 2 threads / 1 thread": ratios(s["K=1, 1 thread"], s["K=1, 2 threads"]),
                "2 threads, no pipeline / K=1 (1 thread)": ratios(s["K=1, 1 thread"], s["2 threads, no pipeline"]),
            },
            "quiet": {
                "K=2 / K=1 (1 thread)": quiet(times, "K=1, 1 thread", "K=2, 1 thread each"),
                "K=2 / K=1 (2 threads)": quiet(times, "K=1, 2 threads", "K=2, 1 thread each"),
                "K=1 2 threads / 1 thread": quiet(times, "K=1, 1 thread", "K=1, 2 threads"),
                "2 threads, no pipeline / K=1 (1 thread)": quiet(times, "K=1, 1 thread", "2 threads, no pipeline"),
            },
        })  # fmt: skip
    result: dict[str, Any] = {"tokens": args.tokens, "balance_by_time": by_time, "rows": rows}
    if args.distributed:
        result["distributed"] = distributed(args, {row["sentences"]: row["balance"] for row in rows})
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def distributed(args: argparse.Namespace, balances: dict[int, list[int]]) -> dict[str, Any]:
    """K=2 over 2 gloo processes (rank 0 also times K=1 in its process); rank 0's results."""
    spec = {"balances": balances, "reps": args.reps, "tokens": args.tokens, "source_len": args.source_len}
    out = Path(args.out) / "distributed.json"
    port, procs = _free_port(), []
    print(f"pipelining: 2 gloo processes, balances {balances}", flush=True)
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), "--rank-main", json.dumps(spec), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + args.dist_timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append(p.communicate()[0])
    if any(p.returncode != 0 for p in procs) or not out.exists():
        print("distributed run failed:\n" + "\n".join(log[-2000:] for log in logs))
        return {"failed": [p.returncode for p in procs]}
    result: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return result


MORE_GROUPS = 4  # the distributed section's second K=2 variant, up to 128 sentences


def rank_main(spec: dict[str, Any], out: str) -> None:
    """One rank of :func:`distributed` (``--rank-main``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    model = gpipe_model()
    pipes = {
        size: gpipe.Pipeline(copy.deepcopy(model), balance, chunks=1, loss_fn=lambda o, t: o.sum()).eval()
        for size, balance in spec["balances"].items()
    }
    rank, tokens = dist.get_rank(), spec["tokens"]

    def world_cpu() -> float:  # both ranks' CPU seconds
        t = torch.tensor([time.process_time()], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    rows = []
    for size_key, pipe in pipes.items():
        size = int(size_key)
        src, st = sources(size, spec["source_len"], seed=size)
        reps = repetitions(spec["reps"], size)
        runs = {
            "K=1, 1 thread": gpipe_decoder(model, src, st, tokens, 1),
            "K=2": gpipe_decoder(pipe, src, st, tokens, 1),
        }
        if size <= 128:  # more groups in flight than stages: does it smooth the imbalance?
            runs[f"K=2, {MORE_GROUPS} groups"] = gpipe_decoder(pipe, src, st, tokens, 1, groups=MORE_GROUPS)
        times: dict[str, dict[str, list[float]]] = {k: {"s": [], "others": []} for k in runs}
        for r in range(reps + 1):  # the first round warms up
            for key in list(runs) if r % 2 == 0 else list(reversed(runs)):
                dist.barrier()
                busy, cpu = _machine_busy(), world_cpu()
                start = time.perf_counter()
                if key != "K=1, 1 thread" or rank == 0:
                    runs[key]()
                wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.barrier()
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                own = world_cpu() - cpu
                others, seconds = (_machine_busy() - busy) - own, float(wall.item())
                if r > 0:
                    times[key]["s"].append(seconds)
                    times[key]["others"].append(max(0.0, others) / (seconds * (os.cpu_count() or 1)))
                    times[key].setdefault("ranks_cpu", []).append(own / seconds)
        one, pipelined = "K=1, 1 thread", [k for k in runs if k != "K=1, 1 thread"]
        rows.append({
            "sentences": size,
            "times": times,
            "balance": spec["balances"][size_key],
            "ratios": {f"{k} / K=1 (1 thread)": ratios(times[one]["s"], times[k]["s"]) for k in pipelined},
            "quiet": {f"{k} / K=1 (1 thread)": quiet(times, one, k) for k in pipelined},
        })  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows}))
    dist.destroy_process_group()


# -- 3. decoder-only: GPT-2 against its own generate -----------------------------------------------


def gpipe_generate(pipe: gpipe.Pipeline, prompts: Tensor, mask: Tensor, tokens: int, beam: int) -> Tensor | None:
    """THE GPIPE SIDE OF THE GPT-2 COMPARISON: the ``(rows, prompt + tokens)`` sequences of ``pipe``
    (GPT-2's ``cached_layers`` in one stage) generating exactly ``tokens`` new tokens per prompt with
    ``beam`` beams (1: greedy), with :func:`hf_generate`'s settings (an eos no token can match,
    ``do_sample=False``, ``length_penalty=1.0``). None while ``Pipeline.generate`` does not exist
    (the section is then skipped)."""
    if not hasattr(pipe, "generate"):
        return None
    with torch.no_grad():  # (as generate runs)
        out: Tensor = pipe.generate(
            prompts, attention_mask=mask, max_new_tokens=tokens, num_beams=beam, do_sample=False, eos_token_id=NEVER,
            pad_token_id=PAD, length_penalty=1.0,
        )  # fmt: skip
    assert out.shape == (prompts.size(0), prompts.size(1) + tokens), out.shape
    return out


def hf_generate(model: nn.Module, prompts: Tensor, mask: Tensor, tokens: int, beam: int) -> Tensor:
    with torch.no_grad():
        out: Tensor = model.generate(
            input_ids=prompts, attention_mask=mask, max_new_tokens=tokens, num_beams=beam, do_sample=False,
            length_penalty=1.0, pad_token_id=PAD, eos_token_id=NEVER,
        )  # fmt: skip
    assert out.shape == (prompts.size(0), prompts.size(1) + tokens), out.shape
    return out


def gpt2(args: argparse.Namespace) -> dict[str, Any]:
    if not hasattr(gpipe.Pipeline, "generate"):
        note = "skipped: gpipe.Pipeline.generate does not exist yet"
        print(f"gpt2: {note}", flush=True)
        return {"skipped": note}
    import transformers

    from gpipe.generation.traced import cached_layers

    config = transformers.GPT2Config(
        n_layer=12, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=512, bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=PAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    layers = cached_layers(copy.deepcopy(hf))
    pipe = pipeline(layers, [len(layers)], args.threads)
    prompts, _ = sources(args.sentences, args.source_len)
    mask = torch.ones_like(prompts)
    got = gpipe_generate(pipe, prompts, mask, args.tokens, 1)
    assert got is not None
    out: dict[str, Any] = {"greedy_tokens_equal": torch.equal(got, hf_generate(hf, prompts, mask, args.tokens, 1))}
    out["rows"] = []
    print(f"gpt2: {args.sentences} prompts x {args.tokens} tokens, {args.reps} repetitions", flush=True)
    for beam in (1, BEAM):
        variants = {
            "gpipe": lambda beam=beam: gpipe_generate(pipe, prompts, mask, args.tokens, beam),
            "HF": lambda beam=beam: hf_generate(hf, prompts, mask, args.tokens, beam),
        }
        times = take_turns(variants, args.reps)
        out["rows"].append({
            "beam": beam, "times": times, "ratio": ratios(times["gpipe"]["s"], times["HF"]["s"]),
            "quiet": quiet(times, "gpipe", "HF"),
        })  # fmt: skip
    return out


# -- where the time goes ----------------------------------------------------------------------------


def profile(args: argparse.Namespace) -> None:
    """torch.profiler's busiest operators of one cached gpipe decode (K=1) and one of Hugging Face's,
    greedy and beam 4, and cProfile's busiest Python functions of gpipe's greedy."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, hf = gpipe_model(), marian()
    source, start = sources(args.sentences, args.source_len)
    for beam in (1, BEAM):
        for name, fn in (
            ("gpipe", gpipe_decoder(model, source, start, args.tokens, beam)),
            ("HF", hf_decoder(hf, source, args.tokens, beam)),
        ):
            fn()
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                wall, _ = timed(fn)
            print(f"\n== {name}, beam {beam}: {wall:.3f} s ==")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    fn = gpipe_decoder(model, source, start, args.tokens, 1)
    with cProfile.Profile() as prof_py:
        fn()
    pstats.Stats(prof_py).sort_stats("tottime").print_stats(25)


# -- the report -------------------------------------------------------------------------------------


def render(result: dict[str, Any], header: str) -> str:
    lines = [header]
    if "versus_hf" in result:
        lines += _render_hf(result["versus_hf"])
    if "pipelining" in result:
        lines += _render_pipelining(result["pipelining"])
    if "gpt2" in result:
        lines += _render_gpt2(result["gpt2"])
    return "\n".join(lines) + "\n"


def _render_hf(hf: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## gpipe against Hugging Face generate (MarianMTModel config), {hf['sentences']} sentences x "
        f"{hf['tokens']} tokens, source {hf['source_len']} tokens",
        "",
        "| variant | seconds, median [min-max] | tokens/s | others' CPU share, median [max] |",
        "|---|---|---|---|",
    ]
    for key, t in hf["times"].items():
        sentences = 1 if "1 sentence" in key else hf["sentences"]
        rate = sentences * hf["tokens"] / statistics.median(t["s"])
        lines.append(
            f"| {key} | {spread(t['s'], 3)} | {rate:.0f} "
            f"| {statistics.median(t['others']):.0%} [{max(t['others']):.0%}] |"
        )
    lines += ["", "| ratio (per repetition) | all repetitions | quiet repetitions |", "|---|---|---|"]
    lines += [f"| {k} | {spread(v)} | {_quiet(hf['quiet'][k], len(v))} |" for k, v in hf["ratios"].items()]
    return lines


def _quiet(values: list[float], total: int) -> str:
    return f"{spread(values)} ({len(values)} of {total})" if values else f"none of {total}"


def _render_pipelining(pipe: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## Pipelining: greedy, K=2 against K=1 ({pipe['tokens']} tokens, 'cpu' workers)",
        "",
        "K=2: the balance whose decode gpipe's simulator finds fastest, from each layer's time at the first "
        "and at a later step of a cached decode of that many sentences (the 'simulated' rows: that bound, "
        "and the one of the split of each layer's total time; balance_by_time, from training passes, "
        f"gives {pipe['balance_by_time']}); 2 groups in flight. Ratios are "
        "throughputs, K=1's time over K=2's (> 1: K=2 faster), per repetition; 'quiet': only the "
        "repetitions where other processes used < 10% of the machine during both variants.",
        "",
        "| sentences | variant | seconds, median [min-max] | others' CPU share, median [max] |",
        "|---|---|---|---|",
    ]
    for row in pipe["rows"]:
        for key, t in row["times"].items():
            name = f"{key} {row['balance']}" if key.startswith("K=2") else key
            lines.append(
                f"| {row['sentences']} | {name} | {spread(t['s'], 3)} "
                f"| {statistics.median(t['others']):.0%} [{max(t['others']):.0%}] |"
            )
    lines += ["", "| sentences | ratio | all repetitions | quiet repetitions |", "|---|---|---|---|"]
    for row in pipe["rows"]:
        total = len(row["times"]["K=1, 1 thread"]["s"])
        for k, v in row["ratios"].items():
            lines.append(f"| {row['sentences']} | {k} | {spread(v)} | {_quiet(row['quiet'][k], total)} |")
        if row["k2_busy"]:
            per = {w: statistics.median(d[w] for d in row["k2_busy"]) for w in row["k2_busy"][0]}
            text = ", ".join(f"worker {w} {b:.0%}" for w, b in sorted(per.items()))
            lines.append(f"| {row['sentences']} | K=2 workers busy (of the wall time, median) | {text} | |")
        for name, bound in row["simulated_k2_speedup"].items():
            lines.append(f"| {row['sentences']} | K=2 / K=1 simulated, balance {name} | {bound:.2f} | |")
    dist = pipe.get("distributed")
    if dist is not None:
        lines += ["", "### Under torch.distributed: 2 gloo processes, one stage and one thread each", ""]
        if "failed" in dist:
            lines.append(f"The run failed (return codes {dist['failed']}).")
        else:
            lines += [
                "K=1: the plain model in rank 0's process (rank 1 waits at a barrier), one thread.",
                "",
                "| sentences | balance | variant | K=1 (s) | K=2 (s) | K=2 / K=1 throughput | quiet repetitions "
                "| others' CPU share (K=1, K=2) | both ranks' CPU, cores (K=1, K=2) |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for row in dist["rows"]:
                t, one = row["times"], row["times"]["K=1, 1 thread"]
                for key in (k for k in t if k != "K=1, 1 thread"):
                    name = "K=2, 2 groups" if key == "K=2" else key
                    k = f"{key} / K=1 (1 thread)"
                    lines.append(
                        f"| {row['sentences']} | {row['balance']} | {name} | {spread(one['s'], 3)} "
                        f"| {spread(t[key]['s'], 3)} | {spread(row['ratios'][k])} "
                        f"| {_quiet(row['quiet'][k], len(t[key]['s']))} "
                        f"| {statistics.median(one['others']):.0%}, {statistics.median(t[key]['others']):.0%} "
                        f"| {statistics.median(one['ranks_cpu']):.2f}, {statistics.median(t[key]['ranks_cpu']):.2f} |"
                    )
    return lines


def _render_gpt2(gpt: dict[str, Any]) -> list[str]:
    lines = ["", "## Decoder-only: GPT-2 cut by cached_layers against its own generate", ""]
    if "skipped" in gpt:
        lines.append(gpt["skipped"] + ".")
    else:
        lines += [
            f"Greedy tokens equal to generate's: {gpt['greedy_tokens_equal']}.",
            "",
            "| beam | gpipe (s) | HF (s) | gpipe / HF | quiet repetitions |",
            "|---|---|---|---|---|",
        ]
        for row in gpt["rows"]:
            t = row["times"]
            lines.append(
                f"| {row['beam']} | {spread(t['gpipe']['s'], 3)} | {spread(t['HF']['s'], 3)} | {spread(row['ratio'])} "
                f"| {_quiet(row['quiet'], len(row['ratio']))} |"
            )
    return lines


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "versus_hf": versus_hf,
    "pipelining": pipelining,
    "gpt2": gpt2,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/decode")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (a third, at least 2, above 128 sentences)")
    parser.add_argument("--slow-reps", type=int, default=3, help="repetitions of the uncached decodes")
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--source-len", type=int, default=40)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 128, 512], help="sentences, pipelining")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every variant")
    parser.add_argument("--no-distributed", dest="distributed", action="store_false")
    parser.add_argument("--dist-timeout", type=float, default=400.0)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions")
    parser.add_argument("--profile", action="store_true", help="print where a decode's time goes, then exit")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    parser.add_argument("--rank-main", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(json.loads(args.rank_main[0]), args.rank_main[1])
        return
    torch.set_num_threads(args.threads)
    if args.quick:
        args.reps, args.slow_reps, args.sentences, args.tokens, args.sizes = 2, 1, 8, 10, [8, 32]
    if args.profile:
        profile(args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    result = {}
    for name in args.only:
        result[name] = SECTIONS[name](args)
        print(f"{name}: done at {time.perf_counter() - began:.0f} s", flush=True)
    import transformers

    header = (
        f"# Decoding (benchmarks/decode.py)\n\n"
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}; "
        f"torch.set_num_threads({args.threads}) for every variant unless it says otherwise; "
        f"{args.reps} repetitions ({repetitions(args.reps, 129)} above 128 sentences), {args.slow_reps} for the "
        f"uncached; load average {os.getloadavg()[0]:.2f} at the end; {time.perf_counter() - began:.0f} s in all"
    )
    report = render(result, header)
    (Path(args.out) / "report.md").write_text(report)
    (Path(args.out) / "results.json").write_text(json.dumps({"args": vars(args), **result}, indent=1))
    print(report)


if __name__ == "__main__":
    main()
