"""The run of ``gpipe train``: :func:`train`, the lock of one run per ``--out`` (:func:`one_run`)
and the training loop (steps, evaluations, metrics, checkpoints, Ctrl-C)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpipe.data import TranslationDataset
from gpipe.data.base import ReplicaBatch
from gpipe.data.instruct import Documents
from gpipe.data.loader import BatchError, StepLoader
from gpipe.distributed import PipelineError, init_from_env, watch_peers
from gpipe.distributed.failure import collective, lost_ranks
from gpipe.evaluation import decoding_left_out, evaluate
from gpipe.health import Recorder
from gpipe.models import parameter_count
from gpipe.models.moe import active_parameters, routing_metrics
from gpipe.models.sharing import unshared_parameters
from gpipe.models.transparent import transparent_weights
from gpipe.nonfinite import locate
from gpipe.recipe import (
    clip_grad_norm_per_parameter,
    grad_norms,
    inverse_sqrt_schedule,
)
from gpipe.rng import derive_seed
from gpipe.runfile import lock_line
from gpipe.schedule import simulate
from gpipe.train.checkpoints import Checkpoints, Interrupts, truncate_metrics
from gpipe.train.config import ConfigError, TrainConfig
from gpipe.train.data import left_out, train_batch
from gpipe.train.elastic import RESTARTS, Restart, finished, record_failure, restart_of, start_job
from gpipe.train.guard import GUARD, NonFiniteError, StepGuard
from gpipe.train.initial import RUN, init_source, warm_start
from gpipe.train.learned import learned_rates, load_rates
from gpipe.train.metrics import (
    bleu_table,
    eval_postfix,
    eval_summary,
    hparams_end,
    plot_curves,
    plot_health,
    progress_bar,
    tensorboard_writer,
)
from gpipe.train.precision import autocast, check_supported
from gpipe.train.resume import check_out, delete_results, resume_point
from gpipe.train.setup import make_data, make_losses, make_model, make_optimizer, make_pipeline, process_rank

__all__ = ["one_run", "train"]


OnEval = Callable[[int, dict[str, Any]], bool]


def train(cfg: TrainConfig, *, on_eval: OnEval | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the final metrics. One run at a time per ``cfg.out``.

    ``on_eval(step, metrics)``: called on every rank after each evaluation with the step's metrics (its
    line of ``metrics.jsonl``, already written); True stops the run after that step, as if ``--steps``
    were that step (its checkpoint is written, the returned metrics say ``"stopped": step``). Every rank
    must return the same answer (``gpipe sweep``'s pruning: the trial's answer, broadcast by rank 0).

    ``cfg.resume``: from the newest checkpoint, saying which settings differ from the run's (see
    :func:`~gpipe.train.resume.resume_point`); a finished run says so and returns its last metrics.
    ``cfg.overwrite``: an earlier run's results in ``cfg.out`` are deleted first."""
    cfg.check()
    out = Path(cfg.out)
    restart = restart_of(cfg.out)  # torchrun restarted this job: it continues from its newest checkpoint
    if restart is not None:
        if (stop := restart.nonfinite()) is not None:  # (the same bad step again: no loop)
            error = NonFiniteError(f"{stop['message']}; the job stopped there before torchrun restarted it, and "
                                   "the restart does not train it again", stop.get("step") or 1)  # fmt: skip
            error.kept = restart.step
            raise error
        # (no checkpoint yet: the job starts again, replacing what its lost attempt wrote)
        cfg = dataclasses.replace(cfg, resume=restart.checkpoint is not None, overwrite=restart.checkpoint is None)
        if int(os.environ.get("RANK", "0")) == 0:  # (the process group does not exist yet)
            print(restart.describe(), file=sys.stderr)
    check_out(cfg)
    point = resume_point(cfg) if cfg.resume else None
    if point is not None and process_rank() == 0 and restart is None:
        print(point.describe(cfg.out), file=sys.stderr)
    if point is not None and point.finished:
        return _last_metrics(out / "metrics.jsonl")
    with one_run(out):
        keep = (RESTARTS,) if restart is not None else ()  # (a job restarted before its first checkpoint: its log)
        if cfg.overwrite and process_rank() == 0 and (gone := delete_results(out, keep)) and restart is None:
            print(f"--overwrite: deleted the earlier run in {cfg.out!r} ({', '.join(gone)})", file=sys.stderr)
        watch = watch_peers(cfg.timeout, functools.partial(record_failure, out, "lost"))
        try:
            with watch if int(os.environ.get("WORLD_SIZE", "1")) > 1 else contextlib.nullcontext():
                result = _train(cfg, restart, on_eval)
        except NonFiniteError as exc:
            record_failure(out, "nonfinite", str(exc), exc.step)
            raise
        except BaseException as exc:  # (under torchrun, for the restart to say; the first record of a rank stays)
            if not isinstance(exc, (SystemExit, ConfigError)):
                _record(out, exc)
            raise
        finished(out)
        return result


