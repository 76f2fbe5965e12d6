"""``to_sequential`` traces the code inside a repeated block once per structure
(``gpipe.sequential.reuse``): the other blocks of that structure are answered by a stand-in. The
layers are the ones a full trace gives (their code, their outputs bitwise), for Hugging Face GPT-2
and Llama on the meta device as ``gpipe train --model hf`` builds them, and for blocks that only
look alike: a block returning other strides, a block whose output length differs (the trace with
stand-ins fails), values the code after the blocks reads from inside them, a hook inside a block."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gpipe.sequential as sequential
from gpipe.sequential import repeated_blocks, to_sequential
from gpipe.sequential.reuse import alike_blocks

transformers = pytest.importorskip("transformers")


def _run(layers: nn.Sequential, value: Any) -> Any:
    for layer in layers:
        value = layer(value)
    return value


def _fully_traced(monkeypatch: pytest.MonkeyPatch, module: nn.Module, *args: Any, **kwargs: Any) -> nn.Sequential:
    """The layers of a trace of every block (the reuse turned off)."""
    with monkeypatch.context() as patch:
        patch.setattr(sequential, "alike_blocks", lambda module, blocks: [])
        return to_sequential(module, *args, **kwargs)


def _same_layers(got: nn.Sequential, want: nn.Sequential) -> None:
    """The same code, and the same checks of the first layer's input (the sizes the trace allows)."""
    assert [layer.code for layer in got] == [layer.code for layer in want]
    checks = [layer.get_submodule("_gpipe.inputs") for layer in (got[0], want[0])]
    assert [(c.shapes, c.constants) for c in checks[:1]] == [(c.shapes, c.constants) for c in checks[1:]]


def _hf(kind: str) -> nn.Module:
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=61, n_positions=32,
                                         bos_token_id=1, eos_token_id=2)  # fmt: skip
    else:
        config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_meta_hf_model_traces_one_block_into_the_layers_of_a_full_trace(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _hf(kind)
    blocks = repeated_blocks(model)
    assert alike_blocks(model, blocks) == [blocks]
    block_class = type(model.get_submodule(blocks[0]))
    traced: list[int] = []
    forward = block_class.forward

    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if isinstance(args[0], torch._subclasses.FakeTensor):  # (in the export; on the meta device: the check)
            traced.append(1)
        return forward(self, *args, **kwargs)

    ids = torch.ones(2, 3, dtype=torch.long)
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with monkeypatch.context() as patch:
        patch.setattr(block_class, "forward", counted)
        layers = to_sequential(model, **example)
    assert len(traced) == 1  # (every block before the change)
    _same_layers(layers, _fully_traced(monkeypatch, model, **example))
    assert not any("stand_in" in layer.code for layer in layers)


class _Notes:
    """What blocks note while they run: values for the code after the blocks, how often each was
    traced (a plain object: export checks modules' tensor attributes and restores the others)."""

    def __init__(self) -> None:
        self.values: list[Tensor] = []
        self.traced: dict[int, int] = {}


class _Block(nn.Module):
    """A linear block noting its traced calls (on fake tensors) in ``notes``; ``columns``: returns
    its output column-major (other strides), ``short``: its first two features only, ``keep``: notes
    what its ``lin`` returned, which the code after the blocks reads; ``pair``: also returns its
    output's first column."""

    def __init__(
        self, notes: _Notes, columns: bool = False, short: bool = False, keep: bool = False, pair: bool = False
    ) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.notes, self.columns, self.short, self.keep, self.pair = notes, columns, short, keep, pair

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(x, torch._subclasses.FakeTensor):
            self.notes.traced[id(self)] = self.notes.traced.get(id(self), 0) + 1
        y = self.lin(x)
        if self.keep:
            self.notes.values.append(y)
        if self.columns:
            y = y.t().contiguous().t()
        if self.pair:
            return y.relu(), y[:, :1]  # type: ignore[return-value]
        return y[:, :2] if self.short else y.relu()


class _Stack(nn.Module):
    def __init__(self, *blocks: dict[str, bool]) -> None:
        super().__init__()
        self.notes = _Notes()
        self.blocks = nn.ModuleList([_Block(self.notes, **block) for block in blocks])
        self.head = nn.Linear(2 if blocks[-1].get("short") else 4, 3)

    def forward(self, x: Tensor) -> Any:
        self.notes.values.clear()
        firsts = []
        for block in self.blocks:
            x = block(x)
            if isinstance(x, tuple):
                x, first = x
                firsts.append(first)
        out = self.head(x) + sum(firsts, torch.zeros(()))
        return (out, torch.stack(self.notes.values).sum(0)) if self.notes.values else out


def _check(model: _Stack, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers' code is a full trace's and their output the model's; how often each block was traced."""
    torch.manual_seed(0)
    layers = to_sequential(model, torch.randn(5, 4))
    traced = [model.notes.traced.get(id(block), 0) for block in model.blocks]
    _same_layers(layers, _fully_traced(monkeypatch, model, torch.randn(5, 4)))
    x = torch.randn(7, 4)
    for got, want in zip(torch.utils._pytree.tree_leaves(_run(layers, x)), torch.utils._pytree.tree_leaves(model(x))):
        assert torch.equal(got, want)
    return traced


def test_alike_blocks_are_traced_once_per_kind_of_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first block's input needs no gradient, the others' do: the first two blocks are traced.
    With ``pair``, each block also returns a view unlike any argument (the stand-in's own operator)."""
    assert _check(_Stack(*[{}] * 5), monkeypatch) == [1, 1, 0, 0, 0]
    assert _check(_Stack(*[{"pair": True}] * 4), monkeypatch) == [1, 1, 0, 0]


@pytest.mark.parametrize("odd", [{"columns": True}, {"short": True}])
def test_blocks_that_only_look_alike_are_traced(odd: dict[str, bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """Same class and parameters, another output: other strides (the trace with stand-ins succeeds,
    the check on the meta device finds them), or fewer features (the head after it fails on what the
    stand-in says: the trace with stand-ins fails): every block traced."""
    assert _check(_Stack({}, {}, {}, odd), monkeypatch)[3] == 1


def test_values_read_from_inside_the_blocks_trace_every_block(monkeypatch: pytest.MonkeyPatch) -> None:
    assert min(_check(_Stack(*[{"keep": True}] * 4), monkeypatch)) >= 1


def test_a_hook_inside_a_block_or_other_parameters_are_never_reused() -> None:
    model = _Stack(*[{}] * 5)
    model.blocks[3].lin = nn.Linear(4, 4, bias=False)
    model.blocks[2].lin.register_forward_hook(lambda m, a, out: None)
    assert alike_blocks(model, repeated_blocks(model)) == [["blocks.0", "blocks.1", "blocks.4"]]
