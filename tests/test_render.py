from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from gpipe.schedule import kind_cost, make_schedule, render_timeline, simulate


@pytest.mark.parametrize("suffix", ["png", "svg"])
@pytest.mark.parametrize(("name", "virtual"), [("gpipe", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_timeline_picture(tmp_path: Path, suffix: str, name: str, virtual: int) -> None:
    sim = simulate(make_schedule(name, 4, 8, virtual), kind_cost(F=1, B=2))
    out = render_timeline(sim, tmp_path / f"t.{suffix}")
    data = out.read_bytes()
    if suffix == "png":
        assert data.startswith(b"\x89PNG")
    else:
        text = data.decode()
        assert "<svg" in text and f"bubble {sim.bubble:.1%}" in text


def test_picture_of_a_measured_step(tmp_path: Path) -> None:
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=4, loss_fn=F.mse_loss)
    pipe.step(torch.randn(8, 4), torch.randn(8, 4))
    assert pipe.last_trace is not None
    out = render_timeline(pipe.last_trace.timeline(), tmp_path / "real.svg", unit="seconds")
    assert "seconds" in out.read_text()
