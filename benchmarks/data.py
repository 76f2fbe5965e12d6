"""Data at scale: ``gpipe prepare``'s memory-mapped corpora and streamed image folders against the
in-memory data sets they replace, side by side in one run.

Reproduce (from the repository root; ≈ 10 min here, corpora and images in a scratch folder)::

    .venv/bin/python benchmarks/data.py --commit HEAD --out benchmarks/results/data
    .venv/bin/python benchmarks/data.py --quick     # 10k / 100k sentence pairs, 200 / 2k images; runs/data

``--commit REV`` measures the gpipe of that commit (its ``src/`` exported with ``git archive``), so that
unfinished edits in the working tree cannot break or bias a run; without it, the working tree's.

What it does, in order (every training run a process of its own, started and timed by this script):

1. *Corpora*: a seeded synthetic corpus of 4 language pairs (en-de, en-fr, en-es, en-it: 60/25/10/5 %
   of the sentence pairs), sentences of 2-60 words drawn uniformly, words drawn Zipf-like (p ∝ 1/rank)
   from 4000 made-up words, the target's length the source's ± up to 20 %; written as ``xx-yy.tsv`` at
   N and 10N sentence pairs (N = 100k; ``--quick``: 10k). One vocabulary for every run: the small
   corpus is prepared first, its vocabulary trained (``--vocab-size 0``: as many pieces as the text
   supports, up to 8000; 4000 words make about 4000), and its ``vocab.model`` is given as ``--vocab``
   to every other prepare and to the in-memory path.
2. *Prepare*: ``gpipe prepare`` of the large corpus with ``--workers 1`` and with ``--workers 2``
   (sentence pairs per second: the manifest's ``seconds``, and the command's wall time), checked to
   write the same bytes; the disk its ``.tok``/``.off``/``.len`` take per token and per sentence pair.
   The in-memory ``ParallelCorpus`` and the prepared corpus are checked to give the same batches.
3. *Time to 3 steps and peak memory*, at N and 10N: *before*, the in-memory path (``gpipe train`` on
   the raw folder with ``gpipe.train.loop.make_data`` replaced by one building
   ``gpipe.data.ParallelCorpus(raw, Vocab(vocab.model), ...)``: every sentence read and encoded into
   Python lists), against *now*, ``gpipe train --data PREPARED``; both with ``--partitions 2 --batch 64
   --max-length 96`` and the default small transformer (2 + 2 layers, dim 64), ``--repeats`` runs of
   each taking turns, run r with ``--seed r`` (other batches, other held-out sentences: the shapes of a
   few steps move a step's peak memory by tens of MiB, so one seed would tie a size to its batches).
   Time: from the start of the process to the moment step 3's line appears in ``metrics.jsonl``; the
   process is then killed (``SIGKILL``: no evaluation or checkpoint after it).
   Peak RSS: its ``VmHWM`` then (not ``ru_maxrss`` of ``getrusage`` or ``wait4``: Linux carries the
   parent's resident memory at the child's start into the child's ``ru_maxrss``); also the largest
   ``RssAnon`` sampled every 10 ms (the process's own memory: no shared libraries, no mapped files),
   and *the data set alone*: a process that builds only the data set and draws its baseline and 3
   batches: its peak growth over the imports, and what of it is still anonymous or file-backed
   (mapped pages of the corpus) at the end. The files are in the page cache (just written). A line
   a + b·N through the two sizes projects each to 100M sentence pairs.
4. *Token batches*: ``gpipe train --data PREPARED(10N) --batch-tokens 4096`` against ``--batch 64``,
   20 steps each: the mean ``padding`` of metrics.jsonl, and the median real (target) tokens per
   second (``tokens_per_s``) of steps 3-20.
5. *The loader against training*: ``PreparedCorpus.token_batch(4096, step)`` and ``.batch(64, step)``
   over 200 steps in one thread: target tokens made per second, against training's tokens per second
   (4.); ``ImageFiles(folder, size=64).batch(32, step)`` images per second against AmoebaNet's
   training images per second (6.). And a step on real data against the same step with its batch in
   memory: the same run (``--batch-tokens 4096``, 24 steps) twice, once reading the prepared corpus,
   once with the loop's batches all made before its first step (the very same batches: same shapes,
   same tokens, same losses), ``--pairs`` pairs of runs taking turns; each step's period is the time
   between the training loop's requests for consecutive batches (so a step that waits for its batch
   shows), the ratio real / in memory of the medians over steps 3-24; the same for AmoebaNet on the
   larger image folder (12 steps). Other processes' share of the machine is measured during each run
   (``/proc/stat`` less this run's CPU time, as benchmarks/decode.py); *quiet* pairs: under 10 %.
6. *Images*: folders of M and 10M PNG images of 64x64 pixels (M = 2000; ``--quick``: 200), 10 class
   sub-folders, seeded class patterns with noise; ``gpipe train --model amoebanet --data FOLDER
   --image-size 64 --batch 32 --layers 2 --filters 8`` to step 3 (run r with ``--seed r``): time and
   peak RSS as in 3., *now* (``ImageFiles``
   decodes a batch's files when it needs them) against *before* (``ImageFiles`` of commit ``f0e8ca5``,
   read with ``git show``, which decoded every image into memory at the start).

Targets (10x the data): peak RSS ≤ 1.15x and time to 3 steps ≤ 1.5x for the prepared corpus (before:
3.7x / 5.1x), disk ≤ 2 bytes a token + 12 bytes a sentence pair, padding ≤ 0.15 with --batch-tokens,
the loader ≥ 10x training's rate, a step on real data ≤ 1.05x one on data in memory, image RSS
10M/M ≤ 1.15x (before: 5.4x)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAIRS = {"en-de": 0.60, "en-fr": 0.25, "en-es": 0.10, "en-it": 0.05}
WORDS = 4000
MAX_LENGTH = 96  # --max-length: every synthetic sentence (at most 72 words) fits
TRAIN = ["--partitions", "2", "--max-length", str(MAX_LENGTH), "--eval-every", "1000", "--checkpoint-every", "1000",
         "--no-progress", "--tensorboard", "off", "--overwrite"]  # fmt: skip
IMAGE_TRAIN = ["--model", "amoebanet", "--image-size", "64", "--batch", "32", "--layers", "2", "--filters", "8",
               "--partitions", "2", "--eval-every", "1000", "--checkpoint-every", "1000", "--no-progress",
               "--tensorboard", "off", "--overwrite"]  # fmt: skip
QUIET = 0.1  # a pair of runs is quiet when other processes used less than this share of the machine in both
IMAGES_BEFORE = "f0e8ca5"  # the last commit whose ImageFiles read every image into memory
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}


def say(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------- synthetic data


def _words(rng: Any) -> list[str]:
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels] + [v + c for v in vowels for c in "lnrs"]
    found: dict[str, None] = {}
    while len(found) < WORDS:
        n = int(rng.integers(1, 5))
        found["".join(syllables[int(i)] for i in rng.integers(0, len(syllables), n))] = None
    return list(found)


def write_corpus(folder: Path, sentences: int, seed: int = 0) -> dict[str, Any]:
    """``sentences`` sentence pairs as PAIRS' .tsv files (seeded); returns their sizes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.asarray(_words(rng), dtype=object)
    weights = 1.0 / np.arange(1, WORDS + 1)
    cdf = np.cumsum(weights / weights.sum())
    folder.mkdir(parents=True, exist_ok=True)
    counts = {name: round(sentences * share) for name, share in PAIRS.items()}
    counts["en-de"] += sentences - sum(counts.values())
    for index, (name, count) in enumerate(counts.items()):
        prng = np.random.default_rng([seed, index])
        with open(folder / f"{name}.tsv", "w", encoding="utf-8") as f:
            for start in range(0, count, 100_000):
                n = min(100_000, count - start)
                source = prng.integers(2, 61, n)
                target = np.maximum(np.rint(source * prng.uniform(0.8, 1.2, n)), 1).astype(np.int64)
                flat = words[np.searchsorted(cdf, prng.random(int(source.sum() + target.sum())))].tolist()
                lines, at = [], 0
                for s, t in zip(source.tolist(), target.tolist()):
                    lines.append(" ".join(flat[at : at + s]) + "\t" + " ".join(flat[at + s : at + s + t]) + "\n")
                    at += s + t
                f.write("".join(lines))
    return {"sentences": sentences, "pairs": counts, "bytes": sum(p.stat().st_size for p in folder.glob("*.tsv"))}


