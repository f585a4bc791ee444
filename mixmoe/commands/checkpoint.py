"""``mixmoe checkpoint consolidate DIR FILE`` and ``mixmoe checkpoint shard FILE SAVE_DIR``:
convert a sharded checkpoint (``--save-dir``'s step-N directory) into one file of the
``--save`` form, and back (``mixmoe.train.consolidate``). Both forms resume at any world size."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="consolidate: a step-N directory; shard: a --save file")
    p.add_argument("target", help="consolidate: the file to write; shard: the save directory")


def run(args: argparse.Namespace) -> int:
    from mixmoe.train.consolidate import consolidate, shard

    if args._command[-1] == "consolidate":
        print(f"consolidated checkpoint written to {consolidate(args.source, args.target)}")
    else:
        print(f"sharded checkpoint written to {shard(args.source, args.target)}")
    return 0
