"""The simulator against measured ``bench layer`` runs: the validation cases and the comparison
(the runs themselves are measured by ``mixmoe.bench.simulator_runs``).

Legend: W ranks, D model dim, F expert hidden dim, T tokens per rank, E experts per rank.

``mixmoe.bench.simulator_runs.measure`` (``mixmoe simulate --validate FILE --remeasure``): for each case, calibrate this
machine on the case's W gloo ranks and D, F (``mixmoe.bench.calibrate``), then run ``bench layer``
(a2a, shadow, mix interleaved, one thread per rank, the calibrated profile given to the
planners) and append one JSON line per (case, strategy): the case, the measured medians, the
first forward's count matrix, the replicas the run used, the profile, ``uptime`` before and
after. Run it on a quiet machine: the records say how busy it was.

One-device cases (``world_size=1``: a one-GPU machine, or one CPU process) calibrate one rank
(``mixmoe calibrate --world-size 1``: GEMM sweep and ``local`` layer runs measured, the link
figures a preset's) and run ``bench layer --world-size 1`` (strategy ``local``) in this process
on the case's ``device`` (float32 on CPU, bfloat16 on CUDA, as calibrate); the prediction is
the simulator's ``local`` step (expert compute and the fixed costs, no communication).

``compare`` re-predicts every record from its stored counts and profile (no timing) and returns
one row per (case, strategy) with the relative error of the step time and, per case, the error
of the predicted speedup ratios mix/a2a and shadow/a2a in points (100 x |pred - meas|), under
the cost model's own aggregation (max over ranks: a processor per rank) and under ``shared``
(mean over ranks: ranks sharing saturated cores; ``mixmoe.simulate.layer``) and, given the
cores the ranks shared (``processors``), under processor sharing (``*_ps`` keys). For the
processor-sharing figures the fixed costs are fitted again under the same aggregation from the
calibration runs a record stores (``calibration``: base profile and layer runs, kept since the
fit under ``--processors`` exists; ``refit_ps`` says whether it was done); a record without
them keeps its stored profile (fitted under the max over ranks).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.replica_search import plan_replicas
from mixmoe.simulate.layer import STRATEGIES, predict_layer

# the stored runs were measured before issue 26: their mix plans came from the source-replica
# search (today's ``plan_replicas``), so records without a ``mix_planner`` field are replayed with
# it; runs measured since (``mix_planner: "plan_mix/ranges"``, written by ``--remeasure``) are replayed
# with the layer's own planner (``run_planners``)
STORED_RUN_PLANNERS = {
    "mix": lambda C, shape, profile, cfg: plan_replicas(C, shape, profile, cfg.max_replicas)
}
MIX_PLANNER = "plan_mix/ranges"  # ``mix_planner`` of records measured with the balanced planner
# (its fill over row ranges; records of its earlier segment fill, "plan_mix", are refused)


def run_planners(record: dict[str, Any]) -> dict | None:
    """The planners a record's run used, for ``predict_layer(planners=...)``: None (each
    strategy's own) for records marked ``mix_planner == MIX_PLANNER``, else
    ``STORED_RUN_PLANNERS`` (records measured before the balanced planner carry no mark)."""
    if record.get("mix_planner") == MIX_PLANNER:
        return None
    if "mix_planner" in record:
        raise ValueError(
            f"validation record has mix_planner={record['mix_planner']!r}; this version replays "
            f"{MIX_PLANNER!r} or unmarked (pre-issue-26) records: re-measure with --remeasure"
        )
    return STORED_RUN_PLANNERS


__all__ = [
    "DEFAULT_CASES",
    "MIX_PLANNER",
    "ONE_DEVICE_CASES",
    "STORED_RUN_PLANNERS",
    "ValidationCase",
    "cases_for",
    "compare",
    "read_records",
    "refit_profile",
    "run_planners",
    "summarize",
]

KIND = "simulator_validation"


@dataclass(frozen=True)
class ValidationCase:
    world_size: int
    model_dim: int
    hidden_size: int
    tokens: int
    experts_per_rank: int
    routing: str
    top_k: int = 2
    max_replicas: int = 4
    device: str = "cpu"

    def label(self) -> str:
        where = "" if self.device == "cpu" else f" {self.device}"
        return (
            f"W={self.world_size} D={self.model_dim} F={self.hidden_size} T={self.tokens} "
            f"E={self.experts_per_rank} {self.routing}{where}"
        )

    @property
    def strategies(self) -> tuple[str, ...]:
        """What ``bench layer`` runs for the case: local on one rank, else a2a, shadow, mix."""
        return ("local",) if self.world_size == 1 else STRATEGIES

    @property
    def dtype(self) -> str:
        """The dtype calibrate and the benchmark use on the case's device."""
        return "float32" if self.device == "cpu" else "bfloat16"