def write_images(folder: Path, count: int, seed: int = 0, classes: int = 10, size: int = 64) -> dict[str, Any]:
    """``count`` PNG images in ``classes`` sub-folders: each class a smooth random pattern, each image
    it shifted, with noise (seeded)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    patterns = [
        np.asarray(Image.fromarray(grid).resize((size, size)), dtype=np.int16)
        for grid in rng.integers(0, 256, (classes, 8, 8, 3), dtype=np.uint8)
    ]
    for c in range(classes):
        (folder / f"class{c}").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        c = i % classes
        shift = rng.integers(-size // 8, size // 8 + 1, 2)
        pixels = np.roll(patterns[c], tuple(shift), axis=(0, 1)) + rng.normal(0, 16, (size, size, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"class{c}" / f"{i:06d}.png",
                                                                       compress_level=1)  # fmt: skip
    return {"images": count, "bytes": sum(p.stat().st_size for p in folder.rglob("*.png"))}


# ---------------------------------------------------------------- runs in processes of their own


def run_command(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` to its end (output to ``log``); its wall time in seconds."""
    began = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - began


def _metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def run_train(argv: list[str], out: Path, until: int, *, driver: str = "") -> dict[str, Any]:
    """``gpipe train argv --out out --steps until+1`` (``driver``: through this script's driver of that
    name) until step ``until``'s metrics line appears; then the process is killed. Returns the seconds
    from its start to that line, its peak RSS (bytes: ``VmHWM`` then, the high-water mark of its own
    memory, not ``ru_maxrss``, which Linux floors at this process's RSS when it starts the child), the
    largest anonymous RSS sampled, the share of the machine's CPUs other processes used meanwhile, and
    the metrics rows."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    args = [*argv, "--out", str(out), "--steps", str(until + 1)]
    if driver:
        cmd = [sys.executable, __file__, "--one", driver, "--", *args]
    else:
        cmd = [sys.executable, "-m", "gpipe", "train", *args]
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as output:
        busy, cpu, began = _machine_busy(), time.process_time(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        seconds, anon, status_now = None, 0, {}
        while True:
            anon = max(anon, _status(proc.pid).get("RssAnon", 0))
            rows = _metrics(metrics)
            if any(r.get("step", 0) >= until for r in rows):
                seconds = time.perf_counter() - began
                status_now = _status(proc.pid)
                break
            if proc.poll() is not None:
                break
            time.sleep(0.01)
        if seconds is None:
            raise RuntimeError(
                f"{' '.join(cmd)} ended ({proc.returncode}) before step {until}:\n{log.read_text()[-3000:]}"
            )
        os.killpg(proc.pid, signal.SIGKILL)  # (this run's process and any it started)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = status
        wall = time.perf_counter() - began
        others = _machine_busy() - busy - (time.process_time() - cpu) - (usage.ru_utime + usage.ru_stime)
    return {
        "seconds": seconds,
        "rss": status_now["VmHWM"],
        "anon_peak": anon,
        "others": max(others, 0.0) / (wall * (os.cpu_count() or 1)),
        **status_now,
        "metrics": _metrics(metrics),
    }


def _machine_busy() -> float:
    """Seconds the machine's CPUs were busy since boot (all processes; as benchmarks/decode.py)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _status(pid: int) -> dict[str, int]:
    """A process's resident memory now, by kind (bytes): anonymous (its own), file-backed (shared
    libraries, memory-mapped files: the page cache's pages it has mapped), and the high-water mark."""
    found = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                found[key] = int(value.split()[0]) * 1024
    return found


# ---------------------------------------------------------------- the driver (in a training process)


