"""Gradients only where they flow: a value crossing a stage boundary requires grad only if it depends
on something that does (a float attention mask does not), and nothing is computed or sent for it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gpipe import GPipe, Pipeline
from gpipe.runtime.stage import Stage
from tests.dist_cases import masked_data, masked_loss, masked_model
from tests.dist_harness import POOL, Pool
from tests.helpers import assert_all_close, grads


def plain_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = masked_model()
    x, y = masked_data()
    loss = masked_loss(model(x), y)
    loss.backward()
    return loss.detach(), grads(model)


@pytest.fixture
def returned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, Any]]:
    """Every input gradient a stage hands back (to the previous stage), by stage."""
    seen: list[tuple[int, Any]] = []
    for name in ("backward", "backward_input"):
        original = getattr(Stage, name)

        def spy(self: Stage, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            out = _original(self, *args, **kwargs)
            seen.append((self.index, out))
            return out

        monkeypatch.setattr(Stage, name, spy)
    return seen


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_mask_crossing_a_boundary_gets_no_gradient(
    returned: list[tuple[int, Any]], schedule: str, checkpoint: str
) -> None:
    pipe = Pipeline(masked_model(), [1, 1, 2], chunks=4, loss_fn=masked_loss, schedule=schedule,
                    checkpoint=checkpoint, devices=["cpu"] * 3)  # fmt: skip
    x, y = masked_data()
    pipe.step(x, y)
    _, expected = plain_grads()
    assert_all_close(grads(pipe), expected, rtol=1e-5, atol=1e-6)
    later = [g for s, g in returned if s > 0]
    assert len(later) == 2 * 4  # stages 1 and 2, four micro-batches each
    for hidden, mask in later:
        assert isinstance(hidden, torch.Tensor) and mask is None
    assert all(g == (None,) for s, g in returned if s == 0)  # token ids: nothing to send back


def test_gpipe_output_that_needs_no_gradient_is_not_differentiable() -> None:
    gp = GPipe(masked_model(), [2, 2], devices=["cpu", "cpu"], chunks=2)
    hidden, mask = gp(masked_data()[0])
    assert hidden.requires_grad and not mask.requires_grad


def test_values_that_need_gradients_still_get_them() -> None:
    """The conservative side: a float value that does depend on a parameter keeps its gradient,
    even when the previous stage's forward ran without autograd (re-materialized)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = Pipeline(copy.deepcopy(model), [1, 2], chunks=4, loss_fn=F.mse_loss, checkpoint="always",
                    devices=["cpu", "cpu"])  # fmt: skip
    pipe.step(x, y)
    F.mse_loss(model(x), y).backward()
    assert_all_close(grads(pipe), grads(model), rtol=1e-5, atol=1e-6)


MASKED = {
    c: POOL.add(2, f"gradflow masked {c}", "masked_step", schedule="1f1b", checkpoint=c) for c in ("never", "always")
}  # cases of the session's pool (tests/dist_harness.py: a few launches in all)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_mask_gradient_is_not_sent_between_ranks(pool: Pool, checkpoint: str) -> None:
    ranks = pool(MASKED[checkpoint])
    loss, expected = plain_grads()
    merged = {n: g for r in ranks for n, g in r["grads"].items()}  # partitions.<stage>.<layer>.<name>
    by_plain = {n.split(".", 2)[2]: g for n, g in merged.items()}
    names = [n for n, _ in masked_model().named_parameters()]
    assert sorted(by_plain) == sorted(names)
    assert_all_close([by_plain[n] for n in names], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ranks[0]["loss"], loss)
    sent = ranks[1]["sent"]  # rank 1 sends the gradients of stage 1's inputs back to rank 0
    assert sent == [["tensor", "none"]] * 4
