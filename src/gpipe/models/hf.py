"""Hugging Face causal language models for ``gpipe train --model hf``: the config, the model built
from it, and the data a causal LM reads.

Nothing is downloaded and no code but transformers' own runs: a config comes from a local
``config.json`` (:func:`load_config`; ``local_files_only``, ``trust_remote_code=False``) or is a
small built-in GPT-2 (:func:`default_config`), and the model is built from it with random weights
(``from_config``), seeded, so that every process and every partition count starts alike.

A causal LM reads one sequence where the built-in data sets hold pairs: :class:`CausalPairs` puts a
pair's source before its target, ``source + target_in``, and counts the loss on the target tokens
only (the source is a prompt: it is random, nothing could predict it). :class:`TextLines` is a plain
text file, one document a line, read with a real tokenizer (a :class:`Tokenizer`: the SentencePiece
vocabulary a run trains on it, or a local ``tokenizer.json``, see :mod:`gpipe.models.tokenizer`).

transformers is imported only when these functions run: ``gpipe`` itself does not need it.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gpipe.data import BOS, EOS, PAD, TextPairs, TranslationBatch, entropy
from gpipe.rng import derive_seed

__all__ = [
    "CONFIG",
    "DEFAULT",
    "SAMPLE_PROMPT",
    "CausalBatch",
    "CausalPairs",
    "TextLines",
    "Tokenizer",
    "build",
    "check_config",
    "config_json",
    "decode_text",
    "default_config",
    "layer_count",
    "load_config",
    "logits_loss",
    "pipeline_layers",
    "read_lines",
    "text_data",
]

CONFIG = "config.json"  # in every checkpoint of a run: the model's config (:func:`config_json`)

DEFAULT = {"n_layer": 4, "n_embd": 128, "n_head": 4}
"""The built-in GPT-2's size; its vocabulary and positions are the data's."""


def _transformers() -> Any:
    # Offline, unless the caller says otherwise: nothing here reads the Hub (local files, from_config),
    # and this keeps anything transformers might try from reaching it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "--model hf needs transformers: install gpipe's hf extra (pip install -c constraints.txt '.[hf]' in "
            "gpipe's folder), or pip install transformers==5.23.0"
        ) from None
    return transformers


def load_config(path: str) -> Any:
    """The transformers config of ``path`` (a ``config.json``, or a folder holding one), from local
    files only; a :class:`ValueError` naming the file unless it is a causal LM's."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(
            f"--hf-config {path!r}: no such file (give a config.json, e.g. one written by "
            "GPT2Config(...).save_pretrained(folder), or the folder)"
        )
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = transformers.AutoConfig.from_pretrained(str(file), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        detail = " ".join(str(exc).split())
        raise ValueError(f"cannot read --hf-config {str(file)!r} as a transformers config: {detail}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"--hf-config {str(file)!r} is a {config.model_type!r} config, which is not a causal language "
            "model (transformers' AutoModelForCausalLM has no class for it); give a decoder's config "
            "such as gpt2, llama or qwen2"
        )
    return config


def default_config(vocab: int, positions: int, dropout: float, *, bos: int | None = BOS, eos: int | None = EOS) -> Any:
    """The built-in GPT-2: :data:`DEFAULT`'s size, the data's vocabulary and sequence length, and
    the ids of its tokens that start and end a document (``generate`` stops at ``eos``)."""
    transformers = _transformers()
    return transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        **DEFAULT,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=bos,
        eos_token_id=eos,
    )  # (no pad_token_id: padding comes after a sequence's last token, and a causal LM never sees it)


def pipeline_layers(model: nn.Module, sample: Tensor) -> nn.Sequential:
    """``model``'s pipeline layers: :func:`gpipe.generation.traced.cached_layers`' (which also
    generate, with key/value caches in the stages), or, for a model it does not cover,
    :func:`gpipe.to_sequential`'s on ``sample``, with the reason as ``cannot_generate``. Both are the
    same layers, with the same names, computing the same forward: a checkpoint loads into either."""
    from gpipe.generation.traced import cached_layers
    from gpipe.sequential import to_sequential

    try:
        return cached_layers(model)
    except ValueError as exc:
        layers = to_sequential(model, sample)
        layers.cannot_generate = str(exc)  # type: ignore[assignment]  # (a plain attribute, as cached_layers' generation)
        return layers


def layer_count(config: Any) -> int:
    """The pipeline layers :func:`gpipe.to_sequential` makes of the model: the embeddings, one per
    block, the final norm with the LM head."""
    return int(config.num_hidden_layers) + 2


