"""The tokenizers of ``gpipe train --model hf`` on a text file, and the ones ``gpipe export`` writes.

A text file is read with one of two tokenizers (:class:`gpipe.data.text.TextLines`):

- a SentencePiece vocabulary (:class:`gpipe.data.vocab.Vocab`): trained on the file's lines into
  ``OUT/vocab.model`` as a translation run trains its own (``--vocab-size``), or given as
  ``--tokenizer x.model``. Its ids are gpipe's: pad 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3;
- a local ``tokenizer.json`` (``--tokenizer``, the file or its folder), read as transformers reads it,
  ``PreTrainedTokenizerFast(tokenizer_file=...)`` (:class:`HFTokenizer`). Which of its tokens start
  and end a document, the file does not say: the ``tokenizer_config.json`` beside it does, as
  ``save_pretrained`` writes it (``bos_token``, ``eos_token``).

Every checkpoint keeps a copy (:func:`checkpoint_files`), and :func:`exported` turns it into a
tokenizer transformers loads: the SentencePiece model converted into a ``tokenizer.json``
(:func:`from_sentencepiece`, checked to give SentencePiece's ids), the other as it was read.

transformers and tokenizers are imported only when these functions run (:func:`_transformers`, which
:mod:`gpipe.models.hf` builds its models with too).
"""

from __future__ import annotations

import importlib
import json
import os
import random
from pathlib import Path
from typing import Any

from gpipe.data.text import Tokenizer
from gpipe.data.vocab import Vocab

__all__ = [
    "CHAT_TEMPLATE",
    "TOKENIZER",
    "TOKENIZER_CONFIG",
    "VOCAB",
    "HFTokenizer",
    "checkpoint_files",
    "exported",
    "from_sentencepiece",
    "load",
    "of_checkpoint",
]

VOCAB, TOKENIZER, TOKENIZER_CONFIG = "vocab.model", "tokenizer.json", "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"  # beside a tokenizer.json: its chat template, as save_pretrained writes it
_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")
_WORD = "\u2581"  # "▁": SentencePiece's mark of a word's start


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


