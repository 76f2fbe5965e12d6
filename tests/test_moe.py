"""The mixture of experts (gpipe.models.moe): GShard's gating (capacity, dropping in token order, the
second expert's random routing, padding never routed, the load-balancing loss), the layer against a
token-by-token computation, its auxiliary loss through the pipeline (the plain model's gradients on
the same micro-batches), bitwise the same at K = 1, 2, 4 and under every schedule, and the flags of
gpipe train."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from gpipe import Pipeline
from gpipe.auxiliary import micro_batch_share
from gpipe.cli import main
from gpipe.models import transformer
from gpipe.models.moe import MoEFeedForward, route, routing_metrics
from gpipe.schedule import SCHEDULES
from tests.dist_harness import POOL, Pool
from tests.helpers import assert_all_close, assert_all_equal, even

VIRTUAL = {"interleaved-1f1b": 2, "zb-v": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}


def test_capacity_drops_in_token_order_first_choices_first_and_padding_is_never_routed() -> None:
    # 6 tokens, 3 experts, top-2; every token prefers expert 0, then expert 1 (token 5: 2, then 0).
    logits = torch.tensor([[3.0, 2.0, 0.0]] * 5 + [[1.0, 0.0, 4.0]])
    routed = torch.tensor([True, True, False, True, True, True])  # token 2 is padding
    r = route(logits, top_k=2, capacity=2, routed=routed)
    e, c = 3, 2
    kept = r.slots < e * c
    # Expert 0 takes the first two routed tokens' first choices (0, 1); tokens 3 and 4 are over its
    # capacity; expert 1 takes the second choices of tokens 0 and 1; token 5 goes to 2, then 0 (full).
    assert kept.tolist() == [[True, True], [True, True], [False, False], [False, False], [False, False],
                             [True, False]]  # fmt: skip
    assert (r.slots[kept] // c).tolist() == [0, 1, 0, 1, 2]
    assert (r.slots[kept] % c).tolist() == [0, 0, 1, 1, 0]
    assert len(set(r.slots.flatten().tolist())) == r.slots.numel()  # every assignment its own row
    assert r.weights[~kept].abs().sum() == 0 and r.weights[2].abs().sum() == 0
    assert r.routed.item() == 5 and r.dropped.item() == 2  # tokens 3 and 4: carried by the residual alone
    loads = torch.tensor([5.0, 4.0, 1.0])  # the assignments asked of each expert
    assert r.busiest.item() == pytest.approx(float(loads.max() / loads.mean()))
    gates = torch.softmax(logits[routed], -1)
    first = F.one_hot(gates.argmax(-1), 3).float().mean(0)
    assert r.aux.item() == pytest.approx(3 * float((gates.mean(0) * first).sum()), rel=1e-6)


def test_balanced_routing_has_an_auxiliary_loss_of_one_and_the_second_choice_is_sampled() -> None:
    logits = torch.eye(4).repeat(8, 1) * 5  # each expert first for a quarter of the tokens
    assert route(logits, top_k=1, capacity=None).aux.item() == pytest.approx(1.0, abs=0.05)
    torch.manual_seed(0)
    weights = route(logits, top_k=2, capacity=None).weights
    sampled = route(logits, top_k=2, capacity=None, sample=True).weights
    assert (weights[:, 1] > 0).all() and (sampled[:, 1] == 0).any()  # (the second weight is small: often left)
    assert torch.equal(sampled[:, 0], weights[:, 0])


def by_hand(ff: MoEFeedForward, x: Tensor, pad: Tensor | None) -> Tensor:
    """The layer token by token: each kept assignment's expert on the token, weighted."""
    flat = x.reshape(-1, x.size(-1))
    r = route(F.linear(flat, ff.gate.weight), top_k=ff.top_k, capacity=ff.capacity(flat.size(0)),
              routed=None if pad is None else ~pad.reshape(-1))  # fmt: skip
    ex = ff.experts
    out = torch.zeros_like(flat)
    for t in range(flat.size(0)):
        for j in range(ff.top_k):
            slot = int(r.slots[t, j])
            if slot < ex.count * r.capacity:
                e = slot // r.capacity
                h = torch.relu(flat[t] @ ex.inner_weight[e] + ex.inner_bias[e])
                out[t] += r.weights[t, j] * (h @ ex.outer_weight[e] + ex.outer_bias[e])
    return out.view_as(x)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_layer_is_its_experts_token_by_token(top_k: int) -> None:
    torch.manual_seed(0)
    ff = MoEFeedForward(8, 16, experts=4, top_k=top_k, capacity_factor=0.4).eval()
    x = torch.randn(3, 5, 8)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True
    with torch.no_grad():
        torch.testing.assert_close(ff(x, pad), by_hand(ff, x, pad))
        assert ff(x, pad)[1, 3:].abs().sum() == 0  # padding: no expert
    metrics = routing_metrics(ff)
    assert metrics is not None and 0 < metrics["moe_dropped"] < 1 and metrics["moe_busiest"] >= 1
    assert routing_metrics(ff) is None  # (read and reset)


