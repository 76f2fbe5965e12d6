"""`gpipe bench`: the projection, the model of memory, the multi-process launcher and the report."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe.bench import _misses, _tracking, engine, memory, run, throughput
from gpipe.bench.common import Bench, Section, launch, workloads
from gpipe.cli import main


def test_projection_of_equal_cells_is_the_fill_drain_formula() -> None:
    """K cells of equal cost: the makespan is (M + K - 1) micro-batch steps of F + (F + B)."""
    forward, backward = [1.0] * 8, [2.0] * 8
    for k, m in [(1, 1), (2, 4), (4, 8), (8, 32)]:
        balance = [8 // k] * k
        f, b = 8 / k / m, 16 / k / m  # per cell and micro-batch
        makespan = throughput.project([x / m for x in forward], [x / m for x in backward], balance, m)
        assert makespan == pytest.approx((m + k - 1) * (f + (f + b)))  # backward re-does the forward


def test_projection_is_bounded_by_the_slowest_cell() -> None:
    makespan = throughput.project([1.0, 1.0, 4.0], [1.0, 1.0, 4.0], [2, 1], 4)
    assert makespan >= 4 * (4.0 + 8.0)  # the slowest cell runs all of its M micro-batches


def test_memory_model_largest_is_the_largest_that_fits() -> None:
    model = memory.MemoryModel(params=(10, 100, 10), per_sample=(1.0, 8.0, 2.0), boundary=4.0, token_bytes=1.0)
    for remat, k, m in [(False, 1, 1), (True, 1, 4), (True, 4, 4)]:
        budget = 20_000.0
        blocks = model.largest(budget, k, 32, m, remat)
        stage_max = max(p + a for p, a in model.stage_bytes(blocks, k, 32, m, remat))
        over = max(p + a for p, a in model.stage_bytes(blocks + 1, k, 32, m, remat))
        assert stage_max <= budget < over
    # hand-computed: naive, one stage of L blocks: 12·(120 + 100 L) + 32·(3 + 8 L) <= 20000
    assert model.largest(20_000.0, 1, 32, 1, False) == (20_000 - 12 * 20 - 32 * 3) // (12 * 100 + 32 * 8)


def test_memory_model_predicts_what_a_step_keeps() -> None:
    """The model of memory against a real step's measured peak, with and without re-materialization."""

    def small(blocks: int) -> torch.nn.Sequential:
        torch.manual_seed(0)
        return memory.transformer_lm(blocks, 128, 2, dim=32, vocab=64, max_len=16, dropout=0.0)

    sample = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    model = memory.MemoryModel.measure(small, sample[:4])
    for remat, k, m in [(False, 1, 1), (True, 2, 4)]:
        predicted = [a for _, a in model.stage_bytes(4, k, 16, m, remat)]
        measured = memory._measured_peaks(small, 4, model, k, sample, m, remat)
        for p, q in zip(predicted, measured):
            assert 0.75 < q / p < 1.25, (remat, predicted, measured)


