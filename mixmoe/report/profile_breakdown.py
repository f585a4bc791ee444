"""The MoE layer's breakdown in a ``torch.profiler`` table, and what the table cannot tell.

Stages are found by their ``record_function`` labels (``CATEGORY_LABELS``: fairseq/DeepSpeed
``MOE*`` labels and mixmoe's ``moe.*`` spans). For each category: calls, CPU time (the labels'
``CPU total``, inclusive) and device time (``<device> total``: kernels launched inside the label),
and their shares of the layer label's totals (``MOELayer`` / ``moe.layer``). ``rest`` = layer
total minus the categories. Without a layer label the layer total is the sum of the categories.
Labels are assumed not to nest within each other; when they do, the categories add up to more
than the layer and a note says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mixmoe.formats.profiler_table import ProfilerRow, ProfilerTable

__all__ = ["CATEGORY_LABELS", "CategoryTime", "MoEBreakdown", "moe_breakdown"]

CATEGORY_LABELS: dict[str, tuple[str, ...]] = {
    "gate": ("MOEGate", "moe.gate"),
    "dispatch": ("DispatchMask", "MOEmm", "moe.count", "moe.count_exchange", "moe.plan"),
    "all-to-all": (
        "MOEAll2All_input",
        "MOEAll2All_output",
        "moe.dispatch",
        "moe.return",
        "moe.replica_fetch",
    ),
    "experts": ("MOEExpert", "moe.experts", "moe.experts_local", "moe.experts_remote"),
    "combine": ("MOECombineExpert", "moe.combine"),
}
LAYER_LABELS = ("MOELayer", "moe.layer")
STEP_PREFIXES = ("ProfilerStep#", "train_step")


@dataclass(frozen=True)
class CategoryTime:
    """One category: ``labels`` found in the table; times in microseconds (summed over calls);
    ``calls`` of the first label found."""

    category: str
    labels: tuple[str, ...]
    calls: int
    cpu_us: float
    device_us: float


@dataclass(frozen=True)
class MoEBreakdown:
    device: str | None
    layer_label: str | None
    layer_calls: int
    layer_cpu_us: float
    layer_device_us: float
    categories: tuple[CategoryTime, ...]
    step_label: str | None
    step_cpu_us: float | None
    step_device_us: float | None
    notes: tuple[str, ...]

    @property
    def rest_cpu_us(self) -> float:
        return self.layer_cpu_us - sum(c.cpu_us for c in self.categories)

    @property
    def rest_device_us(self) -> float:
        return self.layer_device_us - sum(c.device_us for c in self.categories)


def _total(rows: Sequence[ProfilerRow], column: str) -> float:
    return sum(r.get(column) for r in rows)


def _notes(
    table: ProfilerTable,
    b_layer: str | None,
    cats: list[CategoryTime],
    layer: tuple[int, float, float],
    dev: str | None,
) -> list[str]:
    notes: list[str] = []
    calls, cpu, _ = layer
    a2a = next(c for c in cats if c.category == "all-to-all")
    collectives = [r for r in table.rows if r.name.startswith(("nccl:", "gloo:", "c10d::"))]
    if a2a.labels and a2a.device_us == 0 and dev is not None:
        listed = ", ".join(
            f"{r.name} ({r.get('# of Calls'):.0f} calls, CPU total {r.get('CPU total') / 1e3:.3f} ms)"
            for r in collectives
        )
        notes.append(
            f"all-to-all device time shows 0: collectives run asynchronously on their own stream "
            f"and the profiler attributes their kernels to no label, so transfer time is not in "
            f"this table (collective rows: {listed or 'none'}); their CPU time is launch/wait "
            f"time. Trace with mixmoe's TraceRecorder (CUDA events) to time transfers."
        )
    backward = [r.name for r in table.rows if "Backward" in r.name]
    # MoE-looking autograd nodes first: they are the ones a reader would want attributed
    backward.sort(key=lambda name: not any(k in name for k in ("AllToAll", "All2All", "MoE")))
    if backward:
        notes.append(
            f"labels cover the forward pass only: the layer's backward ({len(backward)} autograd "
            f"node types, e.g. {', '.join(backward[:3])}) is mixed with the rest of the model's "
            "and cannot be attributed to the layer from a flat table."
        )
    if b_layer is None:
        notes.append(
            "no layer label (MOELayer / moe.layer): the layer total is the sum of the "
            "categories and 'rest' is unknown."
        )
    elif sum(c.cpu_us for c in cats) > cpu * 1.001:
        notes.append(
            "the categories add up to more than the layer: some labels nest inside "
            "others, so shares overlap."
        )
    if calls > 1:
        notes.append(
            f"{b_layer or 'the layer'} ran {calls} times (e.g. one per MoE layer): "
            "times are totals over all calls."
        )
    if not table.self_totals_us:
        notes.append(
            "the 'Self CPU time total' footer is missing: shares of the step use the "
            "step label's own totals."
        )
    notes.append(
        "CPU time is host time: launch overhead and host waits (syncs, copies) inside "
        "a label cannot be told apart in an aggregated table."
    )
    return notes


def moe_breakdown(table: ProfilerTable) -> MoEBreakdown:
    """Categorise the MoE labels of ``table`` (module docstring). Raises ValueError when the
    table holds none of the known labels."""
    dev = table.device
    dev_col = f"{dev} total" if dev else ""
    cats: list[CategoryTime] = []
    for category, labels in CATEGORY_LABELS.items():
        found = [label for label in labels if table.find(label)]
        rows = [r for label in found for r in table.find(label)]
        calls = int(rows[0].get("# of Calls")) if rows else 0
        cats.append(
            CategoryTime(
                category,
                tuple(found),
                calls,
                _total(rows, "CPU total"),
                _total(rows, dev_col) if dev else 0.0,
            )
        )
    if not any(c.labels for c in cats):
        known = [label for labels in CATEGORY_LABELS.values() for label in labels]
        raise ValueError(
            f"no MoE labels in the table (looked for {known}); wrap the layer's stages in "
            "torch.profiler.record_function or profile mixmoe's MoE layer"
        )
    layer_label = next((label for label in LAYER_LABELS if table.find(label)), None)
    if layer_label is not None:
        rows = table.find(layer_label)
        layer = (
            int(rows[0].get("# of Calls")),
            _total(rows, "CPU total"),
            _total(rows, dev_col) if dev else 0.0,
        )
    else:
        calls = max(c.calls for c in cats)
        layer = (calls, sum(c.cpu_us for c in cats), sum(c.device_us for c in cats))
    steps = [r for r in table.rows if r.name.startswith(STEP_PREFIXES)]
    step_label = steps[0].name if steps else None
    return MoEBreakdown(
        device=dev,
        layer_label=layer_label,
        layer_calls=layer[0],
        layer_cpu_us=layer[1],
        layer_device_us=layer[2],
        categories=tuple(cats),
        step_label=step_label if len(steps) == 1 else f"{len(steps)} step labels",
        step_cpu_us=_total(steps, "CPU total") if steps else None,
        step_device_us=_total(steps, dev_col) if steps and dev else None,
        notes=tuple(_notes(table, layer_label, cats, layer, dev)),
    )
