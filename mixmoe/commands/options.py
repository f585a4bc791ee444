"""Flags several commands share, declared once: where results go (``--jsonl``), which device
runs (``--device``) and how many ranks (``--world-size``, read by ``world_size``). Each command
keeps its own default, because what it writes and where it can run differ."""

from __future__ import annotations

import argparse
import os

from mixmoe.validation import check_int


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


def world_size(given: int | None) -> int:
    """The ranks a command runs on: ``--world-size`` when given (>= 1, else a one-line error:
    0 used to fall back to one rank silently), else torchrun's ``WORLD_SIZE``, else 1."""
    if given is not None:
        check_int("--world-size", given, 1)
        return given
    return int(os.environ.get("WORLD_SIZE", "1"))
