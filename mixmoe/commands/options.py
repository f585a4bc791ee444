"""Flags several commands share, declared once: where results go (``--jsonl``) and which device
runs (``--device``). Each command keeps its own default, because what it writes and where it can
run differ."""

from __future__ import annotations

import argparse


def add_jsonl(p: argparse.ArgumentParser, default: str | None, records: str) -> None:
    """``--jsonl PATH``: append ``records`` (one JSON line each, with the environment) there;
    ``''`` (or no default) writes none."""
    p.add_argument(
        "--jsonl",
        default=default,
        help=f"append {records} here, each with its environment ('' for none)",
    )


def add_device(p: argparse.ArgumentParser, default: str | None, where: str) -> None:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``; ``where`` says what runs on it."""
    p.add_argument("--device", default=default, help=f"cpu, cuda or cuda:N: {where}")
