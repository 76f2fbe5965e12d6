# Quick start: `make demo` and `make test` each create (or refresh) the virtual environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest bench docs gpu-check gpu-check-multi wheel-check clean

# torch is pinned to 2.13.0 by constraints.txt: an open range would pull gigabytes of CUDA packages. The
# dev extra is the hf and tensorboard extras and the tools (README: installing with pip alone).
# torchvision goes apart, into $(VENV)/vision, never site-packages: transformers imports it when
# present, and PyPI's (CUDA) wheels fail to import beside the CPU torch; tests that need it add
# $(VENV)/vision to the path. (--upgrade: a re-run replaces it.)
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(VENV)/vision torchvision==0.28.0
	touch $(STAMP)

# The translation workflow on the built-in synthetic language pairs, written as text files: a shared
# SentencePiece vocabulary, temperature sampling, BLEU per pair at the end (gpipe demo -h: gpipe corpus
# into runs/demo-corpus, then gpipe train on it into runs/demo).
demo: $(STAMP)
	$(BIN)/gpipe demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples docs/conf.py docs/_ext
	$(BIN)/ruff format --check src tests benchmarks examples docs/conf.py docs/_ext

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

# gpipe bench: the paper's tables and the peers, quick sizes; a report in runs/bench/report.md.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(BIN)/gpipe bench --out runs/bench

# The GPU checks (tests/gpu, docs/guides/gpus.md): with a CUDA device, pytest -m cuda and a report in
# benchmarks/results/gpu/report.md; without one, a line saying so and a check that tests/gpu is collected.
# GPU_PYTHON=python3: with that interpreter's own (CUDA) PyTorch and packages, gpipe from src/, no venv
# built (a GPU machine that cannot fetch packages, where the venv's CPU wheel of torch would be no use).
GPU_PYTHON ?=
GPU_RUN = $(if $(GPU_PYTHON),PYTHONPATH=src:. $(GPU_PYTHON),$(BIN)/python)
gpu-check: $(if $(GPU_PYTHON),,$(STAMP))
	$(GPU_RUN) benchmarks/gpu_check.py

# The same for the checks that need two GPUs or more (pytest -m cuda_multi): report-multi.md.
gpu-check-multi: $(if $(GPU_PYTHON),,$(STAMP))
	$(GPU_RUN) benchmarks/gpu_check.py --multi

# The package as a user installs it: python -m build, a fresh venv with torch (pinned) and the wheel, then
# gpipe schedule, gpipe train --config t2-256-4 and gpipe demo in an empty folder (the distribution is
# gpipe-pytorch: "gpipe" in the package index is another project); benchmarks/results/wheel/report.md.
wheel-check: $(STAMP)
	$(BIN)/python benchmarks/wheel_check.py

# The documentation site (Sphinx and MyST, docs/README.md) into docs/_build/html, strictly: a warning, a broken
# cross-reference or a dead internal link fails it (and tests/test_docs.py builds it too). Only changed pages
# are read again, but every page is written (-a), so that a new page shows in every page's sidebar.
docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -a -b html -d docs/_build/doctrees docs docs/_build/html
	@echo "docs/_build/html/index.html"

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis docs/_build
