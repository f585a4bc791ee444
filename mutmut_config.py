"""mutmut (2.5.1) hook for ``make mutation``: skip mutants that no test can catch by design.

Skipped (reported as "skipped", never counted as killed):
- lines of ``raise`` statements (error-message text; the condition guarding the raise is still
  mutated) and of ``assert`` messages;
- the arguments of ``trace_span(...)`` calls and of ``warnings.warn``/``print`` (trace names, log
  text: FORMATS.md is checked by the tracing/report tiers, not by the core's tests).

With ``MUTATION_DEFS`` set (comma-separated names of top-level functions / classes, set by
``run_mutation.py --defs``; ``Class.method`` names one method), every mutant outside those
definitions is skipped too: a run restricted to a module's core when the whole module would take
too long.
"""

from __future__ import annotations

import ast
import functools
import os

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


@functools.cache
def _def_lines(filename: str, names: str) -> frozenset[int]:
    """1-based line numbers of the top-level definitions ``names`` (comma-separated) of ``filename``."""
    with open(filename) as f:
        tree = ast.parse(f.read())
    wanted = set(names.split(","))
    lines: set[int] = set()

    def add(node: ast.AST) -> None:
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        lines.update(range(first, (node.end_lineno or node.lineno) + 1))

    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if isinstance(node, defs) and node.name in wanted:
            add(node)
        if isinstance(node, ast.ClassDef):  # ``Class.method``: one method of a class
            for inner in node.body:
                if isinstance(inner, defs) and f"{node.name}.{inner.name}" in wanted:
                    add(inner)
    return frozenset(lines)


def pre_mutation(context) -> None:
    line = context.current_line_index + 1
    if line in _text_lines(context.filename):
        context.skip = True
    defs = os.environ.get("MUTATION_DEFS")
    if defs and line not in _def_lines(context.filename, defs):
        context.skip = True
