from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest

from gpipe.data.vocab import (
    BOS,
    EOS,
    PAD,
    UNK,
    Pairs,
    Vocab,
    VocabSizeError,
    most_pieces,
    pair_probabilities,
    read_pairs,
    sample_text,
    train_vocab,
)
from gpipe.recipe import temperature_sampling

SYLLABLES = {
    "en": ["the", "an", "or", "is", "wa", "ter", "ing", "ed", "st"],
    "de": ["der", "ein", "ung", "sch", "ich", "ei", "en", "au"],
    "fr": ["le", "la", "ou", "est", "ai", "on", "eau", "qu"],
    "sw": ["ka", "wa", "ni", "ma", "tu", "ki", "za", "mu"],
}
SIZES = {"en-de": 2000, "en-fr": 300, "en-sw": 50}  # high, middle and low resource


def sentence(rng: random.Random, lang: str) -> str:
    words = ["".join(rng.choice(SYLLABLES[lang]) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(4, 9))]
    return " ".join(words)


def write_corpus(root: Path, sizes: dict[str, int] = SIZES, seed: int = 0) -> Path:
    """en-de as a TSV file, the other pairs as two aligned files."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for name, n in sizes.items():
        src, tgt = name.split("-")
        lines = [(f"{sentence(rng, src)} {i}", f"{sentence(rng, tgt)} {i}") for i in range(n)]
        if name == "en-de":
            (root / f"{name}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in lines), encoding="utf-8")
        else:
            (root / f"{name}.{src}").write_text("".join(f"{s}\n" for s, _ in lines), encoding="utf-8")
            (root / f"{name}.{tgt}").write_text("".join(f"{t}\n" for _, t in lines), encoding="utf-8")
    (root / "README.txt").write_text("not a pair file\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def vocab_model(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_vocab(corpus, tmp_path_factory.mktemp("vocab") / "spm", size=200, sample=5000, keep_text=True)


def line_owner(pairs: dict[str, Pairs]) -> dict[str, str]:
    """Which pair each line of the corpus comes from (the lines of different pairs differ)."""
    owner = {line: name for name, p in pairs.items() for line in (*p.sources, *p.targets)}
    assert len(owner) == sum(2 * len(p) for p in pairs.values())
    return owner


def expected(temperature: float) -> dict[str, float]:
    return dict(zip(SIZES, temperature_sampling(list(SIZES.values()), temperature)))


# reading


def test_read_pairs(corpus: Path) -> None:
    pairs = read_pairs(corpus)
    assert list(pairs) == ["en-de", "en-fr", "en-sw"]
    assert {name: len(p) for name, p in pairs.items()} == SIZES
    sw = pairs["en-sw"]
    assert (sw.src, sw.tgt, sw.name) == ("en", "sw", "en-sw")
    assert [f.name for f in sw.files] == ["en-sw.en", "en-sw.sw"]
    assert sw.sources[3].endswith(" 3") and sw.targets[3].endswith(" 3")
    assert pairs["en-de"].sources[7].endswith(" 7") and "\t" not in pairs["en-de"].targets[7]


def test_read_pairs_skips_blank_lines_and_keeps_alignment(tmp_path: Path) -> None:
    (tmp_path / "de-en.tsv").write_text("a\tb\n\n  \nc\td\r\n", encoding="utf-8")
    (tmp_path / "fr-en.fr").write_text("un\n\ntrois\n", encoding="utf-8")
    (tmp_path / "fr-en.en").write_text("one\n\nthree\n", encoding="utf-8")
    pairs = read_pairs(tmp_path)
    assert pairs["de-en"].sources == ("a", "c") and pairs["de-en"].targets == ("b", "d")
    assert pairs["fr-en"].sources == ("un", "trois") and pairs["fr-en"].targets == ("one", "three")


def test_no_pair_files(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("hello\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"no language pair files .*train\.txt.*<src>-<tgt>\.tsv"):
        read_pairs(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        read_pairs(tmp_path / "missing")


def test_unequal_line_counts(tmp_path: Path) -> None:
    (tmp_path / "en-de.en").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "en-de.de").write_text("x\ny\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"en-de\.de' has 2 lines but .*en-de\.en' has more"):
        read_pairs(tmp_path)


def test_missing_side(tmp_path: Path) -> None:
    (tmp_path / "en-de.en").write_text("a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"en-de\.en .* en-de\.de is missing"):
        read_pairs(tmp_path)


def test_tsv_line_without_one_tab(tmp_path: Path) -> None:
    (tmp_path / "en-de.tsv").write_text("a\tb\nno tab here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"en-de\.tsv:2: expected exactly one tab .*found 0"):
        read_pairs(tmp_path)
    (tmp_path / "en-de.tsv").write_text("a\tb\nc\td\te\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"en-de\.tsv:2: .*found 2"):
        read_pairs(tmp_path)


@pytest.mark.parametrize(
    ("files", "error"),
    [
        ({"en-de.tsv": "\n \n"}, r"en-de\.tsv': no sentence pairs"),
        ({"en-de.en": "", "en-de.de": "x\n"}, r"en-de\.en' is empty"),
    ],
)
def test_empty_file(tmp_path: Path, files: dict[str, str], error: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=error):
        read_pairs(tmp_path)


def test_pair_given_twice_or_to_itself(tmp_path: Path) -> None:
    (tmp_path / "en-de.tsv").write_text("a\tb\n", encoding="utf-8")
    (tmp_path / "en-de.en").write_text("a\n", encoding="utf-8")
    (tmp_path / "en-de.de").write_text("b\n", encoding="utf-8")
    with pytest.raises(ValueError, match="pair en-de is given twice"):
        read_pairs(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "en-en.tsv").write_text("a\tb\n", encoding="utf-8")
    with pytest.raises(ValueError, match="must differ"):
        read_pairs(tmp_path / "other")


# sampling


def test_pair_probabilities_follow_temperature(corpus: Path) -> None:
    pairs = read_pairs(corpus)
    total = sum(SIZES.values())
    weights = {n: (d / total) ** (1 / 5) for n, d in SIZES.items()}
    assert pair_probabilities(pairs, 5.0) == pytest.approx({n: w / sum(weights.values()) for n, w in weights.items()})
    assert pair_probabilities(pairs, 1.0) == pytest.approx({n: d / total for n, d in SIZES.items()})


@pytest.mark.parametrize("seed", [0, 1])
def test_sample_text_draws_pairs_with_temperature(corpus: Path, seed: int) -> None:
    pairs = read_pairs(corpus)
    draws = 20_000
    text = sample_text(pairs, temperature=5.0, sentences=draws, seed=seed)
    assert len(text) == 2 * draws
    owner = line_owner(pairs)
    # each draw is a source line followed by its target line, from the same pair
    drawn = [owner[s] for s in text[0::2]]
    assert drawn == [owner[t] for t in text[1::2]]
    counts = Counter(drawn)
    p = expected(5.0)
    chi2 = sum((counts[n] - draws * p[n]) ** 2 / (draws * p[n]) for n in SIZES)
    assert chi2 < 13.82, (counts, p)  # chi-square, 2 degrees of freedom, p = 0.001
    for name in ("en-de", "en-sw"):  # the high- and the low-resource pair
        sd = math.sqrt(p[name] * (1 - p[name]) / draws)
        assert abs(counts[name] / draws - p[name]) < 4 * sd
    # far from the data's own proportions (T = 1): the low-resource pair is upsampled ~13x
    assert counts["en-sw"] / draws > 10 * expected(1.0)["en-sw"]


def test_sample_text_is_deterministic(corpus: Path) -> None:
    pairs = read_pairs(corpus)
    a = sample_text(pairs, sentences=500, seed=3)
    assert a == sample_text(pairs, sentences=500, seed=3)
    assert a != sample_text(pairs, sentences=500, seed=4)
    with pytest.raises(ValueError, match="sentences must be positive"):
        sample_text(pairs, sentences=0)
    with pytest.raises(ValueError, match="temperature must be positive"):
        sample_text(pairs, temperature=0.0)


def test_vocab_training_text_gives_low_resource_pair_its_temperature_share(corpus: Path, vocab_model: Path) -> None:
    """The acceptance test: the low-resource pair's share of the vocabulary's training text is the
    T=5 share, not its share of the data."""
    pairs = read_pairs(corpus)
    text = Path(f"{str(vocab_model)[: -len('.model')]}.sample.txt").read_text(encoding="utf-8").split("\n")[:-1]
    draws = 5000
    assert len(text) == 2 * draws
    owner = line_owner(pairs)
    share = sum(owner[line] == "en-sw" for line in text) / len(text)
    p = expected(5.0)["en-sw"]
    assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / draws), (share, p)
    assert share > 10 * SIZES["en-sw"] / sum(SIZES.values())


# training and the vocabulary


def test_train_vocab_round_trips(corpus: Path, vocab_model: Path) -> None:
    vocab = Vocab(vocab_model)
    assert vocab_model.name == "spm.model" and vocab_model.with_suffix(".vocab").is_file()
    assert vocab.size == len(vocab) == 200
    assert (vocab.pad, vocab.bos, vocab.eos, vocab.unk) == (PAD, BOS, EOS, UNK) == (0, 1, 2, 3)
    pairs = read_pairs(corpus)
    for p in pairs.values():
        for s in (*p.sources[:40], *p.targets[:40]):
            ids = vocab.encode(s)
            assert UNK not in ids
            assert vocab.decode(ids) == s
            assert vocab.decode([vocab.bos, *ids, vocab.eos, vocab.pad]) == s
    ids = vocab.encode("wa ter")
    assert vocab.encode("wa ter", add_bos=True, add_eos=True) == [BOS, *ids, EOS]
    assert vocab.pieces("wa ter") == ["▁wa", "▁ter"]


def test_language_tags_are_single_pieces(vocab_model: Path) -> None:
    vocab = Vocab(vocab_model)
    assert vocab.languages == ["de", "fr", "sw"]  # the target languages
    assert [vocab.tag(lang) for lang in vocab.languages] == [4, 5, 6]
    for lang in vocab.languages:
        # one piece, even inside text (SentencePiece puts its word-start mark "▁" apart)
        assert vocab.pieces(f"<2{lang}>") == ["▁", f"<2{lang}>"]
        assert vocab.pieces(f"wa <2{lang}> ter")[-2:] == [f"<2{lang}>", "▁ter"]
        assert vocab.encode(f"<2{lang}>")[-1] == vocab.tag(lang)
        assert vocab.decode([vocab.tag(lang)]) == f"<2{lang}>"
    with pytest.raises(KeyError, match=r"no tag <2en>.*languages: de, fr, sw"):
        vocab.tag("en")
    with pytest.raises(ValueError, match="out of the vocabulary's range"):
        vocab.decode([200])


def test_train_vocab_is_deterministic(corpus: Path, vocab_model: Path, tmp_path: Path) -> None:
    """The same pieces with the same ids and scores for a seed (the .model files themselves differ:
    they record the paths of the text and the output)."""
    again = train_vocab(read_pairs(corpus), tmp_path / "again", size=200, sample=5000)
    pieces = vocab_model.with_suffix(".vocab").read_text(encoding="utf-8")
    assert again.with_suffix(".vocab").read_text(encoding="utf-8") == pieces
    assert not (tmp_path / "again.sample.txt").exists()
    line = read_pairs(corpus)["en-fr"].targets[0]
    assert Vocab(again).encode(line) == Vocab(vocab_model).encode(line)
    other = train_vocab(corpus, tmp_path / "other", size=200, sample=5000, seed=1)
    assert other.with_suffix(".vocab").read_text(encoding="utf-8") != pieces


def test_train_vocab_size_errors(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"vocabulary size 50000 is too large .* at most \d+ pieces.*lower the size"):
        train_vocab(corpus, tmp_path / "big", size=50_000, sample=500)
    with pytest.raises(ValueError, match="size must exceed the 4 special pieces and 3 language tags"):
        train_vocab(corpus, tmp_path / "tiny", size=7, sample=500)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_most_pieces_bounds_what_sentencepiece_makes(tmp_path: Path, model_type: str) -> None:
    """The bound that refuses a size before training is a true one: SentencePiece, asked for more, makes
    no more pieces than it. Text with what NFKC rewrites (ligatures, full-width letters, a zero-width
    space that joins words, "½"), other scripts and digits."""
    rng = random.Random(0)
    words = ["\ufb01ne", "\uff57\uff4f\uff52\uff44", "a\u200bb", "x\x0by", "\u00bd", "日本語の文", "Straße", "e\u0301"]
    words += ["\u0661\u0662\u0663", "x\u2581y", "wa", "4x5"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(400)]
    text = "".join(f"{a}\t{b}\n" for a, b in zip(lines[::2], lines[1::2]))
    (tmp_path / "en-de.tsv").write_text(text, encoding="utf-8")
    for data, draws in ((tmp_path, 1000), (write_corpus(tmp_path / "syllables", {"en-de": 300, "en-sw": 40}), 2000)):
        pairs = read_pairs(data)
        reserved = 4 + len({p.tgt for p in pairs.values()})
        most = reserved + most_pieces(sample_text(pairs, sentences=draws))
        model = train_vocab(pairs, tmp_path / "v", size=most + 100, exact=False, sample=draws, model_type=model_type)
        assert Vocab(model).size <= most
    assert most_pieces(["ab ab", "ab"]) == len({"▁", "▁a", "▁ab", "a", "ab", "b"})
    assert most_pieces(["abcdef ghijkl"] * 3, stop=4) > 4  # (stops counting early)


def test_a_size_no_text_can_hold_is_refused_before_training(corpus: Path, tmp_path: Path) -> None:
    pairs = read_pairs(corpus)
    most = 7 + most_pieces(sample_text(pairs, sentences=500))
    with pytest.raises(VocabSizeError) as caught:
        train_vocab(pairs, tmp_path / "v", size=most + 1, sample=500)
    assert (caught.value.most, caught.value.exact) == (most, False)  # (the bound's, found before SentencePiece ran)
    assert f"vocabulary size {most + 1} is too large for the sampled text: its words make at most {most} pieces" in str(
        caught.value
    )
    assert not list(tmp_path.iterdir())


def test_a_size_too_large_names_the_largest_that_works(corpus: Path, tmp_path: Path) -> None:
    """``exact=False`` makes as many pieces as the text supports; one more, asked for exactly, is refused
    naming that many, and that many is made."""
    pairs = read_pairs(corpus)
    most = 7 + most_pieces(sample_text(pairs, sentences=500))
    made = Vocab(train_vocab(pairs, tmp_path / "all", size=most, exact=False, sample=500)).size
    assert made < most  # (so that the size below passes the bound and SentencePiece itself finds it too large)
    with pytest.raises(VocabSizeError) as caught:
        train_vocab(pairs, tmp_path / "v", size=made + 1, sample=500)
    assert (caught.value.most, caught.value.exact) == (made, True)
    assert f"at most {made} pieces of it; lower the size to {made} or less" in str(caught.value)
    assert not list(tmp_path.glob("v*"))
    assert Vocab(train_vocab(pairs, tmp_path / "v", size=made, sample=500)).size == made


def test_train_vocab_writes_whole_or_not_at_all(corpus: Path, tmp_path: Path) -> None:
    """A write that fails (here: PREFIX.vocab is a folder) leaves PREFIX.model as it was — the model is
    renamed into place last — and no temporary file behind; a new vocabulary replaces both files."""
    (tmp_path / "v.model").write_bytes(b"the earlier model")
    (tmp_path / "v.vocab").mkdir()
    with pytest.raises(OSError, match=r"v\.vocab"):
        train_vocab(corpus, tmp_path / "v", size=100, sample=500)
    assert (tmp_path / "v.model").read_bytes() == b"the earlier model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.model", "v.vocab"]
    (tmp_path / "v.vocab").rmdir()
    (tmp_path / "v.vocab").write_text("the earlier pieces")
    model = train_vocab(corpus, tmp_path / "v", size=100, sample=500, keep_text=True)
    assert Vocab(model).size == 100 and len((tmp_path / "v.vocab").read_text().splitlines()) == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.model", "v.sample.txt", "v.vocab"]


def test_vocab_missing_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no SentencePiece model"):
        Vocab(tmp_path / "none.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        Vocab(tmp_path / "junk.model")


def test_the_vocab_command(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpipe.cli import main

    out = tmp_path / "shared"
    assert main(["vocab", "--data", str(corpus), "--size", "200", "--sample", "4000", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    shares = pair_probabilities(read_pairs(corpus), 5.0)
    for name, share in shares.items():
        assert f"{share:7.2%} of the sample" in printed, name
    assert f"wrote {out}.model (200 pieces)" in printed
    assert Vocab(Path(f"{out}.model")).size == 200
    assert main(["vocab", "--data", str(tmp_path / "none"), "--size", "200"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["vocab", "--data", str(corpus), "--size", "0"]) == 2
    assert "--size must be positive (got 0)" in capsys.readouterr().err
