"""``python -m gpipe ...``, e.g. ``torchrun --nproc-per-node 2 -m gpipe train``."""

from gpipe.cli import run

run()
