"""``python -m gpipe ...``, e.g. ``torchrun --nproc-per-node 2 -m gpipe train``."""

import sys

from gpipe.cli import main

sys.exit(main())
