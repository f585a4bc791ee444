"""``mixmoe demo`` (what ``make demo`` runs): the strategy comparison on CPU.

2 gloo ranks x 1 thread, fp32, model_dim 256, hidden 1024, 4096 tokens per rank, 4 experts per
rank, top-2, one hot expert taking 40% of all rows: mix vs a2a vs shadow, interleaved on the same
inputs. Any ``mixmoe bench layer`` flag overrides these defaults.
"""

from __future__ import annotations

import argparse

from mixmoe.commands import bench_layer

DEMO_DEFAULTS = {
    "world_size": 2,
    "threads": 1,
    "routing": "hot:0.4",
    "strategy": "mix,a2a,shadow",
    "tokens": 4096,
    "warmup": 5,
    "steps": 15,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    bench_layer.add_arguments(p)
    p.set_defaults(**DEMO_DEFAULTS)


def run(args: argparse.Namespace) -> int:
    return bench_layer.run(args)
