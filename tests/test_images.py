"""Image data for AmoebaNet and `gpipe train --model amoebanet`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpipe.cli import main
from gpipe.data import ImageFiles, SyntheticImages
from gpipe.train import TrainConfig, train


def test_synthetic_images_are_a_pure_function_of_seed_split_and_step() -> None:
    data = SyntheticImages(classes=4, size=12, seed=3)
    a, b = data.batch(8, 5), SyntheticImages(classes=4, size=12, seed=3).batch(8, 5)
    assert a.images.shape == (8, 3, 12, 12) and a.labels.shape == (8,)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, data.batch(8, 6).images)
    assert not torch.equal(a.images, data.batch(8, 5, split="eval").images)
    assert data.baseline() == pytest.approx(math.log(4))
    assert a.count == 8 and data.unit == "images"


def test_synthetic_images_carry_their_class() -> None:
    """Without noise, an image is closest (by correlation) to its own class's pattern."""
    data = SyntheticImages(classes=6, size=16, noise=0.0, seed=0)
    batch = data.batch(64, 0)
    patterns = data.patterns.flatten(1)
    # a shifted pattern still correlates best with its own class (shifts are small: size/8)
    scores = batch.images.flatten(1) @ patterns.T
    assert (scores.argmax(1) == batch.labels).float().mean() > 0.9


def test_bad_synthetic_images() -> None:
    with pytest.raises(ValueError, match="classes: 1"):
        SyntheticImages(classes=1)


def write_npz(path: Path, channels_last: bool, uint8: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (20, 8, 8, 3)) if channels_last else rng.integers(0, 256, (20, 3, 8, 8))
    np.savez(path, x=x.astype(np.uint8) if uint8 else x.astype(np.float32), y=np.arange(20) % 3)


@pytest.mark.parametrize(("channels_last", "uint8"), [(True, True), (False, False)])
def test_npz_images(tmp_path: Path, channels_last: bool, uint8: bool) -> None:
    write_npz(tmp_path / "d.npz", channels_last, uint8)
    data = ImageFiles(tmp_path / "d.npz")
    batch = data.batch(5, 0)
    assert batch.images.shape == (5, 3, 8, 8) and batch.images.dtype == torch.float32
    assert data.classes == 3 and data.channels == 3
    assert len(data.splits["eval"][0]) == 2 and len(data.splits["train"][0]) == 18
    everything = torch.cat([data.splits["train"][0], data.splits["eval"][0]])
    torch.testing.assert_close(everything.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)


def test_image_folder(tmp_path: Path) -> None:
    for name, colour in [("cat", (255, 0, 0)), ("dog", (0, 0, 255))]:
        (tmp_path / name).mkdir()
        for i in range(3):
            Image.new("RGB", (10 + i, 7), colour).save(tmp_path / name / f"{i}.png")
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    data = ImageFiles(tmp_path, size=6)
    assert data.names == ["cat", "dog"] and data.classes == 2
    images, labels = data.splits["train"]
    assert images.shape[1:] == (3, 6, 6) and len(images) + len(data.splits["eval"][0]) == 6
    red = images[:, 0].mean(dim=(1, 2)) > images[:, 2].mean(dim=(1, 2))
    assert torch.equal(red, labels == 0)  # the label follows the folder


