"""Fine-tuning a pretrained folder with ``gpipe train --model hf --init DIR``: the memory of one
process holding every stage against the largest rank of ``torchrun`` (one process per stage), the
time to load the weights against ``from_pretrained``, and LoRA against full fine-tuning.

Reproduce (from the repository root; about 15 min here, everything in a scratch folder under /tmp,
deleted at the end)::

    .venv/bin/python benchmarks/pretrained.py --out benchmarks/results/pretrained
    .venv/bin/python benchmarks/pretrained.py --quick      # a small Llama (2 min); runs/pretrained
    .venv/bin/python benchmarks/pretrained.py --only lora --out benchmarks/results/pretrained  # one section again

The model: a Llama (``LlamaConfig``: hidden 1024, intermediate 2048, 24 layers, 16 heads, vocabulary
32000, 128 positions, untied embeddings; 317M parameters) with seeded random weights, written by
``save_pretrained`` in **float32** (the larger case for memory: 4 bytes a parameter on disk, as in
training) in shards of at most 200 MB, with a BPE ``tokenizer.json`` trained on a generated text file
(2000 lines of 6-30 made-up words; ids 0-3 are ``<pad> <s> </s> <unk>``, gpipe pads with 0) and that
text file (every document at most 33 tokens with BOS and EOS: sequences of 32 tokens).

Every measured process is a process of its own, started by this script (which imports neither torch
nor gpipe itself). Peak RSS is the process's ``VmHWM`` (not ``ru_maxrss``: Linux floors a child's
``ru_maxrss`` at its parent's resident memory when it starts it), read by the process itself; under
torchrun by each rank. Inside each training process a small driver runs ``gpipe.train.main`` and
marks its phases (the high-water mark read, then reset with ``/proc/self/clear_refs``): *setup*
(imports, data, the model on the meta device, traced), *load* (``Pipeline(...)``: each stage
materializes its layers, reading their tensors from the safetensors files), *step* (optimizer, the
step, the evaluation at the last step, metrics) and *checkpoint* (the final checkpoint every run
writes, the curves); a thread samples ``RssAnon`` and ``RssFile`` (mapped files: the safetensors
pages, shared libraries) every 20 ms.

1. *Training*, one step each (``--steps 1 --batch 4 --chunks 4 --optimizer adafactor --eval-batches 1``,
   ``--eval-every`` and ``--checkpoint-every`` 1000, ``--no-progress --tensorboard off``), with
   ``--init DIR`` and with random weights (``--hf-config DIR/config.json --tokenizer DIR``), each in
   one process (``gpipe train --partitions 4``: four stages as threads) and under
   ``torchrun --standalone --nproc-per-node 4 ... --partitions 4`` (a rank per stage): peak RSS of the
   process and of every rank, the largest rank's over the one process's (target ≤ 0.45), wall time.
2. *Load time*: in a fresh process, after the imports, ``make_model`` and ``Pipeline(layers,
   balance_by_flops(4, ...), devices=['cpu'] * 4, chunks=4)`` (what ``gpipe train --init`` does to
   build the pipeline; ``make_data``, the text's tokenization, is left out) against
   ``AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32)``; ``--repeats`` processes of
   each taking turns, the median; the files are in the page cache (just written). Also each
   process's peak RSS.
3. *LoRA* (when ``gpipe train -h`` has ``--lora``): one process, ``--partitions 4 --init DIR``, 3 steps,
   ``--lora 8`` against full fine-tuning: the median step time of steps 2-3 (``tokens / tokens_per_s``
   of ``metrics.jsonl``: the step and the optimizer, without the evaluation), peak RSS, trainable
   parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3: gpipe pads with 0
FULL = {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
        "vocab_size": 32000}  # fmt: skip
QUICK = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
         "vocab_size": 4000}  # fmt: skip
TIMEOUT = 900  # seconds, any one process
MIB = 2**20


# ---------------------------------------------------------------- in the measured processes


def _status() -> dict[str, int]:
    """/proc/self/status's memory lines, in bytes."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.startswith(("Vm", "Rss")):
                found[key] = int(value.split()[0]) * 1024
    return found