def _record(out: Path, exc: BaseException) -> None:
    """Record why this rank failed: at once what it knows, then what the other ranks' heartbeats say."""
    if not isinstance(exc, PipelineError):
        record_failure(out, "lost", _why(exc, ask=False), provisional=True)
    record_failure(out, "lost", _why(exc))


def _why(exc: BaseException, ask: bool = True) -> str:
    """What a failure says about the job: a :class:`PipelineError` names the lost rank; another error is
    told with the ranks the heartbeats find lost (``ask``: read them, a second or two)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, PipelineError):
        return text
    lost = lost_ranks() if ask else None
    if isinstance(exc, KeyboardInterrupt):  # (SIGTERM under torchrun: its agent stops a group whose worker failed)
        stopped = f"rank {process_rank()} was stopped by {text or 'SIGINT'}"
        return f"{lost or 'no rank is lost'} ({stopped})" if ask else stopped
    return f"{lost + ': ' if lost else ''}{type(exc).__name__}: {text}"


def _last_metrics(path: Path) -> dict[str, Any]:
    """The last complete line of a run's ``metrics.jsonl`` ({} if there is none)."""
    with contextlib.suppress(OSError):
        for line in reversed(path.read_text().splitlines()):
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    return row
    return {}


@contextlib.contextmanager
def one_run(out: Path, command: str = "gpipe train") -> Iterator[None]:
    """Hold ``OUT/.lock`` (an exclusive ``flock``, with this process's PID and host in it) for the run: a
    second run on the same ``--out`` is refused, naming the first (``command``: what runs there). The
    kernel releases the lock when the process ends, however it ends, so a crash leaves no stale lock.
    Under torchrun rank 0 holds it for the job."""
    if int(os.environ.get("RANK", "0")) != 0:  # (the process group does not exist yet)
        yield
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; name a directory (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".lock", "a+")  # noqa: SIM115 - held open for the whole run
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            pid = " on ".join(lock.read().split()[:2]) or "unknown"
            raise ConfigError(
                f"another {command} (PID {pid}) is running on --out {str(out)!r}; wait for it to end, "
                "stop it, or give another --out"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(lock_line())
        lock.flush()
        yield
    finally:
        lock.close()  # closing releases the lock


def _train(cfg: TrainConfig, restart: Restart | None, on_eval: OnEval | None) -> dict[str, Any]:
    out = Path(cfg.out)
    distributed = init_from_env(cfg.timeout, devices=cfg.devices)  # (before the data: rank 0 alone trains a vocabulary)
    if distributed:  # every rank has decided whether it restarts the job: then rank 0 marks OUT as the job's
        with collective("barrier after the start"):
            dist.barrier()
    start_job(out, restart)
    try:
        data = make_data(cfg)
    except ConfigError:
        raise
    except ValueError as exc:
        if not cfg.data:
            raise  # synthetic data: the settings were checked, so this is a bug
        raise ConfigError(str(exc)) from exc  # (gpipe.data's errors name the file and what is wrong)
    if process_rank() == 0 and (note := left_out(data, cfg)) is not None:
        print(note, file=sys.stderr)
    if process_rank() == 0 and callable(summary := getattr(data, "summary", None)) and (said := summary()):
        print(said, file=sys.stderr)  # (instruction records cut or left out)
    model = make_model(cfg, data)
    losses = make_losses(cfg, data)
    loss_fn, cross_entropy, tokens = losses.loss_fn, losses.cross_entropy, losses.tokens
    if cfg.model == "hf" and (cannot := getattr(model, "cannot_generate", None)) is not None and process_rank() == 0:
        print(f"note: evaluations show no sample generation: {cannot}", file=sys.stderr)
    if cfg.experts and process_rank() == 0:  # (counted on the whole model: on the meta device where not here)
        total, active = parameter_count(model), active_parameters(model)
        print(f"note: a mixture of experts: {total:,} parameters, {active:,} of them per token", file=sys.stderr)
    if cfg.share_layers > 1 and process_rank() == 0:  # (a shared tensor counted once; the stages hold copies)
        print(f"note: layers shared every {cfg.share_layers}: {parameter_count(model):,} parameters "
              f"({unshared_parameters(model):,} without sharing)", file=sys.stderr)  # fmt: skip
    pipe = make_pipeline(cfg, model, data, losses, distributed=distributed)
    if process_rank() == 0 and (left := decoding_left_out(pipe, data)) is not None:
        command = "translate" if left == "BLEU" else "generate"
        split = f" --tensor-parallel {cfg.tensor_parallel}" if cfg.tensor_parallel > 1 else ""
        print(
            f"note: evaluations show no {left} with --data-parallel {cfg.data_parallel}{split}: decoding does not "
            f"run on replicas or split layers of a pipeline (the held-out losses are computed on all of them); "
            f"decode a checkpoint with gpipe {command} --checkpoint {cfg.out}",
            file=sys.stderr,
        )
    check_supported(cfg.precision, pipe.devices)
    # --precision bf16: the step and the evaluations under autocast (the pipeline carries it to its stages);
    # the parameters, and so their gradients, the clipping and the optimizer, stay float32.
    precision = functools.partial(autocast, cfg.precision, pipe.devices)
    optimizer = make_optimizer(cfg, pipe.parameters())
    scheduler = inverse_sqrt_schedule(optimizer, cfg.lr, cfg.warmup)
    checkpoints = Checkpoints(cfg, pipe, optimizer, scheduler, out, data)
    checkpoints.lora = getattr(model, "lora", None)  # (--lora: the adapters' settings, kept in lora.json)
    guard = StepGuard(cfg, pipe)  # --on-nonfinite, --max-skips, --skip-spikes
    checkpoints.guard = guard.state
    rates = learned_rates(cfg, pipe, optimizer)  # --lr-hypergradient
    checkpoints.rates = rates
    start = checkpoints.resume() if cfg.resume else 1
    if checkpoints.loaded is not None:
        guard.load(checkpoints.loaded / GUARD)
        load_rates(rates, checkpoints.loaded)
    if cfg.init and not cfg.resume and (found := init_source(cfg.init))[0] == RUN:
        said = warm_start(cfg, pipe, data, found[1])  # the weights only: a new optimizer and schedule
        if process_rank() == 0:
            print(said, file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    trained = truncate_metrics(metrics_path, start) if process_rank() == 0 else 0.0  # (the seconds before a resume)
    began_run = time.perf_counter()
    baseline = data.baseline()
    rate = f"{data.unit}_per_s"
    bubble = simulate(pipe.schedule_for(cfg.chunks)).bubble
    bar = progress_bar(cfg, start)
    board = tensorboard_writer(cfg, out, start)
    last: dict[str, Any] = {}
    shown: dict[str, str] = {}  # the latest evaluation, in the progress bar
    done = start - 1  # the last step whose update is complete: what a checkpoint holds
    stop = False  # on_eval said so
    interrupts = Interrupts()
    # the next batches are made while a step computes (a thread, or --workers processes)
    make = functools.partial(train_batch, data, cfg, pipe.dp_rank)  # (a replica reads its share alone)
    loader = StepLoader(make, start, cfg.steps, workers=cfg.workers)
    try:
        for step, batch in loader:
            seed = derive_seed(cfg.seed, 2, step)
            torch.manual_seed(seed)  # dropout follows the step, for --resume
            began = time.perf_counter()
            optimizer.zero_grad()
            guard.begin()
            shared = batch.share if isinstance(batch, ReplicaBatch) else None
            health = Recorder(pipe) if cfg.health_every and step % cfg.health_every == 0 else None  # --health-every
            with precision(), health or contextlib.nullcontext():
                loss = float(pipe.step(batch.inputs, batch.target, share=shared))

            def again(seed: int = seed, batch: Any = batch, shared: Any = shared) -> Any:
                torch.manual_seed(seed)  # the step again, as it ran, every layer watched
                with precision():
                    return locate(pipe, batch.inputs, batch.target, share=shared)

            # (read once: checked, then clipped; the health metrics' global norm is theirs, before clipping)
            norms = grad_norms(pipe.parameters()) if cfg.clip_norm or health else None
            report = health.result(norms) if health is not None else None
            # NaN or Inf: stops, or says why the update is skipped
            skipped = guard.check(step, loss, again, norms, None if report is None else report.grad_norm)
            if norms is not None and skipped is None:
                clip_grad_norm_per_parameter(pipe.parameters(), cfg.clip_norm, norms=norms)
            # From the update to the step's metrics line, Ctrl-C and SIGTERM wait: a checkpoint written
            # on interruption is then labelled with the step whose update its weights hold.
            with interrupts.held():
                if skipped is None:
                    optimizer.step() if rates is None else rates.step()
                scheduler.step()  # (the learning rate follows the step number)
                done = step
                seconds = time.perf_counter() - began
                last = {
                    "step": step,
                    "loss": loss if math.isfinite(loss) else None,
                    "lr": scheduler.get_last_lr()[0],
                    rate: batch.count / seconds,
                    "bubble": bubble,
                }
                if rates is not None:  # the learned rates of the step that ran
                    last.update(rates.metrics(last["lr"]))
                if report is not None:
                    last.update(report.metrics())
                if skipped is not None:
                    last["skipped"] = skipped
                if guard.skips:
                    last["skips"] = guard.skips
                if step == start and isinstance(data, Documents):  # (instruction records: cut, left out)
                    last["records_cut"], last["records_skipped"] = data.cut, sum(data.skipped.values())
                if tokens:  # the real tokens of the step, and the share of its positions that is padding
                    last["tokens"] = batch.count
                    if (padding := getattr(batch, "padding", None)) is not None:  # (pairs, packed or not rows)
                        last["padding"] = padding
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    with precision():  # (the held-out losses of the model as it trains)
                        held_out = evaluate(
                            pipe,
                            data,
                            loss_fn,
                            batch=cfg.batch,
                            batches=cfg.eval_batches,
                            beam=cfg.beam,
                            length_penalty=cfg.length_penalty,
                            cross_entropy=cross_entropy,
                        )
                    last.update(held_out)
                    if cfg.transparent:  # the learned mixes (every rank: shared by the rank that holds them)
                        last.update(transparent_weights(pipe))
                    if cfg.experts:  # the routing of the held-out batches (every rank: summed over them)
                        last.update(routing_metrics(pipe) or {})
                    shown = eval_postfix(last)
                last["elapsed_s"] = trained + time.perf_counter() - began_run  # (wall time, the resumes' summed)
                if process_rank() == 0:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(last) + "\n")
                if on_eval is not None and "eval_loss" in last:
                    stop = on_eval(step, last)
                if board is not None:
                    for name, value in last.items():
                        if name == "elapsed_s":
                            continue  # (TensorBoard keeps each value's wall time)
                        if isinstance(value, str):
                            board.add_text(name, value, step)
                        elif name != "step":
                            board.add_scalar(name, math.nan if value is None else value, step)  # (None: NaN)
                if bar is not None:
                    speed = {f"{data.unit}/s": f"{last[rate]:.0f}"}  # tokens/s or images/s
                    skips = {"skips": str(guard.skips)} if guard.skips else {}
                    bar.set_postfix(loss=f"{loss:.3f}", **speed, bubble=f"{bubble:.2f}", **skips, **shown)
                    bar.update(1)
            if restart is not None and step == start and process_rank() == 0:
                restart.log(time.time(), start - 1)  # (OUT/restarts.jsonl: the time from the failure to this step)
            if stop:
                break  # (the checkpoint of this step is written below)
            if step % cfg.checkpoint_every == 0:
                checkpoints.save(step, background=True)
        if board is not None:
            hparams_end(board)  # (the last steps done, or stopped by on_eval: the session ended, not lost)
    except BatchError as exc:  # bad data found mid-run (an image that cannot be read): one line, as a bad flag
        checkpoints.finish()
        kept = f"; the checkpoint of step {checkpoints.saved} is kept: fix the data, then --resume"
        where = f"--data {cfg.data!r}: " if cfg.data else ""
        raise ConfigError(f"{where}{exc}{kept if checkpoints.saved else ''}") from exc
    except NonFiniteError as exc:  # every rank stops at the same step: the checkpoint of the step before it
        interrupts.restore()
        if bar is not None:
            bar.close()
        if guard.clean:  # (not if the bad step changed running statistics: the newest checkpoint stays)
            checkpoints.save(done)
        checkpoints.finish()
        exc.kept = checkpoints.saved
        raise
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (torchrun's agent stops the group when a worker failed)
        interrupts.restore()
        if bar is not None:
            bar.close()
        _record(out, exc)  # (before the save: with a rank lost it fails, or waits)
        checkpoints.save(done)
        checkpoints.finish()
        print(f"\ninterrupted: checkpoint of step {done} written to {out / 'checkpoints'}", file=sys.stderr)
        raise
    finally:
        loader.close()
        interrupts.restore()
        if board is not None:
            board.close()
    if bar is not None:
        bar.close()
    checkpoints.save(done)
    checkpoints.finish()
    if process_rank() == 0:
        plot_curves(metrics_path, out / "loss.png", baseline, data.baseline_name)
        plot_health(metrics_path, out / "grad_norm_ratio.png")  # (when --health-every logged any)
        final = last.get("loss")
        evaluated = f", {said}" if (said := eval_summary(last)) else ""
        print(
            f"step {done}: loss {float('nan') if final is None else final:.4f}{evaluated} ({data.baseline_name} "
            f"baseline {baseline:.4f}); metrics in {metrics_path}, curves in {out / 'loss.png'}"
        )
        if "sample" in last:
            print(f"sample: {last['sample']}")
        if isinstance(data, TranslationDataset) and "bleu" in last:
            print(bleu_table(last, data.pair_sizes))
    return {**last, "baseline": baseline, **({"stopped": done} if stop else {})}
