"""Loading a pretrained folder: ``gpipe train --model hf --init DIR``'s model, traced and
materialized, against ``from_pretrained``, with gpipe's source tree before a change and after it,
taking turns (issue 47, item 6).

Reproduce (from the repository root; about 6 min here, the model folder in a scratch folder under
/tmp, deleted at the end)::

    .venv/bin/python benchmarks/pretrained_load.py --before b7e8d67 --out benchmarks/results/pretrained_load
    .venv/bin/python benchmarks/pretrained_load.py --before b7e8d67 --quick   # a small Llama; runs/pretrained_load

``--before REV``: the ``src`` of that revision (``git archive``) is the *before* tree; the working
tree's ``src`` is *after*. The model is ``benchmarks/pretrained.py``'s: a Llama of 317M parameters
(hidden 1024, intermediate 2048, 24 layers, 16 heads, vocabulary 32000, untied embeddings) with
seeded random weights, written by ``save_pretrained`` in float32 in shards of at most 200 MB, with
its BPE tokenizer and text file.

Each measurement is a fresh process (``OMP_NUM_THREADS=1``); a round runs one of each, the order
rotating from round to round; the files are in the page cache (written just before, and read by
every round). Timed after the imports of the script's process (torch, transformers, gpipe's
training modules), the modules the load itself imports the first time included, as a user waits
for them: they are imported first and timed as a phase of their own (the Llama's modeling code,
and for gpipe torch.export's machinery, ``torch.export._trace`` and ``torch._functorch.partitioners``
with networkx):

- *from_pretrained*: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32)`` as it
  returns (its float32 tensors are views of the memory-mapped files, read when first touched), and
  then with every parameter read once.
- *gpipe (before, after)*: what ``gpipe train --init DIR --partitions 4`` does to build its
  pipeline, as ``benchmarks/pretrained.py`` times it: ``make_model`` (``hf.build``: the model on
  the meta device and its causality check; ``pretrained.plan``: the folder checked from its
  headers; ``hf.pipeline_layers``: the trace into layers), ``balance_by_flops(4, ...,
  state_bytes=8)`` (FLOPs and memory, as ``gpipe train --model hf`` balances with its default
  optimizer) and ``Pipeline(layers, balance, chunks=4, devices=['cpu'] * 4)``, which materializes every layer and
  reads its tensors (``make_data``, the tokenization, before the clock). Each phase's wall and CPU
  time. Then, untimed, every parameter, the pipeline's logits on an evaluation batch (eval mode)
  and a training step's loss and gradients (``Pipeline.step``, the next tokens' cross-entropy),
  hashed (SHA-256 of their bytes): before and after must load and train the same model.

The figure is gpipe's load over from_pretrained's of the same round (the median over the rounds):
noise on the machine is common to the processes of a round.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TIMEOUT = 900  # seconds, any one process
KINDS = ("from_pretrained", "after", "before")


# ---------------------------------------------------------------- in the measured processes


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _loss(output: Any, target: Any) -> Any:
    """A training step's loss: the next tokens' cross-entropy, padding (0) left out."""
    import torch.nn.functional as F  # noqa: N812

    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten(), ignore_index=0)


def _digest(tensors: Any) -> str:
    """SHA-256 of the tensors' bytes, in order (16 hex digits)."""
    import torch

    found = hashlib.sha256()
    for t in tensors:
        found.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return found.hexdigest()[:16]


def _imports(*, gpipe: bool) -> list[float]:
    """Import, before the clock, the modules the load would import the first time (wall and CPU
    seconds): the model's code (both), and torch.export's machinery, which the trace needs (gpipe's;
    ``torch._functorch.partitioners`` brings networkx)."""
    import importlib

    wall, cpu = _clock()
    importlib.import_module("transformers.models.llama.modeling_llama")
    if gpipe:
        importlib.import_module("torch.export._trace")
        importlib.import_module("torch._functorch.partitioners")
    now = _clock()
    return [now[0] - wall, now[1] - cpu]