class Phases:
    """A process's phases: at each mark, the peak RSS since the last (``VmHWM``, then reset to what
    is resident), the largest ``RssAnon`` and ``RssFile`` sampled every 20 ms, and the time."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.anon = self.file = 0
        self.resets = self._reset()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    @staticmethod
    def _reset() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # (Linux: the high-water mark to the resident memory)
        except OSError:
            return False
        return True

    def _sample(self) -> None:
        while not self.stop.wait(0.02):
            now = _status()
            with self.lock:
                self.anon = max(self.anon, now.get("RssAnon", 0))
                self.file = max(self.file, now.get("RssFile", 0))

    def mark(self, name: str, **extra: Any) -> None:
        now = _status()
        with self.lock:
            anon, file = now.get("RssAnon", 0), now.get("RssFile", 0)
            row = {"phase": name, "t": time.perf_counter() - self.began, "peak": now["VmHWM"], "rss": now["VmRSS"],
                   "anon_peak": max(self.anon, anon), "file_peak": max(self.file, file), "anon": anon, "file": file,
                   **extra}  # fmt: skip
            self.rows.append(row)
            self._reset()
            self.anon = self.file = 0

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _train_driver(report: Path, argv: list[str]) -> int:
    """``gpipe train argv`` in this process (a rank under torchrun), its phases written to
    ``report/rank-RANK.json``."""
    phases = Phases()
    import torch

    import gpipe.models.pretrained as pretrained
    import gpipe.train.checkpoints as checkpoints
    import gpipe.train.loop as loop
    from gpipe.train import main

    built = loop.Pipeline
    saving = checkpoints.Checkpoints.save
    reading = pretrained.Source.read
    state: dict[str, Any] = {"read": 0, "files": set()}

    def read(self: Any, wanted: Any) -> Any:  # what this process reads of the folder
        for name, tensor in reading(self, wanted):
            state["read"] += tensor.numel() * tensor.element_size()
            state["files"].add(self.files[self.names[name]].name)
            yield name, tensor

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        phases.mark("setup")
        pipe = built(*args, **kwargs)
        params = list(pipe.parameters())
        size = sum(p.numel() * p.element_size() for p in params)
        phases.mark("load", params=sum(p.numel() for p in params), bytes=size, read=state["read"],
                    files=len(state["files"]))  # fmt: skip
        return pipe

    def save(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not state.get("saved"):  # (--checkpoint-every is large: the first save is the final one)
            state["saved"] = True
            trainable = (
                sum(p.numel() for p in self.pipe.parameters() if p.requires_grad) if hasattr(self, "pipe") else None
            )
            phases.mark("step", trainable=trainable)
        return saving(self, *args, **kwargs)

    loop.Pipeline = pipeline  # type: ignore[misc]
    checkpoints.Checkpoints.save = save  # type: ignore[method-assign]
    pretrained.Source.read = read  # type: ignore[method-assign]
    try:
        code = main(argv)
    finally:
        phases.mark("checkpoint")
        phases.close()
        rank = int(os.environ.get("RANK", "0"))
        result = {"rank": rank, "resets": phases.resets, "threads": torch.get_num_threads(), "phases": phases.rows}
        (report / f"rank-{rank}.json").write_text(json.dumps(result))
    return code


def _load_gpipe(folder: Path, text: Path) -> dict[str, Any]:
    """What ``gpipe train --init folder --partitions 4`` does to build its pipeline, timed."""
    import torch

    from gpipe.balance import balance_by_flops
    from gpipe.pipeline import Pipeline
    from gpipe.train import TrainConfig
    from gpipe.train.setup import make_data, make_model

    scratch = tempfile.mkdtemp(prefix="gpipe-pretrained-load-")
    try:
        cfg = TrainConfig(model="hf", init=str(folder), data=str(text), partitions=4, batch=4, chunks=4, out=scratch)
        cfg.check()
        data = make_data(cfg)
        before = _status()["VmHWM"]
        phases = Phases()
        began = time.perf_counter()
        layers = make_model(cfg, data)
        meta = time.perf_counter()
        sample = data.batch(cfg.batch, 0, split="eval").inputs
        pipe = Pipeline(layers, balance_by_flops(4, layers, sample, chunks=4), chunks=4, devices=["cpu"] * 4,
                        cpu_threads=1)  # fmt: skip
        done = time.perf_counter()
        phases.mark("load")
        phases.close()
        params = sum(p.numel() for p in pipe.parameters())
        assert all(p.device.type == "cpu" for p in pipe.parameters())
        del torch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"seconds": done - began, "meta_seconds": meta - began, "materialize_seconds": done - meta,
            "params": params, "peak": max(before, phases.rows[0]["peak"]), "phases": phases.rows}  # fmt: skip


def _load_hf(folder: Path) -> dict[str, Any]:
    """``from_pretrained(folder)`` in float32, timed (after the imports)."""
    import torch
    import transformers

    before = _status()["VmHWM"]
    phases = Phases()
    began = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    done = time.perf_counter()
    phases.mark("load")
    with torch.no_grad():  # every parameter read once: the pages of the files a lazy load left unread
        for p in model.parameters():
            p.sum()
    read = time.perf_counter()
    phases.mark("read")
    phases.close()
    mapped = _mapped_files()
    in_files = sum(p.numel() for p in model.parameters() if any(a <= p.data_ptr() < b for a, b in mapped))
    return {"seconds": done - began, "read_seconds": read - began, "params": sum(p.numel() for p in model.parameters()),
            "params_in_files": in_files, "peak_load": max(before, phases.rows[0]["peak"]),
            "peak": max(before, *(r["peak"] for r in phases.rows)), "phases": phases.rows}  # fmt: skip


def _mapped_files() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of .safetensors files."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5].endswith(".safetensors"):
            start, end = parts[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _make_folder(folder: Path, sizes: dict[str, int]) -> dict[str, Any]:
    """The Llama, its tokenizer and the text file, in ``folder``."""
    import tokenizers
    import torch
    import transformers

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    letters = "bdfgklmnprstvz"
    vowels = "aeiou"
    words = sorted(
        {"".join(rng.choice(letters) + rng.choice(vowels) for _ in range(rng.randint(1, 3))) for _ in range(600)}
    )
    text = folder / "text.txt"
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 30))) + "." for _ in range(2000)]
    text.write_text("\n".join(lines) + "\n")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train(
        [str(text)], tokenizers.trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIALS, show_progress=False)
    )
    tok.save(str(folder / "tokenizer.json"))
    ends = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(ends))
    longest = max(len(e.ids) for e in tok.encode_batch(lines)) + 2  # (BOS and EOS)
    heads = sizes["num_attention_heads"]
    config = transformers.LlamaConfig(**sizes, num_key_value_heads=heads, max_position_embeddings=128,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    began = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size="200MB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    return {"params": params, "tokenizer_size": tok.get_vocab_size(), "longest_document": longest,
            "shards": len(shards), "bytes": sum((folder / s).stat().st_size for s in shards), "dtype": "float32",
            "config": sizes, "seconds": time.perf_counter() - began}  # fmt: skip


# ---------------------------------------------------------------- the orchestration (no torch here)


def _one(kind: str, *args: str) -> dict[str, Any]:
    """This script with ``--one kind args`` in a process of its own; its last stdout line, JSON."""
    cmd = [sys.executable, __file__, "--one", kind, *args]
    done = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _train(argv: list[str], run: Path, *, ranks: int) -> dict[str, Any]:
    """:func:`_train_once`, tried a second time if it fails (the failure's log kept in the result)."""
    try:
        return _train_once(argv, run, ranks=ranks)
    except RuntimeError as exc:
        print(f"failed; trying once more: {str(exc)[-2000:]}", flush=True)
        return {**_train_once(argv, run, ranks=ranks), "failed_first": str(exc)[-6000:]}


def _train_once(argv: list[str], run: Path, *, ranks: int) -> dict[str, Any]:
    """``gpipe train argv --out run`` through the driver, in one process (``ranks`` 0) or under
    torchrun with ``ranks`` processes: wall time, every rank's phases, metrics.jsonl."""
    shutil.rmtree(run, ignore_errors=True)
    report = run.parent / f"{run.name}.report"
    shutil.rmtree(report, ignore_errors=True)
    report.mkdir(parents=True)
    driver = [__file__, "--one", "train", str(report), "--", *argv, "--out", str(run)]
    if ranks:
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks), *driver]
    else:
        cmd = [sys.executable, *driver]
    log = run.parent / f"{run.name}.log"
    began = time.perf_counter()
    with open(log, "w") as output:
        proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # (this run's processes only: its own session)
            proc.wait()
            raise RuntimeError(f"{' '.join(cmd)} ran past {TIMEOUT} s:\n{log.read_text()[-4000:]}") from None
    wall = time.perf_counter() - began
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{log.read_text()[-12000:]}")
    rows = [json.loads(p.read_text()) for p in sorted(report.glob("rank-*.json"))]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    checkpoint = sum(p.stat().st_size for p in (run / "checkpoints").rglob("*") if p.is_file())
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(report, ignore_errors=True)
    for row in rows:
        row["peak"] = max(p["peak"] for p in row["phases"])
    rows.sort(key=lambda r: r["rank"])
    return {"command": " ".join(["torchrun ... -m gpipe train" if ranks else "gpipe train", *argv]), "wall": wall,
            "ranks": rows, "metrics": metrics, "checkpoint_bytes": checkpoint}  # fmt: skip


