"""``mixmoe.formats``: every on-disk format module is torch-free and round-trips (write -> read)."""

from __future__ import annotations

import os
import pkgutil
import random
import subprocess
import sys
from pathlib import Path

import pytest

import mixmoe.formats
from mixmoe.formats import chrome, cmd_trace, layer_log, model_log, profiler_table
from mixmoe.formats.cmd_trace import CmdOp, SubOp

ROOT = Path(mixmoe.formats.__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"
FORMAT_MODULES = sorted(m.name for m in pkgutil.iter_modules(mixmoe.formats.__path__))


def test_format_modules_are_torch_free():
    """In a fresh interpreter, importing every format module (and the report analyses and the
    ``mixmoe`` root) leaves torch out of ``sys.modules``."""
    assert {"chrome", "cmd_trace", "layer_log", "model_log", "profiler_table", "results"} <= set(
        FORMAT_MODULES
    )
    names = [f"mixmoe.formats.{m}" for m in FORMAT_MODULES]
    names += ["mixmoe", "mixmoe.report.trace_summary", "mixmoe.report.profile_breakdown"]
    names += ["mixmoe.report.run_stats", "mixmoe.report.text_table", "mixmoe.tracing"]
    code = "import importlib, sys\n"
    code += "".join(f"importlib.import_module({n!r})\n" for n in names)
    code += "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"torch was imported: {proc.stdout}"


def test_lazy_root_still_exports_the_public_names():
    import mixmoe

    assert set(mixmoe.__all__) <= set(dir(mixmoe))
    assert mixmoe.MoEConfig(model_dim=8, hidden_dim=16, num_experts=4).top_k == 2
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mixmoe.Nope  # noqa: B018


def _ops(rng: random.Random, rank: int) -> list[CmdOp]:
    ops, t = [], rng.uniform(1e3, 1e6)
    for b in range(4):
        subs = []
        for j in range(rng.randint(0, 3)):
            dur = round(rng.uniform(0.01, 3.0), 6)
            t = round(t + dur, 6)  # sub-ops follow each other, as a recorder writes them
            subs.append(
                SubOp(
                    name=f"moe.dispatch{j}",
                    kind="comm",
                    comm_func="all_to_all",
                    group="exp",
                    shape=(rng.randint(1, 99), 16),
                    dtype="torch.float32",
                    duration_ms=dur,
                    timestamp_ms=t,
                    in_splits=(rng.randint(0, 9), rng.randint(0, 9)),
                    out_splits=(rng.randint(0, 9), rng.randint(0, 9)),
                    # the count exchange's per-expert counts (an additive key): on some sub-ops
                    counts=tuple(rng.randint(0, 99) for _ in range(5)) if j == 1 else None,
                )
            )
        dur = round(rng.uniform(5.0, 20.0), 6)
        t = round(t + 1.0, 6)
        ops.append(
            CmdOp(
                rank=rank,
                name="forward_step",
                stage_id=0,
                batch_id=b,
                mg_state="steady",
                duration_ms=dur,
                description="fwd (micro-batch, x=1)",
                group_kind=None,
                shape=(8, 16),
                dtype="torch.bfloat16",
                timestamp_ms=t,
                sub_ops=tuple(subs),
            )
        )
    return ops


def test_cmd_round_trip(tmp_path):
    ops = _ops(random.Random(1), rank=3)
    path = cmd_trace.write_cmd_file(ops, tmp_path / "rank3.txt")
    assert cmd_trace.read_cmd_file(path) == ops
    renamed = [CmdOp(rank=0, name="exp_dp_allreduce", duration_ms=1.0, timestamp_ms=2.0)]
    cmd_trace.write_cmd_file(renamed, tmp_path / "alias.txt")
    assert cmd_trace.read_cmd_trace(tmp_path / "alias.txt")[0].name == "ep_dp_allreduce"


def _close_ops(a: list[CmdOp], b: list[CmdOp]) -> None:
    """Equal up to the microsecond rounding of Chrome timestamps (line numbers aside)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.rank, x.name, x.batch_id, x.shape, x.dtype) == (
            y.rank,
            y.name,
            y.batch_id,
            y.shape,
            y.dtype,
        )
        assert x.duration_ms == pytest.approx(y.duration_ms, abs=2e-6)
        assert x.timestamp_ms == pytest.approx(y.timestamp_ms, abs=2e-6)
        assert [s.in_splits for s in x.sub_ops] == [s.in_splits for s in y.sub_ops]
        assert [s.counts for s in x.sub_ops] == [s.counts for s in y.sub_ops]
        assert [s.name for s in x.sub_ops] == [s.name for s in y.sub_ops]


def test_chrome_round_trip(tmp_path):
    rng = random.Random(2)
    ops = _ops(rng, 0) + _ops(rng, 1)
    path = chrome.write_chrome_trace([ops[:4], ops[4:]], tmp_path / "trace.json")
    _close_ops(chrome.read_chrome_trace(path), ops)


def test_layer_log_round_trip(tmp_path):
    rng = random.Random(3)
    steps = [tuple(round(rng.uniform(1, 50), 6) for _ in range(3)) for _ in range(7)]
    lines = [
        layer_log.header_line(
            world_size=2,
            dtype="bfloat16",
            model_dim=64,
            hidden_size=128,
            samples=512,
            num_local_experts=4,
            top_k=2,
            device="cuda:0",
        ),
        "rank: 1, nranks: 2",  # noise a reader must skip
    ]
    for i, (st, fw, bw) in enumerate(steps):
        tf = layer_log.nominal_tflops(512, 64, 128, 2, st)
        lines.append(layer_log.step_line(i, st, fw, bw, tf))
    lines.append(layer_log.summary_line("mixmoe-mix", 4, 10.5, 4.25, 6.25))
    path = tmp_path / "layer.log"
    path.write_text("\n".join(lines) + "\n")
    ((key, (run,)),) = layer_log.read_layer_log(path).items()
    assert key == ("mixmoe-mix", 4) and run.header["model_dim"] == 64
    assert run.header["device"] == "cuda:0" and layer_log.detect_log_kind(path) == "layer"
    assert [(r.step_ms, r.forward_ms, r.backward_ms) for r in run.steps] == steps
    assert run.summary is not None and (run.summary.step_ms, run.summary.backward_ms) == (
        10.5,
        6.25,
    )


def test_model_log_round_trip(tmp_path):
    rng = random.Random(4)
    steps = [tuple(round(rng.uniform(1, 500), 6) for _ in range(3)) for _ in range(5)]
    lines = [model_log.step_line(i, *s) for i, s in enumerate(steps)]
    lines.append(model_log.summary_line("mix_moe", "bert", 16, 205.5))
    path = tmp_path / "model.log"
    path.write_text("\n".join(lines) + "\n")
    assert layer_log.detect_log_kind(path) == "model"
    ((key, (run,)),) = model_log.read_model_log(path).items()
    assert key == ("mix_moe", "bert", 16)
    assert [(r.step_ms, r.forward_ms, r.backward_ms) for r in run.steps] == steps
    assert run.summary is not None and run.summary.step_ms == 205.5


def test_profiler_table_round_trip():
    table = profiler_table.read_profiler_table(DATA / "profiler_table_fairseq_moe.txt")
    again = profiler_table.parse_profiler_table(profiler_table.format_profiler_table(table))
    assert again.columns == table.columns
    assert [(r.name, dict(r.values)) for r in again.rows] == [
        (r.name, dict(r.values)) for r in table.rows
    ]
    assert again.self_totals_us.keys() == table.self_totals_us.keys()
    for k, v in table.self_totals_us.items():
        assert again.self_totals_us[k] == pytest.approx(v, rel=1e-3)