SHAPES = ((128, 512, 1024, 4), (256, 1024, 512, 2))  # (D, F, T, E): two small shapes
ROUTINGS = ("uniform", "zipf:1.2", "hot:0.4", "hot:0.8")
DEFAULT_CASES = tuple(
    ValidationCase(W, D, F, T, E, routing)
    for W in (2, 4)
    for D, F, T, E in SHAPES
    for routing in ROUTINGS
)
# one device (``--validate-world 1``): the two shapes under uniform routing
ONE_DEVICE_CASES = tuple(ValidationCase(1, D, F, T, E, "uniform") for D, F, T, E in SHAPES)


def cases_for(worlds: Iterable[int], device: str = "cpu") -> tuple[ValidationCase, ...]:
    """The default cases of the given W (1: ``ONE_DEVICE_CASES`` on ``device``; W >= 2 run on
    spawned gloo ranks, so only on CPU)."""
    worlds = tuple(worlds)
    if device != "cpu" and any(W != 1 for W in worlds):
        raise ValueError(
            f"cases on {device} run on one rank only (W >= 2 spawns gloo CPU ranks); measure "
            f"W={[W for W in worlds if W != 1]} with --device cpu"
        )
    out = []
    for W in worlds:
        if W == 1:
            out += [dataclasses.replace(c, device=device) for c in ONE_DEVICE_CASES]
        elif W >= 2:
            out += [c for c in DEFAULT_CASES if c.world_size == W] or [
                dataclasses.replace(c, world_size=W) for c in DEFAULT_CASES if c.world_size == 2
            ]
        else:
            raise ValueError(f"validation world sizes must be >= 1, got {W}")
    return tuple(out)


def refit_profile(
    rec: dict[str, Any], shape: LayerShape, processors: int | None
) -> HardwareProfile | None:
    """The record's profile with its fixed costs fitted again from the calibration runs it
    stores, every prediction of the fit aggregated under ``processors`` (None: the max over
    ranks); None when the record stores no calibration runs (records measured before they
    were kept)."""
    from mixmoe.simulate.fixed_cost_fit import fit_fixed_costs

    cal = rec.get("calibration")
    if not cal:
        return None
    base = HardwareProfile(**cal["base_profile"])
    fitted, _ = fit_fixed_costs(base, cal["runs"], shape, processors)
    return dataclasses.replace(fitted, name=rec["profile"]["name"])


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The validation records of a JSONL file (other lines are skipped)."""
    where = os.fspath(path)
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"validation file {where!r} does not exist; create it with `mixmoe simulate "
            f"--validate {where} --remeasure`"
        ) from None
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}:{i}: not JSON ({exc})") from None
        if isinstance(rec, dict) and rec.get("kind") == KIND:
            records.append(rec)
    if not records:
        raise ValueError(f"{where} holds no {KIND} records")
    return records


def compare(
    records: list[dict[str, Any]], fixed_ms: float = 0.0, processors: int | None = None
) -> list[dict[str, Any]]:
    """One row per record: measured and predicted step (ms), relative error, replicas (measured
    by the run, predicted by the planner), and the case's ratio errors (points); with
    ``processors`` also the processor-sharing prediction (``predicted_ps_ms``, ``error_ps``,
    ``ratio_ps``, ``ratio_error_ps_points``)."""
    rows = []
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in records:
        case = ValidationCase(**rec["case"])
        by_case.setdefault(json.dumps(rec["case"], sort_keys=True), {})[rec["strategy"]] = rec
    for key, recs in by_case.items():
        case = ValidationCase(**json.loads(key))
        first = next(iter(recs.values()))
        shape = LayerShape(
            model_dim=case.model_dim,
            hidden_dim=case.hidden_size,
            experts_per_rank=case.experts_per_rank,
            world_size=case.world_size,
            bytes_per_element=4 if case.device == "cpu" else 2,
        )
        profile = HardwareProfile(**first["profile"])
        kw: dict[str, Any] = dict(
            top_k=case.top_k,
            max_replicas=case.max_replicas,
            strategies=tuple(recs),
            fixed_s=fixed_ms / 1e3,
            planners=run_planners(first),
        )
        preds = predict_layer(first["counts_WN"], shape, profile, **kw)
        shared = predict_layer(first["counts_WN"], shape, profile, shared=True, **kw)
        pred_ps: dict[str, float] = {}
        refit = None
        if processors is not None:
            # fitted under the same aggregation when the record keeps its calibration runs
            refit = refit_profile(first, shape, processors)
            ps_profile = profile if refit is None else refit
            # the plan the run used (its profile's), priced with the re-fitted costs
            ps = predict_layer(
                first["counts_WN"],
                shape,
                ps_profile,
                processors=processors,
                plan_profile=profile,
                **kw,
            )
            pred_ps = {s: p.step_s * 1e3 for s, p in ps.items()}
        meas = {s: r["step_ms"] for s, r in recs.items()}
        pred = {s: p.step_s * 1e3 for s, p in preds.items()}
        pred_sh = {s: p.step_s * 1e3 for s, p in shared.items()}
        for s, r in recs.items():
            row = {
                "case": case.label(),
                "strategy": s,
                "measured_ms": meas[s],
                "predicted_ms": pred[s],
                "error": abs(pred[s] - meas[s]) / meas[s],
                "predicted_shared_ms": pred_sh[s],
                "error_shared": abs(pred_sh[s] - meas[s]) / meas[s],
                "replicas_measured": r["replicas"],
                "replicas_predicted": preds[s].replicas,
            }
            if s != "a2a" and "a2a" in recs:
                row["ratio_measured"] = meas[s] / meas["a2a"]
                row["ratio_predicted"] = pred[s] / pred["a2a"]
                row["ratio_error_points"] = 100 * abs(
                    row["ratio_predicted"] - row["ratio_measured"]
                )
                row["ratio_shared"] = pred_sh[s] / pred_sh["a2a"]
                row["ratio_error_shared_points"] = 100 * abs(
                    row["ratio_shared"] - row["ratio_measured"]
                )
            if pred_ps:
                row["world_size"] = case.world_size
                row["refit_ps"] = refit is not None
                row["predicted_ps_ms"] = pred_ps[s]
                row["error_ps"] = abs(pred_ps[s] - meas[s]) / meas[s]
                if "ratio_measured" in row:
                    row["ratio_ps"] = pred_ps[s] / pred_ps["a2a"]
                    row["ratio_error_ps_points"] = 100 * abs(
                        row["ratio_ps"] - row["ratio_measured"]
                    )
            rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median / max step error, median / max ratio error (points), replica agreement, and how
    often the strategy predicted fastest is the one measured fastest."""
    import statistics

    errs = [r["error"] for r in rows]
    ratio = [r["ratio_error_points"] for r in rows if "ratio_error_points" in r]
    errs_sh = [r["error_shared"] for r in rows]
    ratio_sh = [r["ratio_error_shared_points"] for r in rows if "ratio_error_shared_points" in r]
    return {
        "shared_step_error_median": statistics.median(errs_sh),
        "shared_within_10pct": sum(e <= 0.10 for e in errs_sh),
        "shared_ratio_error_median_points": statistics.median(ratio_sh) if ratio_sh else 0.0,
        "shared_ratios_within_5_points": sum(e <= 5 for e in ratio_sh),
        "cases": len(rows),
        "step_error_median": statistics.median(errs),
        "step_error_max": max(errs),
        "within_10pct": sum(e <= 0.10 for e in errs),
        "ratio_error_median_points": statistics.median(ratio) if ratio else float("nan"),
        "ratio_error_max_points": max(ratio) if ratio else float("nan"),
        "ratios_within_5_points": sum(e <= 5 for e in ratio),
        "ratios": len(ratio),
        "replicas_agree": sum(r["replicas_measured"] == r["replicas_predicted"] for r in rows),
        **_fastest_agreement(rows),
        **(_ps_summary(rows) if rows and "error_ps" in rows[0] else {}),
    }


