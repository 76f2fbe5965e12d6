"""Image data for classifiers: :class:`ImageBatch`, class-structured :class:`SyntheticImages` and real
images read by :class:`ImageFiles` (from the sources of :mod:`gpipe.data.imagefiles`), in seeded epochs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from gpipe.data.base import ReplicaBatch, _generator, share_of
from gpipe.data.imagefiles import FolderImages, NpzImages
from gpipe.microbatch import Share
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


class ImageFiles(_Images):
    """Labelled images read from ``path``, a batch at a time: a folder with one sub-folder per class
    (named as the class; sorted, they give the label order) of image files, indexed, each decoded when
    a batch needs it and resized to ``size``x``size``; or a ``.npz`` written by ``np.savez`` with ``x``
    (N, H, W, C) or (N, C, H, W), uint8 or float, and ``y`` (N,) integer labels, memory-mapped, its
    images at their own size (:mod:`gpipe.data.imagefiles`). Memory does not grow with the images
    beyond an index per image.

    A seeded tenth (at least one image) is held out for the ``eval`` split. Each split is read in
    epochs, each a seeded permutation of its images: the i-th image of ``batch(size, step)`` is the
    split's position p = step * size + i, image ``perm_e[p % n]`` of epoch e = p // n, so each image
    comes once per epoch and a batch is a pure function of (seed, step, size). With ``augment``, a
    training image is cropped (random-resized, to ``size``x``size`` or the .npz's own size) and
    flipped with probability 0.5 by a generator of (seed, epoch, image): the same in every process
    and for every batch size. Pixels are standardized per channel by the mean and std of a seeded
    sample of at most 512 training images."""

    def __init__(self, path: str | os.PathLike[str], *, size: int = 32, seed: int = 0, augment: bool = False) -> None:
        self.path, self.seed, self.augment = Path(path), seed, augment
        self.source: FolderImages | NpzImages
        if self.path.is_dir():
            self.source = FolderImages(self.path, size)
        elif self.path.suffix == ".npz":
            self.source = NpzImages(self.path)
        else:
            raise ValueError(
                f"cannot read the image data {str(path)!r}: give a .npz file (arrays x and y) or a folder "
                f"with one sub-folder of images per class"
            )
        count = len(self.source.labels)
        if count < 2:
            raise ValueError(f"{str(path)!r} holds {count} image(s); at least 2 are needed (train and eval)")
        self.names = self.source.names
        self.classes, self.channels = max(len(self.names), 2), self.source.channels
        order = torch.randperm(count, generator=torch.Generator().manual_seed(derive_seed(seed, 8, 0))).numpy()
        held = max(count // 10, 1)
        self.rows = {"eval": order[:held], "train": order[held:]}  # each split's images (indices of the source)
        self._epochs: dict[str, tuple[int, np.ndarray[Any, Any]]] = {}  # per split: its latest epoch's permutation
        self.mean, self.std = self._statistics()

    def _statistics(self, most: int = 512, chunk: int = 64) -> tuple[Tensor, Tensor]:
        """Each channel's mean and std (at least 1e-6) over a seeded sample of training images, as
        ``batch`` reads them without augmentation: (C, 1, 1) each."""
        train = self.rows["train"]
        g = torch.Generator().manual_seed(derive_seed(self.seed, _STATISTICS, 0))
        sample = np.sort(train[torch.randperm(len(train), generator=g)[:most].numpy()])
        sums = torch.zeros(2, self.channels, dtype=torch.float64)
        pixels = 0
        for start in range(0, len(sample), chunk):
            rows = sample[start : start + chunk].tolist()
            images = self.source.read(rows, [None] * len(rows)).double()
            sums += torch.stack([images.sum(dim=(0, 2, 3)), images.square().sum(dim=(0, 2, 3))])
            pixels += images[:, 0].numel()
        mean = sums[0] / pixels
        std = (sums[1] / pixels - mean.square()).clamp_min(0).sqrt().clamp_min(1e-6)
        return mean.float().view(-1, 1, 1), std.float().view(-1, 1, 1)

    def _permutation(self, split: str, epoch: int) -> np.ndarray[Any, Any]:
        """Epoch ``epoch``'s order of the split's images; the latest is kept (replaced whole: safe
        across threads, at worst computed twice)."""
        cached = self._epochs.get(split)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        g = torch.Generator().manual_seed(derive_seed(self.seed, _EPOCHS[split], epoch))
        permutation = torch.randperm(len(self.rows[split]), generator=g).numpy()
        self._epochs[split] = (epoch, permutation)
        return permutation

    def indices(self, size: int, step: int, *, split: str = "train") -> tuple[list[int], list[int]]:
        """The images (indices of the source) of ``batch(size, step, split=split)`` and their epochs."""
        if split not in self.rows:
            raise ValueError(f"split must be one of {sorted(self.rows)} (split: {split!r})")
        rows, n = self.rows[split], len(self.rows[split])
        images, epochs = [], []
        for position in range(step * size, (step + 1) * size):
            epoch, at = divmod(position, n)
            images.append(int(rows[self._permutation(split, epoch)[at]]))
            epochs.append(epoch)
        return images, epochs

    def batch(self, size: int, step: int, *, split: str = "train", share: tuple[int, int] | None = None) -> Any:
        """The images of ``indices(size, step, split)``, decoded (and augmented); with ``share`` =
        (replica, replicas), only that replica's rows are decoded (a :class:`~gpipe.data.base.ReplicaBatch`)."""
        images, epochs = self.indices(size, step, split=split)
        if share is not None:
            mine = share_of(range(len(images)), share)
            part = self._decode([images[i] for i in mine], [epochs[i] for i in mine], split)
            return ReplicaBatch(part, Share(len(images)), len(images))
        return self._decode(images, epochs, split)

    def _decode(self, images: list[int], epochs: list[int], split: str) -> ImageBatch:
        generators = [
            torch.Generator().manual_seed(derive_seed(derive_seed(self.seed, _AUGMENT, epoch), image, 0))
            if self.augment and split == "train"
            else None
            for image, epoch in zip(images, epochs, strict=True)
        ]
        pixels = (self.source.read(images, generators) - self.mean) / self.std
        return ImageBatch(pixels, torch.from_numpy(self.source.labels[images]))

    def __getstate__(self) -> dict[str, Any]:
        """Small: the source's index (its memory map dropped), the splits and statistics, no cache."""
        return {**self.__dict__, "_epochs": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


# derive_seed's second argument for this module's streams (7: SyntheticImages, 8: the held-out split)
_EPOCHS = {"train": 10, "eval": 11}
_AUGMENT = 12
_STATISTICS = 13
