"""Image data for classifiers: :class:`ImageBatch`, class-structured :class:`SyntheticImages` and real
images read by :class:`ImageFiles`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from gpipe.data.base import _generator
from gpipe.rng import derive_seed

__all__ = ["ImageBatch", "ImageFiles", "SyntheticImages"]


@dataclass(frozen=True)
class ImageBatch:
    images: Tensor  # (B, C, H, W) float
    labels: Tensor  # (B,) class indices

    @property
    def inputs(self) -> Tensor:
        return self.images

    @property
    def target(self) -> Tensor:
        return self.labels

    @property
    def count(self) -> int:
        return self.images.size(0)


class _Images:
    unit = "images"
    baseline_name = "chance"
    classes: int
    channels: int

    def baseline(self) -> float:
        """The loss of a uniform guess over the classes: log(classes) nats."""
        return math.log(self.classes)


class SyntheticImages(_Images):
    """``classes`` classes of ``channels``x``size``x``size`` images: class c's pattern is smooth
    noise (a random ``detail``x``detail`` grid, upsampled), and an image of class c is that pattern
    shifted by up to ``size/8`` pixels, scaled by a contrast in [0.5, 1.5], plus Gaussian ``noise``."""

    def __init__(
        self,
        *,
        classes: int = 10,
        size: int = 32,
        channels: int = 3,
        detail: int = 4,
        noise: float = 3.0,
        seed: int = 0,
    ) -> None:
        if classes < 2 or size < 4 or channels < 1 or detail < 1 or noise < 0:
            raise ValueError(
                f"SyntheticImages needs classes >= 2, size >= 4, channels >= 1, detail >= 1, noise >= 0 "
                f"(classes: {classes}, size: {size}, channels: {channels}, detail: {detail}, noise: {noise})"
            )
        self.classes, self.size, self.channels, self.noise, self.seed = classes, size, channels, noise, seed
        g = torch.Generator().manual_seed(derive_seed(seed, 7, 0))
        grid = torch.randn(classes, channels, detail, detail, generator=g)
        patterns = F.interpolate(grid, size=(size, size), mode="bicubic", align_corners=False)
        self.patterns = (patterns - patterns.mean(dim=(1, 2, 3), keepdim=True)) / patterns.std(
            dim=(1, 2, 3), keepdim=True
        )

    def batch(self, size: int, step: int, *, split: str = "train") -> ImageBatch:
        g = _generator(self.seed, split, step)
        labels = torch.randint(0, self.classes, (size,), generator=g)
        reach = max(self.size // 8, 1)
        shifts = torch.randint(-reach, reach + 1, (size, 2), generator=g).tolist()
        contrast = 0.5 + torch.rand(size, 1, 1, 1, generator=g)
        noise = torch.randn(size, self.channels, self.size, self.size, generator=g)
        shifted = torch.stack([self.patterns[c].roll(tuple(s), dims=(1, 2)) for c, s in zip(labels.tolist(), shifts)])
        return ImageBatch(shifted * contrast + self.noise * noise, labels)


_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"}


class ImageFiles(_Images):
    """Labelled images read into memory from ``path``: a ``.npz`` file with ``x`` (N, H, W, C) or
    (N, C, H, W), uint8 or float, and ``y`` (N,) integer labels; or a folder with one sub-folder
    per class (named as the class; sorted, they give the label order) of image files, all resized to
    ``size``x``size``. Pixels are standardized per channel; a seeded tenth (at least one image) is
    held out for the ``eval`` split."""

    def __init__(self, path: str | os.PathLike[str], *, size: int = 32, seed: int = 0) -> None:
        self.path, self.seed = Path(path), seed
        if self.path.is_dir():
            images, labels, self.names = self._read_folder(size)
        elif self.path.suffix == ".npz":
            images, labels = self._read_npz()
            self.names = [str(c) for c in range(int(labels.max()) + 1)]
        else:
            raise ValueError(
                f"cannot read the image data {str(path)!r}: give a .npz file (arrays x and y) or a folder "
                f"with one sub-folder of images per class"
            )
        if len(images) < 2:
            raise ValueError(f"{str(path)!r} holds {len(images)} image(s); at least 2 are needed (train and eval)")
        mean = images.mean(dim=(0, 2, 3), keepdim=True)
        std = images.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
        images = (images - mean) / std
        self.classes, self.channels = max(len(self.names), 2), images.size(1)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(derive_seed(seed, 8, 0)))
        held = max(len(images) // 10, 1)
        self.splits = {
            "eval": (images[order[:held]], labels[order[:held]]),
            "train": (images[order[held:]], labels[order[held:]]),
        }

    def _read_npz(self) -> tuple[Tensor, Tensor]:
        import numpy as np

        try:
            with np.load(self.path) as archive:
                x, y = archive["x"], archive["y"]
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"cannot read {str(self.path)!r} as a .npz of arrays x and y: {exc!r}") from None
        if x.ndim != 4 or y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(
                f"{str(self.path)!r}: x must be (N, H, W, C) or (N, C, H, W) and y (N,) integers "
                f"(x: {x.shape} {x.dtype}, y: {y.shape} {y.dtype})"
            )
        if len(y) and y.min() < 0:
            raise ValueError(f"{str(self.path)!r}: labels must be non-negative (smallest: {int(y.min())})")
        images = torch.from_numpy(np.ascontiguousarray(x)).float()
        if x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
            images = images.permute(0, 3, 1, 2)
        if x.dtype == np.uint8:
            images = images / 255.0
        return images.contiguous(), torch.from_numpy(y.astype(np.int64))

    def _read_folder(self, size: int) -> tuple[Tensor, Tensor, list[str]]:
        import numpy as np
        from PIL import Image, UnidentifiedImageError

        names = sorted(d.name for d in self.path.iterdir() if d.is_dir())
        images, labels = [], []
        for label, name in enumerate(names):
            for file in sorted((self.path / name).iterdir()):
                if file.suffix.lower() not in _IMAGE_SUFFIXES:
                    continue
                try:
                    with Image.open(file) as image:
                        pixels = np.asarray(image.convert("RGB").resize((size, size)), dtype=np.float32) / 255.0
                except (OSError, UnidentifiedImageError) as exc:
                    raise ValueError(f"cannot read the image {str(file)!r}: {exc}") from None
                images.append(torch.from_numpy(pixels).permute(2, 0, 1))
                labels.append(label)
        if not images:
            raise ValueError(
                f"{str(self.path)!r} has no class sub-folders with images ({', '.join(sorted(_IMAGE_SUFFIXES))})"
            )
        return torch.stack(images), torch.tensor(labels), names

    def batch(self, size: int, step: int, *, split: str = "train") -> ImageBatch:
        g = _generator(self.seed, split, step)
        images, labels = self.splits[split]
        rows = torch.randint(0, len(images), (size,), generator=g)
        return ImageBatch(images[rows], labels[rows])
