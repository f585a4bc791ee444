"""``torch.profiler`` operator tables (``key_averages().table()`` text, docs/formats.md section 4):
records, reader and writer. Torch-free.

The reader is header-driven, never fixed offsets:

- The header is the line between the first two dashed rules; its cells are split at runs of two
  or more spaces, and a cell that overflowed into its neighbour (one space apart) is split back
  into known column names.
- A row's values are the last whitespace-separated tokens, one per column after ``Name``
  (memory values such as ``8.00 Mb`` count as one); the rest of the line is the name, so names
  may contain spaces. Trailing text columns (``Input Shapes``, ``Source Location``) are cut at
  their dashed rule's start.
- Values: times (``13.980ms``, ``3.916s``, ``0.000us``) -> microseconds; percentages (``0.17%``,
  or a bare ``0`` for async collectives) -> percent; ``# of Calls`` -> int; memory -> bytes; other
  numbers -> float.
- The footer lines ``Self CPU time total: X`` / ``Self CUDA time total: X`` are optional.

A row that cannot be read (truncated file) raises ValueError naming ``path:line``.

The writer (``format_profiler_table``) prints a table in the same layout from the rows' cell text
(``ProfilerRow.raw``), so reading its output gives back the same rows and values.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ProfilerRow",
    "ProfilerTable",
    "format_profiler_table",
    "parse_profiler_table",
    "read_profiler_table",
]

_DEVICES = ("CUDA", "XPU", "MTIA", "HPU", "PrivateUse1", "Device")
KNOWN_COLUMNS = frozenset(
    [
        "Name",
        "Self CPU %",
        "Self CPU",
        "CPU total %",
        "CPU total",
        "CPU time avg",
        "CPU Mem",
        "Self CPU Mem",
        "# of Calls",
        "Input Shapes",
        "Source Location",
        "Node ID",
        "Total GFLOPs",
        "Total MFLOPs",
        "Total KFLOPs",
        "Total FLOPs",
        "Overload Name",
    ]
    + [
        c.format(d)
        for d in _DEVICES
        for c in (
            "Self {}",
            "Self {} %",
            "{} total",
            "{} total %",
            "{} time avg",
            "{} Mem",
            "Self {} Mem",
        )
    ]
)
TEXT_COLUMNS = frozenset(["Input Shapes", "Source Location", "Overload Name"])
_RULE = re.compile(r"^\s*-{3,}(\s+-{3,})*\s*$")
_TIME = re.compile(r"^(-?\d+(?:\.\d+)?)(ns|us|ms|s)$")
_TIME_SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
_MEM_SCALE = {
    "b": 1,
    "B": 1,
    "Kb": 1024,
    "KB": 1024,
    "Mb": 1024**2,
    "MB": 1024**2,
    "Gb": 1024**3,
    "GB": 1024**3,
}
_FOOTER = re.compile(r"^\s*Self (\S+) time total:\s*(\S+)\s*$")


@dataclass(frozen=True)
class ProfilerRow:
    """One operator row. ``values``: column -> parsed value (times in us, % in percent, calls int,
    memory in bytes, text columns as str); ``raw``: column -> the cell text."""

    name: str
    values: Mapping[str, float | int | str]
    raw: Mapping[str, str]
    line_no: int

    def get(self, column: str, default: float = 0.0) -> float:
        """Numeric value of ``column`` (``default`` if absent or not numeric)."""
        value = self.values.get(column)
        return float(value) if isinstance(value, int | float) else default


@dataclass(frozen=True)
class ProfilerTable:
    columns: tuple[str, ...]
    rows: tuple[ProfilerRow, ...]
    self_totals_us: Mapping[str, float]  # footer: "CPU"/"CUDA" -> us; empty if missing

    @property
    def device(self) -> str | None:
        """The accelerator named by the columns (``CUDA``, ``XPU``, ...), or None."""
        return next((d for d in _DEVICES if f"{d} total" in self.columns), None)

    def find(self, name: str) -> list[ProfilerRow]:
        """Rows named exactly ``name``, in table order."""
        return [r for r in self.rows if r.name == name]


def _split_header(line: str) -> list[str]:
    cells = re.split(r"\s{2,}", line.strip())
    out: list[str] = []
    for cell in cells:
        out.extend(_repair(cell) or [cell])
    return out


def _repair(cell: str) -> list[str] | None:
    """Split an overflowed ``"Self CUDA % CUDA total"`` into known column names (None if not)."""
    if cell in KNOWN_COLUMNS:
        return [cell]
    words = cell.split(" ")
    for i in range(len(words) - 1, 0, -1):
        head = " ".join(words[:i])
        if head in KNOWN_COLUMNS and (tail := _repair(" ".join(words[i:]))) is not None:
            return [head, *tail]
    return None


def _value(column: str, text: str) -> float | int | str:
    if column in TEXT_COLUMNS:
        return text
    if column == "# of Calls":
        return int(text)
    if column.endswith("%"):
        return float(text[:-1]) if text.endswith("%") else float(text)
    if "Mem" in column:
        number, _, unit = text.partition(" ")
        return float(number) * _MEM_SCALE.get(unit, 1)
    m = _TIME.match(text)
    if m:
        return float(m.group(1)) * _TIME_SCALE[m.group(2)]
    return float(text)


def _row(line: str, columns: list[str], text_starts: dict[str, int], line_no: int) -> ProfilerRow:
    numeric = [c for c in columns[1:] if c not in TEXT_COLUMNS]
    cut = min(text_starts.values(), default=len(line))
    head = line[:cut]
    tokens = [(m.start(), m.group()) for m in re.finditer(r"\S+", head)]
    cells: list[str] = []
    i = len(tokens)
    while len(cells) < len(numeric) and i > 0:
        i -= 1
        start, tok = tokens[i]
        if tok in _MEM_SCALE and i > 0:
            i -= 1
            start, tok = tokens[i][0], f"{tokens[i][1]} {tok}"
        cells.insert(0, tok)
    name_end = tokens[i][0] if i < len(tokens) else len(head)
    name = head[:name_end].strip()
    if len(cells) < len(numeric) or not name:
        raise ValueError(f"row has {len(cells)} values for {len(numeric)} columns (truncated?)")
    raw = dict(zip(numeric, cells, strict=True))
    for column, start in text_starts.items():
        raw[column] = line[start:].strip()
    values: dict[str, float | int | str] = {}
    for column, text in raw.items():
        try:
            values[column] = _value(column, text)
        except ValueError:
            raise ValueError(f"cannot read {text!r} as {column!r} (truncated row?)") from None
    return ProfilerRow(name, values, raw, line_no)


def parse_profiler_table(text: str, source: str = "<table>") -> ProfilerTable:
    """Parse the table text; see the module docstring. ``source`` names it in errors."""
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if _RULE.match(line)]
    if len(rules) < 2 or rules[1] != rules[0] + 2:
        raise ValueError(f"{source}: no '----' / header / '----' block; is this a profiler table?")
    header_at = rules[0] + 1
    columns = _split_header(lines[header_at])
    if columns[0] != "Name":
        raise ValueError(
            f"{source}:{header_at + 1}: the first column is {columns[0]!r}, not 'Name'"
        )
    spans = [m.start() for m in re.finditer(r"-+", lines[rules[1]])]
    text_starts = {}
    if len(spans) == len(columns):
        text_starts = {c: s for c, s in zip(columns, spans, strict=True) if c in TEXT_COLUMNS}
    rows: list[ProfilerRow] = []
    totals: dict[str, float] = {}
    in_body = True
    for i in range(rules[1] + 1, len(lines)):
        line = lines[i]
        if _RULE.match(line):
            in_body = False
            continue
        if (m := _FOOTER.match(line)) is not None:
            in_body = False
            time = _TIME.match(m.group(2))
            if time:
                totals[m.group(1)] = float(time.group(1)) * _TIME_SCALE[time.group(2)]
            continue
        if not in_body or not line.strip():
            continue
        try:
            rows.append(_row(line, columns, text_starts, i + 1))
        except ValueError as err:
            raise ValueError(f"{source}:{i + 1}: {err}; fix or delete that line") from None
    return ProfilerTable(tuple(columns), tuple(rows), totals)


def read_profiler_table(path: str | os.PathLike[str]) -> ProfilerTable:
    """``parse_profiler_table`` on the file at ``path``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_profiler_table(f.read(), os.fspath(path))


def _fmt_us(us: float) -> str:
    for unit in ("s", "ms"):
        if us >= _TIME_SCALE[unit]:
            return f"{us / _TIME_SCALE[unit]:.3f}{unit}"
    return f"{us:.3f}us"


def format_profiler_table(table: ProfilerTable) -> str:
    """The text of ``table`` in the ``key_averages().table()`` layout: a dashed rule, the header,
    a rule, one line per row (``raw`` cells, names left-aligned), a rule and the footer totals."""
    columns = list(table.columns)
    cells = [[r.name] + [r.raw.get(c, "") for c in columns[1:]] for r in table.rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    lines = [rule, line(columns), rule, *(line(row) for row in cells), rule]
    lines += [f"Self {k} time total: {_fmt_us(v)}" for k, v in table.self_totals_us.items()]
    return "\n".join(lines) + "\n"