def _has_lora() -> bool:
    done = subprocess.run([str(BIN / "gpipe"), "train", "-h"], env=ENV, capture_output=True, text=True, timeout=120)
    return "--lora " in done.stdout


def _step_seconds(metrics: list[dict[str, Any]]) -> list[float]:
    return [row["tokens"] / row["tokens_per_s"] for row in metrics if "tokens_per_s" in row]


def measure(sections: list[str], folder: Path, scratch: Path, repeats: int, results: dict[str, Any]) -> None:
    text = folder / "text.txt"
    common = ["--model", "hf", "--data", str(text), "--partitions", "4", "--batch", "4", "--chunks", "4",
              "--optimizer", "adafactor", "--eval-every", "1000", "--eval-batches", "1", "--checkpoint-every", "1000",
              "--no-progress", "--tensorboard", "off"]  # fmt: skip
    weights = {"pretrained": ["--init", str(folder)],
               "random": ["--hf-config", str(folder / "config.json"), "--tokenizer", str(folder)]}  # fmt: skip
    if "train" in sections:
        train: dict[str, Any] = {}
        for name, given in weights.items():
            for layout, ranks in (("one process", 0), ("torchrun 4 ranks", 4)):
                found = _train([*common, *given, "--steps", "1"], scratch / f"{name}-{ranks}", ranks=ranks)
                train.setdefault(name, {})[layout] = found
                peaks = ", ".join(f"{r['peak'] / MIB:.0f}" for r in found["ranks"])
                print(f"train {name:>10} {layout:>16}: peak RSS {peaks} MiB, wall {found['wall']:.1f} s", flush=True)
        results["train"] = train
    if "load" in sections:
        load: dict[str, list[dict[str, Any]]] = {"gpipe": [], "from_pretrained": []}
        for r in range(repeats):
            for name in ("gpipe", "from_pretrained") if r % 2 == 0 else ("from_pretrained", "gpipe"):
                args = [str(folder), str(text)] if name == "gpipe" else [str(folder)]
                found = _one("load-gpipe" if name == "gpipe" else "load-hf", *args)
                load[name].append(found)
                print(f"load {name:>15}: {found['seconds']:.2f} s, peak RSS {found['peak'] / MIB:.0f} MiB", flush=True)
        results["load"] = load
    if "lora" in sections:
        if not _has_lora():
            results["lora"] = {"missing": "gpipe train -h has no --lora"}
            print("lora: gpipe train -h has no --lora; left out", flush=True)
        else:
            lora: dict[str, Any] = {}
            for name, extra in (("full", []), ("lora 8", ["--lora", "8"])):
                found = _train([*common, *weights["pretrained"], "--steps", "3", *extra], scratch / "lora", ranks=0)
                lora[name] = found
                steps = _step_seconds(found["metrics"])
                print(f"lora {name:>7}: steps {', '.join(f'{s:.2f}' for s in steps)} s, peak RSS "
                      f"{found['ranks'][0]['peak'] / MIB:.0f} MiB", flush=True)  # fmt: skip
            results["lora"] = lora


