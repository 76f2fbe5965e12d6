"""``gpipe.Pipeline``: the step API, for every schedule.

``loss = pipe.step(inputs, target)`` runs one training step — the forward and backward of every
micro-batch in the order the schedule says, the loss computed per micro-batch on the last stage — and
leaves the gradients of the mini-batch's mean loss in the parameters for the optimizer; ``pipe(inputs)``
runs the forwards only, for evaluation. Inputs, targets and what layers hand on may be any pytree (see
:mod:`gpipe.microbatch`). The same script runs in one process (a worker thread per device) or under
``torchrun`` (one process per worker, each holding only its stages; every rank calls ``step`` alike and
gets the loss). Building — placement, partitions, ties, transport — is :mod:`gpipe.engine`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.checkpoint import Checkpoint, Selective, check_mode, checkpoint_stop, selective
from gpipe.distributed import init_from_env
from gpipe.distributed.devices import comm_device
from gpipe.distributed.experts import check_expert_parallel
from gpipe.distributed.tensor_parallel import TpPlan, check_plan
from gpipe.engine import build
from gpipe.microbatch import Share, batch_size, gather, scatter, scatter_pair
from gpipe.runtime.context import LossFn, StepContext, loss_scale
from gpipe.runtime.decoding import DecodeTrace, Feed, Streams, decode
from gpipe.runtime.partition import Layers, as_balance, check_chunks
from gpipe.runtime.planner import AutoSchedule
from gpipe.runtime.trace import StepTrace
from gpipe.schedule.decode import min_groups
from gpipe.schedule.generate import SCHEDULES
from gpipe.schedule.ir import Schedule
from gpipe.sequential import as_layers

__all__ = ["Pipeline"]


class Pipeline(nn.Module):
    """A model cut into stages that trains one mini-batch per :meth:`step` under a schedule.

    Args:
        module: an ``nn.Sequential`` (on the meta device too), a list of layer factories (each
            process builds its own; initialized seeded by global index, so independent of K), or
            any other module, traced into layers on ``sample`` (:func:`gpipe.to_sequential`).
        balance: the number of layers of each stage (K x ``virtual`` stages; the schedule places
            them on the K workers), or ``'auto'``: time each layer on ``sample`` and split exactly.
        chunks: M, the number of micro-batches of a mini-batch.
        schedule: a name in ``gpipe.schedule.SCHEDULES`` ('gpipe' (fill-drain), '1f1b',
            'interleaved-1f1b', 'zb-h1', 'zb-h2', 'zb-v', 'dualpipev'), or ``'auto'`` /
            :class:`gpipe.AutoSchedule`: planned from measured costs within a memory cap.
        loss_fn: ``loss_fn(output, target) -> scalar``, applied per micro-batch (None: a pipeline for
            inference, whose :meth:`step` refuses to run): by default a mean
            over the micro-batch's samples, weighted by its share of the mini-batch's samples, so
            that the step's gradients are those of the mean loss over the mini-batch.
        loss_count: for a loss averaged over items (tokens that are not padding): counts a target's
            items; ``loss_fn`` then returns a micro-batch's *sum*, and the step's loss is the
            mini-batch's item mean (e.g. ``gpipe.recipe.count_tokens(pad)``).
        checkpoint: which micro-batches are re-materialized ('always', 'except_last', 'never'), or a
            :class:`gpipe.Selective` policy: which layers, and which operators' outputs they keep.
        devices: one device per worker (default: the GPUs, or 'cpu' for each).
        virtual: stages per worker (2 for the V schedules; any for 'interleaved-1f1b').
        cpu_threads: intra-op threads per CPU worker (default: shared out); fix it for bitwise
            reproducibility across partition counts on CPU.
        deferred_batch_norm: per-micro-batch batch-norm statistics, running averages per mini-batch.
        measure_memory: record every worker's peak activation memory in each step's trace
            (``last_trace.peak_activation_bytes``); costs a hook call per saved tensor.
        timeout: under torch.distributed, seconds a transfer or collective may take before the step
            fails naming the rank that does not answer (one that dies or raises is named at once).
        data_parallel: under torch.distributed, replicas of the pipeline (world = data_parallel x K,
            a DeviceMesh ("dp", "pp")); each trains on its share of the global mini-batch.
        fsdp: shard each stage's parameters, gradients and optimizer state over its data-parallel
            group (torch's ``fully_shard``) instead of replicating them: the parameters are
            gathered once per step before the stage's first action and the gradients
            reduce-scattered once after its last backward, as actions of the schedule
            (:func:`gpipe.schedule.ir.sharded`). Needs ``data_parallel`` >= 2; the parameters
            are then ``DTensor`` shards (build the optimizer from ``pipe.parameters()``).
        expert_parallel: under torch.distributed, split the experts of each mixture-of-experts layer
            (a module with ``gpipe_split_experts``: ``gpipe.models.moe.MoEFeedForward``, transformers'
            experts after ``gpipe.models.hf_moe.prepare_split``) over this
            many replicas (it divides ``data_parallel``), with an all-to-all of the tokens per layer
            and micro-batch (:mod:`gpipe.distributed.experts`). With ``fsdp``, FSDP shards the
            other parameters.
        tensor_parallel: under torch.distributed, split each layer that has a plan over this many
            ranks (world = data_parallel x K x tensor_parallel, a DeviceMesh ("dp", "pp", "tp")):
            the tp ranks of a stage run it together on the same micro-batches.
        tp_plan: how layers are split (:mod:`gpipe.distributed.tensor_parallel`): 'auto' (a
            layer's own ``tensor_parallel_plan``, as gpipe's Transformer layers have, or the
            Hugging Face model's ``base_model_tp_plan``: Llama, Qwen2, Mistral), a dict of
            module-name patterns to ``torch.distributed.tensor.parallel`` styles, or a function
            ``plan(layer, tp_mesh)``. Dropout between the two halves of a split pair draws per
            rank: such a model is not bitwise partition-invariant with dropout.
        init_seed: the seed layers built here (factories, the meta device) are initialized from.
        sample: a mini-batch of inputs: to trace a module that is not an ``nn.Sequential`` (on its
            first micro-batch, what the first layer gets), and to time the layers for ``balance='auto'``.
        tied: groups of '<layer index>.<parameter name>' that are one parameter; copies' gradients
            are summed. Parameters several layers hold as one object are tied without being named.
        init_fn: initializes a layer materialized from the meta device in place (default: the
            layer's own, e.g. a traced Hugging Face model's ``_init_weights``, or ``reset_parameters``).
    """

    def __init__(
        self,
        module: Layers,
        balance: Sequence[int] | str,
        *,
        chunks: int,
        loss_fn: LossFn | None = None,
        schedule: str | AutoSchedule = "gpipe",
        checkpoint: Checkpoint = "except_last",
        devices: Sequence[torch.device | str | int] | None = None,
        virtual: int = 1,
        cpu_threads: int | None = None,
        deferred_batch_norm: bool = False,
        measure_memory: bool = False,
        timeout: float = 60.0,
        data_parallel: int = 1,
        fsdp: bool = False,
        expert_parallel: int = 1,
        tensor_parallel: int = 1,
        tp_plan: TpPlan = "auto",
        init_seed: int = 0,
        sample: Any = None,
        tied: Sequence[Sequence[str]] = (),
        loss_count: Callable[[Any], int | Tensor] | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(schedule, AutoSchedule) and schedule not in (*SCHEDULES, "auto"):
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}, auto")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target) (loss_fn: {loss_fn!r})")
        if loss_count is not None and not callable(loss_count):
            raise TypeError(
                f"loss_count must be callable as loss_count(target) -> number of items (loss_count: {loss_count!r})"
            )
        if not isinstance(data_parallel, int) or data_parallel <= 0:
            raise ValueError(f"data_parallel must be a positive integer (data_parallel: {data_parallel!r})")
        if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel <= 0:
            raise ValueError(f"tensor_parallel must be a positive integer (tensor_parallel: {tensor_parallel!r})")
        distributed = init_from_env(timeout) and dist.get_world_size() > 1
        if data_parallel > 1 and not distributed:
            raise ValueError(
                f"data_parallel={data_parallel} needs torch.distributed (run under torchrun with "
                f"data_parallel x stages processes)"
            )
        if tensor_parallel > 1 and not distributed:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} needs torch.distributed (run under torchrun with "
                f"data_parallel x stages x tensor_parallel processes)"
            )
        check_plan(tp_plan)
        if not isinstance(fsdp, bool):
            raise TypeError(f"fsdp must be True or False (fsdp: {fsdp!r})")
        if fsdp and data_parallel < 2:
            raise ValueError(
                f"fsdp=True shards each stage over its data-parallel replicas, but data_parallel={data_parallel}: "
                "give data_parallel >= 2 (world = data_parallel x stages under torchrun)"
            )
        check_expert_parallel(expert_parallel, data_parallel, distributed=distributed)
        self.loss_count, self.virtual = loss_count, virtual
        self.trains = loss_fn is not None  # (an inference pipeline's step refuses)
        # What the layers say about generating (gpipe.generation.traced.cached_layers's), for generate.
        self.generation = getattr(module, "generation", None) if isinstance(module, nn.Sequential) else None
        # The model's first and last block (gpipe.health.mark_blocks), for the gradient-norm ratio.
        self.health_blocks = getattr(module, "health_blocks", None) if isinstance(module, nn.Sequential) else None
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_mode(checkpoint)
        self.engine = build(
            as_layers(module, sample, self.chunks * data_parallel), as_balance(balance), schedule=schedule,
            chunks=self.chunks, loss_fn=loss_fn,
            devices=devices, virtual=virtual, cpu_threads=cpu_threads, deferred_batch_norm=deferred_batch_norm,
            timeout=timeout, data_parallel=data_parallel, fsdp=fsdp, expert_parallel=expert_parallel,
            tensor_parallel=tensor_parallel,
            tp_plan=tp_plan, init_seed=init_seed, sample=sample, tied=tied, init_fn=init_fn, distributed=distributed,
        )  # fmt: skip
        self.partitions = nn.ModuleDict({str(s): p for s, p in self.engine.partitions.items()})
        self.schedule = self.engine.planner.name
        self.balance, self.devices = self.engine.balance, self.engine.devices
        if isinstance(self.checkpoint, Selective):
            self.checkpoint.check_layers(sum(self.balance))
        self.distributed, self.data_parallel, self.fsdp = distributed, data_parallel, fsdp
        self.tensor_parallel, self.expert_parallel = tensor_parallel, expert_parallel
        self.schedule_for(self.chunks)  # fail now, not at the first step, if the schedule can't be made
        self.measure_memory = measure_memory
        self.last_trace: StepTrace | None = None
        self.last_decode: DecodeTrace | None = None

    @property
    def num_workers(self) -> int:
        """K: devices in one process, or ranks under torch.distributed."""
        return self.engine.placement.num_workers

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel replica (0 without data parallelism)."""
        return self.engine.comm.dp_rank

    def schedule_for(self, microbatches: int) -> Schedule:
        """The validated schedule for a mini-batch of ``microbatches`` micro-batches."""
        return self.engine.planner.schedule_for(microbatches)

    def step(self, inputs: Any, target: Any, *, share: Share | None = None) -> Tensor:
        """Forward and backward of one mini-batch; returns its mean loss (detached). Gradients are
        accumulated into the parameters' ``.grad``. ``inputs`` and ``target`` are pytrees (a tensor,
        a tuple, a dict, ...) whose tensors have the same size in dim 0.

        With data parallelism each replica takes its share of the mini-batch it is given; with
        ``share`` (a :class:`gpipe.microbatch.Share`) ``inputs`` and ``target`` are already this
        replica's share (the rows ``torch.chunk`` gives it), and ``share`` says the mini-batch's size
        and ``loss_count`` of its whole target: the same step, without reading the other rows."""
        if not self.trains:
            raise TypeError(
                "Pipeline.step trains with a loss: this pipeline was built without loss_fn (for inference: "
                "pipe(inputs), decoding); build it with Pipeline(..., loss_fn=...) to train"
            )
        if target is None:
            raise TypeError(
                "Pipeline.step(inputs, target) needs the target that loss_fn compares the output with "
                "(target: None); to run the forward pass alone, call pipe(inputs)"
            )
        engine, comm = self.engine, self.engine.comm
        total = share.size if share is not None else batch_size(scatter(inputs, 1)[0])
        self._check_exchanges(total)
        if share is None:
            batches, targets, sizes = scatter_pair(comm.share(inputs), comm.share(target), self.chunks)
            scale = loss_scale(self.loss_count, target, sizes, total)
            shares = [n / total for n in sizes]
        else:
            count = self._check_share(share, batch_size(scatter(inputs, 1)[0]))
            batches, targets, sizes = scatter_pair(inputs, target, self.chunks)
            scale = loss_scale(None if count is None else (lambda _: count), None, sizes, share.size)
            shares = [n / share.size for n in sizes]
        last = engine.executor.stages.get(engine.placement.num_stages - 1)
        seed = comm.seed()
        with torch.enable_grad():
            ctx = StepContext.capture(
                num_microbatches=len(batches),
                checkpoint_stop=checkpoint_stop(self.checkpoint, len(batches)),
                selective=selective(self.checkpoint),
                training=self.training,
                seed=seed,
                targets=[last.receive(t).value for t in targets] if last is not None else None,
                loss_scale=scale,
                shares=shares,
                first_microbatch=comm.dp_rank * self.chunks,
            )
            schedule = self.schedule_for(len(batches))
            meter = self.measure_memory or engine.planner.measures_memory(len(batches))
            run, losses = engine.executor.step(schedule, batches, ctx, measure_memory=meter)
        engine.planner.observe(len(batches), schedule, run.trace, run.meter)
        comm.sync_ties(engine.ties)
        # (sharded stages reduce-scattered theirs in the schedule's G actions, all but split experts')
        comm.reduce_gradients([p.grad for p in self.parameters() if p.grad is not None], dense=not self.fsdp)
        peak = tuple(run.meter.peak) if run.meter is not None else None
        self.last_trace = StepTrace(schedule, run.trace, peak)
        return comm.loss(torch.stack([b.value for b in losses]).sum() if losses else None)

    def _check_exchanges(self, rows: int) -> None:
        """With experts split over replicas, refuse a mini-batch of ``rows`` on which the replicas would
        run different numbers of micro-batches: their all-to-alls pair up one for one."""
        if self.expert_parallel == 1:
            return
        counts = {min(self.chunks, Share(size=rows).rows(self.data_parallel, r)) for r in range(self.data_parallel)}
        if len(counts) > 1:
            raise ValueError(
                f"a mini-batch of {rows} rows gives the {self.data_parallel} replicas {sorted(counts)} micro-batches "
                f"(chunks={self.chunks}); with expert_parallel={self.expert_parallel} every replica runs as many "
                "(their experts exchange tokens per micro-batch): give at least chunks rows to each replica"
            )

    def _check_share(self, share: Share, rows: int) -> int | None:
        """``share`` checked against this replica's ``rows``; the whole mini-batch's count (None without
        ``loss_count``)."""
        want = share.rows(self.data_parallel, self.dp_rank)
        if rows != want or want == 0:
            raise ValueError(
                f"Pipeline.step(share=Share(size={share.size})): data-parallel replica {self.dp_rank} of "
                f"{self.data_parallel} takes {want} row(s) of a mini-batch of {share.size} (as torch.chunk splits it), "
                f"but was given {rows}; give it those rows, or the whole mini-batch without share"
            )
        if self.loss_count is not None and share.count is None:
            raise ValueError(
                "Pipeline.step(share=...): this pipeline's loss_count counts the whole mini-batch's items; give "
                "Share(size=..., count=loss_count(the whole target))"
            )
        return share.count if self.loss_count is not None else None

    def check_decodable(self) -> None:
        """Refuse, in one line, a layout decoding does not support (replicas of the pipeline)."""
        if self.data_parallel > 1 or self.tensor_parallel > 1:
            raise NotImplementedError(
                f"decoding a Pipeline with data_parallel={self.data_parallel}, "
                f"tensor_parallel={self.tensor_parallel} is not supported: build one with neither to decode"
            )

    def from_last_stage(self, value: Tensor | None, shape: tuple[int, ...] = ()) -> Tensor:
        """A float tensor of ``shape`` (a scalar by default) known where the last stage runs
        (``None`` elsewhere), on every rank (across ranks as float32)."""
        return self.engine.comm.from_last_stage(value, shape)

    def forward(self, inputs: Any) -> Any:
        """The forwards only, without autograd, for evaluation; returns the gathered output (under
        torch.distributed: on the last stage's rank, ``None`` on the others; with data parallelism,
        each replica evaluates and returns its share)."""
        self._check_exchanges(batch_size(scatter(inputs, 1)[0]))
        batches = scatter(self.engine.comm.share(inputs), self.chunks)
        seed = self.engine.comm.seed()
        with torch.no_grad():
            ctx = StepContext.capture(
                num_microbatches=len(batches), checkpoint_stop=0, training=self.training, seed=seed,
                first_microbatch=self.engine.comm.dp_rank * self.chunks,
            )  # fmt: skip
            _, outputs = self.engine.executor.forward(self.schedule_for(len(batches)), batches, ctx)
        return gather(outputs) if outputs else None

    def generate(
        self,
        input_ids: Tensor,
        *,
        max_new_tokens: int,
        attention_mask: Tensor | None = None,
        num_beams: int = 1,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = 50,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_return_sequences: int = 1,
        groups: int | None = None,
    ) -> Tensor:
        """Continue the prompts ``input_ids`` (batch, length; left-padded, ``attention_mask`` 0 on
        the padding) of a causal LM built by :func:`gpipe.generation.traced.cached_layers`, with key/value
        caches in the stages and ``groups`` groups of prompts in flight (default: one per stage).
        Greedy by default; ``num_beams`` > 1: beam search; ``do_sample``: sampling (``temperature``,
        ``top_k``, ``top_p``; ``seed``: each prompt's own random stream, the same tokens whatever
        the stages and groups). The arguments and the result are transformers' ``generate``'s (the
        prompts, then the new tokens, finished sequences padded); ``eos_token_id`` and
        ``pad_token_id`` default to the model's. Every rank calls it alike and gets the result."""
        from gpipe.generation.generate import Settings, generate, share_from

        if self.generation is None:
            raise ValueError(
                "this pipeline's layers cannot generate: build it from gpipe.generation.traced.cached_layers(model) "
                "(a Hugging Face causal LM traced with caches), not from the model or to_sequential"
            )
        settings = Settings(
            max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=do_sample, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
            length_penalty=length_penalty, early_stopping=early_stopping, num_return_sequences=num_return_sequences,
        )  # fmt: skip
        if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
            raise ValueError(f"groups must be an integer >= 1 (groups: {groups!r})")
        placement = self.engine.placement
        src, group, device = None, None, torch.device("cpu")
        if self.distributed:
            src = placement.rank_of(placement.num_stages - 1)
            group = getattr(self.engine.comm, "pp_group", None)
            device = comm_device(self.engine.devices[0], group)
        rows = input_ids.size(0) if isinstance(input_ids, Tensor) and input_ids.dim() else 1
        share = share_from(src, group, device)
        if groups is None:  # one per stage, fewer for fewer prompts, but never fewer than the placement needs
            groups = max(min(placement.num_stages, rows), min_groups(placement.worker_of))
        return generate(self.decode, self.generation, input_ids, attention_mask, settings, groups=groups, share=share)

    def decode(self, feed: Feed) -> DecodeTrace:
        """Decode ``feed``'s groups of sequences through the stages, each stage keeping the groups'
        caches, several groups in flight (:mod:`gpipe.runtime.decoding`); returns what this process
        did (also kept as ``last_decode``). Under torch.distributed every rank calls it alike; the
        feed's choices are made where the last stage runs."""
        if self.training:
            raise ValueError("decode a pipeline in evaluation mode: call pipe.eval() first")
        self.check_decodable()
        streams: Streams | None = None
        if self.distributed:
            from gpipe.distributed.channels import ChannelTransport
            from gpipe.distributed.streams import ChannelStreams

            transport = self.engine.executor.transport
            assert isinstance(transport, ChannelTransport)
            streams = ChannelStreams.of(transport)
        with torch.random.fork_rng(devices=[]):  # (the seed leaves the global generator to the feed's draws)
            seed = self.engine.comm.seed()
        self.last_decode = decode(self.engine.executor, feed, streams=streams, seed=seed)
        return self.last_decode