def check_config(config: Any, where: str, vocab: int, positions: int, *, eos: int | None = None) -> None:
    """A :class:`ValueError` unless the config's vocabulary covers the data's token ids and its
    positions the data's sequence length (an embedding lookup out of range would fail mid-step), and
    its ``eos_token_id``, if it has one, is the data's ``eos`` (the token ``generate`` stops at)."""
    if config.vocab_size < vocab:
        raise ValueError(
            f"{where}: vocab_size {config.vocab_size} is smaller than the data's vocabulary of {vocab} tokens; "
            f"set vocab_size to {vocab} or more"
        )
    most = getattr(config, "max_position_embeddings", None)
    if isinstance(most, int) and most < positions:
        raise ValueError(
            f"{where}: {most} positions (max_position_embeddings) are fewer than the data's sequence length "
            f"of {positions} tokens; set them to {positions} or more"
        )
    ends = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    if eos is not None and config.eos_token_id is not None and eos not in ends:
        raise ValueError(
            f"{where}: eos_token_id {config.eos_token_id} is not the tokenizer's end of a document, id {eos}; set "
            f"eos_token_id to {eos} (generate stops at it)"
        )


def config_json(config: Any) -> str:
    """``config`` as the ``config.json`` a checkpoint keeps: what ``save_pretrained`` writes, its
    ``dtype`` float32, the dtype the weights are trained and saved in whatever the config says."""
    written = copy.deepcopy(config)
    written.dtype = torch.float32
    return str(written.to_json_string())


