"""Giant models: layers built on the meta device or from factories, initialized seeded by layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gpipe import Pipeline
from tests.dist_harness import run_ranks


def factories() -> list[object]:
    return [lambda: nn.Linear(8, 8), nn.GELU, lambda: nn.Linear(8, 8), nn.Tanh, lambda: nn.LayerNorm(8), nn.ReLU]


def weights(pipe: nn.Module) -> dict[str, torch.Tensor]:
    return {n.split(".", 2)[2]: p.detach().clone() for n, p in pipe.named_parameters()}


def test_initial_weights_do_not_depend_on_partitions() -> None:
    results = []
    for balance in ([6], [3, 3], [2, 2, 2], [1, 1, 1, 1, 1, 1]):
        pipe = Pipeline(factories(), balance, chunks=2, loss_fn=F.mse_loss, devices=["cpu"] * len(balance))  # type: ignore[arg-type]
        results.append(weights(pipe))
    assert set(results[0]) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    for other in results[1:]:
        assert all(torch.equal(other[k], v) for k, v in results[0].items())
    assert not torch.equal(results[0]["0.weight"], results[0]["2.weight"]), "layers must get different seeds"


def test_meta_model_is_materialized_like_its_factories() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[f() for f in factories()])  # type: ignore[operator]
    pipe = Pipeline(model, [3, 3], chunks=2, loss_fn=F.mse_loss, devices=["cpu", "cpu"])
    assert not any(p.is_meta for p in pipe.parameters())
    built = Pipeline(factories(), [2, 4], chunks=2, loss_fn=F.mse_loss, devices=["cpu", "cpu"])  # type: ignore[arg-type]
    mine, theirs = weights(pipe), weights(built)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.isfinite(pipe.step(x, y))


def test_init_seed_changes_the_weights() -> None:
    a = weights(Pipeline(factories(), [6], chunks=1, loss_fn=F.mse_loss, init_seed=0))  # type: ignore[arg-type]
    b = weights(Pipeline(factories(), [6], chunks=1, loss_fn=F.mse_loss, init_seed=1))  # type: ignore[arg-type]
    assert not torch.equal(a["0.weight"], b["0.weight"])


def test_meta_layer_without_reset_parameters_is_refused() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.s

    with torch.device("meta"):
        model = nn.Sequential(Scale(), nn.Linear(3, 3))
    with pytest.raises(TypeError, match=r"layer 0 .*\['Scale'\] has no reset_parameters"):
        Pipeline(model, [1, 1], chunks=1, loss_fn=F.mse_loss, devices=["cpu", "cpu"])


def test_factory_must_return_a_module() -> None:
    with pytest.raises(TypeError, match="layer factory 1 returned int"):
        Pipeline([nn.ReLU, lambda: 3], [2], chunks=1, loss_fn=F.mse_loss)  # type: ignore[list-item]


def test_each_rank_materializes_only_its_stage(tmp_path: Path) -> None:
    """4 ranks, a 128 MiB model built on the meta device: each rank's memory grows by its own
    stage's 32 MiB, and its weights are those one process materializes."""
    ranks = run_ranks("meta_memory", 4, tmp_path, width=2048, layers=8)
    stage_mib = 2 * (2048 * 2048 + 2048) * 4 / 2**20
    for r, out in enumerate(ranks):
        model_mib = out["rss_mib"] - out["overhead_mib"]
        print(
            f"rank {r}: peak RSS +{out['rss_mib']:.1f} MiB building the pipeline, of which "
            f"{out['overhead_mib']:.1f} MiB any pipeline takes (process groups) and {model_mib:.1f} MiB "
            f"its stage ({stage_mib:.1f} MiB of parameters); building the whole model: +{out['whole_rss_mib']:.1f} MiB"
        )
        assert out["param_mib"] == pytest.approx(stage_mib)
        assert 0.9 * stage_mib < model_mib < 1.3 * stage_mib, out
        assert out["whole_rss_mib"] > 3.5 * stage_mib, out["whole_rss_mib"]  # the measure sees a whole model
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])
    one = Pipeline(model, [2, 2, 2, 2], chunks=1, loss_fn=F.mse_loss, devices=["cpu"] * 4)
    expected = weights(one)
    for out in ranks:
        for k, v in out["weights"].items():
            assert torch.equal(v, expected[k]), k