class HFTokenizer:
    """A local ``tokenizer.json`` (or the folder holding one) as transformers'
    ``PreTrainedTokenizerFast``, its special tokens named by the ``tokenizer_config.json`` beside it.
    A :class:`ValueError`, naming ``flag`` and the file, if it cannot be read, names no ``eos_token``
    (a document ends with it), or names a special token that is not one of its tokens.

    Its chat template (:attr:`chat_template`, what chat records are rendered with): ``chat_template``
    (a Jinja file, ``--chat-template``), else the :data:`CHAT_TEMPLATE` file beside it, else the
    ``chat_template`` of its ``tokenizer_config.json``; None where there is none. A checkpoint keeps
    it as :data:`CHAT_TEMPLATE`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        flag: str = "--tokenizer",
        chat_template: str | os.PathLike[str] | None = None,
    ) -> None:
        given = Path(path)
        self.path = given / TOKENIZER if given.is_dir() else given
        if not self.path.is_file():
            raise ValueError(
                f"{flag} {str(path)!r}: no such file; give a tokenizer.json (or its folder, as save_pretrained "
                "writes it), or a SentencePiece .model"
            )
        transformers = _transformers()
        import tokenizers

        try:
            raw = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as exc:  # (tokenizers raises a bare Exception for a file it cannot parse)
            raise ValueError(f"cannot read {flag} {str(self.path)!r} as a tokenizer.json: {exc}") from None
        config = self.path.parent / TOKENIZER_CONFIG
        specials = _special_tokens(config) if config.is_file() else {}
        for name, token in specials.items():
            if raw.token_to_id(token) is None:
                raise ValueError(
                    f"{str(config)!r}: {name} {token!r} is not a token of {str(self.path)!r}; name one of its tokens"
                )
        self.files = {TOKENIZER: self.path, **({TOKENIZER_CONFIG: config} if config.is_file() else {})}
        self.tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(self.path), **specials)
        self.chat_template = self._chat_template(config, chat_template)
        if self.chat_template is not None:
            self.tokenizer.chat_template = self.chat_template  # (what an export's tokenizer keeps)
        if self.eos is None:
            added = [t.content for t in raw.get_added_tokens_decoder().values() if t.special]
            hint = f" (its special tokens: {', '.join(map(repr, added[:8]))})" if added else ""
            raise ValueError(
                f"{flag} {str(self.path)!r} does not say which token ends a document{hint}: put a "
                f'{TOKENIZER_CONFIG} beside it naming it, {{"eos_token": "..."}} (and "bos_token" if documents '
                "start with one), as save_pretrained writes it"
            )

    def _chat_template(self, config: Path, given: str | os.PathLike[str] | None) -> str | None:
        file = Path(given) if given is not None else self.path.parent / CHAT_TEMPLATE
        if given is not None or file.is_file():
            try:
                template = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                flag = "--chat-template" if given is not None else "the chat template"
                raise ValueError(f"cannot read {flag} {str(file)!r}: {exc}") from None
            self.files[CHAT_TEMPLATE] = file
            return template
        if not config.is_file():
            return None
        found = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(found, list):  # (named templates: the default one)
            found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
        return found if isinstance(found, str) else None

    @property
    def size(self) -> int:
        return len(self.tokenizer)

    @property
    def bos(self) -> int | None:
        return self.tokenizer.bos_token_id  # type: ignore[no-any-return]

    @property
    def eos(self) -> int | None:
        return self.tokenizer.eos_token_id  # type: ignore[no-any-return]

    def encode_lines(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, without special tokens (the data adds bos and eos)."""
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, its special tokens left out."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def _special_tokens(config: Path) -> dict[str, str]:
    """The special tokens a ``tokenizer_config.json`` names (a string, or an ``AddedToken``'s fields)."""
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(config)!r}: {exc}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{str(config)!r} holds a {type(settings).__name__}, not the settings of a tokenizer")
    found = {}
    for name in _SPECIALS:
        value = settings.get(name)
        token = value.get("content") if isinstance(value, dict) else value
        if token is not None:
            if not isinstance(token, str):
                raise ValueError(f"{str(config)!r}: {name} must be a token (a string), not {token!r}")
            found[name] = token
    return found


def load(
    path: str | os.PathLike[str], *, flag: str = "--tokenizer", chat_template: str | os.PathLike[str] | None = None
) -> Vocab | HFTokenizer:
    """``--tokenizer``: a SentencePiece ``.model``, else a ``tokenizer.json`` or its folder (with
    ``chat_template``, a Jinja file, as its chat template)."""
    if chat_template is not None and Path(path).suffix == ".model":
        raise ValueError(
            f"--chat-template renders chats with a transformers tokenizer; {flag} {str(path)!r} is a SentencePiece "
            "model: give a tokenizer.json (or its folder)"
        )
    if Path(path).suffix == ".model":
        try:
            return Vocab(path)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return HFTokenizer(path, flag=flag, chat_template=chat_template)


def checkpoint_files(tokenizer: Tokenizer) -> dict[str, Path]:
    """What a checkpoint keeps of ``tokenizer`` (a :class:`Vocab` or an :class:`HFTokenizer`): its
    files, by their name in the checkpoint."""
    if isinstance(tokenizer, Vocab):
        return {VOCAB: tokenizer.path}
    if isinstance(tokenizer, HFTokenizer):
        return dict(tokenizer.files)
    raise TypeError(f"a checkpoint cannot keep a {type(tokenizer).__name__}: it has no files")