def test_bad_image_data(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"a \.npz file"):
        ImageFiles(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class sub-folders"):
        ImageFiles(tmp_path / "empty")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="cannot read"):
        ImageFiles(tmp_path / "bad.npz")
    np.savez(tmp_path / "flat.npz", x=np.zeros((4, 8)), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match=r"x must be .*x: \(4, 8\)"):
        ImageFiles(tmp_path / "flat.npz")
    (tmp_path / "broken" / "a").mkdir(parents=True)
    (tmp_path / "broken" / "a" / "0.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="cannot read the image"):
        ImageFiles(tmp_path / "broken")


def amoebanet_run(out: Path, **kwargs: object) -> TrainConfig:
    settings = dict(
        model="amoebanet", layers=3, filters=16, image_size=16, batch=32, steps=80, warmup=10, eval_every=20
    )
    return TrainConfig(out=str(out), progress=False, **{**settings, **kwargs})  # type: ignore[arg-type]


def test_amoebanet_learns_and_is_the_same_for_one_and_two_stages(tmp_path: Path) -> None:
    """The learning criterion must hold whatever the CPU's kernels: float rounding sends a run down
    another trajectory, so it is checked where every trajectory has long passed it. With a warm-up of
    10 steps, over 28 perturbed runs (seeds 0-9, 2 threads per stage, float64, and ATen, oneDNN and
    MKL held to AVX2 or SSE4 as on other CPUs) the eval loss at step 80 was 0.92-1.22 (chance 2.30,
    bound 1.80) and the accuracy 0.69-0.85 (bound 0.4); every eval from step 60 on was under 1.76
    with an accuracy of 0.5 or more. (The first version, a warm-up of 30 and 60 steps, stopped
    mid-descent: 1.09-2.46 at step 60; 2.04 held to AVX2, as on a Zen 3.)"""
    two = train(amoebanet_run(tmp_path / "k2", partitions=2))
    # one stage, over a prefix: batches, dropout and the learning rate are a pure function of the
    # step, so its first 20 steps (and the evaluation after them) are the two-stage run's, bitwise
    train(amoebanet_run(tmp_path / "k1", partitions=1, steps=20))
    rows = [
        [json.loads(line) for line in (tmp_path / k / "metrics.jsonl").read_text().splitlines()] for k in ("k1", "k2")
    ]
    keys = ("step", "loss", "lr", "eval_loss", "eval_accuracy")
    one_rows, two_rows = ([[r.get(k) for k in keys] for r in rs] for rs in rows)
    assert len(one_rows) == 20 and one_rows[-1][3] is not None
    assert one_rows == two_rows[:20]  # bitwise: floats survive JSON exactly
    assert two["eval_loss"] < two["baseline"] - 0.5, (two["eval_loss"], two["baseline"])
    assert two["eval_accuracy"] > 0.4, two["eval_accuracy"]  # chance: 0.1
    assert "images_per_s" in rows[1][-1]


def test_amoebanet_on_npz_data_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_npz(tmp_path / "d.npz", channels_last=True, uint8=True)
    flags = ["--model", "amoebanet", "--layers", "1", "--filters", "4", "--image-size", "8", "--batch", "8"]
    code = main(["train", *flags, "--steps", "2", "--data", str(tmp_path / "d.npz"), "--out", str(tmp_path / "r"),
                 "--no-progress", "--partitions", "3"])  # fmt: skip
    assert code == 0
    assert "chance baseline 1.0986" in capsys.readouterr().out  # log 3: the classes of the file
    assert main(["train", *flags, "--partitions", "6", "--out", str(tmp_path / "r")]) == 2
    assert "exceeds the model's 5 layers (AmoebaNet-D(1, ...) has L + 4)" in capsys.readouterr().err
    assert main(["train", *flags, "--data", str(tmp_path / "missing.npz"), "--out", str(tmp_path / "r")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_micro_batches_too_small_for_batch_norm_are_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """8x8 images end as 1x1 feature maps: a micro-batch of one image has one value per channel, which
    batch norm cannot normalize. One line with the numbers, not a traceback (issue 24, item 8)."""
    out = tmp_path / "run"
    argv = ["train", "--model", "amoebanet", "--image-size", "8", "--out", str(out), "--steps", "1", "--no-progress"]
    assert main([*argv, "--batch", "4", "--chunks", "4"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert "--batch 4 in --chunks 4 makes micro-batches of 1 image(s)" in err and "1 pixel(s)" in err, err
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert main([*argv, "--batch", "8", "--chunks", "4", "--eval-every", "1"]) == 0  # two images: fine
