"""One SentencePiece vocabulary shared by every language, as in the paper's multilingual NMT.

The vocabulary is trained on text sampled from every language pair with temperature T (T=5 in the
paper): pair l, holding D_l sentence pairs, is drawn with probability ∝ (D_l / ΣD)^(1/T)
(:func:`gpipe.recipe.temperature_sampling`), so low-resource languages get far more of the
vocabulary than their share of the data; character coverage 0.999995.

A data directory holds one parallel file per language pair; the file name gives the direction:

- ``<src>-<tgt>.tsv``: one ``source<TAB>target`` per line (``en-de.tsv``); blank lines are skipped,
  any other line must hold exactly one tab;
- ``<src>-<tgt>.<src>`` + ``<src>-<tgt>.<tgt>``: two files aligned line by line (``en-de.en`` +
  ``en-de.de``); they must have as many lines, and lines blank on both sides are skipped.

Both sides of every other line must hold text (:mod:`gpipe.data.files` reads them).

Language codes are letters, digits and ``_`` (``en``, ``zh_Hant``); other files are ignored. The
target language ``xx`` of a pair gets the tag ``<2xx>``, one piece of the vocabulary.

Fixed ids (as :mod:`gpipe.data`): pad 0 (``<pad>``), bos 1 (``<s>``), eos 2 (``</s>``), unk 3
(``<unk>``), then the ``<2xx>`` tags in sorted order from 4, then the learnt pieces.

:func:`train_vocab` is a pure function of (data, size, temperature, sample, seed, threads): it seeds
SentencePiece's generator and gives it the sampled text in a fixed order. It writes its files whole or
not at all, and refuses at once a size the text cannot hold (:func:`most_pieces`). Pair files are read
whole into memory: ``gpipe prepare`` trains the same vocabulary from the same draws (:func:`sample_draws`)
read from the files by index. It needs the ``sentencepiece`` package (in the ``dev`` extra), imported
only here.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpipe.data.files import Pairs, read_pairs
from gpipe.recipe import temperature_sampling
from gpipe.saving import write_atomically

if TYPE_CHECKING:
    import sentencepiece

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "UNK",
    "Pairs",
    "Vocab",
    "VocabSizeError",
    "extend_vocab",
    "extends",
    "most_pieces",
    "pair_probabilities",
    "read_pairs",
    "sample_draws",
    "sample_text",
    "tag_piece",
    "train_text_vocab",
    "train_vocab",
]

PAD, BOS, EOS, UNK = 0, 1, 2, 3
_RESERVED = 4  # pad, bos, eos, unk
_LONGEST_PIECE = 16  # SentencePiece's max_sentencepiece_length, which train_vocab leaves at its default
_WORD = "\u2581"  # "▁", SentencePiece's mark of a word's start (it replaces whitespace)


def tag_piece(lang: str) -> str:
    """The tag asking for a translation into ``lang``: ``<2lang>``."""
    return f"<2{lang}>"


def pair_probabilities(pairs: Mapping[str, Pairs], temperature: float = 5.0) -> dict[str, float]:
    """The probability of drawing each pair (by name, sorted): (D_l / ΣD)^(1/T), normalized."""
    names = sorted(pairs)
    if not names:
        raise ValueError("no language pairs")
    probabilities = temperature_sampling([len(pairs[n]) for n in names], temperature)
    return dict(zip(names, probabilities))


def sample_text(
    pairs: Mapping[str, Pairs], temperature: float = 5.0, sentences: int = 100_000, seed: int = 0
) -> list[str]:
    """``sentences`` draws of a sentence pair: each draw picks a language pair with
    :func:`pair_probabilities` and then one of its sentence pairs uniformly (with replacement), and
    contributes both sides, source then target — ``2 * sentences`` lines. Deterministic for a seed."""
    draws = sample_draws({name: len(pair) for name, pair in pairs.items()}, temperature, sentences, seed)
    return [side for name, i in draws for side in (pairs[name].sources[i], pairs[name].targets[i])]


def sample_draws(sizes: Mapping[str, int], temperature: float, sentences: int, seed: int) -> list[tuple[str, int]]:
    """:func:`sample_text`'s draws from pairs of ``sizes`` sentence pairs (by name), as (pair, index): what
    ``gpipe prepare`` reads from the files to train the same vocabulary without holding them."""
    if sentences <= 0:
        raise ValueError(f"sentences must be positive (sentences: {sentences})")
    names = sorted(sizes)
    if not names:
        raise ValueError("no language pairs")
    weights = temperature_sampling([sizes[n] for n in names], temperature)
    rng = random.Random(seed)
    return [(name, rng.randrange(sizes[name])) for name in rng.choices(names, weights=weights, k=sentences)]


def _sentencepiece() -> Any:
    try:
        import sentencepiece
    except ImportError:
        raise ImportError("gpipe.data.vocab needs sentencepiece: pip install sentencepiece") from None
    return sentencepiece


class VocabSizeError(ValueError):
    """A vocabulary size the sampled text cannot fill. ``most``: the most pieces it can make, special
    pieces and tags included — SentencePiece's count when ``exact``, else an upper bound (:func:`most_pieces`)
    found before training."""

    def __init__(self, message: str, *, size: int, most: int, exact: bool) -> None:
        super().__init__(message)
        self.size, self.most, self.exact = size, most, exact


def most_pieces(text: Iterable[str], stop: int | None = None) -> int:
    """An upper bound, found in a moment, on the pieces SentencePiece's unigram, bpe and char models can
    learn from ``text`` (special pieces and tags not counted): it normalizes each line (NFKC, whitespace
    to "▁", a "▁" first) and learns only pieces of at most 16 characters that hold "▁" at most first, so
    each is a substring of one word with its "▁" and there are no more pieces than such distinct
    substrings (training keeps far fewer). Not for the word model, whose pieces are whole words of any
    length. Counting stops once past ``stop``: the result then only says it exceeds ``stop``."""
    normalize = _sentencepiece().SentencePieceNormalizer(rule_name="nmt_nfkc").normalize
    lines = list(dict.fromkeys(text))  # (distinct, in a fixed order)
    words: set[str] = set()
    pieces: set[str] = set()
    for start in range(0, len(lines), 4096):
        for line in normalize(lines[start : start + 4096]):
            for word in line.split(_WORD):
                if word in words:
                    continue
                words.add(word)
                marked = _WORD + word
                for i in range(len(marked)):
                    pieces.update(marked[i:j] for j in range(i + 1, min(len(marked), i + _LONGEST_PIECE) + 1))
            if stop is not None and len(pieces) > stop:
                return len(pieces)
    return len(pieces)


def train_vocab(
    data: str | os.PathLike[str] | Mapping[str, Pairs],
    out_prefix: str | os.PathLike[str],
    *,
    size: int,
    exact: bool = True,
    temperature: float = 5.0,
    sample: int = 1_000_000,
    character_coverage: float = 0.999995,
    seed: int = 0,
    model_type: str = "unigram",
    threads: int = 16,
    keep_text: bool = False,
    quiet: bool = True,
) -> Path:
    """Train a shared SentencePiece vocabulary of ``size`` pieces; returns ``<out_prefix>.model``
    (``<out_prefix>.vocab`` lists the pieces). Each file is written aside and renamed into place, the
    model last: a failure or a kill leaves the files as they were, and no temporary file beside them.

    ``data``: a data directory (:func:`read_pairs`) or its pairs. The training text is
    :func:`sample_text` (``sample`` draws, both sides, at ``temperature``); SentencePiece uses all of
    it (input_sentence_size = its line count, no shuffling of its own). ``keep_text`` keeps it as
    ``<out_prefix>.sample.txt``. Every target language ``xx`` gets the piece ``<2xx>``; ids are those
    of the module's docstring. ``threads`` changes the result: keep it fixed for reproducible ids.

    ``exact``: a ``size`` too large for the text raises :class:`VocabSizeError` (one line, with a hint),
    before training where :func:`most_pieces` shows it, else after; ``exact=False`` makes as many pieces
    as the text supports, up to ``size`` (``Vocab(path).size`` says how many)."""
    pairs = data if isinstance(data, Mapping) else read_pairs(data)
    tags = sorted({tag_piece(p.tgt) for p in pairs.values()})
    return _train(lambda: sample_text(pairs, temperature, sample, seed), out_prefix, size=size, tags=tags,
                  exact=exact, character_coverage=character_coverage, seed=seed, model_type=model_type,
                  threads=threads, keep_text=keep_text, quiet=quiet)  # fmt: skip


def train_text_vocab(
    lines: Sequence[str],
    out_prefix: str | os.PathLike[str],
    *,
    size: int,
    exact: bool = True,
    sample: int = 1_000_000,
    character_coverage: float = 0.999995,
    seed: int = 0,
    model_type: str = "unigram",
    threads: int = 16,
    keep_text: bool = False,
    quiet: bool = True,
    tags: Sequence[str] = (),
) -> Path:
    """A SentencePiece vocabulary of plain text (``gpipe train --model hf`` on a text file), trained
    as :func:`train_vocab` trains one but on ``lines`` themselves (a seeded ``sample`` of them where
    there are more), with the user-defined pieces ``tags`` (none for plain text; ``gpipe prepare`` gives the
    language tags of the pairs it sampled the lines from); the same ids (pad 0, bos 1, eos 2, unk 3) and errors."""

    def text() -> list[str]:
        return list(lines) if len(lines) <= sample else random.Random(seed).sample(list(lines), sample)

    return _train(text, out_prefix, size=size, tags=sorted(tags), exact=exact, character_coverage=character_coverage,
                  seed=seed, model_type=model_type, threads=threads, keep_text=keep_text, quiet=quiet)  # fmt: skip


def _train(
    sampled: Callable[[], list[str]],
    out_prefix: str | os.PathLike[str],
    *,
    size: int,
    tags: list[str],
    exact: bool,
    character_coverage: float,
    seed: int,
    model_type: str,
    threads: int,
    keep_text: bool,
    quiet: bool,
) -> Path:
    """SentencePiece trained on the text ``sampled()`` returns, once the settings are checked and the
    folder made (see :func:`train_vocab`)."""
    spm = _sentencepiece()
    reserved = _RESERVED + len(tags)
    if size <= reserved:
        raise ValueError(
            f"size must exceed the {_RESERVED} special pieces and {len(tags)} language tags (size: {size})"
        )
    if not 0 < character_coverage <= 1:
        raise ValueError(f"character_coverage must be in (0, 1] (character_coverage: {character_coverage})")
    prefix = Path(out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)  # (before the work: an unwritable place fails at once)
    text = sampled()
    if exact and model_type != "word" and (most := reserved + most_pieces(text, stop=size - reserved)) < size:
        raise VocabSizeError(
            f"vocabulary size {size} is too large for the sampled text: its words make at most {most} pieces "
            f"(the {reserved} special pieces and language tags included; training usually keeps far fewer); lower "
            "the size, or give more text (a larger sample or more data)",
            size=size,
            most=most,
            exact=False,
        )
    with tempfile.TemporaryDirectory(prefix="gpipe-vocab-") as scratch:
        text_path, made = Path(scratch) / "sample.txt", Path(scratch) / "vocab"
        with open(text_path, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(line + "\n" for line in text)
        spm.set_random_generator_seed(seed % 0xFFFFFFFF)  # 0xFFFFFFFF would mean "a random seed"
        try:
            spm.SentencePieceTrainer.train(
                input=str(text_path),
                model_prefix=str(made),
                vocab_size=size,
                hard_vocab_limit=False,  # (up to size: exact is checked below)
                model_type=model_type,
                character_coverage=character_coverage,
                input_sentence_size=len(text) if len(text) > 100 else 0,  # (1 to 100 is refused; 0: all, too)
                shuffle_input_sentence=False,
                pad_id=PAD,
                bos_id=BOS,
                eos_id=EOS,
                unk_id=UNK,
                pad_piece="<pad>",
                bos_piece="<s>",
                eos_piece="</s>",
                unk_piece="<unk>",
                user_defined_symbols=tags,
                num_threads=threads,
                minloglevel=2 if quiet else 0,
            )
        except RuntimeError as exc:
            message = " ".join(str(exc).split())
            raise ValueError(f"SentencePiece could not train on {len(text)} sampled lines: {message}") from None
        pieces = spm.SentencePieceProcessor(model_file=f"{made}.model").get_piece_size()
        if exact and pieces < size:
            raise VocabSizeError(
                f"vocabulary size {size} is too large for the sampled text: SentencePiece can make at most "
                f"{pieces} pieces of it; lower the size to {pieces} or less, or give more text (a larger sample or "
                "more data)",
                size=size,
                most=pieces,
                exact=True,
            )
        if keep_text:
            _copy(text_path, Path(f"{prefix}.sample.txt"))
        _copy(Path(f"{made}.vocab"), Path(f"{prefix}.vocab"))
        _copy(Path(f"{made}.model"), Path(f"{prefix}.model"))  # last: a complete vocabulary appears at once
    return Path(f"{prefix}.model")


def extend_vocab(base: str | os.PathLike[str], languages: Sequence[str], out_prefix: str) -> Path:
    """``PREFIX.model`` (and ``PREFIX.vocab``): the SentencePiece model ``base`` with the tags
    ``<2lang>`` of ``languages`` it lacks appended, as user-defined pieces after its own, so that
    every id of ``base`` keeps its piece (a model trained with ``base`` grows its embeddings by rows
    for the new tags alone; :func:`extends` tells). Text is read as ``base`` reads it. Written whole
    or not at all; a :class:`ValueError` where ``base`` is not a SentencePiece model or ``protobuf``
    (to edit it) is missing."""
    old = Vocab(base)  # (refuses a file that is not a model)
    try:
        import importlib

        pb: Any = importlib.import_module("sentencepiece.sentencepiece_model_pb2")
    except ImportError as exc:
        raise ValueError(f"extending a SentencePiece model needs protobuf (pip install protobuf): {exc}") from None
    proto = pb.ModelProto()
    proto.ParseFromString(old.path.read_bytes())
    for lang in sorted(set(languages) - set(old.languages)):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = tag_piece(lang), 0.0, pb.ModelProto.SentencePiece.USER_DEFINED
    model, table = Path(f"{out_prefix}.model"), Path(f"{out_prefix}.vocab")
    rows = "".join(f"{p.piece}\t{p.score:g}\n" for p in proto.pieces)
    write_atomically(table, lambda tmp: Path(tmp).write_text(rows, encoding="utf-8"))
    data = proto.SerializeToString()
    write_atomically(model, lambda tmp: Path(tmp).write_bytes(data))  # last: a complete model appears at once
    return model


def extends(grown: Vocab, base: Vocab) -> bool:
    """Whether ``grown`` is ``base`` with pieces appended (:func:`extend_vocab`): ``base``'s ids keep
    their pieces, and it reads text as ``base`` does."""
    if grown.size < base.size:
        return False
    same = all(grown._sp.id_to_piece(i) == base._sp.id_to_piece(i) for i in range(base.size))
    sample = "a sample of text, Ünïcode and 123"
    return same and grown.encode(sample) == base.encode(sample)


def _copy(source: Path, target: Path) -> None:
    """``source`` to ``target``, whole or not at all."""
    write_atomically(target, lambda tmp: shutil.copyfile(source, tmp))


class Vocab:
    """A SentencePiece model (such as :func:`train_vocab`'s): ids of text and text of ids."""

    def __init__(self, model: str | os.PathLike[str]) -> None:
        spm = _sentencepiece()
        self.path = Path(model)
        if not self.path.is_file():
            raise ValueError(f"no SentencePiece model at {str(self.path)!r}")
        try:
            self._sp: sentencepiece.SentencePieceProcessor = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"{str(self.path)!r} is not a SentencePiece model: {exc}") from None
        self._tags = {
            piece[2:-1]: i
            for i in range(self.size)
            if re.fullmatch(r"<2[A-Za-z0-9_]+>", piece := self._sp.id_to_piece(i))
            and not self._sp.is_control(i)
            and self._sp.get_score(i) == 0.0  # a user-defined piece, not one learnt from text
        }

    @property
    def size(self) -> int:
        return self._sp.get_piece_size()

    def __len__(self) -> int:
        return self.size

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    @property
    def languages(self) -> list[str]:
        """The languages with a ``<2xx>`` tag, sorted."""
        return sorted(self._tags)

    def tag(self, lang: str) -> int:
        """The id of ``<2lang>``, the tag asking for a translation into ``lang``."""
        if lang not in self._tags:
            raise KeyError(f"no tag {tag_piece(lang)} in {str(self.path)!r} (languages: {', '.join(self.languages)})")
        return self._tags[lang]

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """The ids of ``text``'s pieces (after SentencePiece's NFKC normalization)."""
        return [int(i) for i in self._sp.encode(text, add_bos=add_bos, add_eos=add_eos)]

    def encode_lines(self, texts: Iterable[str]) -> list[list[int]]:
        """The ids of many texts at once (as :meth:`encode` of each, without bos or eos)."""
        return [[int(i) for i in ids] for ids in self._sp.encode(list(texts))]

    def pieces(self, text: str) -> list[str]:
        """``text``'s pieces, as strings."""
        return [str(p) for p in self._sp.encode(text, out_type=str)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; pad, bos and eos decode to nothing."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.size]
        if bad:
            raise ValueError(f"ids out of the vocabulary's range [0, {self.size}): {bad[:5]}")
        return str(self._sp.decode(ids))

    def __repr__(self) -> str:
        return f"Vocab({str(self.path)!r}, size={self.size}, languages={self.languages})"