def from_sentencepiece(path: str | os.PathLike[str], *, checks: int = 500) -> Any:
    """The SentencePiece unigram model ``path`` as a transformers tokenizer that gives the same ids: a
    ``tokenizers`` Unigram model of its pieces and scores, its normalization (the precompiled NFKC
    map, white space stripped and squeezed, ``▁`` before every word), its control pieces special, its
    ``<s>`` put before a text as training put it. Tried on ``checks`` texts made of its pieces
    (seeded) against SentencePiece itself; a :class:`ValueError` saying why it cannot convert (a BPE
    or byte-fallback model, protobuf missing, an id that differs)."""
    transformers = _transformers()
    import tokenizers
    from tokenizers import normalizers, pre_tokenizers, processors

    try:  # (the model's settings are a protobuf message)
        model_pb2: Any = importlib.import_module("sentencepiece.sentencepiece_model_pb2")
    except ImportError as exc:
        raise ValueError(
            f"reading the SentencePiece model's settings needs protobuf (pip install protobuf): {exc}"
        ) from None
    vocab = Vocab(path)
    proto = model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != trainer.UNIGRAM or trainer.byte_fallback:
        raise ValueError(
            f"{str(path)!r} is a SentencePiece {trainer.ModelType.Name(trainer.model_type).lower()} model"
            f"{' with byte fallback' if trainer.byte_fallback else ''}: only unigram models without byte fallback "
            "(as gpipe trains them) convert"
        )
    model = tokenizers.Tokenizer(
        tokenizers.models.Unigram([(p.piece, p.score) for p in proto.pieces], unk_id=trainer.unk_id)
    )
    steps: list[Any] = (
        [normalizers.Precompiled(normalizer.precompiled_charsmap)] if normalizer.precompiled_charsmap else []
    )
    if normalizer.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(tokenizers.Regex(" {2,}"), " ")]
    model.normalizer = normalizers.Sequence(steps)
    scheme = "always" if normalizer.add_dummy_prefix else "never"
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_WORD, prepend_scheme=scheme, split=True)
    model.decoder = tokenizers.decoders.Metaspace(replacement=_WORD, prepend_scheme=scheme, split=True)
    control, user = proto.SentencePiece.CONTROL, proto.SentencePiece.USER_DEFINED
    model.add_special_tokens([tokenizers.AddedToken(p.piece, special=True, normalized=False)
                              for p in proto.pieces if p.type == control])  # fmt: skip
    model.add_tokens([tokenizers.AddedToken(p.piece, special=False, normalized=False)
                      for p in proto.pieces if p.type == user])  # fmt: skip
    ids = {"bos_token": trainer.bos_id, "eos_token": trainer.eos_id, "unk_token": trainer.unk_id,
           "pad_token": trainer.pad_id}  # fmt: skip
    specials = {name: proto.pieces[i].piece for name, i in ids.items() if 0 <= i < len(proto.pieces)}
    if "bos_token" in specials:  # what a document starts with in training, and a prompt must too
        bos = specials["bos_token"]
        model.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, trainer.bos_id)]
        )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=model, **specials)
    normal = [i for i, p in enumerate(proto.pieces) if p.type == p.NORMAL]
    rng = random.Random(0)
    texts = [vocab.decode(rng.choices(normal, k=rng.randint(1, 12))) for _ in range(checks)]
    texts += [f"  {text}  {text}\t{text} " for text in texts[:20]]
    for text in texts:
        ours, theirs = fast(text, add_special_tokens=False)["input_ids"], vocab.encode(text)
        if ours != theirs:
            raise ValueError(
                f"the tokenizer converted from {str(path)!r} reads {text!r} as {ours}, SentencePiece as {theirs}"
            )
    return fast


def of_checkpoint(folder: Path) -> Vocab | HFTokenizer | None:
    """The tokenizer a run read its text with, from the copy its checkpoint ``folder`` keeps (None:
    the run read token ids). ``gpipe generate`` encodes prompts with it as training encoded text."""
    if (folder / VOCAB).is_file():
        return load(folder / VOCAB, flag="the checkpoint's")
    if (folder / TOKENIZER).is_file():
        return HFTokenizer(folder / TOKENIZER, flag="the checkpoint's")
    return None


def exported(folder: Path) -> tuple[Any, str]:
    """The transformers tokenizer of a checkpoint ``folder``, and what it came from; ``(None, why)``
    where there is none (the run read ids, not text) or its SentencePiece model does not convert."""
    if (folder / VOCAB).is_file():
        try:
            return from_sentencepiece(folder / VOCAB), f"converted from the run's SentencePiece {VOCAB}"
        except ValueError as exc:
            return None, str(exc)
    if (folder / TOKENIZER).is_file():
        return HFTokenizer(folder / TOKENIZER, flag="the checkpoint's").tokenizer, f"the run's {TOKENIZER}"
    return None, "the run read token ids, not text (the built-in corpus, or source<TAB>target lines)"
