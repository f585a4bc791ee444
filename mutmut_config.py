"""mutmut (2.5.1) hook for ``make mutation``: skip mutants that no test can catch by design.

Skipped (reported as "skipped", never counted as killed):
- lines of ``raise`` statements (error-message text; the condition guarding the raise is still
  mutated) and of ``assert`` messages;
- the arguments of ``trace_span(...)`` calls and of ``warnings.warn``/``print`` (trace names, log
  text: FORMATS.md is checked by the tracing/report tiers, not by the core's tests).
"""

from __future__ import annotations

import ast
import functools

_TEXT_CALLS = {"trace_span", "warn", "print"}


@functools.cache
def _text_lines(filename: str) -> frozenset[int]:
    """1-based line numbers of ``filename`` that hold only message / log / trace text."""
    with open(filename) as f:
        tree = ast.parse(f.read())
    lines: set[int] = set()

    def span(node: ast.AST) -> range:
        return range(node.lineno, (node.end_lineno or node.lineno) + 1)

    for node in ast.walk(tree):
        if isinstance(node, ast.Raise):
            lines.update(span(node))
        elif isinstance(node, ast.Assert) and node.msg is not None:
            lines.update(span(node.msg))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _TEXT_CALLS:
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    lines.update(span(arg))
                lines.add(node.lineno)
    return frozenset(lines)


def pre_mutation(context) -> None:
    if context.current_line_index + 1 in _text_lines(context.filename):
        context.skip = True
