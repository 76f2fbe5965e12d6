"""What a run of ``gpipe train`` builds in each process: the data set (and ``--data FOLDER``'s
vocabulary), the model on the meta device (the transformer, AmoebaNet-D, a Hugging Face causal LM)
and the optimizer."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpipe.balance import balance_by_flops
from gpipe.checkpoint import Selective
from gpipe.data import (
    Dataset,
    ImageDataset,
    ImageFiles,
    SyntheticImages,
    SyntheticTranslation,
    TextPairs,
    TokenDataset,
    ignore_index,
    tokenizer,
)
from gpipe.data.instruct import InstructionData
from gpipe.data.prepare import train_vocabulary
from gpipe.data.prepare_records import PreparedRecords
from gpipe.data.prepared import PreparedCorpus, PreparedText, read_manifest
from gpipe.data.records import is_records
from gpipe.data.text import CausalPairs, TextLines, Tokenizer, read_lines, text_data
from gpipe.data.vocab import Vocab
from gpipe.distributed import choose_devices
from gpipe.models import amoebanet, amoebanet_d, hf, hf_moe, lora, pretrained, transformer
from gpipe.pipeline import Pipeline
from gpipe.recipe import adafactor, count_tokens, label_smoothing_loss, rmsprop
from gpipe.train.config import ConfigError, TrainConfig
from gpipe.train.data import on_rank_zero, prepared_folder
from gpipe.train.initial import PRETRAINED, init_source, init_tokenizer

__all__ = [
    "Losses",
    "hf_config",
    "image_model",
    "make_data",
    "make_losses",
    "make_model",
    "make_optimizer",
    "make_pipeline",
    "process_rank",
    "translation_model",
]


def process_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


STATE_BYTES = {"adam": 16.0, "adafactor": 8.0, "rmsprop": 12.0, "sgd": 12.0}
"""What a float32 parameter holds in training, by ``--optimizer``: weight, gradient and optimizer state
(Adam's two moments; Adafactor's factored ones, next to nothing; RMSprop's one; SGD's momentum)."""


def make_optimizer(cfg: TrainConfig, params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = (p for p in params if p.requires_grad)  # (--lora: the frozen weights have no optimizer state)
    if cfg.optimizer == "adafactor":
        return adafactor(params)
    if cfg.optimizer == "rmsprop":
        return rmsprop(params, lr=1.0)
    if cfg.optimizer == "sgd":  # (momentum 0.9)
        return torch.optim.SGD(params, lr=1.0, momentum=0.9)
    return torch.optim.Adam(params, lr=1.0, betas=(0.9, 0.98), eps=1e-9)


@dataclass(frozen=True)
class Losses:
    """A run's losses: ``loss_fn(logits, target, reduction=...)`` (the training loss, label
    smoothed; its evaluations' too), ``cross_entropy`` (``--model hf``: without label smoothing, for
    the held-out perplexity; else None), and ``tokens`` (whether they are token means, padding left
    out, rather than means over images)."""

    loss_fn: Callable[..., torch.Tensor]
    cross_entropy: Callable[..., torch.Tensor] | None
    tokens: bool


def make_losses(cfg: TrainConfig, data: Dataset) -> Losses:
    """The losses of a run on ``data`` (:class:`Losses`)."""
    tokens = data.unit != "images"
    ignore = ignore_index(data)
    loss_fn: Any = functools.partial(label_smoothing_loss, smoothing=cfg.label_smoothing, ignore_index=ignore)
    cross_entropy: Any = None
    if cfg.model == "hf":  # its last layer returns the model's ModelOutput
        loss_fn = functools.partial(hf.logits_loss, loss_fn)
        plain = functools.partial(label_smoothing_loss, smoothing=0.0, ignore_index=ignore)
        cross_entropy = functools.partial(hf.logits_loss, plain)
    return Losses(loss_fn, cross_entropy, tokens)


def make_pipeline(
    cfg: TrainConfig, model: torch.nn.Sequential, data: Dataset, losses: Losses, *, distributed: bool
) -> Pipeline:
    """The run's :class:`~gpipe.Pipeline` of ``model``: ``--partitions`` stages balanced by FLOPs (from
    shapes, on the meta device; for ``--model hf`` by memory too, within 5% of that time:
    :data:`STATE_BYTES`), the schedule, re-materialization and layout the settings say; the
    same for ``gpipe train`` and ``gpipe eval`` (which evaluates a checkpoint with the numbers
    training's own evaluation had). Token losses leave out padding, and a step's loss is the
    mini-batch's token mean however the padding falls into micro-batches: each micro-batch sums, the
    step divides by the tokens counted."""
    sample = data.batch(cfg.batch, 0, split="eval").inputs
    # A causal LM's embedding and head hold a large share of its parameters: balanced for memory too
    state = (4 if cfg.lora else STATE_BYTES[cfg.optimizer]) if cfg.model == "hf" else None  # (frozen: weights)
    return Pipeline(
        model,
        balance_by_flops(cfg.partitions * cfg.virtual, model, sample, chunks=cfg.chunks, state_bytes=state),
        virtual=cfg.virtual,
        chunks=cfg.chunks,
        deferred_batch_norm=cfg.model == "amoebanet" and cfg.norm != "none",
        schedule=cfg.schedule,
        loss_fn=functools.partial(losses.loss_fn, reduction="sum") if losses.tokens else losses.loss_fn,
        loss_count=count_tokens(ignore_index(data)) if losses.tokens else None,
        checkpoint=Selective(save_ops="matmuls", microbatches="except_last")
        if cfg.checkpoint == "matmuls"
        else cfg.checkpoint,
        devices=_devices(cfg),
        data_parallel=cfg.data_parallel,
        fsdp=cfg.fsdp,
        expert_parallel=cfg.expert_parallel,
        tensor_parallel=cfg.tensor_parallel,
        init_seed=cfg.seed,
        cpu_threads=cfg.threads,
        timeout=cfg.timeout,
    )


def _devices(cfg: TrainConfig) -> list[torch.device] | None:
    """``--devices``' devices of the pipeline's workers (None under torchrun: each rank's own)."""
    try:
        return choose_devices(cfg.devices, cfg.partitions)
    except ValueError as exc:  # (gpipe eval's --devices, checked here)
        raise ConfigError(str(exc)) from None


def make_data(cfg: TrainConfig) -> Dataset:
    if cfg.model == "hf":  # a causal LM: one sequence of pairs' tokens, or a text file's lines
        if cfg.prepared and read_manifest(cfg.data).get("kind") == "records":  # (gpipe prepare --data FILE.jsonl)
            return PreparedRecords(cfg.data, length=cfg.max_length, seed=cfg.seed, pack=cfg.pack,
                                   train_on_prompt=cfg.train_on_prompt)  # fmt: skip
        if cfg.prepared:  # (gpipe prepare --data TEXT)
            return PreparedText(cfg.data, length=cfg.max_length, seed=cfg.seed)
        if cfg.data and is_records(cfg.data):  # instruction or chat records
            reader = _hf_tokenizer(cfg, records=True)
            return InstructionData(cfg.data, reader, length=cfg.max_length, seed=cfg.seed, pack=cfg.pack,
                                   train_on_prompt=cfg.train_on_prompt, skip_bad=cfg.skip_bad)  # fmt: skip
        if cfg.data:
            data = text_data(cfg.data, seed=cfg.seed, tokenizer=lambda: _hf_tokenizer(cfg))
            if cfg.tokenizer and not isinstance(data, TextLines):
                raise ConfigError(
                    f"--tokenizer is for text, a document a line; --data {cfg.data!r} holds source<TAB>target lines, "
                    "read with a vocabulary of their words: leave --tokenizer out"
                )
            return data
        return CausalPairs(SyntheticTranslation(temperature=cfg.temperature, seed=cfg.seed))
    if cfg.model == "amoebanet":
        if cfg.data:
            return ImageFiles(cfg.data, size=cfg.image_size, seed=cfg.seed, augment=cfg.augment)
        return SyntheticImages(classes=cfg.classes, size=cfg.image_size, seed=cfg.seed)
    if cfg.parallel_folder:  # prepared (once, for a folder of pair files), memory-mapped
        return PreparedCorpus(prepared_folder(cfg), length=cfg.max_length, temperature=cfg.temperature, seed=cfg.seed)
    if cfg.data:
        return TextPairs(cfg.data, seed=cfg.seed)
    return SyntheticTranslation(temperature=cfg.temperature, seed=cfg.seed)


def make_model(cfg: TrainConfig, data: Dataset) -> torch.nn.Sequential:
    """The model on the meta device: each stage materializes only its own layers."""
    if cfg.model == "hf":
        return _hf_model(cfg, _tokens(data))
    if cfg.model == "amoebanet":
        images = _images(data)
        with torch.device("meta"):
            model = image_model(cfg, images.classes, images.channels)
        if cfg.norm != "none":  # (batch norm per micro-batch needs more than one value per channel)
            _check_batch_norm(cfg, model, tuple(images.batch(1, 0).inputs.shape[1:]))
        return model
    tokens = _tokens(data)
    with torch.device("meta"):
        return translation_model(cfg, tokens.vocab, tokens.length)


def _check_batch_norm(cfg: TrainConfig, model: torch.nn.Module, image: tuple[int, ...]) -> None:
    """Each micro-batch is normalized with its own statistics, which needs more than one value per
    channel in every batch norm: refuse micro-batches too small for the model's last feature maps."""
    smallest = min(len(part) for part in torch.empty(cfg.batch).chunk(cfg.chunks))  # (as scatter splits)
    pixels = amoebanet.smallest_feature_map(model, image)
    if smallest * pixels < 2:
        raise ConfigError(
            f"--batch {cfg.batch} in --chunks {cfg.chunks} makes micro-batches of {smallest} image(s), and at "
            f"{image[1]}x{image[2]} pixels AmoebaNet-D's smallest feature maps have {pixels} pixel(s): batch norm, "
            "computed per micro-batch, needs more than one value per channel. Raise --batch or --image-size, "
            "or lower --chunks"
        )


def translation_model(cfg: TrainConfig, vocab: int, length: int) -> torch.nn.Sequential:
    """The transformer ``cfg`` describes, for ``vocab`` tokens and sentences of up to ``length``
    (positions: at least 64). ``gpipe translate`` rebuilds a checkpoint's model with it."""
    return transformer(
        cfg.depth,
        cfg.hidden,
        cfg.heads,
        dim=cfg.dim,
        vocab=vocab,
        max_len=max(64, length),
        dropout=cfg.dropout,
        logit_clip=cfg.logit_clip or None,
        transparent=cfg.transparent,
        head_dim=cfg.head_dim or None,
        target_padding="end",
        experts=cfg.experts,
        expert_top_k=cfg.expert_top_k,
        capacity_factor=cfg.capacity_factor,
        moe_every=cfg.moe_every,
        moe_loss_weight=cfg.moe_loss_weight,
        norm="layer" if cfg.norm == "auto" else cfg.norm,
        init_scheme=cfg.init_scheme,
        share_layers=cfg.share_layers,
    )  # fmt: skip (gpipe's batches: at the end)


def image_model(cfg: TrainConfig, classes: int, channels: int) -> torch.nn.Sequential:
    """The AmoebaNet-D ``cfg`` describes, for images of ``channels`` channels in ``classes`` classes
    (built on the current device: the meta device, for a run)."""
    return amoebanet_d(cfg.depth, cfg.filters, classes=classes, in_channels=channels, stem_cells=cfg.stem_cells,
                       reference_cells=cfg.reference_cells, norm="batch" if cfg.norm == "auto" else cfg.norm,
                       init_scheme=cfg.init_scheme)  # fmt: skip


def _vocab(cfg: TrainConfig) -> Vocab:
    """``--model hf --data TEXT``'s SentencePiece vocabulary: ``OUT/vocab.model``, trained by rank 0
    on the first run (on ``min(10^6, lines)`` of the text's lines) and written whole or not at all.
    (A folder of language pairs gets its vocabulary where it is prepared: :mod:`gpipe.train.data`.)"""
    path = cfg.vocab_path()
    if not path.exists():
        if cfg.resume:
            raise ConfigError(f"--resume: the run's vocabulary {str(path)!r} is missing; restore it, or start afresh")
        on_rank_zero(lambda: _train_vocab(cfg, path), cfg)
    elif not cfg.resume and process_rank() == 0:
        print(f"using the vocabulary {path} of an earlier run (delete it to train a new one)", file=sys.stderr)
    try:
        return Vocab(path)
    except ValueError as exc:
        raise ConfigError(f"{exc}; delete it to train a new one") from exc


def _train_vocab(cfg: TrainConfig, path: Path) -> None:
    """Train ``path`` (and its ``.vocab``) on the text's lines (a seeded 10^6 of them where there are more):
    ``--vocab-size`` pieces, or with 0 as many as the text supports up to 8000 (said in one line when
    fewer). Both files are written whole or not at all."""
    lines = read_lines(cfg.data)
    draws = min(1_000_000, len(lines))
    train_vocabulary(lines, path, size=cfg.vocab_size, seed=cfg.seed, tags=[], sample=draws,
                     what=f"{draws} lines of {cfg.data} into {path}")  # fmt: skip


def _tokens(data: Dataset) -> TokenDataset:
    if not isinstance(data, TokenDataset):
        raise TypeError(f"a language model needs token data, got {type(data).__name__}")
    return data


def _images(data: Dataset) -> ImageDataset:
    if not isinstance(data, ImageDataset):
        raise TypeError(f"an image classifier needs image data, got {type(data).__name__}")
    return data


def _hf_tokenizer(cfg: TrainConfig, *, records: bool = False) -> Tokenizer:
    """What ``--model hf`` reads a text file with: ``--tokenizer``, else the ``--init`` folder's or
    checkpoint's, else the SentencePiece vocabulary ``OUT/vocab.model``, trained on the file's lines
    on the first run as ``--data FOLDER``'s is. Instruction ``records`` are read with the model's
    own (``--chat-template`` its chat template)."""
    path = init_tokenizer(cfg)  # (--tokenizer, or the one --init brings)
    if not path and records:
        raise ConfigError(
            f"--data {cfg.data!r} holds instruction records, read with the model's own tokenizer and chat template: "
            "give --init (a folder save_pretrained wrote, with its tokenizer) or --tokenizer"
        )
    if not path:
        return _vocab(cfg)
    try:
        return tokenizer.load(path, chat_template=cfg.chat_template or None)
    except ValueError as exc:  # (its messages name the file)
        raise ConfigError(str(exc)) from exc


def hf_config(cfg: TrainConfig, data: TokenDataset) -> Any:
    """The transformers config of a ``--model hf`` run: ``--hf-config``'s, checked against the data,
    or the built-in GPT-2 sized to it (a text's tokenizer's BOS and EOS its own). What the model is
    built from, and what every checkpoint keeps as ``config.json``."""
    config = cfg.hf_model_config()
    where = _where(cfg)
    text = data if isinstance(data, (TextLines, PreparedText, InstructionData, PreparedRecords)) else None
    try:
        if config is None:
            ends = {"bos": text.bos, "eos": text.eos} if text is not None else {}
            return hf.default_config(data.vocab, data.length, cfg.dropout, **ends)
        hf.check_config(config, where, data.vocab, data.length, eos=text.eos if text is not None else None)
    except ValueError as exc:  # (its messages name the config)
        raise ConfigError(str(exc)) from exc
    return config


def _hf_model(cfg: TrainConfig, data: TokenDataset) -> torch.nn.Sequential:
    """The Hugging Face model as pipeline layers, on the meta device like the built-in models: each
    process materializes its own stages' layers, initialized by the model's ``_init_weights``
    seeded per layer from ``--seed``, alike in every process and for every partition count.

    The layers are :func:`~gpipe.generation.traced.cached_layers`' where the model is one it covers:
    they train as :func:`~gpipe.to_sequential`'s do (the same layers, names and forward), and the
    pipeline can also generate (the evaluation's sample, ``gpipe generate``); else
    ``to_sequential``'s, and the run has no sample."""
    config = hf_config(cfg, data)
    where = _where(cfg)
    try:
        model = hf.build(config)
    except ValueError as exc:  # a setting from_config refuses, or a model that is not causal
        raise ConfigError(f"{where}: {exc}") from exc
    adapters = None
    if cfg.lora:  # on the meta model, before it is traced: the layers carry the adapters
        try:
            given = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
            targets = lora.targets_for(config, given, model=model)
            adapters = lora.add_adapters(model, rank=cfg.lora, targets=targets)
        except ValueError as exc:
            raise ConfigError(f"--lora: {exc}") from exc
    source = None
    if cfg.init and not cfg.resume and init_source(cfg.init)[0] == PRETRAINED:  # (every rank checks the folder)
        try:
            source = pretrained.plan(model, cfg.init)
        except ValueError as exc:  # (its messages name the file or the tensor)
            raise ConfigError(str(exc)) from exc
    sample = data.batch(2, 0, split="eval").inputs
    if cfg.pack:  # (refused where examples laid end to end would see each other, or the layers cannot say where)
        try:
            hf.check_packing(config)
            layers = hf.pipeline_layers(model, sample, packed=True)
        except ValueError as exc:
            raise ConfigError(f"--pack: {exc}") from exc
    else:
        layers = hf.pipeline_layers(model, sample)
    if cfg.expert_parallel > 1:  # the model's own experts, split over the replicas as the pipeline is built
        _split_hf_experts(cfg, layers)
    if source is not None:  # each stage reads its own layers' tensors as the pipeline materializes them
        pretrained.attach(layers, source)
    if adapters is not None:  # then peft's initialization of the adapters (B = 0: the model starts as it was)
        lora.with_adapter_init(layers)
        layers.lora = lora.lora_json(adapters)  # type: ignore[assignment]  # (what the checkpoints keep)
    return layers


def _split_hf_experts(cfg: TrainConfig, layers: torch.nn.Sequential) -> None:
    """``--expert-parallel`` for a Hugging Face model: its experts modules made splittable
    (:mod:`gpipe.models.hf_moe`), refused in one line where there are none or they do not divide."""
    n, where = cfg.expert_parallel, _where(cfg)
    try:
        found = hf_moe.prepare_split(layers)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if not found:
        raise ConfigError(
            f"--expert-parallel {n}: {where} has no experts to split (it splits transformers' stacked experts: "
            "Mixtral, Qwen3-MoE); leave --expert-parallel out"
        )
    counts = sorted({int(getattr(m, "num_experts", 0)) for m in layers.modules() if hf_moe.splittable(m)})
    if any(c % n for c in counts):
        raise ConfigError(f"--expert-parallel {n} must divide the model's experts ({', '.join(map(str, counts))})")


def _where(cfg: TrainConfig) -> str:
    """Where ``--model hf``'s config comes from, for messages."""
    if cfg.hf_config:
        return f"--hf-config {cfg.hf_config!r}"
    return f"--init {cfg.init!r}'s config.json" if cfg.init else "the built-in GPT-2"
