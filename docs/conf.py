"""Sphinx's configuration of gpipe's documentation: markdown pages (MyST), the API from the docstrings
(autodoc), the command-line reference from the commands' parsers and schedule timelines drawn at build time
(``_ext/``). How to build it and write for it: docs/README.md."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
# This checkout's gpipe, ahead of any installed one; then the extensions of _ext/.
sys.path[:0] = [str(DOCS.parent / "src"), str(DOCS / "_ext")]
os.environ.setdefault("MPLBACKEND", "Agg")  # the timelines are drawn without a screen

import gpipe  # noqa: E402

project = "gpipe"
author = "the gpipe authors"
copyright = "the gpipe authors"
release = version = gpipe.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "gpipe_api",  # docstrings' Args: sections; references to gpipe's internals that have no page
    "gpipe_cli",  # reference/cli.md from the commands' parsers
    "gpipe_schedule",  # {gpipe-schedule} FLAGS: a timeline drawn by gpipe schedule
    "gpipe_links",  # links in and to included files (benchmarks/README.md)
]

root_doc = "index"
source_suffix = {".md": "markdown"}
# README.md is for whoever writes these pages, not a page; _ext holds the extensions.
exclude_patterns = ["_build", "_ext", "README.md", "**/.*"]

# MyST: every relative link is a link into the site and must resolve (a dead one fails the build); headings
# down to level 4 get GitHub's anchors, so `page.md#a-heading` links work here as on GitHub.
myst_all_links_external = False
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# Quotes and dashes as typed: '--steps' must not become an en dash, nor 'gpipe' curly quotes.
smartquotes = False

# Strictness (with -W): every cross-reference must resolve. What cannot: types outside gpipe, since the build
# reads no other project's inventory (no network at build time): PyTorch's, NumPy's, the standard library's
# and third-party names in signatures and docstrings. A name of gpipe's is never ignored here: one without a
# page is checked against the code by _ext/gpipe_api.py (it must exist).
nitpicky = True
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(torch|nn|np|numpy|optim|collections|typing|typing_extensions|pathlib|os|io|argparse|enum|fractions|"
        r"dataclasses|concurrent|threading|contextlib|types|abc|datetime|json|logging|subprocess|transformers|"
        r"peft|safetensors|sentencepiece|sacrebleu|optuna|matplotlib|tensorboard|PIL)(\..*)?",
    ),
]

# The API: members in the order the source gives them, signatures with their types.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
autodoc_inherit_docstrings = False  # an undocumented override (GPipe.to) shows no torch docstring
add_module_names = False
python_use_unqualified_type_names = True

html_theme = "furo"
html_title = f"gpipe {release}"
html_static_path = ["_static"]
html_css_files = ["gpipe.css"]
html_show_sourcelink = False