def _load_gpipe(folder: Path, text: Path) -> dict[str, Any]:
    """``gpipe train --init folder --partitions 4``'s pipeline, each phase timed, then the
    digests of its logits on an evaluation batch and of its parameters."""
    import functools

    import torch

    import gpipe.models.hf as hf
    import gpipe.models.pretrained as pretrained
    from gpipe.balance import balance_by_flops
    from gpipe.pipeline import Pipeline
    from gpipe.train import TrainConfig
    from gpipe.train.setup import STATE_BYTES, make_data, make_model

    phases: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                now = _clock()
                phases[name] = [now[0] - wall, now[1] - cpu]

        return run

    hf.build = timed("build", hf.build)  # type: ignore[method-assign]
    pretrained.plan = timed("plan", pretrained.plan)  # type: ignore[method-assign]
    hf.pipeline_layers = timed("trace", hf.pipeline_layers)  # type: ignore[method-assign]
    scratch = tempfile.mkdtemp(prefix="gpipe-pretrained-load-")
    try:
        cfg = TrainConfig(model="hf", init=str(folder), data=str(text), partitions=4, batch=4, chunks=4, out=scratch)
        cfg.check()
        data = make_data(cfg)
        sample = data.batch(cfg.batch, 0, split="eval").inputs
        began = _clock()
        phases["imports"] = _imports(gpipe=True)
        layers = make_model(cfg, data)
        built = _clock()
        balance = balance_by_flops(4, layers, sample, chunks=4, state_bytes=STATE_BYTES[cfg.optimizer])  # (as train)
        balanced = _clock()
        pipe = Pipeline(layers, balance, chunks=4, devices=["cpu"] * 4, cpu_threads=1, loss_fn=_loss)
        done = _clock()
        phases["make_model"] = [built[0] - began[0] - phases["imports"][0], built[1] - began[1] - phases["imports"][1]]
        phases["balance"] = [balanced[0] - built[0], balanced[1] - built[1]]
        phases["materialize"] = [done[0] - balanced[0], done[1] - balanced[1]]
        phases["total"] = [done[0] - began[0], done[1] - began[1]]
        weights = _digest(t for _, t in sorted(pipe.named_parameters()))
        pipe.eval()
        with torch.no_grad():
            out = pipe(sample)
        logits = _digest([getattr(out, "logits", out)])
        pipe.train()
        batch = data.batch(cfg.batch, 0)
        loss = pipe.step(batch.inputs, batch.target)
        step = _digest([loss.detach(), *(p.grad for _, p in sorted(pipe.named_parameters()) if p.grad is not None)])
        return {"phases": phases, "balance": list(balance), "params": sum(p.numel() for p in pipe.parameters()),
                "weights": weights, "logits": logits, "loss": float(loss), "step": step}  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _load_hf(folder: Path) -> dict[str, Any]:
    """``from_pretrained(folder)`` in float32, timed as it returns and after every parameter is read."""
    import torch
    import transformers

    began = _clock()
    imports = _imports(gpipe=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    returned = _clock()
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    read = _clock()
    return {"phases": {"total": [returned[0] - began[0], returned[1] - began[1]],
                       "read": [read[0] - began[0], read[1] - began[1]], "imports": imports},
            "params": sum(p.numel() for p in model.parameters())}  # fmt: skip


# ---------------------------------------------------------------- the orchestration (no torch here)


def _one(src: Path, kind: str, *args: str) -> dict[str, Any]:
    """This script with ``--one kind args`` in a process of its own, ``src`` first on its path."""
    env = {**BASE_ENV, "PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, "--one", kind, *args]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _make(folder: Path, quick: bool) -> dict[str, Any]:
    """The model folder, by ``benchmarks/pretrained.py``'s ``--one make``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from pretrained import FULL, QUICK  # (the same model as the other pretrained benchmark)

    env = {**BASE_ENV, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "pretrained.py"), "--one", "make", str(folder),
           json.dumps(QUICK if quick else FULL)]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def _source(rev: str, into: Path) -> Path:
    """The ``src`` folder of git revision ``rev``, extracted into ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def measure(folder: Path, trees: dict[str, Path], rounds: int) -> list[dict[str, Any]]:
    text = folder / "text.txt"
    found = []
    for r in range(rounds):
        order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
        row: dict[str, Any] = {"round": r, "order": list(order)}
        for kind in order:
            if kind == "from_pretrained":
                row[kind] = _one(trees["after"], "hf", str(folder))
            else:
                row[kind] = _one(trees[kind], "gpipe", str(folder), str(text))
            wall, cpu = row[kind]["phases"]["total"]
            print(f"round {r} {kind:>15}: {wall:.2f} s ({cpu:.2f} s CPU)", flush=True)
        found.append(row)
    return found


# ---------------------------------------------------------------- the report


def _median(rows: list[dict[str, Any]], kind: str, phase: str, which: int = 0) -> float:
    return statistics.median(r[kind]["phases"][phase][which] for r in rows if phase in r[kind]["phases"])


def _ratio(rows: list[dict[str, Any]], kind: str, which: int = 0) -> list[float]:
    return [r[kind]["phases"]["total"][which] / r["from_pretrained"]["phases"]["total"][which] for r in rows]


def report(results: dict[str, Any], out: Path) -> str:
    rows = results["rounds"]
    model = results["model"]
    lines: list[str] = [
        "# Loading a pretrained folder: gpipe before and after, against from_pretrained",
        "",
        f"Reproduce: `{results['command']}` ({results['wall_minutes']:.1f} min). Machine: {results['machine']}. "
        f"After: git {results['commit']}; before: git {results['before']}. Load average (1 min) "
        f"{results['load_average']['start']:.1f} at the start, {results['load_average']['end']:.1f} at the end.",
        "",
        f"Model: Llama, {model['params'] / 1e6:.1f}M parameters ({model['config']}), saved in {model['dtype']} in "
        f"{model['shards']} shards ({model['bytes'] / 2**20:,.0f} MiB). {len(rows)} rounds, each a fresh process "
        "of each kind, the order rotating.",
        "",
        "## Load time (s; median of the rounds: wall, and the process's CPU time in brackets)",
        "",
        "| load | total | / from_pretrained, per round: wall [CPU] | first imports | build | plan | trace | balance "
        "| materialize |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("before", "after"):
        wall, cpu = _ratio(rows, kind), _ratio(rows, kind, 1)
        cells = [
            f"{_median(rows, kind, p):.2f} [{_median(rows, kind, p, 1):.2f}]"
            for p in ("imports", "build", "plan", "trace", "balance", "materialize")
        ]
        lines.append(
            f"| gpipe {kind} | **{_median(rows, kind, 'total'):.2f}** [{_median(rows, kind, 'total', 1):.2f}] "
            f"| **{statistics.median(wall):.2f}x** [{statistics.median(cpu):.2f}x] "
            f"({', '.join(f'{w:.2f} [{c:.2f}]' for w, c in zip(wall, cpu))}) | {' | '.join(cells)} |"
        )
    lines += [
        f"| from_pretrained(dtype=float32) as it returns | **{_median(rows, 'from_pretrained', 'total'):.2f}** "
        f"[{_median(rows, 'from_pretrained', 'total', 1):.2f}] | 1 "
        f"| {_median(rows, 'from_pretrained', 'imports'):.2f} [{_median(rows, 'from_pretrained', 'imports', 1):.2f}] "
        "| | | | | |",
        f"| from_pretrained, then every parameter read once | {_median(rows, 'from_pretrained', 'read'):.2f} "
        f"[{_median(rows, 'from_pretrained', 'read', 1):.2f}] | | | | | | | |",
        "",
        "After over before, per round (wall): "
        + ", ".join(f"{r['after']['phases']['total'][0] / r['before']['phases']['total'][0]:.2f}" for r in rows)
        + ". Target: gpipe's load at most 2x from_pretrained's.",
        "",
        "## The same model",
        "",
        "SHA-256 (16 hex digits) of the loaded parameters, of the logits on an evaluation batch (eval mode), and "
        "of a training step's loss and gradients (`Pipeline.step` on the first training batch, the next tokens' "
        "cross-entropy); one row per distinct result over the rounds.",
        "",
        "| tree | balance | parameters | weights | logits | step loss | loss and gradients |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in ("before", "after"):
        seen = {(tuple(r[kind]["balance"]), r[kind]["params"], r[kind]["weights"], r[kind]["logits"],
                 r[kind]["loss"], r[kind]["step"]) for r in rows}  # fmt: skip
        for balance, params, weights, logits, loss, step in sorted(seen):
            lines.append(f"| {kind} | {list(balance)} | {params:,} | `{weights}` | `{logits}` | {loss!r} | `{step}` |")
    lines.append("")
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the git revision whose src is the before tree")
    parser.add_argument("--out", help="where results.json and report.md go (default runs/pretrained_load)")
    parser.add_argument("--quick", action="store_true", help="a small Llama (8 layers, hidden 256)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of one process of each kind (default 5)")
    if sys.argv[1:2] == ["--one"]:  # in a measured process
        kind, *rest = sys.argv[2:]
        found = _load_gpipe(Path(rest[0]), Path(rest[1])) if kind == "gpipe" else _load_hf(Path(rest[0]))
        print(json.dumps(found))
        return 0
    args = parser.parse_args()
    out = Path(args.out or "runs/pretrained_load")
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="gpipe-pretrained-load-"))
    try:
        trees = {"after": ROOT / "src", "before": _source(args.before, scratch / "before")}
        folder = scratch / "llama"
        model = _make(folder, args.quick)
        print(f"model: {model['params'] / 1e6:.1f}M parameters, {model['shards']} shards", flush=True)
        rounds = measure(folder, trees, args.rounds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    versions = subprocess.run(
        [sys.executable, "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"],
        env=BASE_ENV, capture_output=True, text=True, timeout=120,
    ).stdout.split()  # fmt: skip
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True).stdout
    results = {
        "command": ".venv/bin/python benchmarks/pretrained_load.py --before " + args.before
        + (" --quick" if args.quick else "") + f" --out {out}",
        "machine": f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, torch {versions[0]}, "
        f"transformers {versions[1]}",
        "commit": commit.strip() + (" with src/ edits in the working tree" if dirty.strip() else ""),
        "before": args.before,
        "load_average": {"start": load_before, "end": os.getloadavg()[0]},
        "wall_minutes": (time.perf_counter() - began) / 60,
        "model": model,
        "rounds": rounds,
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(report(results, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