def _ps_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The processor-sharing figures of ``compare(..., processors=P)`` rows, overall and per W
    (next to the max-over-ranks figures of the same W)."""
    import statistics

    def ratios(sel: list[dict[str, Any]], key: str) -> list[float]:
        return [r[key] for r in sel if key in r]

    errs, ratio = [r["error_ps"] for r in rows], ratios(rows, "ratio_error_ps_points")
    by_world = {}
    for W in sorted({r["world_size"] for r in rows}):
        sel = [r for r in rows if r["world_size"] == W]
        by_world[W] = {
            "step": statistics.median(r["error_ps"] for r in sel),
            "step_max": statistics.median(r["error"] for r in sel),
            "ratio": statistics.median(ratios(sel, "ratio_error_ps_points") or [float("nan")]),
            "ratio_max": statistics.median(ratios(sel, "ratio_error_points") or [float("nan")]),
        }
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["strategy"]] = r
    agree = sum(
        min(c, key=lambda s: c[s]["measured_ms"]) == min(c, key=lambda s: c[s]["predicted_ps_ms"])
        for c in by_case.values()
    )
    return {
        "ps_refit_cases": len({r["case"] for r in rows if r["refit_ps"]}),
        "ps_step_error_median": statistics.median(errs),
        "ps_within_10pct": sum(e <= 0.10 for e in errs),
        "ps_ratio_error_median_points": statistics.median(ratio) if ratio else float("nan"),
        "ps_ratios_within_5_points": sum(e <= 5 for e in ratio),
        "ps_fastest_agree": agree,
        "ps_by_world": by_world,
    }


def _fastest_agreement(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Per case, whether the strategy predicted fastest is the one measured fastest, under the
    cost model's aggregation and the shared one; and how often the measured fastest is a2a."""
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["strategy"]] = r
    agree = agree_sh = a2a_best = 0
    for recs in by_case.values():
        best = min(recs, key=lambda s: recs[s]["measured_ms"])
        agree += best == min(recs, key=lambda s: recs[s]["predicted_ms"])
        agree_sh += best == min(recs, key=lambda s: recs[s]["predicted_shared_ms"])
        a2a_best += best == "a2a"
    return {
        "fastest_agree": agree,
        "shared_fastest_agree": agree_sh,
        "measured_fastest_a2a": a2a_best,
        "case_count": len(by_case),
    }
