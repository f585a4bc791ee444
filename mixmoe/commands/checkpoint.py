"""``mixmoe checkpoint consolidate DIR FILE`` and ``mixmoe checkpoint shard FILE SAVE_DIR``:
convert a sharded checkpoint (``--save-dir``'s step-N directory) into one file of the
``--save`` form, and back (``mixmoe.train.consolidate``). Both forms resume at any world size.
``mixmoe checkpoint export CKPT OUT_DIR``: a ``--model mixtral`` checkpoint as a transformers
model (``save_pretrained``, safetensors)."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source", help="consolidate: a step-N directory; shard: a --save file; export: either"
    )
    p.add_argument(
        "target",
        help="consolidate: the file to write; shard: the save directory; export: the "
        "transformers model directory",
    )


def run(args: argparse.Namespace) -> int:
    from mixmoe.train.consolidate import consolidate, export_transformers, shard

    if args._command[-1] == "consolidate":
        print(f"consolidated checkpoint written to {consolidate(args.source, args.target)}")
    elif args._command[-1] == "export":
        model = export_transformers(args.source, args.target)
        print(f"{type(model).__name__} saved to {args.target} (from_pretrained loads it)")
    else:
        print(f"sharded checkpoint written to {shard(args.source, args.target)}")
    return 0
