"""Where :class:`~gpipe.data.images.ImageFiles` reads its images, one batch at a time: a folder indexed
(:class:`FolderImages`: file names and labels; Pillow decodes an image when a batch needs it) or an
uncompressed ``.npz`` memory-mapped (:class:`NpzImages`: the zip member's ``.npy`` data read in place,
nothing copied but the rows of a batch); and the seeded Inception-style random-resized crop
(:func:`crop_box`) with its horizontal flip.

Both sources' ``read(indices, generators)`` return (B, C, H, W) float pixels in [0, 1] (uint8 / 255),
an image cropped and flipped where its generator is given, resized (folders) or left at its size (.npz)
where it is ``None``."""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

__all__ = ["SUFFIXES", "FolderImages", "NpzImages", "crop_box"]

SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"})

# the random-resized crop's ranges: of the image's area, and of the crop's width / height
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
TRIES = 10


def crop_box(width: int, height: int, g: torch.Generator) -> tuple[int, int, int, int]:
    """The (left, top, width, height) of a random-resized crop of a ``width`` x ``height`` image: an area
    uniform in ``SCALE`` of the image's and a width / height ratio log-uniform in ``RATIO``, placed
    uniformly; after ``TRIES`` draws that do not fit, the largest centred crop whose ratio is in range."""
    area = width * height
    low, high = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(TRIES):
        scale, log_ratio = torch.rand(2, generator=g, dtype=torch.float64).tolist()
        target = area * (SCALE[0] + scale * (SCALE[1] - SCALE[0]))
        ratio = math.exp(low + log_ratio * (high - low))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=g))
            left = int(torch.randint(0, width - w + 1, (1,), generator=g))
            return left, top, w, h
    if width / height < RATIO[0]:  # too tall: the full width
        w, h = width, min(round(width / RATIO[0]), height)
    elif width / height > RATIO[1]:  # too wide: the full height
        w, h = min(round(height * RATIO[1]), width), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _flipped(image: Tensor, g: torch.Generator | None) -> Tensor:
    """``image`` (C, H, W) mirrored left-right with probability 0.5 (never without a generator)."""
    if g is not None and float(torch.rand((), generator=g)) < 0.5:
        return image.flip(-1)
    return image


class FolderImages:
    """The images of a folder with one sub-folder per class (sorted, they give the labels), indexed:
    the files' names (sorted, with a suffix of ``SUFFIXES``) and labels. ``read`` decodes them with
    Pillow (``Image.open(...).convert("RGB")``) and gives ``size`` x ``size`` images."""

    channels = 3

    def __init__(self, root: Path, size: int) -> None:
        self.root, self.size = root, size
        self.names = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
        self.files: list[str] = []  # relative to root: class/file
        labels: list[int] = []
        for label, name in enumerate(self.names):
            files = sorted(
                e.name for e in os.scandir(root / name) if e.is_file() and Path(e.name).suffix.lower() in SUFFIXES
            )
            self.files += [f"{name}/{file}" for file in files]
            labels += [label] * len(files)
        if not self.files:
            raise ValueError(f"{str(root)!r} has no class sub-folders with images ({', '.join(sorted(SUFFIXES))})")
        self.labels = np.asarray(labels, dtype=np.int64)

    def read(self, indices: Sequence[int], generators: Sequence[torch.Generator | None]) -> Tensor:
        from PIL import Image

        out = torch.empty(len(indices), 3, self.size, self.size)
        for k, (index, g) in enumerate(zip(indices, generators, strict=True)):
            file = self.root / self.files[index]
            try:
                with Image.open(file) as image:
                    rgb = image.convert("RGB")
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
                raise ValueError(f"cannot read the image {str(file)!r}: {exc}") from None
            box = None
            if g is not None:
                left, top, w, h = crop_box(rgb.width, rgb.height, g)
                box = (left, top, left + w, top + h)
            pixels = np.asarray(rgb.resize((self.size, self.size), box=box), dtype=np.float32) / 255.0
            out[k] = _flipped(torch.from_numpy(pixels).permute(2, 0, 1), g)
        return out


