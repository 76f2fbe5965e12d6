"""Mini-batches, layer outputs and targets as pytrees: dicts, lists, namedtuples, dataclasses,
ModelOutputs; split, handed between stages and ranks, and gathered back in the same structure."""

from __future__ import annotations

import collections
import copy
import dataclasses
import re
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from gpipe import GPipe, Pipeline
from gpipe.microbatch import Batch, gather, scatter
from tests import dist_cases
from tests.dist_cases import Prediction, dict_data, dict_loss, dict_model
from tests.dist_harness import POOL, Pool
from tests.helpers import assert_all_close


class Pair(NamedTuple):
    x: Tensor
    label: str


@dataclasses.dataclass
class Sample:
    pixels: Tensor
    ids: Tensor
    tag: str


pytree.register_dataclass(Sample)


def assert_same_tree(a: Any, b: Any) -> None:
    """Same structure (types, keys) and equal leaves."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    assert spec_a == spec_b, (spec_a, spec_b)
    for u, v in zip(leaves_a, leaves_b):
        if isinstance(u, Tensor):
            assert isinstance(v, Tensor) and torch.equal(u, v)
        else:
            assert u == v


def rows(n: int, width: int = 3) -> Tensor:
    return torch.arange(float(n * width)).view(n, width)


TREES = {
    "dict": lambda: {"x": rows(10), "mask": torch.ones(10, dtype=torch.bool)},
    "nested": lambda: {"a": [rows(10), {"b": torch.arange(10)}], "c": (rows(10, 2), 7)},
    "namedtuple": lambda: Pair(rows(10), "label"),
    "dataclass": lambda: Sample(rows(10), torch.arange(10), "tag"),
    "none_and_ints": lambda: {"x": rows(10), "none": None, "n": 3, "list": [None, 4, rows(10)]},
    "list": lambda: [rows(10), rows(10)],
}


@pytest.mark.parametrize("name", TREES)
def test_scatter_gather_round_trip(name: str) -> None:
    tree = TREES[name]()
    batches = scatter(tree, 4)
    assert [len(b.values) for b in batches] == [len(batches[0].values)] * 4  # uneven: 3, 3, 3, 1 rows
    for m, b in enumerate(batches):
        part = b.value
        assert type(part) is type(tree)
        leaves, spec = pytree.tree_flatten(part)
        assert spec == pytree.tree_flatten(tree)[1]
        for leaf, whole in zip(leaves, pytree.tree_leaves(tree)):
            if isinstance(whole, Tensor):
                assert torch.equal(leaf, whole[3 * m : 3 * m + 3])
            else:
                assert leaf is whole  # handed unchanged to every micro-batch
    assert_same_tree(gather(batches), tree)


def test_a_mapping_pytree_does_not_know_is_a_dict() -> None:
    tree = collections.UserDict({"x": rows(6), "inner": collections.UserDict({"y": rows(6)}), "n": 1})
    batches = scatter(tree, 2)
    part = batches[1].value
    assert type(part) is dict and type(part["inner"]) is dict
    assert torch.equal(part["inner"]["y"], rows(6)[3:])
    assert_same_tree(gather(batches), {"x": rows(6), "inner": {"y": rows(6)}, "n": 1})


def test_zero_dim_tensors_are_shared_and_outputs_stacked() -> None:
    scale = torch.tensor(2.0)
    batches = scatter({"x": rows(4), "scale": scale}, 2)
    assert all(b.value["scale"] is scale for b in batches)
    out = gather([Batch.of({"loss": torch.tensor(float(m)), "y": rows(2)}) for m in range(2)])
    assert torch.equal(out["loss"], torch.tensor([0.0, 1.0])) and out["y"].shape == (4, 3)


def test_batch_of_fast_paths_and_structures() -> None:
    t = torch.ones(2)
    assert Batch.of(t).spec is None and Batch.of(t).value is t
    flat = Batch.of((t, 1, None))
    assert flat.value == (t, 1, None) and flat.values == (t, 1, None)
    d = Batch.of({"a": t, "b": [t, 2]})
    assert d.values == (t, t, 2) and d.value == {"a": t, "b": [t, 2]}
    with_skip = d.with_skips({"s": torch.zeros(1)})
    assert with_skip.value == {"a": t, "b": [t, 2]} and len(with_skip) == 4


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ({"x": rows(4), "y": {"z": rows(5)}}, r"\[4, 5\] \(\['x'\]: 4, \['y'\]\['z'\]: 5\)"),
        (Sample(rows(4), torch.arange(3), "t"), r"\[3, 4\] \(\.pixels: 4, \.ids: 3\)"),
        ({"n": 1, "s": "text"}, r"at least one tensor .* got dict of \(int, str\)"),
        ({"scale": torch.tensor(1.0)}, "0-dimensional"),
        ({"x": torch.zeros(0, 2)}, "empty batch"),
    ],
)
def test_scatter_rejects_naming_the_leaves(inputs: Any, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        scatter(inputs, 2)


def test_gather_rejects_micro_batches_of_other_structures() -> None:
    with pytest.raises(ValueError, match=r"micro-batch 1 has another structure .*\{'a': \*, 'b': \*\}"):
        gather([Batch.of({"a": rows(2)}), Batch.of({"a": rows(2), "b": rows(2)})])


# End to end: a dict enters the model, a registered dataclass leaves it, the target is a dict.


def plain_dict_step(model: nn.Module) -> tuple[Tensor, list[Tensor], Prediction]:
    model = copy.deepcopy(model)
    x, y = dict_data()
    out = model(x)
    loss = dict_loss(out, y)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], out  # type: ignore[misc]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_pipeline_step_with_dicts_equals_plain(schedule: str, chunks: int) -> None:
    model = dict_model()
    loss_plain, grads_plain, out_plain = plain_dict_step(model)
    pipe = Pipeline(
        copy.deepcopy(model), [2, 2], chunks=chunks, schedule=schedule, loss_fn=dict_loss, devices=["cpu"] * 2
    )
    x, y = dict_data()
    loss = pipe.step(x, y)
    torch.testing.assert_close(loss, loss_plain)
    assert_all_close([p.grad for p in pipe.parameters()], grads_plain)  # type: ignore[misc]
    out = pipe(x)
    assert isinstance(out, Prediction)
    torch.testing.assert_close(out.logits, out_plain.logits.detach())
    torch.testing.assert_close(out.mask, out_plain.mask)


def test_pipeline_takes_a_mapping_pytree_does_not_know() -> None:
    model = dict_model()
    loss_plain, grads_plain, _ = plain_dict_step(model)
    pipe = Pipeline(copy.deepcopy(model), [2, 2], chunks=2, loss_fn=dict_loss, devices=["cpu"] * 2)
    x, y = dict_data()
    loss = pipe.step(collections.UserDict(x), collections.UserDict(y))
    torch.testing.assert_close(loss, loss_plain)
    assert_all_close([p.grad for p in pipe.parameters()], grads_plain)  # type: ignore[misc]


class Scaled(nn.Module):
    """{"x", "mask", "t"} -> {"h", "mask"}, with ``t`` a 0-dimensional tensor (a temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Any]:
        return {"h": torch.tanh(self.lin(batch["x"]) / batch["t"]) * batch["mask"], "aux": (batch["mask"], 2)}


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_gpipe_with_a_dict_gives_its_tensors_their_gradients(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), dist_cases.DictBlock(), dist_cases.DictHead())
    x, y = dict_data()

    def run(module: nn.Module) -> tuple[Tensor, Tensor, list[Tensor]]:
        inputs = {"x": x["x"].clone().requires_grad_(), "mask": x["mask"], "t": torch.tensor(1.5, requires_grad=True)}
        out = module(inputs)
        assert isinstance(out, Prediction) and out.logits.requires_grad and not out.mask.requires_grad
        dict_loss(out, y).backward()
        return inputs["x"].grad, inputs["t"].grad, [p.grad for p in module.parameters()]  # type: ignore[return-value]

    x_plain, t_plain, grads_plain = run(copy.deepcopy(model))
    gp = GPipe(copy.deepcopy(model), [1, 2], devices=["cpu"] * 2, chunks=3, checkpoint=checkpoint)
    x_grad, t_grad, grads = run(gp)
    torch.testing.assert_close(x_grad, x_plain)
    torch.testing.assert_close(t_grad, t_plain)
    assert_all_close(grads, grads_plain)


