"""Render rows as an aligned plain-text table or a Markdown table."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["render_table"]


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], *, markdown: bool = False
) -> str:
    """Cells are ``str()``-ed; ``None`` shows as ``-``. Text: the first column left-aligned, the
    others right-aligned, a dashed rule under the header. Markdown: a GitHub pipe table."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells for {len(headers)} headers")
    if markdown:
        rule = ["---"] + ["---:"] * (len(headers) - 1)
        lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), line(["-" * w for w in widths]), *map(line, cells)])
