"""torchvision's model code for the tests, beside the CPU build of torch.

PyPI's torchvision wheels are CUDA builds: beside torch's CPU build their compiled operators
(``torchvision::nms``, ``roi_align``, ``deform_conv2d``) do not load, and importing torchvision then
fails (it registers fake kernels for operators that do not exist) — and makes ``import
transformers`` fail, which imports torchvision when it can find it. So the Makefile installs
torchvision 0.28.0 (the release for torch 2.13) outside site-packages, in ``.venv/vision``, and the
tests that need its models (ResNet, ViT: pure Python) import it from there through
:func:`torchvision`, which first declares the two operators torchvision's import registers fake
kernels for. The detection operators stay unavailable: calling one raises torch's "no kernel" error.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

VISION = Path(sys.prefix) / "vision"


def torchvision() -> ModuleType:
    """The torchvision package (its model code), or skip where `make` did not install it."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    if not (VISION / "torchvision").is_dir():
        pytest.skip(f"torchvision is not installed in {VISION} (run `make` to install it)")
    try:
        torch.ops.torchvision.nms  # noqa: B018 - declared already?
    except (AttributeError, RuntimeError):
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _KEEP.append(library)
    sys.path.insert(0, str(VISION))
    try:
        return importlib.import_module("torchvision")
    finally:
        sys.path.remove(str(VISION))


_KEEP: list[object] = []  # a Library deregisters its definitions when collected