def moe_model(capacity_factor: float = 1.25) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return transformer(3, 32, 2, dim=16, vocab=20, max_len=16, dropout=0.1, experts=4, moe_every=1,
                       moe_loss_weight=0.1, capacity_factor=capacity_factor, target_padding="end")  # fmt: skip


def batch() -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(1, 20, (8, 7), generator=g), torch.randint(1, 20, (8, 6), generator=g)
    src[0, 5:] = 0
    tgt[1, 4:] = 0
    return (src, tgt[:, :-1]), tgt[:, 1:]


def token_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0)


def test_the_auxiliary_loss_reaches_the_gradients_as_the_plain_models_on_the_micro_batches() -> None:
    """A pipeline step's gradients are the plain model's on the same micro-batches, each micro-batch's
    loss and load-balancing loss weighted by its share of the mini-batch; without the auxiliary loss
    the gate's gradients differ."""
    model = moe_model().eval()  # (no dropout, no random routing: the plain runs draw alike)
    inputs, target = batch()
    pipe = Pipeline(copy.deepcopy(model), even(len(model), 2), chunks=4, loss_fn=token_loss, devices=["cpu"] * 2)
    pipe.eval()
    with torch.enable_grad():
        pipe.step(inputs, target)
    plain = copy.deepcopy(model)
    for src, tgt, y in zip(*(t.chunk(4) for t in (*inputs, target))):
        with micro_batch_share(src.size(0) / inputs[0].size(0)):
            (token_loss(plain((src, tgt)), y) * src.size(0) / inputs[0].size(0)).backward()
    assert_all_close([p.grad for p in pipe.parameters()], [p.grad for p in plain.parameters()])
    for layer in model.modules():
        if isinstance(layer, MoEFeedForward):
            layer.loss_weight = 0.0
    without = copy.deepcopy(model)
    for src, tgt, y in zip(*(t.chunk(4) for t in (*inputs, target))):
        (token_loss(without((src, tgt)), y) * src.size(0) / inputs[0].size(0)).backward()
    gates = [n for n, _ in plain.named_parameters() if n.endswith("gate.weight")]
    assert gates and all(
        not torch.allclose(dict(plain.named_parameters())[n].grad, dict(without.named_parameters())[n].grad)
        for n in gates
    )


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_same_bits_at_every_partition_count_and_schedule(name: str) -> None:
    """Dropout, the second expert's random routing and the tokens dropped are the same at K = 1, 2, 4
    and under every schedule: the same loss and gradients, bitwise."""
    model = moe_model()
    inputs, target = batch()
    virtual = VIRTUAL.get(name, 1)
    results = {}
    for k in (1, 2, 4):
        if name == "dualpipev" and 2 * k > 8:
            continue
        torch.manual_seed(3)
        pipe = Pipeline(copy.deepcopy(model), even(len(model), k * virtual), chunks=8, schedule=name,
                        virtual=virtual, loss_fn=token_loss, devices=["cpu"] * k, cpu_threads=1)  # fmt: skip
        loss = pipe.step(inputs, target)
        pipe.eval()
        with torch.no_grad():
            pipe(inputs)
        results[k] = (loss, [p.grad.clone() for p in pipe.parameters()], routing_metrics(pipe))
    first = results[1]
    for k, (loss, grads, metrics) in results.items():
        assert torch.equal(loss, first[0]), k
        assert_all_equal(grads, first[1])
        assert metrics == first[2] and metrics is not None