def _import_before_images() -> Any:
    source = subprocess.run(["git", "show", f"{IMAGES_BEFORE}:src/gpipe/data/images.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "images_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("images_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["images_before"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def driver(kind: str, argv: list[str]) -> int:
    """``gpipe train argv`` in this process, its data set replaced as ``kind`` says: ``before`` (the
    in-memory ParallelCorpus of the raw folder), ``images-before`` (ImageFiles of IMAGES_BEFORE),
    ``memory`` (the real data set; the loop's batches all made before its first step, in its thread, then
    handed out from memory), ``real`` (unchanged).
    Every kind writes, per step, when the loop asked for that step's batch to OUT/periods.jsonl."""
    import gpipe.train
    import gpipe.train.loop as loop
    from gpipe.data.loader import StepLoader

    make = loop.make_data
    cfg_holder: dict[str, Any] = {}

    def make_data(cfg: Any) -> Any:
        cfg_holder["cfg"] = cfg
        if kind == "before":
            from gpipe.data import ParallelCorpus
            from gpipe.data.vocab import Vocab

            return ParallelCorpus(cfg.data, Vocab(cfg.vocab), length=cfg.max_length, temperature=cfg.temperature,
                                  held_out=cfg.eval_sentences, seed=cfg.seed)  # fmt: skip
        if kind == "images-before":
            return _import_before_images().ImageFiles(cfg.data, size=cfg.image_size, seed=cfg.seed)
        return make(cfg)

    class Timed(StepLoader):
        def __iter__(self) -> Any:
            path = Path(cfg_holder["cfg"].out) / "periods.jsonl" if "cfg" in cfg_holder else None
            if kind == "memory":  # every batch made first, in this thread, by the loop's own function
                made = [(step, self.make(step)) for step in range(self.start, self.stop + 1)]
                batches = iter(made)
            else:
                batches = super().__iter__()
            for step, batch in batches:
                if path is not None:
                    with open(path, "a") as f:
                        f.write(json.dumps({"step": step, "asked": time.perf_counter()}) + "\n")
                yield step, batch

    loop.make_data = make_data
    loop.StepLoader = Timed  # type: ignore[misc]
    with contextlib.suppress(FileNotFoundError):
        (Path(argv[argv.index("--out") + 1]) / "periods.jsonl").unlink()
    return gpipe.train.main(argv)


# ---------------------------------------------------------------- measurements in this process


def dataset_memory(kind: str, path: str, vocab: str) -> dict[str, float]:
    """In this process (a fresh one): the resident memory the data set alone takes, built as gpipe train
    builds it, with its unigram baseline and 3 training batches drawn: the peak growth over what the
    imports took, and the seconds."""
    import torch  # noqa: F401  (imported first, as in training: not the data set's memory)

    from gpipe.data import ParallelCorpus
    from gpipe.data.prepared import PreparedCorpus
    from gpipe.data.vocab import Vocab

    with contextlib.suppress(OSError):  # the high-water mark reset to what is resident now (Linux: 5)
        Path("/proc/self/clear_refs").write_text("5")
    start = _status(os.getpid())
    before = start["VmRSS"]
    began = time.perf_counter()
    data: Any
    if kind == "before":
        data = ParallelCorpus(path, Vocab(vocab), length=MAX_LENGTH)
    elif kind == "now":
        data = PreparedCorpus(path, length=MAX_LENGTH)
    else:
        images = _import_before_images() if kind == "images-before" else None
        if images is None:
            from gpipe.data import ImageFiles
        data = (images.ImageFiles if images else ImageFiles)(path, size=64)
    data.baseline()
    for step in range(1, 4):
        data.batch(32 if "images" in kind else 64, step)
    seconds = time.perf_counter() - began
    end = _status(os.getpid())
    return {
        "growth": end["VmHWM"] - before,  # (not ru_maxrss: Linux floors it at the parent's RSS)
        "anon": end["RssAnon"] - start["RssAnon"],
        "file": end["RssFile"] - start["RssFile"],
        "seconds": seconds,
        "imports": before,
    }


def loader_rate(prepared: Path, steps: int) -> dict[str, float]:
    """Training batches made by PreparedCorpus in this thread: target tokens per second."""
    from gpipe.data.prepared import PreparedCorpus

    corpus = PreparedCorpus(prepared, length=MAX_LENGTH)
    rates = {}
    for name, make in (
        ("tokens 4096", lambda s: corpus.token_batch(4096, s)),
        ("batch 64", lambda s: corpus.batch(64, s)),
    ):
        make(0)
        began, count = time.perf_counter(), 0
        for step in range(1, steps + 1):
            count += make(step).count
        rates[name] = count / (time.perf_counter() - began)
    return rates


def image_rate(folder: Path, steps: int) -> float:
    """``ImageFiles(folder, size=64).batch(32, step)`` in this thread: images per second."""
    from gpipe.data import ImageFiles

    images = ImageFiles(folder, size=64)
    images.batch(32, 0)
    began = time.perf_counter()
    for step in range(1, steps + 1):
        images.batch(32, step)
    return 32 * steps / (time.perf_counter() - began)


def same_batches(raw: Path, prepared: Path, steps: int = 5) -> bool:
    """The in-memory ParallelCorpus and PreparedCorpus give the same sentence and token batches."""
    import torch

    from gpipe.data import ParallelCorpus
    from gpipe.data.prepared import PreparedCorpus
    from gpipe.data.vocab import Vocab

    old = ParallelCorpus(raw, Vocab(prepared / "vocab.model"), length=MAX_LENGTH)
    new = PreparedCorpus(prepared, length=MAX_LENGTH)
    for step in range(steps):
        for a, b in (
            (old.batch(64, step), new.batch(64, step)),
            (old.token_batch(4096, step), new.token_batch(4096, step)),
        ):
            if not all(torch.equal(x, y) for x, y in zip((a.source, a.target_in, a.target_out),
                                                       (b.source, b.target_in, b.target_out))):  # fmt: skip
                return False
    return True


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.glob("*")):
        if path.suffix in (".tok", ".off", ".len"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": median(values), "min": min(values), "max": max(values), "all": values}


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """The line a + b·N through two points."""
    (n0, y0), (n1, y1) = points
    b = (y1 - y0) / (n1 - n0)
    return y0 - b * n0, b


def _k(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def _one_process(kind: str, path: Path, vocab: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--one", f"dataset-{kind}", "--", str(path), str(vocab)],
                          env=ENV, cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"the data set alone ({kind}, {path}) failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _load() -> float:
    return os.getloadavg()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10k / 100k sentence pairs, 200 / 2000 images")
    parser.add_argument("--repeats", type=int, default=4, help="runs of each timed training setting (default 4)")
    parser.add_argument("--pairs", type=int, default=4, help="pairs of runs real / in memory (default 4)")
    parser.add_argument("--out", help="where data.json and README.md go (default runs/data)")
    parser.add_argument("--scratch", default="/tmp/gpipe-data-bench", help="corpora, images and runs (deleted after)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument(
        "--commit", help="measure the gpipe of this commit (src/ exported with git archive) instead of the working tree"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # driver kind: gpipe train the arguments after --
    args, rest = parser.parse_known_args()
    if args.one:
        rest = rest[1:] if rest[:1] == ["--"] else rest
        if args.one.startswith("dataset-"):
            print(json.dumps(dataset_memory(args.one.removeprefix("dataset-"), *rest)))
            return 0
        return driver(args.one, rest)
    small = 10_000 if args.quick else 100_000
    large, images_small = 10 * small, small // 50
    images_large = 10 * images_small
    out = Path(args.out or "runs/data")
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    began = time.perf_counter()
    rev = args.commit or "HEAD"
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True)
    if args.commit:  # (others' unfinished edits in the working tree cannot break the run)
        archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
        ENV["PYTHONPATH"] = str(scratch / "src")
        sys.path.insert(0, str(scratch / "src"))
    import torch

    r: dict[str, Any] = {
        "command": f".venv/bin/python benchmarks/data.py{' --quick' if args.quick else ''}"
        f"{f' --commit {args.commit}' if args.commit else ''} --out {out}",
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "commit": commit.stdout.strip(),
                    "source": f"git archive {rev}" if args.commit else "the working tree"},
        "sizes": {"small": small, "large": large, "images_small": images_small, "images_large": images_large},
        "repeats": args.repeats,
        "pairs": args.pairs,
        "load": {"start": _load()},
    }  # fmt: skip
    try:
        measure(r, scratch, args.repeats, args.pairs)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    r["load"]["end"] = _load()
    r["seconds"] = time.perf_counter() - began
    (out / "data.json").write_text(json.dumps(r, indent=1) + "\n")
    report = render(r)
    (out / "README.md").write_text(report)
    print(report)
    return 0


def measure(r: dict[str, Any], scratch: Path, repeats: int, pairs: int) -> None:
    small, large = r["sizes"]["small"], r["sizes"]["large"]
    images_small, images_large = r["sizes"]["images_small"], r["sizes"]["images_large"]
    # 1. corpora, the vocabulary
    raw = {n: scratch / f"raw-{_k(n)}" for n in (small, large)}
    prepared = {n: scratch / f"prepared-{_k(n)}" for n in (small, large)}
    for n, folder in raw.items():
        t = time.perf_counter()
        info = write_corpus(folder, n)
        say(f"wrote {n} sentence pairs ({info['bytes'] / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f} s")
        r.setdefault("corpora", {})[str(n)] = info
    wall = run_command([sys.executable, "-m", "gpipe", "prepare", "--data", str(raw[small]), "--out",
                        str(prepared[small]), "--workers", "2"], scratch / "prepare-small.log")  # fmt: skip
    vocab = prepared[small] / "vocab.model"
    say(f"prepared {small} with a trained vocabulary in {wall:.1f} s")

    # 2. prepare's throughput, the same bytes, the disk
    r["load"]["prepare"] = _load()
    prepare: dict[str, Any] = {}
    for workers in (1, 2):
        target = scratch / f"prepared-{_k(large)}-w{workers}"
        command = [sys.executable, "-m", "gpipe", "prepare", "--data", str(raw[large]), "--out", str(target),
                   "--vocab", str(vocab), "--workers", str(workers)]  # fmt: skip
        wall = run_command(command, scratch / f"prepare-w{workers}.log")
        manifest = json.loads((target / "manifest.json").read_text())
        prepare[str(workers)] = {
            "seconds": manifest["seconds"],
            "wall": wall,
            "pairs_per_s": large / manifest["seconds"],
            "pairs_per_s_wall": large / wall,
            "digest": digest(target),
        }
        say(f"prepare {large}, --workers {workers}: {manifest['seconds']:.1f} s ({wall:.1f} s wall), "
            f"{prepare[str(workers)]['pairs_per_s']:.0f} sentence pairs/s")  # fmt: skip
    prepare["same_bytes"] = prepare["1"]["digest"] == prepare["2"]["digest"]
    r["prepare"] = prepare
    shutil.rmtree(scratch / f"prepared-{_k(large)}-w1")
    (scratch / f"prepared-{_k(large)}-w2").rename(prepared[large])
    manifest = json.loads((prepared[large] / "manifest.json").read_text())
    files = {
        suffix: sum(p.stat().st_size for p in prepared[large].glob(f"*{suffix}")) for suffix in (".tok", ".off", ".len")
    }
    tokens, sentences = manifest["tokens"], manifest["sentences"]
    r["disk"] = {
        "files": files,
        "tokens": tokens,
        "sentences": sentences,
        "held_out": sum(p["held_out"] for p in manifest["pairs"].values()),
        "tok_bytes_per_token": files[".tok"] / tokens,
        "index_bytes_per_sentence": (files[".off"] + files[".len"]) / sentences,
        "index_bytes": files[".off"] + files[".len"],
        "pairs": len(manifest["pairs"]),
        "target_bytes": 2 * tokens + 12 * sentences,
        "total": sum(files.values()),
        "raw_bytes": r["corpora"][str(large)]["bytes"],
        "vocab_size": manifest["vocab"]["size"],
        "longest": len(manifest["lengths"]) - 1,
        "tokens_per_pair": tokens / sentences,
    }
    say(f"disk: {r['disk']['tok_bytes_per_token']:.3f} bytes a token, "
        f"{r['disk']['index_bytes_per_sentence']:.2f} bytes a sentence pair")  # fmt: skip
    r["same_batches"] = same_batches(raw[small], prepared[small])
    say(f"ParallelCorpus and PreparedCorpus give the same batches: {r['same_batches']}")

    # 3. time to 3 steps, peak RSS: before (in memory) and now (prepared); the data set alone
    r["load"]["scale"] = _load()
    scale: dict[str, Any] = {"before": {}, "now": {}}
    for rep in range(repeats):
        for n in (small, large):
            for path in ("now", "before") if rep % 2 == 0 else ("before", "now"):
                folder = scratch / f"run-{path}-{_k(n)}"
                if path == "now":
                    run = run_train(
                        ["--data", str(prepared[n]), "--batch", "64", "--seed", str(rep), *TRAIN], folder, 3
                    )
                else:
                    flags = ["--data", str(raw[n]), "--vocab", str(vocab), "--batch", "64", "--seed", str(rep)]
                    run = run_train([*flags, *TRAIN], folder, 3,
                                    driver="before")  # fmt: skip
                row = scale[path].setdefault(str(n), {"seconds": [], "rss": [], "anon": [], "others": []})
                row["seconds"].append(run["seconds"])
                row["rss"].append(run["rss"])
                row["anon"].append(run["anon_peak"])
                row["others"].append(run["others"])
                say(f"{path:>6} {n:>8}: {run['seconds']:6.1f} s to step 3, peak RSS {run['rss'] / 2**20:7.0f} MiB "
                    f"(anonymous {run['anon_peak'] / 2**20:.0f})")  # fmt: skip
    for path in ("before", "now"):
        for n in (small, large):
            one = _one_process(path, raw[n] if path == "before" else prepared[n], vocab)
            scale[path][str(n)]["dataset"] = one
            say(f"{path:>6} {n:>8}: the data set alone {one['growth'] / 2**20:.0f} MiB, {one['seconds']:.1f} s")
        rows = scale[path]
        for n in (small, large):
            for key in ("seconds", "rss", "anon"):
                rows[str(n)][key] = spread(rows[str(n)][key])
        for key in ("seconds", "rss", "anon"):
            rows[f"{key}_ratio"] = rows[str(large)][key]["median"] / rows[str(small)][key]["median"]
        for key in ("rss", "seconds", "dataset"):
            points = [(n, rows[str(n)]["dataset"]["growth"] if key == "dataset" else rows[str(n)][key]["median"])
                      for n in (small, large)]  # fmt: skip
            a, b = fit(points)
            rows[f"{key}_fit"] = {"a": a, "b_per_pair": b, "at_100M": a + b * 1e8}
    r["scale"] = scale

    # 4. token batches against sentence batches
    r["load"]["batches"] = _load()
    batches: dict[str, Any] = {}
    for name, flags in (("tokens 4096", ["--batch-tokens", "4096"]), ("batch 64", ["--batch", "64"])):
        run = run_train(["--data", str(prepared[large]), *flags, *TRAIN], scratch / f"run-{name.replace(' ', '')}", 20)
        rows = [row for row in run["metrics"] if row["step"] <= 20]
        batches[name] = {
            "padding": statistics.fmean(row["padding"] for row in rows),
            "tokens_per_s": median([row["tokens_per_s"] for row in rows if row["step"] >= 3]),
            "tokens_per_step": statistics.fmean(row["tokens"] for row in rows),
        }
        say(f"{name}: padding {batches[name]['padding']:.3f}, {batches[name]['tokens_per_s']:.0f} tokens/s")
    batches["speedup"] = batches["tokens 4096"]["tokens_per_s"] / batches["batch 64"]["tokens_per_s"]
    r["batches"] = batches

    # 5. the loader's rate; a step on real data against the same step with its batch in memory
    rates = loader_rate(prepared[large], 200)
    r["loader"] = {
        name: {"tokens_per_s": rate, "x_training": rate / batches[name]["tokens_per_s"]} for name, rate in rates.items()
    }
    say(f"loader: {', '.join(f'{k} {v:.0f} tokens/s' for k, v in rates.items())}")
    r["load"]["real_vs_memory"] = _load()
    r["real_vs_memory"] = real_vs_memory(["--data", str(prepared[large]), "--batch-tokens", "4096", *TRAIN], scratch,
                                         "text", 24, pairs)  # fmt: skip

    # 6. images
    folders = {n: scratch / f"images-{_k(n)}" for n in (images_small, images_large)}
    for n, folder in folders.items():
        t = time.perf_counter()
        info = write_images(folder, n)
        say(f"wrote {n} images ({info['bytes'] / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f} s")
        r.setdefault("image_folders", {})[str(n)] = info
    r["load"]["images"] = _load()
    images: dict[str, Any] = {"before": {}, "now": {}}
    for rep in range(repeats):
        for n, folder in folders.items():
            for path in ("now", "before") if rep % 2 == 0 else ("before", "now"):
                flags = ["--data", str(folder), "--seed", str(rep), *IMAGE_TRAIN]
                run = run_train(flags, scratch / f"img-{path}-{n}", 3,
                                driver="images-before" if path == "before" else "")  # fmt: skip
                row = images[path].setdefault(
                    str(n), {"seconds": [], "rss": [], "anon": [], "images_per_s": [], "others": []}
                )
                row["seconds"].append(run["seconds"])
                row["rss"].append(run["rss"])
                row["anon"].append(run["anon_peak"])
                row["others"].append(run["others"])
                row["images_per_s"] += [m["images_per_s"] for m in run["metrics"] if 2 <= m["step"] <= 3]
                say(f"images {path:>6} {n:>6}: {run['seconds']:6.1f} s to step 3, peak RSS "
                    f"{run['rss'] / 2**20:7.0f} MiB (anonymous {run['anon_peak'] / 2**20:.0f})")  # fmt: skip
    for path in ("before", "now"):
        rows = images[path]
        for n, folder in folders.items():
            rows[str(n)]["dataset"] = _one_process(f"images-{path}", folder, vocab)
            for key in ("seconds", "rss", "anon", "images_per_s"):
                rows[str(n)][key] = spread(rows[str(n)][key])
        for key in ("seconds", "rss", "anon"):
            rows[f"{key}_ratio"] = rows[str(images_large)][key]["median"] / rows[str(images_small)][key]["median"]
    made = image_rate(folders[images_large], 20)
    images["loader_images_per_s"] = made
    images["training_images_per_s"] = images["now"][str(images_large)]["images_per_s"]["median"]
    images["loader_x_training"] = made / images["training_images_per_s"]
    say(f"ImageFiles.batch(32): {made:.0f} images/s, {images['loader_x_training']:.1f}x training's")
    r["images"] = images
    r["load"]["images_real_vs_memory"] = _load()
    r["images_real_vs_memory"] = real_vs_memory(["--data", str(folders[images_large]), *IMAGE_TRAIN], scratch,
                                                "images", 12, pairs)  # fmt: skip


def real_vs_memory(argv: list[str], scratch: Path, name: str, steps: int, repeats: int) -> dict[str, Any]:
    """The same run reading its data and with its batches made before: ``repeats`` pairs of runs taking
    turns; per run the median period (between the loop's requests for consecutive batches) and step
    (the metrics' own seconds) over steps 3..``steps``; per pair the ratio real / in memory."""
    found: dict[str, Any] = {kind: {"period": [], "step": [], "others": []} for kind in ("real", "memory")}
    for rep in range(repeats):
        for kind in ("real", "memory") if rep % 2 == 0 else ("memory", "real"):
            folder = scratch / f"run-{name}-{kind}-{rep}"
            run = run_train(argv, folder, steps, driver=kind)
            asked = {row["step"]: row["asked"] for row in _metrics(folder / "periods.jsonl")}
            periods = [asked[s + 1] - asked[s] for s in range(3, steps) if s + 1 in asked and s in asked]
            unit = "tokens" if name == "text" else "images"
            seconds = [(row["tokens"] if unit == "tokens" else _batch_images(argv)) / row[f"{unit}_per_s"]
                       for row in run["metrics"] if 3 <= row["step"] <= steps]  # fmt: skip
            found[kind]["period"].append(median(periods))
            found[kind]["step"].append(median(seconds))
            found[kind]["others"].append(run["others"])
            say(f"{name} {kind}: period {median(periods) * 1e3:.0f} ms, step {median(seconds) * 1e3:.0f} ms, "
                f"others used {run['others']:.0%} of the machine")  # fmt: skip
    quiet = [max(a, b) < QUIET for a, b in zip(found["real"]["others"], found["memory"]["others"])]
    for key in ("period", "step"):
        ratios = [a / b for a, b in zip(found["real"][key], found["memory"][key])]
        found[f"{key}_ratio"] = spread(ratios)
        found[f"{key}_ratio_quiet"] = [x for x, q in zip(ratios, quiet) if q]
    say(f"{name}: real / in memory, period {found['period_ratio']['median']:.3f} "
        f"[{found['period_ratio']['min']:.3f}-{found['period_ratio']['max']:.3f}], step "
        f"{found['step_ratio']['median']:.3f}")  # fmt: skip
    return found


def _batch_images(argv: list[str]) -> int:
    return int(argv[argv.index("--batch") + 1])


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f}"


def _alone(label: str, a: dict[str, float], b: dict[str, float]) -> str:
    """A row of the data set alone: its peak memory, what of it is anonymous / file-backed at the end (and
    the seconds to build) at the two sizes."""

    def cell(x: dict[str, float]) -> str:
        return f"{_mib(x['growth'])} ({_mib(x['anon'])} / {_mib(x['file'])}; {x['seconds']:.1f} s)"

    return (
        f"| {label}: the data set alone, peak MiB (anonymous / file-backed at the end; s to build) | {cell(a)} | "
        f"{cell(b)} | {b['growth'] / max(a['growth'], 1):.2f}x | |"
    )


def _projection(rows: dict[str, Any], small: int, large: int) -> str:
    """What the line a + b·N through the two sizes says at 100M: the peak RSS, its anonymous part, the
    data set alone's; whether the time grows more than the runs at one size differ."""
    f_rss, f_time = rows["rss_fit"], rows["seconds_fit"]
    anon = [rows[str(n)]["anon"]["median"] for n in (small, large)]
    b_anon = (anon[1] - anon[0]) / (large - small)
    alone = {k: (rows[str(large)]["dataset"][k] - rows[str(small)]["dataset"][k]) / (large - small)
             for k in ("anon", "file")}  # fmt: skip
    if b_anon > 0:
        anonymous = (
            f"its anonymous part {b_anon:.0f} bytes a pair → {(anon[0] + b_anon * (1e8 - small)) / 2**30:.1f} GiB"
        )
    else:
        anonymous = f"its anonymous part does not grow ({anon[0] / 2**20:.0f} and {anon[1] / 2**20:.0f} MiB)"
    rss = (
        f"peak RSS {f_rss['a'] / 2**20:.0f} MiB + {f_rss['b_per_pair']:.0f} bytes a sentence pair → "
        f"**{f_rss['at_100M'] / 2**30:.1f} GiB** at 100M; {anonymous}; the data set alone "
        f"{max(alone['anon'], 0):.0f} bytes a pair anonymous, {max(alone['file'], 0):.0f} of mapped corpus pages"
    )
    seconds = [rows[str(n)]["seconds"] for n in (small, large)]
    if seconds[1]["median"] - seconds[0]["median"] > max(x["max"] - x["min"] for x in seconds):
        time_part = (f"time to step 3 {f_time['a']:.1f} s + {f_time['b_per_pair'] * 1e6:.2f} µs a pair → "
                     f"**{f_time['at_100M'] / 60:.1f} min** at 100M")  # fmt: skip
    else:
        time_part = (f"time to step 3 {seconds[0]['median']:.1f} s and {seconds[1]['median']:.1f} s (runs at one "
                     "size differ by more): no growth measurable")  # fmt: skip
    return f"{rss}; {time_part}."


def _cell(row: dict[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    """median [min-max] of a spread, divided by ``scale``."""
    m, lo, hi = row["median"] / scale, row["min"] / scale, row["max"] / scale
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def _verdict(value: float, target: float, at_least: bool = False) -> str:
    met = value >= target if at_least else value <= target
    if met:
        return "**met**"
    return f"missed by {abs(value / target - 1):.1%}"


def render(r: dict[str, Any]) -> str:
    sizes, m = r["sizes"], r["machine"]
    small, large, i_small, i_large = sizes["small"], sizes["large"], sizes["images_small"], sizes["images_large"]
    load = ", ".join(f"{k} {v:.1f}" for k, v in r["load"].items())
    lines = [
        "# Data at scale: prepared corpora and streamed images",
        "",
        f"Reproduce: `{r['command']}` ({r['seconds'] / 60:.1f} min). {m['cores']} cores, {m['platform']}, Python "
        f"{m['python']}, torch {m['torch']}; gpipe from {m['source']} ({m['commit']}). Load average (1 min) as "
        f"each part began: {load}. What is measured and how: `benchmarks/data.py`'s docstring.",
        "",
        f"Corpora: 4 language pairs (60/25/10/5 %), 2-60 words a sentence from 4000 made-up words; "
        f"{_k(small)}: {r['corpora'][str(small)]['bytes'] / 2**20:.0f} MiB of .tsv, {_k(large)}: "
        f"{r['corpora'][str(large)]['bytes'] / 2**20:.0f} MiB; one SentencePiece vocabulary of "
        f"{r['disk']['vocab_size']} pieces (trained on {_k(small)}, as many as the text supports), "
        f"{r['disk']['tokens_per_pair']:.1f} tokens a sentence pair. ParallelCorpus and the prepared corpus "
        f"give the same batches: {r['same_batches']}.",
        "",
        f"## Time to 3 steps and peak memory, {_k(small)} and {_k(large)} sentence pairs",
        "",
        "`gpipe train` (transformer 2 + 2 layers, dim 64, `--partitions 2 --batch 64 --max-length 96`), a process "
        f"per run, {r['repeats']} runs of each taking turns, run r with `--seed r`: median [min-max]. *Before*: the "
        "in-memory `ParallelCorpus` on the raw folder; *now*: `--data PREPARED`. Peak RSS: the process's `VmHWM` at "
        "step 3; "
        "anonymous: the largest `RssAnon` sampled every 10 ms (without the shared libraries and mapped files); "
        "the data set alone: a process that builds only the data set (its baseline and 3 batches), its peak "
        "RSS growth over the imports.",
        "",
        f"| | {_k(small)} | {_k(large)} | {_k(large)} / {_k(small)} | target |",
        "|---|---|---|---|---|",
    ]
    sc = r["scale"]
    for path, label in (("before", "before (in memory)"), ("now", "now (prepared)")):
        rows = sc[path]
        targets = {"rss": ("≤ 1.15x", 1.15), "seconds": ("≤ 1.5x", 1.5)} if path == "now" else {}
        was = {"rss": "(was 3.7x)", "seconds": "(was 5.1x)"} if path == "before" else {}
        for key, what, scale, digits in (("rss", "peak RSS (MiB)", 2**20, 0), ("seconds", "time to step 3 (s)", 1, 1),
                                         ("anon", "peak anonymous RSS (MiB)", 2**20, 0)):  # fmt: skip
            ratio = rows[f"{key}_ratio"]
            target = f"{targets[key][0]}: {_verdict(ratio, targets[key][1])}" if key in targets else was.get(key, "")
            lines.append(f"| {label}: {what} | {_cell(rows[str(small)][key], scale, digits)} | "
                         f"{_cell(rows[str(large)][key], scale, digits)} | {ratio:.2f}x | {target} |")  # fmt: skip
        a, b = rows[str(small)]["dataset"], rows[str(large)]["dataset"]
        lines.append(_alone(label, a, b))
    others = [x for path in ("before", "now") for n in (small, large) for x in sc[path][str(n)]["others"]]
    lines += [
        "",
        f"Other processes used {median(others):.0%} of the machine during these runs (at most {max(others):.0%}).",
        "",
        "Projected to 100M sentence pairs (the line a + b·N through the two sizes' medians):",
        "",
    ]
    for path, label in (("before", "Before"), ("now", "Now")):
        rows = sc[path]
        lines.append(f"- {label}: {_projection(rows, small, large)}")
    lines += [
        "",
        "What grows with the prepared corpus is file-backed: the pages of the corpus's arrays the process has "
        "mapped. The kernel maps 64 KiB around each page a read faults in, so each sentence read maps up to 64 KiB "
        "of `.tok` (and of `.off` and `.len`), until the whole of a small file is mapped; these pages are the page "
        "cache's, shared by every process reading the corpus and dropped under memory pressure, and they grow with "
        "the sentences read (here the unigram baseline's 20 x 64 and 3 steps' 64), not with the corpus: a line "
        "through them overstates 100M. The anonymous memory, what the process itself needs, does not grow.",
        "",
    ]
    p, d = r["prepare"], r["disk"]
    w1, w2 = p["1"], p["2"]
    lines += [
        "",
        f"## gpipe prepare, {_k(large)} sentence pairs, and the disk",
        "",
        "| | seconds (manifest) | wall (s, with the process's start) | sentence pairs/s (manifest) | wall |",
        "|---|---|---|---|---|",
        *(
            f"| `--workers {n}` | {w['seconds']:.1f} | {w['wall']:.1f} | {w['pairs_per_s']:.0f} | "
            f"{w['pairs_per_s_wall']:.0f} |"
            for n, w in (("1", w1), ("2", w2))
        ),
        "",
        f"2 workers against 1: {w2['pairs_per_s'] / w1['pairs_per_s']:.2f}x; both wrote the same bytes: "
        f"{p['same_bytes']}. At this rate 100M sentence pairs prepare in "
        f"{1e8 / w2['pairs_per_s'] / 60:.0f} min with 2 workers (once; every run then starts in seconds).",
        "",
        f"Disk ({d['sentences']} training sentence pairs, {d['tokens']} tokens; {d['held_out']} held out in "
        f"heldout.json): `.tok` {d['files']['.tok']} bytes = **{d['tok_bytes_per_token']:.3f} bytes a token**; "
        f"`.off` + `.len` {d['files']['.off'] + d['files']['.len']} bytes = **{d['index_bytes_per_sentence']:.2f} "
        f"bytes a sentence pair**; {d['total'] / 2**20:.1f} MiB in all against {d['raw_bytes'] / 2**20:.1f} MiB of "
        f"text ({d['total'] / d['raw_bytes']:.2f}x). (`.off` holds one offset more than sentences per language "
        f"pair: {8 * d['pairs']} bytes in all.) Target ≤ 2 bytes a token + 12 a sentence pair: "
        f"{_verdict(max(d['tok_bytes_per_token'] / 2, (d['index_bytes'] - 8 * d['pairs']) / d['sentences'] / 12), 1)}.",
    ]
    b = r["batches"]
    t, s64 = b["tokens 4096"], b["batch 64"]
    lines += [
        "",
        f"## Token batches and the loader, {_k(large)} prepared",
        "",
        "20 steps of each (metrics.jsonl: padding, the mean over steps 1-20; real target tokens per second, the "
        "median over steps 3-20; the loader: `PreparedCorpus.token_batch(4096, step)` and `.batch(64, step)`, 200 "
        "steps each in one thread, target tokens made per second):",
        "",
        "| | padding | target tokens a step | training tokens/s | the loader's tokens/s | loader / training |",
        "|---|---|---|---|---|---|",
        f"| `--batch-tokens 4096` | **{t['padding']:.3f}** | {t['tokens_per_step']:.0f} | {t['tokens_per_s']:.0f} | "
        f"{r['loader']['tokens 4096']['tokens_per_s']:.0f} | {r['loader']['tokens 4096']['x_training']:.0f}x |",
        f"| `--batch 64` | {s64['padding']:.3f} | {s64['tokens_per_step']:.0f} | {s64['tokens_per_s']:.0f} | "
        f"{r['loader']['batch 64']['tokens_per_s']:.0f} | {r['loader']['batch 64']['x_training']:.0f}x |",
        "",
        f"Padding with `--batch-tokens 4096`: target ≤ 0.15, {_verdict(t['padding'], 0.15)}; real tokens per "
        f"second {b['speedup']:.2f}x those of `--batch 64`. The loader: target ≥ 10x training's rate, "
        f"{_verdict(min(v['x_training'] for v in r['loader'].values()), 10, at_least=True)}.",
    ]
    im = r["images"]
    lines += [
        "",
        "## A step on real data against the same step with its batch already in memory",
        "",
        "The same run twice, reading its data (*real*) and with every training batch made before the run "
        "(*in memory*: the same batches, shapes and losses); the period between the training loop's requests for "
        "consecutive batches (what a step costs, a wait for data included), median over the steps of a run; "
        f"{r['pairs']} pairs of runs taking turns, ratio real / in memory per pair: median [min-max]; *quiet*: the "
        f"pairs where other processes used less than {QUIET:.0%} of the machine during both runs.",
        "",
        "| | real: period (ms) | in memory (ms) | real / in memory, all pairs | quiet pairs | the step alone "
        "(metrics), real / in memory | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, label in (
        ("real_vs_memory", f"translation, `--batch-tokens 4096`, {_k(large)} prepared, 24 steps"),
        ("images_real_vs_memory", f"AmoebaNet, {_k(i_large)} PNG images, batch 32, 12 steps"),
    ):
        v = r[key]
        quiet = v["period_ratio_quiet"]
        shown = _cell(spread(quiet), 1, 3) + f" ({len(quiet)})" if quiet else "none"
        judged = median(quiet) if quiet else v["period_ratio"]["median"]
        lines.append(
            f"| {label} | {median(v['real']['period']) * 1e3:.0f} | {median(v['memory']['period']) * 1e3:.0f} | "
            f"{_cell(v['period_ratio'], 1, 3)} | {shown} | {_cell(v['step_ratio'], 1, 3)} | ≤ 1.05x: "
            f"{_verdict(judged, 1.05)} |"
        )
    lines += [
        "",
        f"## Images: {_k(i_small)} and {_k(i_large)} PNG images of 64x64",
        "",
        "`gpipe train --model amoebanet --data FOLDER --image-size 64 --batch 32 --layers 2 --filters 8 "
        f"--partitions 2` to step 3, {r['repeats']} runs of each taking turns, run r with `--seed r`: median "
        "[min-max]. *Before*: "
        f"`ImageFiles` of {IMAGES_BEFORE} (every image decoded into memory at the start); *now*: decoded a batch "
        "at a time.",
        "",
        f"| | {_k(i_small)} | {_k(i_large)} | {_k(i_large)} / {_k(i_small)} | target |",
        "|---|---|---|---|---|",
    ]
    for path, label in (("before", "before (in memory)"), ("now", "now (streamed)")):
        rows = im[path]
        for key, what, scale, digits in (("rss", "peak RSS (MiB)", 2**20, 0), ("seconds", "time to step 3 (s)", 1, 1),
                                         ("anon", "peak anonymous RSS (MiB)", 2**20, 0)):  # fmt: skip
            ratio = rows[f"{key}_ratio"]
            target = ""
            if key == "rss":
                target = f"≤ 1.15x: {_verdict(ratio, 1.15)}" if path == "now" else "(was 5.4x)"
            lines.append(f"| {label}: {what} | {_cell(rows[str(i_small)][key], scale, digits)} | "
                         f"{_cell(rows[str(i_large)][key], scale, digits)} | {ratio:.2f}x | {target} |")  # fmt: skip
        a, c = rows[str(i_small)]["dataset"], rows[str(i_large)]["dataset"]
        lines.append(_alone(label, a, c))
    lines += [
        "",
        f"Training {im['training_images_per_s']:.0f} images/s (steps 2-3 of the {_k(i_large)} runs); "
        f"`ImageFiles(folder, size=64).batch(32, step)` makes {im['loader_images_per_s']:.0f} images/s in one "
        f"thread: {im['loader_x_training']:.1f}x (target ≥ 10x: {_verdict(im['loader_x_training'], 10, True)}).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