# ---------------------------------------------------------------- the report


def _mib(x: float) -> str:
    return f"{x / MIB:,.0f}"


def _phase(row: dict[str, Any], name: str) -> dict[str, Any]:
    return next((p for p in row["phases"] if p["phase"] == name), {})


def report(results: dict[str, Any], out: Path) -> str:
    model = results["model"]
    lines = [
        "# Fine-tuning a pretrained folder: memory per process, load time, LoRA",
        "",
        f"Reproduce: `{results['command']}` ({results['wall_minutes']:.1f} min). Machine: {results['machine']}. "
        f"Git {results['commit']}. Load average (1 min) {results['load_average']['start']:.1f} at the start, "
        f"{results['load_average']['end']:.1f} at the end.",
        "",
        f"Model: Llama, {model['params'] / 1e6:.1f}M parameters ({model['config']}), saved in {model['dtype']} in "
        f"{model['shards']} shards of at most 200 MB ({model['bytes'] / MIB:,.0f} MiB); tokenizer of "
        f"{model['tokenizer_size']} tokens; sequences of {model['longest_document'] - 1} tokens.",
        "",
    ]
    train = results.get("train")
    if train:
        lines += [
            "## Peak RSS of one training step (MiB)",
            "",
            "One step, `--batch 4 --chunks 4 --optimizer adafactor --partitions 4`, the evaluation at the last step "
            "and the final checkpoint included. Per phase: the peak within it (setup: imports, data, meta model and "
            "tracing; load: the pipeline's materialization; step: the step, the evaluation; checkpoint: the final "
            "checkpoint's write, the curves). *Read*: the bytes of the tensors the process read from the folder "
            "(`Source.read`), against its stage's parameters in float32. *Mapped*: the largest `RssFile` sampled "
            "every 20 ms while the pipeline is built, less `RssFile` before it (safetensors pages).",
            "",
            "| weights | layout | rank | stage parameters | read (MiB) | mapped | peak RSS | setup | load | step "
            "| checkpoint | load (s) | wall (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, layouts in train.items():
            for layout, found in layouts.items():
                for row in found["ranks"]:
                    load = _phase(row, "load")
                    setup = _phase(row, "setup")
                    cells = [_mib(_phase(row, p).get("peak", 0)) for p in ("setup", "load", "step", "checkpoint")]
                    rank = "all 4 stages" if layout == "one process" else str(row["rank"])
                    mapped = load.get("file_peak", 0) - setup.get("file", 0)
                    read = f"{_mib(load['read'])} of {_mib(load['bytes'])}" if load.get("read") else "-"
                    lines.append(
                        f"| {name} | {layout} | {rank} | {load.get('params', 0) / 1e6:.1f}M | {read} | {_mib(mapped)} "
                        f"| **{_mib(row['peak'])}** | {' | '.join(cells)} | {load['t'] - setup['t']:.1f} "
                        f"| {found['wall']:.1f} |"
                    )
        lines += ["", "| weights | one process (MiB) | largest rank (MiB) | ratio | target |", "|---|---|---|---|---|"]
        for name, layouts in train.items():
            one = layouts["one process"]["ranks"][0]["peak"]
            largest = max(r["peak"] for r in layouts["torchrun 4 ranks"]["ranks"])
            lines.append(f"| {name} | {_mib(one)} | {_mib(largest)} | **{largest / one:.2f}** | ≤ 0.45 |")
        lines.append("")
    load = results.get("load")
    if load:
        gp, hf = load["gpipe"], load["from_pretrained"]

        def median(runs: list[dict[str, Any]], key: str) -> float:
            return statistics.median(r[key] for r in runs)

        def every(runs: list[dict[str, Any]], key: str) -> str:
            return ", ".join(f"{r[key]:.2f}" for r in runs)

        lines += [
            "## Load time (s, median of the processes; files in the page cache)",
            "",
            "| load | median (s) | all (s) | peak RSS of the process (MiB) |",
            "|---|---|---|---|",
            f"| gpipe: make_model + Pipeline(devices=['cpu'] * 4) (weights copied into float32 tensors) "
            f"| **{median(gp, 'seconds'):.2f}** | {every(gp, 'seconds')} | {_mib(median(gp, 'peak'))} |",
            f"| from_pretrained(dtype=float32) as it returns | **{median(hf, 'seconds'):.2f}** "
            f"| {every(hf, 'seconds')} | {_mib(median(hf, 'peak_load'))} |",
            f"| from_pretrained, then every parameter read once | **{median(hf, 'read_seconds'):.2f}** "
            f"| {every(hf, 'read_seconds')} | {_mib(median(hf, 'peak'))} |",
            "",
            "gpipe's load splits into the model on the meta device and its tracing "
            f"({median(gp, 'meta_seconds'):.2f} s) and the materialization that reads the tensors "
            f"({median(gp, 'materialize_seconds'):.2f} s). "
            f"from_pretrained of float32 files into float32 returns {hf[0]['params_in_files'] / 1e6:.1f}M of its "
            f"{hf[0]['params'] / 1e6:.1f}M parameters as views of its memory-mapped safetensors files, whose pages "
            f"are read when first touched (RssFile {_mib(_phase(hf[0], 'load').get('file', 0))} MiB as it returns, "
            f"{_mib(_phase(hf[0], 'read').get('file', 0))} after the read).",
            "",
        ]
    lora = results.get("lora")
    if lora:
        lines += ["## LoRA against full fine-tuning (one process, --partitions 4, --init, 3 steps)", ""]
        if "missing" in lora:
            lines += [f"Left out: {lora['missing']}.", ""]
        else:
            lines += [
                "| training | trainable parameters | step time, median of steps 2-3 (s) | steps (s) | peak RSS (MiB) |",
                "|---|---|---|---|---|",
            ]
            for name, found in lora.items():
                steps = _step_seconds(found["metrics"])
                row = found["ranks"][0]
                trainable = _phase(row, "step").get("trainable")
                lines.append(
                    f"| {name} | {trainable / 1e6 if trainable else float('nan'):.2f}M | "
                    f"**{statistics.median(steps[1:]):.2f}** | "
                    f"{', '.join(f'{s:.2f}' for s in steps)} | {_mib(row['peak'])} |"
                )
            lines.append("")
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="where results.json and report.md go (default runs/pretrained)")
    parser.add_argument("--quick", action="store_true", help="a small Llama (8 layers, hidden 256)")
    parser.add_argument("--repeats", type=int, default=3, help="processes of each load (default 3)")
    parser.add_argument("--only", default="", help="comma-separated sections to rerun into OUT/results.json: "
                        "train, load, lora (default: all)")  # fmt: skip
    if sys.argv[1:2] == ["--one"]:  # in a measured process
        kind, *rest = sys.argv[2:]
        if kind == "train":
            report_dir, _, *argv = rest  # (report, "--", gpipe train's arguments)
            return _train_driver(Path(report_dir), argv)
        if kind == "make":
            found = _make_folder(Path(rest[0]), json.loads(rest[1]))
        elif kind == "load-gpipe":
            found = _load_gpipe(Path(rest[0]), Path(rest[1]))
        else:
            found = _load_hf(Path(rest[0]))
        print(json.dumps(found))
        return 0
    args = parser.parse_args()
    out = Path(args.out or "runs/pretrained")
    out.mkdir(parents=True, exist_ok=True)
    sections = [s.strip() for s in args.only.split(",") if s.strip()] or ["train", "load", "lora"]
    results: dict[str, Any] = {}
    if args.only and (out / "results.json").is_file():
        results = json.loads((out / "results.json").read_text())
    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="gpipe-pretrained-"))
    try:
        folder = scratch / "llama"
        model = _one("make", str(folder), json.dumps(QUICK if args.quick else FULL))
        print(f"model: {model['params'] / 1e6:.1f}M parameters, {model['shards']} shards, {model['bytes'] / MIB:,.0f} "
              f"MiB, tokenizer {model['tokenizer_size']}, longest document {model['longest_document']} tokens "
              f"({model['seconds']:.0f} s)", flush=True)  # fmt: skip
        results["model"] = model
        measure(sections, folder, scratch, args.repeats, results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    torch_version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], env=ENV,
                                   capture_output=True, text=True, timeout=120).stdout.strip()  # fmt: skip
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True).stdout
    results["command"] = "  ".join(
        [".venv/bin/python benchmarks/pretrained.py" + (" --quick" if args.quick else "") + f" --out {out}"]
    )
    results["machine"] = f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, torch {torch_version}"
    results["commit"] = commit.strip() + (" with src/ edits in the working tree" if dirty.strip() else "")
    results["load_average"] = {"start": load_before, "end": os.getloadavg()[0]}  # (1 min: other work on the machine)
    minutes = (time.perf_counter() - began) / 60
    results["wall_minutes"] = results.get("wall_minutes", 0) + minutes if args.only else minutes
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(report(results, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