def build(config: Any) -> nn.Module:
    """The model of ``config`` on the meta device, in float32 whatever the config's dtype: the
    pipeline materializes each stage's layers only, initialized by the model's own
    ``_init_weights`` seeded per layer (the same weights in every process and for every partition
    count). A :class:`ValueError` if the model is not causal (tried on a real one-block copy)."""
    transformers = _transformers()
    probe = copy.deepcopy(config)
    probe.num_hidden_layers = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        _check_causal(transformers.AutoModelForCausalLM.from_config(probe, trust_remote_code=False), config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    return model  # type: ignore[no-any-return]


@torch.no_grad()
def _check_causal(model: nn.Module, config: Any) -> None:
    """Refuse a model whose outputs see later tokens (BERT's LM head without ``is_decoder``, say):
    trained on next tokens it would copy them. Tried, not looked up: change the last token of a
    short sequence and compare the logits before it."""
    vocab = int(config.vocab_size)
    x = torch.full((1, 4), vocab - 1)
    y = x.clone()
    y[0, -1] = max(vocab - 2, 0)
    was_training = model.training
    model.eval()
    try:
        a, b = model(x).logits[:, :-1], model(y).logits[:, :-1]
    finally:
        model.train(was_training)
    if not torch.allclose(a, b, atol=1e-5):
        raise ValueError(
            f"the {config.model_type!r} model of the config sees later tokens (it is not causal), so it cannot "
            "be trained to predict them; give a decoder's config (gpt2, llama, ...), or set is_decoder: true "
            "where the model has it"
        )


def logits_loss(loss_fn: Any, output: Any, target: Tensor, **kwargs: Any) -> Tensor:
    """``loss_fn`` on the logits of a model's output (a ``ModelOutput``, or the logits themselves)."""
    logits = output if isinstance(output, Tensor) else output.logits
    return loss_fn(logits, target, **kwargs)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class CausalBatch:
    inputs: Tensor  # (B, L) token ids
    target: Tensor  # (B, L) the next token at each position; PAD where nothing is to be predicted

    @property
    def count(self) -> int:
        return int((self.target != PAD).sum())


class _Pairs(Protocol):
    unit: str
    baseline_name: str

    @property
    def vocab(self) -> int: ...

    @property
    def length(self) -> int: ...

    def baseline(self) -> float: ...

    def batch(self, size: int, step: int, *, split: str = "train") -> TranslationBatch: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


SAMPLE_PROMPT = 8
"""The most tokens of the held-out prompt an evaluation's sample continues (:meth:`TextLines.sample_prompt`)."""


class CausalPairs:
    """Translation pairs as one sequence each, ``source + target_in``, predicting ``target_out``
    after the source: the decoder-only form of the same task, with the same tokens counted and the
    same baseline (the targets' unigram entropy)."""

    unit = "tokens"

    def __init__(self, pairs: _Pairs) -> None:
        self.pairs = pairs
        self.baseline_name = pairs.baseline_name

    @property
    def vocab(self) -> int:
        return self.pairs.vocab

    @property
    def length(self) -> int:
        return 2 * self.pairs.length

    def baseline(self) -> float:
        return self.pairs.baseline()

    def batch(self, size: int, step: int, *, split: str = "train") -> CausalBatch:
        pair = self.pairs.batch(size, step, split=split)
        return CausalBatch(
            torch.cat([pair.source, pair.target_in], dim=1),
            torch.cat([torch.full_like(pair.source, PAD), pair.target_out], dim=1),
        )

    def sample_prompt(self) -> list[int]:
        """A held-out pair's source and the first token of its target (the language's tag): an
        evaluation's sample continues it with the translation."""
        pair = self.pairs.batch(1, 0, split="eval")
        return [*pair.source[0].tolist(), int(pair.target_in[0, 0])]

    def text(self, ids: Sequence[int]) -> str:
        """``ids`` in the pairs' words (tags and padding read nothing; EOS ends them)."""
        return self.pairs.detokenize(ids)


def read_lines(path: str | os.PathLike[str]) -> list[str]:
    """The non-blank lines of the text file ``path``: its documents."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the data file {str(path)!r}: {exc}") from None


class Tokenizer(Protocol):
    """What :class:`TextLines` reads a text with: a SentencePiece :class:`~gpipe.data.vocab.Vocab`, or a
    :class:`~gpipe.models.tokenizer.HFTokenizer`."""

    @property
    def size(self) -> int: ...

    @property
    def bos(self) -> int | None: ...

    @property
    def eos(self) -> int | None: ...

    def encode_lines(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


def decode_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of ``ids`` read with ``tokenizer`` (special tokens read nothing). A model's vocabulary
    may be larger than its tokenizer's (``--hf-config``'s ``vocab_size``): an id the tokenizer does
    not have reads ``<id N>``, between the texts of the ids around it."""
    parts: list[str] = []
    run: list[int] = []
    for i in [*ids, None]:
        if i is not None and 0 <= i < tokenizer.size:
            run.append(int(i))
            continue
        if run:
            parts.append(tokenizer.decode(run))
            run = []
        if i is not None:
            parts.append(f"<id {i}>")
    return " ".join(part for part in parts if part)


class TextLines:
    """A text file, one document a line, read with ``tokenizer``: ``BOS pieces EOS`` (the tokenizer's
    own; a tokenizer.json's may have no BOS), cut at ``length`` + 1 tokens (or the longest line's, if
    shorter) and padded with id 0, which the loss leaves out: a tokenizer that gives id 0 to a token
    of the text is refused. A seeded tenth of the lines (at least one) is held out for the ``eval``
    split."""

    unit = "tokens"
    baseline_name = "unigram entropy"

    def __init__(self, path: str | os.PathLike[str], tokenizer: Tokenizer, *, length: int = 64, seed: int = 0) -> None:
        lines = read_lines(path)
        if len(lines) < 2:
            raise ValueError(
                f"{str(path)!r} holds {len(lines)} non-empty line(s); at least 2 are needed (train and eval)"
            )
        self.tokenizer = tokenizer
        first = [] if tokenizer.bos is None else [tokenizer.bos]
        last = [] if tokenizer.eos is None else [tokenizer.eos]
        documents = [[*first, *ids, *last] for ids in tokenizer.encode_lines(lines)]
        padding = [i for i, ids in enumerate(documents) if PAD in ids]
        if padding:
            raise ValueError(
                f"the tokenizer reads {len(padding)} line(s) of {str(path)!r} with id {PAD} (the first: "
                f"{lines[padding[0]][:60]!r}), which is gpipe's padding, left out of the loss; give a tokenizer whose "
                f"id {PAD} is a special token the text does not produce, such as a pad token"
            )
        self.bos, self.eos = tokenizer.bos, tokenizer.eos
        self.length = min(length, max(len(ids) for ids in documents) - 1)
        rows = torch.tensor([self._pad(ids) for ids in documents])
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(derive_seed(seed, 8, 0)))
        held = max(len(rows) // 10, 1)
        self.splits = {"eval": rows[order[:held]], "train": rows[order[held:]]}
        self.seed = seed

    @property
    def vocab(self) -> int:
        return self.tokenizer.size

    def _pad(self, ids: list[int]) -> list[int]:
        ids = ids[: self.length + 1]
        return ids + [PAD] * (self.length + 1 - len(ids))

    def baseline(self) -> float:
        """The unigram entropy (nats) of the training targets: the loss of a model ignoring its input."""
        targets = self.splits["train"][:, 1:]
        return entropy(Counter(targets[targets != PAD].tolist()))

    def batch(self, size: int, step: int, *, split: str = "train") -> CausalBatch:
        if split not in self.splits:
            raise ValueError(f"split must be one of {sorted(self.splits)} (split: {split!r})")
        g = torch.Generator().manual_seed(derive_seed(self.seed, 0 if split == "train" else 1, step))
        rows = self.splits[split]
        picked = rows[torch.randint(0, len(rows), (size,), generator=g)]
        return CausalBatch(picked[:, :-1], picked[:, 1:])

    def sample_prompt(self) -> list[int]:
        """The first held-out document's first half (BOS and pieces), at most :data:`SAMPLE_PROMPT`
        tokens and at least one: what an evaluation's sample continues."""
        document = [i for i in self.splits["eval"][0].tolist() if i != PAD]
        if self.eos is not None and document and document[-1] == self.eos:
            document = document[:-1]
        return document[: max(1, min(SAMPLE_PROMPT, len(document) // 2))]

    def text(self, ids: Sequence[int]) -> str:
        """``ids`` read with the tokenizer (:func:`decode_text`)."""
        return decode_text(self.tokenizer, ids)


def text_data(path: str, seed: int, tokenizer: Callable[[], Tokenizer]) -> CausalPairs | TextLines:
    """``--data`` for a causal LM: a file of source<TAB>target lines (every line has one tab) as
    :class:`CausalPairs` (a whitespace vocabulary, :class:`~gpipe.data.TextPairs`), any other text
    file as :class:`TextLines` read with ``tokenizer()`` (called for text only: it may train one)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the data file {path!r}: {exc}") from None
    if lines and all(line.count("\t") == 1 for line in lines):
        return CausalPairs(TextPairs(path, seed=seed))
    return TextLines(path, tokenizer(), seed=seed)