class NpzImages:
    """The arrays ``x`` (N, H, W, C) or (N, C, H, W), uint8 or float, and ``y`` (N,) non-negative
    integer labels of an ``.npz`` written by ``np.savez``: ``y`` read, ``x`` memory-mapped at its
    member's offset in the file (opened again, lazily, after a pickle). Images keep their own size;
    a crop is resized back to it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with zipfile.ZipFile(path) as archive, open(path, "rb") as file:
                x, y = (_member(archive, file, name) for name in ("x.npy", "y.npy"))
                (shape, fortran, dtype, _), (y_shape, _, y_dtype, y_offset) = x, y
                if (
                    len(shape) != 4
                    or len(y_shape) != 1
                    or shape[0] != y_shape[0]
                    or dtype.kind not in "uif"
                    or y_dtype.kind not in "iu"
                ):
                    raise _RefusedError(
                        f"{str(path)!r}: x must be (N, H, W, C) or (N, C, H, W) and y (N,) integers "
                        f"(x: {shape} {dtype}, y: {y_shape} {y_dtype})"
                    )
                file.seek(y_offset)
                labels = np.fromfile(file, dtype=y_dtype, count=y_shape[0])
        except _RefusedError as exc:  # a message of its own
            raise ValueError(str(exc)) from None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"cannot read {str(path)!r} as a .npz of arrays x and y: {exc!r}") from None
        if len(labels) != y_shape[0] or x[3] + math.prod(shape) * dtype.itemsize > path.stat().st_size:
            raise ValueError(f"cannot read {str(path)!r} as a .npz of arrays x and y: the file is cut short")
        if len(labels) and labels.min() < 0:
            raise ValueError(f"{str(path)!r}: labels must be non-negative (smallest: {int(labels.min())})")
        self.labels = labels.astype(np.int64)
        self.names = [str(c) for c in range(int(self.labels.max()) + 1)] if len(labels) else []
        self.shape, self.dtype, self.offset = shape, dtype, x[3]
        self.order: Literal["C", "F"] = "F" if fortran else "C"
        self.channels_last = shape[-1] in (1, 3, 4) and shape[1] not in (1, 3, 4)
        self.channels = shape[-1] if self.channels_last else shape[1]
        self.height, self.width = shape[1:3] if self.channels_last else shape[2:4]
        self._x: np.ndarray[Any, Any] | None = None

    @property
    def array(self) -> np.ndarray[Any, Any]:
        """``x``, memory-mapped (read-only), mapped again in a process that unpickled this object."""
        x = self._x
        if x is None:
            x = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape, order=self.order)
            self._x = x
        return x

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_x": None}  # the map is not pickled (its pages would be); reopened lazily

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def read(self, indices: Sequence[int], generators: Sequence[torch.Generator | None]) -> Tensor:
        rows = np.asarray(indices, dtype=np.int64)
        images = torch.from_numpy(np.asarray(self.array[rows], dtype=np.float32))  # (B, ...): these rows copied
        if self.channels_last:
            images = images.permute(0, 3, 1, 2)
        if self.dtype == np.uint8:
            images = images / 255.0
        out = images.contiguous()
        for k, g in enumerate(generators):
            if g is not None:
                left, top, w, h = crop_box(self.width, self.height, g)
                crop = out[k : k + 1, :, top : top + h, left : left + w]
                resized = F.interpolate(crop, size=(self.height, self.width), mode="bilinear", antialias=True)
                out[k] = _flipped(resized[0], g)
        return out


class _RefusedError(ValueError):
    """An .npz read but refused, with its own message: compressed, or x and y not of the shapes and types
    an image data set needs."""


def _member(archive: zipfile.ZipFile, file: Any, name: str) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """The shape, Fortran order, dtype and data offset in the file of the ``.npy`` member ``name``."""
    info = archive.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        raise _RefusedError(
            f"{archive.filename!r} is a compressed .npz (np.savez_compressed), which cannot be memory-mapped: write "
            f"it once uncompressed, with d = np.load(path); np.savez(out, x=d['x'], y=d['y'])"
        )
    if info.flag_bits & 0x1:
        raise ValueError(f"{name} is encrypted")
    file.seek(info.header_offset)
    header = file.read(30)  # the local file header: its name and extra field come after these 30 bytes
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError(f"no local file header for {name} at byte {info.header_offset}")
    file.seek(
        info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    )
    version = np.lib.format.read_magic(file)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(file)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(file)
    else:
        raise ValueError(f"{name} is a .npy of version {version}, not 1.0 or 2.0")
    if dtype.hasobject:
        raise ValueError(f"{name} holds Python objects, not numbers")
    return tuple(shape), bool(fortran), dtype, file.tell()
