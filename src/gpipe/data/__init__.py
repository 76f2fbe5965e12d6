"""Data for ``gpipe train``, nothing to download: every data source and every tokenizer lives here.

Every data set has ``batch(size, step, split=...)`` returning a batch with ``inputs``, ``target``
and ``count`` (tokens or images, for the throughput), a ``unit`` naming what ``count`` counts, and
``baseline()``: the loss of a model that ignores its input.

:class:`SyntheticTranslation` is a small multilingual "translation" corpus made up on the spot:
several language pairs of very different sizes; in pair p a sentence of content tokens translates
token by token through the pair's own permutation of the vocabulary, and the target starts with the
pair's tag. Pairs are drawn with temperature-based sampling (:func:`gpipe.recipe.temperature_sampling`,
T=5 by default), so the small pairs are seen far more often than their share; :meth:`~SyntheticTranslation.write`
writes it as text files.

:class:`ParallelCorpus` reads every language pair of a folder of parallel files, encoded with one
shared SentencePiece vocabulary (:mod:`gpipe.data.vocab`), sampled the same way. :class:`TextPairs` reads
one pair from a tab-separated file (source<TAB>target per line), with a whitespace vocabulary built
from the file. All three are :class:`TranslationDataset` s: held-out sentences per pair, for BLEU.

Data larger than memory is prepared once (``gpipe prepare``: :mod:`~gpipe.data.prepare`,
:mod:`~gpipe.data.prepare_text`, the pair files streamed by :mod:`~gpipe.data.files`) into
memory-mapped arrays that :class:`~gpipe.data.prepared.PreparedCorpus` (the batches of
``ParallelCorpus``, :mod:`~gpipe.data.batches`: by sentences or by tokens from length buckets) and
:class:`~gpipe.data.prepared.PreparedText` (those of ``TextLines``) read;
:class:`~gpipe.data.loader.StepLoader` makes the next batches in a thread or worker processes.

:class:`SyntheticImages` are class-structured images for AmoebaNet: every class has its own smooth
random pattern; an image is its class's pattern, shifted, scaled in contrast and buried in noise.
:class:`ImageFiles` reads real images from a ``.npz`` file (arrays ``x`` and ``y``, memory-mapped) or a
folder with one sub-folder of images per class (decoded when a batch needs them), in seeded epochs, cropped
and flipped with ``augment``; :mod:`~gpipe.data.imagefiles` holds its two sources and the crop.

A causal LM (``--model hf``) reads :mod:`gpipe.data.text`: pairs as one sequence (``CausalPairs``) or
a text file, a document a line (``TextLines``), read with a tokenizer of :mod:`gpipe.data.tokenizer`
(a SentencePiece vocabulary, or a local ``tokenizer.json``).

Batches are a pure function of (seed, step): a run resumed at step N sees exactly the batches an
uninterrupted run sees.

An application part: imports the library, :mod:`gpipe.recipe` and its own modules (:mod:`~gpipe.data.base`,
:mod:`~gpipe.data.synthetic`, :mod:`~gpipe.data.corpus`, :mod:`~gpipe.data.images`,
:mod:`~gpipe.data.imagefiles`, :mod:`~gpipe.data.vocab`, :mod:`~gpipe.data.text`, :mod:`~gpipe.data.tokenizer`,
the preparation and its readers above),
never :mod:`gpipe.models` (models import data);
``import gpipe.data`` does not import ``sentencepiece``, ``transformers`` or ``tokenizers``, which only
:mod:`gpipe.data.vocab` and :mod:`gpipe.data.tokenizer` import, lazily.
"""

from gpipe.data.base import (
    BOS,
    EOS,
    PAD,
    DataBatch,
    Dataset,
    HeldOut,
    ImageDataset,
    TokenDataset,
    TranslationBatch,
    TranslationDataset,
    entropy,
    ignore_index,
)
from gpipe.data.corpus import ParallelCorpus, TextPairs
from gpipe.data.images import ImageBatch, ImageFiles, SyntheticImages
from gpipe.data.synthetic import SyntheticTranslation

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "DataBatch",
    "Dataset",
    "HeldOut",
    "ImageBatch",
    "ImageDataset",
    "ImageFiles",
    "ParallelCorpus",
    "SyntheticImages",
    "SyntheticTranslation",
    "TextPairs",
    "TokenDataset",
    "TranslationBatch",
    "TranslationDataset",
    "entropy",
    "ignore_index",
]
