"""``mixmoe demo`` (what ``make demo`` runs): the layer benchmark on CPU with default settings."""

from __future__ import annotations

import argparse

from mixmoe.bench import layer


def add_arguments(p: argparse.ArgumentParser) -> None:
    layer.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return layer.run(args)