# a case of the session's pool (tests/dist_harness.py: a few launches in all)
ACROSS = POOL.add(2, "pytree", "dict_step", schedule="1f1b", chunks=4)


def test_a_dict_travels_between_ranks(pool: Pool) -> None:
    ranks = pool(ACROSS)
    one = dist_cases.dict_step("1f1b", 4, workers=2)
    merged = {n: g for out in ranks for n, g in out["grads"].items()}
    assert set(merged) == set(one["grads"])
    for name, g in merged.items():
        assert torch.equal(g, one["grads"][name]), name
    for out in ranks:
        assert torch.equal(out["loss"], one["loss"])
    assert ranks[0]["eval"] is None
    assert set(ranks[1]["eval"]) == {"logits", "mask"}
    for key, value in ranks[1]["eval"].items():
        assert torch.equal(value, one["eval"][key]), key


# Hugging Face: a ModelOutput leaves the model, a BatchEncoding enters it.


def test_model_output_is_gathered_back() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    class LMHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 5)

        def forward(self, state: dict[str, Any]) -> CausalLMOutput:
            return CausalLMOutput(logits=self.lin(state["h"]))

    def loss_fn(out: CausalLMOutput, target: dict[str, Tensor]) -> Tensor:
        return nn.functional.cross_entropy(out.logits, target["labels"])

    torch.manual_seed(0)
    model = nn.Sequential(dist_cases.DictIn(), dist_cases.DictBlock(), LMHead())
    x, _ = dict_data()
    target = {"labels": torch.arange(8) % 5}
    plain = copy.deepcopy(model)
    loss_fn(plain(x), target).backward()
    pipe = Pipeline(copy.deepcopy(model), [2, 1], chunks=4, loss_fn=loss_fn, devices=["cpu"] * 2)
    encoding = transformers.BatchEncoding(x)  # a Mapping pytree does not know: taken as a dict
    loss = pipe.step(encoding, target)
    torch.testing.assert_close(loss, loss_fn(plain(x), target).detach())
    assert_all_close([p.grad for p in pipe.parameters()], [p.grad for p in plain.parameters()])  # type: ignore[misc]
    out = pipe(encoding)
    assert type(out) is CausalLMOutput and list(out.keys()) == ["logits"]
    torch.testing.assert_close(out.logits, plain(x).logits.detach())
    assert re.search("CausalLMOutput", repr(scatter(CausalLMOutput(logits=rows(4)), 2)[0].spec))
