"""``python -m lightning_pstar.consolidate DIR OUT.ckpt``: a sharded checkpoint -> one consolidated file."""

from __future__ import annotations

import argparse

from lightning_pstar.checkpoint.io import CheckpointError
from lightning_pstar.checkpoint.sharded import consolidate

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the consolidate command; a checkpoint that cannot be used exits with status 2 and the reason."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pstar.consolidate",
        description="Turn a PatrickStar sharded checkpoint directory into one consolidated checkpoint file.",
    )
    parser.add_argument("directory", help="the sharded checkpoint directory")
    parser.add_argument("output", help="the .ckpt file to write")
    args = parser.parse_args(argv)
    try:
        consolidate(args.directory, args.output)
    except CheckpointError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(f"wrote {args.output}")
    return 0
