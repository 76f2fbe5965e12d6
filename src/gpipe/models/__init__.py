"""The paper's models, as sequences of layers ready for partitioning."""

from gpipe.models.transformer import parameter_count, transformer, transformer_lm

__all__ = ["parameter_count", "transformer", "transformer_lm"]