def test_gpipe_train_with_experts_reports_the_routing_and_refuses_bad_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    flags = ["train", "--steps", "4", "--eval-every", "2", "--no-progress", "--tensorboard", "off"]
    assert main([*flags, "--experts", "4", "--capacity-factor", "0.5", "--out", str(out)]) == 0
    said = capsys.readouterr().err
    model = transformer(2, 256, 4, dim=64, vocab=1, experts=4)  # (the vocabulary: not in the experts)
    per_expert = sum(p.numel() for p in model[2].ff.experts.parameters()) // 4
    total, active = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) parameters, ([\d,]+) of them", said)[0])
    assert total - active == 2 * (4 - 2) * per_expert  # (two mixtures: the second layer's of each side)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "eval_loss" in r]
    assert evaluated and all("bleu" in r for r in evaluated)  # (beam search, with the caches: routing each token)
    assert all(0 < r["moe_dropped"] < 1 and r["moe_busiest"] >= 1 and math.isfinite(r["moe_aux_loss"])
                             for r in evaluated)  # fmt: skip
    capsys.readouterr()
    assert main(["runs", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "| dropped |" in table.replace("  ", " ") or " dropped " in table, table
    bad = [
        (["--experts", "2", "--expert-top-k", "3"], "at least as many experts as each token takes"),
        (["--experts", "4", "--capacity-factor", "0"], "--capacity-factor must be a positive finite number"),
        (["--experts", "4", "--moe-every", "3"], "--moe-every 3 makes no layer"),
        (["--experts", "4", "--model", "amoebanet"], "--experts"),
        (["--capacity-factor", "2"], "--capacity-factor is for a mixture of experts"),
        (["--expert-parallel", "2"], "--expert-parallel is for a mixture of experts"),
        (["--experts", "4", "--expert-parallel", "2"], "must divide --data-parallel 1 and --experts 4"),
        (["--experts", "3", "--expert-parallel", "2", "--data-parallel", "2"], "must divide --data-parallel 2 and"),
        (["--experts", "4", "--expert-parallel", "0"], "--expert-parallel must be positive"),
        (["--model", "hf", "--expert-parallel", "2"], "it must divide --data-parallel 1"),
    ]
    for argv, message in bad:
        assert main([*flags, *argv, "--out", str(tmp_path / "bad")]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def _train(pipe: Pipeline, steps: int) -> list[Tensor]:
    """``steps`` steps of SGD (lr 0.5) on the MoE batch, then an evaluation forward; the losses."""
    inputs, target = batch()
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(pipe.step(inputs, target))
        optimizer.step()
    pipe.eval()
    with torch.no_grad():
        pipe(inputs)
    return losses


def spread(steps: int) -> dict[str, Any]:
    """A pool case (4 ranks): the MoE model as 2 replicas of 2 stages, its experts split over the 2
    replicas (expert_parallel=2), ``steps`` steps of SGD; each rank's losses, gradients of the last
    step (its parts of the experts'), its routing figures and how many expert values it holds."""
    from torch.distributed.tensor import DTensor

    model = moe_model(capacity_factor=0.5)
    inputs, target = batch()
    torch.manual_seed(3)
    pipe = Pipeline(model, even(len(model), 2), chunks=2, loss_fn=token_loss, data_parallel=2, expert_parallel=2)
    losses = _train(pipe, steps)
    try:  # 3 rows: 2 micro-batches on one replica, 1 on the other
        pipe.step(tuple(t[:3] for t in inputs), target[:3])
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    grads = {n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in pipe.named_parameters()}
    experts = [p for n, p in pipe.named_parameters() if ".experts." in n]
    return {"losses": losses, "grads": grads, "routing": routing_metrics(pipe), "dp": pipe.dp_rank, "refused": refused,
            "held": sum(p.to_local().numel() for p in experts), "whole": sum(p.numel() for p in experts)}  # fmt: skip


SPREAD = POOL.add(4, "moe expert-parallel", "test_moe:spread", steps=2)


def test_experts_split_over_two_replicas_train_as_one_process_with_their_micro_batches(pool: Pool) -> None:
    """expert_parallel=2 over 2 replicas of a 2-stage pipeline (chunks=2 each) trains as one process's
    pipeline with chunks=4 (the replicas' micro-batches, seeded alike: dropout and the second expert's
    random routing draw the same numbers, the same tokens drop): the same losses, gradients and
    routing over two steps, to float32 rounding; each rank holds half of its stage's experts. A
    mini-batch on which the replicas would run different numbers of micro-batches is refused."""
    ranks = pool(SPREAD)
    model = moe_model(capacity_factor=0.5)
    torch.manual_seed(3)
    pipe = Pipeline(model, even(len(model), 2), chunks=4, loss_fn=token_loss, devices=["cpu"] * 2)
    losses = _train(pipe, 2)
    want = dict(pipe.named_parameters())
    routing = routing_metrics(pipe)
    assert routing is not None and routing["moe_dropped"] > 0  # (tokens are dropped: their choice matters)
    for rank in ranks:
        assert torch.stack(rank["losses"]).tolist() == pytest.approx(torch.stack(losses).tolist(), rel=1e-6)
        assert rank["routing"] == pytest.approx(routing, rel=1e-5)
        assert rank["held"] * 2 == rank["whole"] > 0
        assert "gives the 2 replicas [1, 2] micro-batches" in rank["refused"]
        for name, grad in rank["grads"].items():
            whole = want[name].grad
            if ".experts." in name:  # this replica's half of the experts
                half = whole.size(0) // 2
                whole = whole[rank["dp"] * half : (rank["dp"] + 1) * half]
            assert torch.allclose(grad, whole, rtol=1e-4, atol=1e-6), (name, (grad - whole).abs().max())


def test_gpipe_train_splits_the_experts_over_replicas_and_the_run_resumes_in_one_process(tmp_path: Path) -> None:
    """torchrun, 2 ranks: --data-parallel 2 --expert-parallel 2 (chunks 4 each), replicated or with
    --fsdp, gives the losses, held-out losses and dropped tokens of one process with --chunks 8; each
    rank writes its experts, and the run resumes in one process, going on as the uninterrupted run."""
    from tests.test_train_data_parallel import FLAGS, finish, rows, start_train

    moe = ["--experts", "4", "--moe-every", "1", "--capacity-factor", "0.5"]
    whole = tmp_path / "whole"
    layouts = {"replicated": [], "fsdp": ["--fsdp"]}
    jobs = {name: start_train(2, "--partitions", "1", "--data-parallel", "2", "--expert-parallel", "2", *flags, *moe,
                              "--steps", "2", "--out", str(tmp_path / name))
            for name, flags in layouts.items()}  # fmt: skip
    # (the run in one process, while torchrun's run)
    assert main(["train", *FLAGS, "--partitions", "1", "--chunks", "8", *moe, "--steps", "4", "--out", str(whole)]) == 0
    keys = ("step", "loss", "eval_loss", "moe_dropped", "moe_aux_loss")
    want = [{k: r[k] for k in keys if k in r} for r in rows(whole)]
    assert [r["step"] for r in want] == list(range(1, 5))
    assert any(r.get("moe_dropped", 0) > 0 for r in want)  # (dropping tokens: which ones matters)
    for name, job in jobs.items():
        finish(job)
        spread = tmp_path / name
        step = spread / "checkpoints" / "step-00000002"
        assert sorted(p.name for p in step.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # each its experts
        assert main(["train", "--resume", "--out", str(spread), "--data-parallel", "1", "--chunks", "8", "--steps",
                     "4", "--no-progress"]) == 0  # fmt: skip
        got = [{k: r[k] for k in keys if k in r} for r in rows(spread)]
        assert got == [{k: pytest.approx(v, rel=1e-6) for k, v in r.items()} for r in want], name


def _mixtral_layers() -> tuple[torch.nn.Module, torch.nn.Sequential]:
    """A tiny Mixtral (tests.test_tracer_models': 4 experts, top-2, router loss) and its layers."""
    from gpipe.sequential import to_sequential
    from tests.test_tracer_models import TOKENS, mixtral

    model = mixtral()
    return model, to_sequential(copy.deepcopy(model), **TOKENS)


def hf_spread() -> dict[str, Any]:
    """A pool case (2 ranks): the tiny Mixtral as 2 replicas, its experts split over them
    (gpipe.models.hf_moe); the step's loss and this rank's gradients."""
    from torch.distributed.tensor import DTensor

    from gpipe.models.hf_moe import prepare_split
    from tests.test_tracer_models import TOKENS

    _, layers = _mixtral_layers()
    assert prepare_split(layers) == 2
    pipe = Pipeline(layers, [len(layers)], chunks=2, loss_fn=lambda out, _: out.loss, data_parallel=2,
                    expert_parallel=2)  # fmt: skip
    loss = pipe.step(TOKENS, TOKENS["input_ids"])
    grads = {n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in pipe.named_parameters()}
    return {"loss": loss, "grads": grads, "dp": pipe.dp_rank}


HF_SPREAD = POOL.add(2, "hf moe expert-parallel", "test_moe:hf_spread")


def test_a_hugging_face_models_experts_split_over_two_replicas_train_as_one_process(pool: Pool) -> None:
    """transformers' Mixtral, its stacked experts split over 2 replicas (each sends its tokens' rows
    to the experts' rank and back; nothing dropped, as transformers' own): the loss and gradients of
    one process with the replicas' micro-batches (the router's load-balancing loss included)."""
    pytest.importorskip("transformers")
    from tests.test_tracer_models import TOKENS

    _, layers = _mixtral_layers()
    pipe = Pipeline(layers, [len(layers)], chunks=4, loss_fn=lambda out, _: out.loss, devices=["cpu"])
    loss = pipe.step(TOKENS, TOKENS["input_ids"])
    want = dict(pipe.named_parameters())
    for rank in pool(HF_SPREAD):
        assert float(rank["loss"]) == pytest.approx(float(loss), rel=1e-5)
        for name, grad in rank["grads"].items():
            whole = want[name].grad
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # this replica's half
                half = whole.size(0) // 2
                whole = whole[rank["dp"] * half : (rank["dp"] + 1) * half]
            assert torch.allclose(grad, whole, rtol=1e-4, atol=1e-6), (name, (grad - whole).abs().max())


def _split_heads_model() -> torch.nn.Sequential:
    """The MoE model with attention tensor parallelism can split (head_dim), without dropout (a split
    pair's dropout draws per rank)."""
    torch.manual_seed(0)
    return transformer(3, 32, 2, dim=16, vocab=20, max_len=16, dropout=0.0, experts=4, moe_every=2, moe_loss_weight=0.1,
                       capacity_factor=0.5, target_padding="end", head_dim=8)  # fmt: skip


def tensor_spread() -> dict[str, Any]:
    """A pool case (4 ranks): 2 replicas x tensor_parallel 2, the experts split over the replicas; the
    step's loss and this rank's whole gradients."""
    from torch.distributed.tensor import DTensor

    model = _split_heads_model()
    inputs, target = batch()
    torch.manual_seed(3)
    pipe = Pipeline(model, [len(model)], chunks=2, loss_fn=token_loss, data_parallel=2, tensor_parallel=2,
                    expert_parallel=2)  # fmt: skip
    loss = pipe.step(inputs, target)
    grads = {}
    for n, p in pipe.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):  # the experts' (this replica's half) or a split layer's (made whole)
            g = g.to_local() if g.device_mesh.mesh_dim_names == ("ep",) else g.full_tensor()
        grads[n] = g
    return {"loss": loss, "grads": grads, "dp": pipe.dp_rank}


TENSOR_SPREAD = POOL.add(4, "moe expert-parallel with tensor-parallel", "test_moe:tensor_spread")


def test_experts_split_over_replicas_beside_tensor_parallel_layers_train_as_one_process(pool: Pool) -> None:
    """--tensor-parallel 2 splits the attention (a mixture of experts runs whole on each tp rank,
    drawing alike) while --expert-parallel 2 splits the experts over the replicas: the loss and
    gradients of one process with the replicas' micro-batches."""
    model = _split_heads_model()
    inputs, target = batch()
    torch.manual_seed(3)
    pipe = Pipeline(model, [len(model)], chunks=4, loss_fn=token_loss, devices=["cpu"])
    loss = pipe.step(inputs, target)
    want = dict(pipe.named_parameters())
    for rank in pool(TENSOR_SPREAD):
        assert float(rank["loss"]) == pytest.approx(float(loss), rel=1e-5)
        for name, grad in rank["grads"].items():
            whole = want[name].grad
            if ".experts." in name:
                half = whole.size(0) // 2
                whole = whole[rank["dp"] * half : (rank["dp"] + 1) * half]
            assert torch.allclose(grad, whole, rtol=1e-4, atol=1e-6), (name, (grad - whole).abs().max())
