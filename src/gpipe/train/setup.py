"""What a run of ``gpipe train`` builds in each process: the data set (and ``--data FOLDER``'s
vocabulary), the model on the meta device (the transformer, AmoebaNet-D, a Hugging Face causal LM)
and the optimizer."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from gpipe.data import (
    Dataset,
    ImageDataset,
    ImageFiles,
    ParallelCorpus,
    SyntheticImages,
    SyntheticTranslation,
    TextPairs,
    TokenDataset,
)
from gpipe.data.vocab import Vocab, read_pairs, train_vocab
from gpipe.models import amoebanet, amoebanet_d, hf, transformer
from gpipe.recipe import adafactor, rmsprop
from gpipe.sequential import to_sequential
from gpipe.train.config import ConfigError, TrainConfig

__all__ = ["make_data", "make_model", "make_optimizer", "process_rank", "translation_model"]


def process_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def make_optimizer(cfg: TrainConfig, params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "adafactor":
        return adafactor(params)
    if cfg.optimizer == "rmsprop":
        return rmsprop(params, lr=1.0)
    return torch.optim.Adam(params, lr=1.0, betas=(0.9, 0.98), eps=1e-9)


def make_data(cfg: TrainConfig) -> Dataset:
    if cfg.model == "hf":  # a causal LM: one sequence of pairs' tokens, or a text file's lines
        if cfg.data:
            return hf.text_data(cfg.data, seed=cfg.seed)
        return hf.CausalPairs(SyntheticTranslation(temperature=cfg.temperature, seed=cfg.seed))
    if cfg.model == "amoebanet":
        if cfg.data:
            return ImageFiles(cfg.data, size=cfg.image_size, seed=cfg.seed)
        return SyntheticImages(classes=cfg.classes, size=cfg.image_size, seed=cfg.seed)
    if cfg.parallel_folder:
        return ParallelCorpus(cfg.data, _vocab(cfg), length=cfg.max_length, temperature=cfg.temperature,
                              held_out=cfg.eval_sentences, seed=cfg.seed)  # fmt: skip
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
            model = amoebanet_d(cfg.depth, cfg.filters, classes=images.classes, in_channels=images.channels,
                                stem_cells=cfg.stem_cells)  # fmt: skip
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
    return transformer(cfg.depth, cfg.hidden, cfg.heads, dim=cfg.dim, vocab=vocab, max_len=max(64, length),
                       dropout=cfg.dropout, logit_clip=cfg.logit_clip or None)  # fmt: skip


def _vocab(cfg: TrainConfig) -> Vocab:
    """``--data FOLDER``'s shared vocabulary: ``--vocab``, or ``OUT/vocab.model``, trained by rank 0
    on the first run (from ``min(10^6, sentence pairs)`` draws at ``--temperature``) and written
    whole or not at all."""
    path = cfg.vocab_path()
    if not path.exists():
        if cfg.resume:
            raise ConfigError(f"--resume: the run's vocabulary {str(path)!r} is missing; restore it, or start afresh")
        error = None
        if process_rank() == 0:
            try:
                _train_vocab(cfg, path)
            except ValueError as exc:
                error = f"--data {cfg.data!r}: {exc}"
        if dist.is_initialized():
            shared = [error]
            dist.broadcast_object_list(shared, src=0)
            error = shared[0]
        if error is not None:
            raise ConfigError(error)
    elif not cfg.vocab and not cfg.resume and process_rank() == 0:
        print(f"using the vocabulary {path} of an earlier run (delete it to train a new one)", file=sys.stderr)
    try:
        return Vocab(path)
    except ValueError as exc:
        raise ConfigError(f"{exc}; give a SentencePiece .model as --vocab") from exc


def _train_vocab(cfg: TrainConfig, path: Path) -> None:
    pairs = read_pairs(cfg.data)
    draws = min(1_000_000, sum(len(p) for p in pairs.values()))
    print(f"training a vocabulary of {cfg.vocab_size} pieces on {draws} sentence pairs of {cfg.data} "
          f"(T={cfg.temperature:g}) into {path}", file=sys.stderr)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.stem}.tmp-{os.getpid()}"
    try:
        model = train_vocab(pairs, staging, size=cfg.vocab_size, temperature=cfg.temperature, sample=draws,
                            seed=cfg.seed)  # fmt: skip
        os.replace(f"{staging}.vocab", path.with_suffix(".vocab"))
        os.replace(model, path)  # last: a complete vocabulary appears at once
    finally:
        for leftover in (f"{staging}.vocab", f"{staging}.model"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)


def _tokens(data: Dataset) -> TokenDataset:
    if not isinstance(data, TokenDataset):
        raise TypeError(f"a language model needs token data, got {type(data).__name__}")
    return data


def _images(data: Dataset) -> ImageDataset:
    if not isinstance(data, ImageDataset):
        raise TypeError(f"an image classifier needs image data, got {type(data).__name__}")
    return data


def _hf_model(cfg: TrainConfig, data: TokenDataset) -> torch.nn.Sequential:
    """The Hugging Face model as pipeline layers, on the meta device like the built-in models: each
    process materializes its own stages' layers, initialized by the model's ``_init_weights``
    seeded per layer from ``--seed``, alike in every process and for every partition count."""
    config = cfg.hf_model_config()
    where = f"--hf-config {cfg.hf_config!r}" if config is not None else "the built-in GPT-2"
    try:
        if config is None:
            config = hf.default_config(data.vocab, data.length, cfg.dropout)
        else:
            hf.check_config(config, where, data.vocab, data.length)
    except ValueError as exc:  # (its messages name the config)
        raise ConfigError(str(exc)) from exc
    try:
        model = hf.build(config)
    except ValueError as exc:  # a setting from_config refuses, or a model that is not causal
        raise ConfigError(f"{where}: {exc}") from exc
    return to_sequential(model, data.batch(2, 0, split="eval").inputs)
