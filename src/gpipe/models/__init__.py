"""The models: the paper's Transformer (:mod:`~gpipe.models.transformer`; with transparent attention for
deep encoders, :mod:`~gpipe.models.transparent`) and AmoebaNet-D (:mod:`~gpipe.models.amoebanet`) as
sequences of layers ready for partitioning, and the Hugging Face causal LMs of ``gpipe train --model hf``
(:mod:`~gpipe.models.hf`). Models only: the data they read and the tokenizers of its text are
:mod:`gpipe.data`'s.

An application part: imports torch, the library and ``gpipe.recipe`` / ``gpipe.data``; a model is
built here and cut by the library, which never imports it.
"""

from gpipe.models.amoebanet import amoebanet_d
from gpipe.models.transformer import parameter_count, transformer, transformer_lm

__all__ = ["amoebanet_d", "parameter_count", "transformer", "transformer_lm"]