def test_memory_model_in_bf16_halves_the_activations_and_counts_the_weight_copies_once() -> None:
    """Under bf16 autocast a block keeps half the bytes per sample, plus the bf16 copies of its matmuls'
    weights, which do not grow with the batch (2 bytes per weight)."""

    def small(blocks: int) -> torch.nn.Sequential:
        torch.manual_seed(0)
        return memory.transformer_lm(blocks, 128, 2, dim=32, vocab=64, max_len=16, dropout=0.0)

    sample = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    fp32, bf16 = (memory.MemoryModel.measure(small, sample, p) for p in ("fp32", "bf16"))
    assert 0.4 < bf16.per_sample[1] / fp32.per_sample[1] < 0.6, (fp32, bf16)
    assert fp32.fixed[1] < 0.05 * fp32.per_sample[1]
    block = small(1)[1]
    matmul_weights = sum(m.weight.numel() + m.bias.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    matmul_weights += block.self_attn.in_proj_weight.numel() + block.self_attn.in_proj_bias.numel()
    assert 1.5 * matmul_weights <= bf16.fixed[1] <= 2.1 * matmul_weights, (bf16.fixed, matmul_weights)
    assert bf16.boundary == fp32.boundary / 2


def test_launch_runs_the_pipelined_workload_on_two_processes() -> None:
    bench = Bench(quick=True, repeats=1)
    work = workloads(bench, batch=8)[0]
    spec = {"task": "throughput", "quick": True, "batch": 8, "workload": work.name,
            "costs": [1.0] * len(work.build()), "microbatches": [1, 4], "repeats": 1}  # fmt: skip
    times = launch(2, spec, timeout=300)
    assert set(times) == {"1", "4"} and all(len(t) == 1 and t[0] > 0 for t in times.values())


def test_launch_reports_a_failing_worker() -> None:
    with pytest.raises(RuntimeError, match=r"benchmark worker failed: nonsense on 2 process\(es\)"):
        launch(2, {"task": "nonsense"}, timeout=120)


def test_overhead_report_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpipe bench --only overhead writes its report; on a smaller MLP than the quick run's (what is
    tested is the report, and the quick sizes took 30 s beside the pool's launches)."""
    import gpipe.bench.overhead

    sizes = {"blocks": 8, "hidden": 64, "ffn": 256, "batch": 32, "chunks": 8}
    monkeypatch.setattr(gpipe.bench.overhead, "mlp_sizes", lambda bench: sizes)
    assert main(["bench", "--only", "overhead", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "Reproduce: `gpipe bench --only overhead --repeats 1" in report
    assert "| zb-h1 | always |" in report and "target ≤ 3%" in report
    assert "## Where gpipe misses" in report
    assert (tmp_path / "results.json").exists()
    assert main(["bench", "--only", "nonsense", "--out", str(tmp_path)]) == 2
    assert "unknown section(s) nonsense" in capsys.readouterr().err


def test_misses_are_stated_from_the_numbers() -> None:
    slow = {"gpipe": [1.0], "1f1b": [1.0]}
    times = {"torch gpipe": [1.0], "torch 1f1b": [1.0], "gpipe gpipe (never)": [1.2], "gpipe 1f1b (never)": [0.9]}
    lines = _misses([Section("Peers", "", [], {"vs_torch": times}), Section("Runtime overhead", "", [], slow)])
    text = "\n".join(lines)
    assert "(gpipe, equal work): 1.20x" in text and "(1f1b" not in text
    assert "Overhead: the largest median is 100.0%" in text
    assert _misses([])[-1] == "- Nothing measured in this run misses its target."


def _row(k2: float, k1: float) -> dict[str, Any]:
    """Throughputs measured at K=2 and K=1 for M=1 and M=4: M=4 short of the projection by ``k2`` and
    ``k1`` (normalized to K=2, M=1, which is the projection's by definition)."""
    projected = {"K=2,M=1": 2.0, "K=2,M=4": 3.0, "K=1,M=1": 1.0, "K=1,M=4": 1.5}
    measured = {"K=2,M=1": [4.0], "K=2,M=4": [6.0 * (1 - k2)], "K=1,M=1": [2.0], "K=1,M=4": [3.0 * (1 - k1)]}
    return {"measured": measured, "projected": projected}


def test_throughput_tracking_says_what_the_gap_is_or_that_there_is_none() -> None:
    """No '0% below the projection': a shortfall under 1% is none, and the gap's likely cause
    follows where it is (K=2 alone: what crosses the processes; at K=1 too: work inside a stage)."""
    none = _tracking(_row(0.0, 0.004))
    assert none == "Measured keeps up with the projection at K=2 and at K=1: no M falls 1% or more below it."
    k2 = _tracking(_row(0.1, 0.0))
    assert k2.startswith("Measured falls up to 10% below the projection at K=2 but keeps up with it at K=1")
    assert "the hand-over between the processes" in k2
    k1 = _tracking(_row(0.0, 0.2))
    assert k1.startswith("Measured keeps up with the projection at K=2 but falls up to 20% below it at K=1:")
    both = _tracking(_row(0.1, 0.2))
    assert both.startswith("Measured falls up to 10% below the projection at K=2 and up to 20% at K=1")
    assert "per-micro-batch work inside a stage" in both and "not the transfers" in both
    assert all(" 0%" not in text for text in (none, k2, k1, both))


def test_a_missing_torchgpipe_is_what_make_bench_installs(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe.bench.peers import vs_torchgpipe

    monkeypatch.setitem(sys.modules, "torchgpipe", None)  # (importing it raises ImportError)
    why = vs_torchgpipe(Bench(quick=True, repeats=1))
    assert isinstance(why, str) and why.startswith("torchgpipe is not installed (`make bench` installs it")
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", (Path(__file__).parents[1] / "Makefile").read_text(), re.M)
    assert recipe is not None
    install = re.search(r"pip install (.*)\)$", why)
    assert install is not None and install[1] in recipe[1], (why, recipe[1])


def test_the_memory_section_takes_transformer_l_from_the_papers_configurations() -> None:
    table = memory.paper_transformer_l()
    assert table.sizes == {"n_embd": 2048, "n_inner": 8192, "n_head": 32, "vocab_size": 32000, "n_positions": 1024,
                           "batch": 32, "chunks": 32}  # fmt: skip
    assert table.rows == {"naive-1": (3, "282.2M"), "pipeline-1": (13, "785.8M"), "pipeline-8": (103, "5.3B"),
                          "pipeline-32": (415, "21.0B"), "pipeline-128": (1663, "83.9B")}  # fmt: skip
    naive = {"projected": {"naive-1": 2}, "projected_bf16": {"naive-1": 2}, "paper_blocks": {"naive-1": 3}}
    text = "\n".join(_misses([Section("Memory (Table 1)", "", [], naive)]))
    assert "fits 2 blocks in 16 GB here against the paper's 3" in text


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="repeats must be positive"):
        run(tmp_path, only=["overhead"], repeats=-1)


def test_engine_section_measures_every_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine section at tiny sizes: every comparison has its positive numbers, the report states
    the targets, the thread count is put back, and a missing torch.compile is reported, not raised."""
    monkeypatch.setattr(engine, "_compile_problem", lambda: "no compiler here (test)")
    sizes = dataclasses.replace(engine.sizes(Bench(quick=True, repeats=1)), lm_layers=1, lm_hidden=32, lm_dim=16,
                                batch=8, seq=4, chunks=(1, 4), tiny_layers=3, tiny_steps=2)  # fmt: skip
    threads = torch.get_num_threads()
    data = engine.measure(sizes)
    assert torch.get_num_threads() == threads
    assert set(data["lm"]) == {"dropout=0,M=1", "dropout=0,M=4", "dropout=0.1,M=1", "dropout=0.1,M=4"}
    for row in data["lm"].values():
        assert all(len(row[k]) == 1 and row[k][0] > 0 for k in ("pipeline", "plain", "ratio"))
    assert all(len(data["host"][k]) == 3 and min(data["host"][k]) > 0 for k in ("pipeline_us", "plain_us", "ratio"))
    assert data["compiled"] == {"unavailable": "no compiler here (test)"}
    text = engine.render(data)
    assert "| 0.1 | 4 |" in text and "Target ≤ 1.02x at dropout=0.1, M=4:" in text and "target ≤ 1.2x" in text
    assert "**Not measured** — not run: no compiler here (test)." in text
    misses = _misses([Section(engine.TITLE, text, [], data)])
    assert "- Compiled layers in the Pipeline: not run: no compiler here (test)." in misses


def _compiled(pipeline_calls: tuple[int, int], plain_calls: tuple[int, int]) -> dict[str, Any]:
    return {"pipeline": [1.2, 1.2], "plain": [1.0, 1.0], "ratio": [1.2, 1.2], "plain_alone": [2.0],
            "graphs": {"pipeline": 0, "plain": 3}, "warmup_s": {"pipeline": 0.1, "plain": 5.0},
            "calls_before": {"plain": (4, 4)}, "calls": {"pipeline": pipeline_calls, "plain": plain_calls}}  # fmt: skip


def test_engine_states_compiled_layers_that_ran_eagerly() -> None:
    ran_eagerly = _compiled((0, 4), (0, 4))
    status = engine.compiled_status(ran_eagerly)
    assert status is not None and "only 0 of the 4 layer calls" in status and "ran eagerly too" in status
    assert engine.compiled_ratio(ran_eagerly) == [0.6, 0.6]  # against the plain loop timed before, compiled
    assert engine.compiled_status(_compiled((4, 4), (4, 4))) is None
    assert engine.compiled_ratio(_compiled((4, 4), (4, 4))) == [1.2, 1.2]
    data = {"sizes": dataclasses.asdict(engine.sizes(Bench(quick=True, repeats=2))),
            "lm": {"dropout=0.1,M=32": {"pipeline": [1.0], "plain": [1.0], "ratio": [1.01]}},
            "host": {"pipeline_us": [30.0], "plain_us": [10.0], "extra_us": [20.0], "ratio": [3.0]},
            "compiled": ran_eagerly}  # fmt: skip
    text = engine.render(data)
    assert "| Pipeline | 1.200 [1.200-1.200] | 0 of 4 | 0 |" in text and "**Compile status: only 0" in text
    lines = "\n".join(engine.misses(data))
    assert "Transformer LM" not in lines  # 1.01x meets 1.02x
    assert "30.0 µs per (layer, micro-batch) in the Pipeline against 10.0 µs in plain PyTorch, 3.00x" in lines
    assert "- Compiled layers in the Pipeline: 0.60x the plain loop's step (target ≤ 1.05x); only 0 of" in lines


def test_torch_schedules_place_stages_as_torch_and_gpipe_do() -> None:
    """Each torch.distributed.pipelining schedule gets the stages its placement puts on a rank, and
    the gpipe schedule paired with it places them alike."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    from gpipe.bench.common import GPIPE_SCHEDULES, TORCH_SCHEDULES
    from gpipe.bench.peers import PAIRS
    from gpipe.bench.worker import torch_stage_indices
    from gpipe.schedule import make_schedule

    ours = {name: v for name, v, _ in GPIPE_SCHEDULES}
    for name, _, virtual, style in TORCH_SCHEDULES:
        rank_of = generate_stage_to_rank_mapping(2, 2 * virtual, style)
        for rank in range(2):
            assert sorted(torch_stage_indices(rank, 2, virtual, style)) == [s for s, r in rank_of.items() if r == rank]
        if name in PAIRS:
            assert ours[name] == virtual
            assert make_schedule(name, 2, 8, virtual).placement == tuple(rank_of[s] for s in range(2 * virtual))


def test_peers_report_pairs_failures_and_auto() -> None:
    """The peers section from made-up numbers: same-schedule ratios, a torch schedule that did not
    run (and its reason), auto's plan, best against best and auto against torch's best."""
    from gpipe.bench.peers import render

    times = {"torch gpipe": [1.0, 1.0], "torch zb-v": [0.8, 0.8], "gpipe gpipe (never)": [0.9, 1.1],
             "gpipe zb-v (never)": [0.6, 0.8], "gpipe auto (never)": [0.72, 0.8]}  # fmt: skip
    found = {"times": times, "not_run": {"torch dualpipev": "rank 1: RuntimeError: a | b"},
             "auto": {"gpipe auto (never)": {"chosen": "zb-h2", "bubble": 0.0312, "explain": ""}}}  # fmt: skip
    sizes = {"blocks": 8, "hidden": 64, "ffn": 128, "batch": 16, "chunks": 8}
    text = render(sizes, 2, found, "torchgpipe is not installed")
    assert "| torch zb-v (ScheduleZBVZeroBubble) | 0.800 [0.800-0.800] |  |" in text
    assert "| gpipe zb-v (never), v=2 | 0.700 [0.600-0.800] | 0.88 [0.75-1.00] |" in text
    assert "| gpipe gpipe (never) | 1.000 [0.900-1.100] | 1.00 [0.90-1.10] |" in text
    assert "| torch dualpipev (ScheduleDualPipeV) | not run: rank 1: RuntimeError: a / b | |" in text
    assert "`gpipe auto (never)` chose zb-h2 (simulated bubble 0.031" in text
    assert "Best against best (equal work): gpipe zb-v (never) / torch zb-v = 0.88 [0.75-1.00]." in text
    assert "gpipe auto (never) / torch zb-v = 0.95 [0.90-1.00] (target ≤ 0.95)." in text
    assert "Not run: torchgpipe is not installed." in text
