"""Profiler tables: the real fairseq MoE table, tables printed by this torch, header overflow,
truncation; and ``mixmoe analyze profile``.

Fixture figures read by hand from the table (CPU total / CUDA total, # of Calls):
MOELayer 18.605 / 18.406 ms (2 calls); MOEGate 11.512 / 8.593; DispatchMask 0.176 / 0.456 and
MOEmm 0.195 / 1.652; MOEAll2All_input 1.154 / 0 and _output 0.976 / 0; MOEExpert 2.506 / 5.924;
MOECombineExpert 0.310 / 1.624; train_step-0 3.916 s / 46.271 ms. So rest = 18.605 - 16.829 =
1.776 ms CPU and 18.406 - 18.249 = 0.157 ms CUDA; the layer is 18.406 / 46.271 of the step's
CUDA time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mixmoe.cli import main
from mixmoe.formats.profiler_table import parse_profiler_table, read_profiler_table
from mixmoe.report.profile_breakdown import moe_breakdown

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "profiler_table_fairseq_moe.txt"


def test_fixture_table() -> None:
    t = read_profiler_table(FIXTURE)
    assert t.columns == (
        "Name",
        "Self CPU %",
        "Self CPU",
        "CPU total %",
        "CPU total",
        "CPU time avg",
        "Self CUDA",
        "Self CUDA %",
        "CUDA total",
        "CUDA time avg",
        "# of Calls",
    )
    assert len(t.rows) == 84 and t.device == "CUDA"
    assert t.self_totals_us == {}  # the footer lines are missing from this file
    step = t.find("train_step-0")[0]
    assert step.values["CPU total"] == 3916000.0 and step.values["CUDA total"] == 46271.0
    nccl = t.find("nccl:all_to_all")[0]
    assert nccl.raw["CPU total %"] == "0" and nccl.values["CPU total %"] == 0.0  # bare 0
    assert nccl.values["CPU total"] == 739.0 and nccl.values["# of Calls"] == 8
    assert t.find("Optimizer.step#Adam.step")[0].values["CUDA total"] == 3065.0
    assert t.rows[-1].name == "cudaDeviceSynchronize" and t.rows[-1].line_no == 87


def test_fixture_breakdown() -> None:
    b = moe_breakdown(read_profiler_table(FIXTURE))
    cats = {c.category: c for c in b.categories}
    assert (b.layer_label, b.layer_calls, b.layer_cpu_us, b.layer_device_us) == (
        "MOELayer",
        2,
        18605.0,
        18406.0,
    )
    assert (cats["gate"].cpu_us, cats["gate"].device_us) == (11512.0, 8593.0)
    assert (cats["dispatch"].cpu_us, cats["dispatch"].device_us) == (371.0, 2108.0)
    assert (cats["all-to-all"].cpu_us, cats["all-to-all"].device_us) == (2130.0, 0.0)
    assert (cats["experts"].cpu_us, cats["combine"].device_us) == (2506.0, 1624.0)
    assert b.rest_cpu_us == pytest.approx(1776.0)
    assert b.rest_device_us == pytest.approx(157.0)
    assert b.layer_device_us / b.step_device_us == pytest.approx(18406 / 46271)
    assert any("asynchronously" in n and "nccl:all_to_all (8 calls" in n for n in b.notes)
    assert any("_AllToAllBackward" in n for n in b.notes)


def test_header_overflow_footer_and_truncation(tmp_path) -> None:
    text = FIXTURE.read_text()
    lines = text.splitlines()
    # the last header cells overflow their columns: one space apart instead of two or more
    lines[1] = lines[1].replace("Self CUDA %    CUDA total", "Self CUDA % CUDA total")
    lines[1] = lines[1].replace("CUDA time avg    # of Calls", "CUDA time avg # of Calls")
    lines.append("Self CPU time total: 8.302s")
    lines.append("Self CUDA time total: 46.271ms")
    t = parse_profiler_table("\n".join(lines))
    assert t.columns == read_profiler_table(FIXTURE).columns
    assert t.find("MOEExpert")[0].values["CUDA total"] == 5924.0
    assert t.self_totals_us == {"CPU": 8302000.0, "CUDA": 46271.0}
    cut = tmp_path / "cut.txt"
    cut.write_text("\n".join(text.splitlines()[:40]) + "\n" + text.splitlines()[40][:120])
    with pytest.raises(ValueError) as err:
        read_profiler_table(cut)
    assert f"{cut}:41:" in str(err.value)
    with pytest.raises(ValueError, match="no MoE labels"):
        moe_breakdown(parse_profiler_table("\n".join(lines[:6])))


def test_tables_printed_by_this_torch_with_memory_and_shapes() -> None:
    """Parse what torch.profiler prints here (memory in KB/B, an Input Shapes column) and compare
    with the profiler's own numbers, and with mixmoe's moe.* labels."""
    from mixmoe import MoE, MoEConfig

    torch.manual_seed(0)
    layer = MoE(MoEConfig(model_dim=16, hidden_dim=32, num_experts=4, top_k=2))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as p:
        y, aux = layer(torch.randn(64, 16))  # the layer labels itself "moe.layer"
        y.sum().backward()
    events = {e.key: e for e in p.key_averages()}
    for by_shape in (False, True):
        table = parse_profiler_table(
            p.key_averages(group_by_input_shape=by_shape).table(row_limit=-1)
        )
        assert "CPU Mem" in table.columns and table.device is None
        assert ("Input Shapes" in table.columns) is by_shape
        for label in ("moe.layer", "moe.gate", "moe.count", "moe.experts"):
            (row,) = table.find(label)
            e = events[label]
            assert row.values["CPU total"] == pytest.approx(e.cpu_time_total, rel=1e-3, abs=1e-3)
            assert row.values["# of Calls"] == e.count == 1
            assert row.values["CPU Mem"] == pytest.approx(e.cpu_memory_usage, rel=5e-3, abs=1)
            if by_shape:
                assert row.values["Input Shapes"] == "[]"
    b = moe_breakdown(table)
    cats = {c.category: c for c in b.categories}
    assert b.layer_label == "moe.layer" and cats["gate"].labels == ("moe.gate",)
    assert cats["gate"].cpu_us == pytest.approx(events["moe.gate"].cpu_time_total, rel=1e-3)
    labels = [label for c in b.categories for label in c.labels]
    assert {"moe.gate", "moe.experts"} <= set(labels)
    rest = events["moe.layer"].cpu_time_total - sum(events[x].cpu_time_total for x in labels)
    assert b.rest_cpu_us == pytest.approx(rest, abs=len(labels) + 1.0)  # printed to ~1 us


def test_cli(capsys) -> None:
    assert main(["analyze", "profile", str(FIXTURE)]) == 0
    text = capsys.readouterr().out
    assert (
        "gate                                    MOEGate      2  11.512   61.9%    8.593   46.7%"
        in text
    )
    assert "rest" in text and "1.776" in text and "0.157" in text
    assert "CUDA 39.8% of 46.271 ms" in text
    assert "cannot tell" in text
