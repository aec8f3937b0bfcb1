"""``python -m lightning_pstar.consolidate DIR OUT.ckpt``: a sharded checkpoint -> one consolidated file.

The arguments are read before torch's checkpoint machinery is imported, so ``--help`` and a wrong argument
answer at once ([Note: command lines without Lightning] in ``lightning_pstar/__init__.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["main"]


def _not_a_directory(path: Path) -> str | None:
    """Why ``path`` cannot be consolidated before anything is read from it, or None for a directory."""
    if path.is_dir():
        return None
    if not path.exists():  # a sharded save killed mid-publish may have set it aside: put it back first
        from lightning_pstar.checkpoint.io import restore_set_aside

        if restore_set_aside(path) is not None and path.is_dir():
            return None
        return f"'{path}' does not exist. HINT: pass the sharded checkpoint directory (checkpoint='sharded')."
    what = _describe_file(path)
    return f"'{path}' is a file ({what}), not a sharded checkpoint directory. HINT: " + (
        "it needs no consolidation: give it to plain Lightning (ckpt_path=...) or torch.load as it is."
        if what == "already a consolidated checkpoint"
        else "pass the directory a checkpoint='sharded' run wrote (e.g. 'epoch=0-step=100.ckpt/')."
    )


def _describe_file(path: Path) -> str:
    """What ``path`` holds: "already a consolidated checkpoint" for a Lightning checkpoint file."""
    import torch  # after argparse: see the module docstring

    from lightning_pstar.checkpoint.sharded import SHARDED_KEY

    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:  # noqa: BLE001 - only described: the user passed a file that is not one
        return f"not a torch checkpoint: {type(err).__name__}"
    if isinstance(loaded, dict) and SHARDED_KEY in loaded:
        return "the meta.pt of a sharded checkpoint: pass its directory"
    if isinstance(loaded, dict) and "state_dict" in loaded:
        return "already a consolidated checkpoint"
    return f"a torch file holding a {type(loaded).__name__}, not a checkpoint"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pstar.consolidate",
        description="Turn a PatrickStar sharded checkpoint directory into one consolidated checkpoint file"
        " (an ordinary Lightning checkpoint that plain Lightning and torch.load read). Exit status: 0 written,"
        " 2 bad input or an unusable checkpoint.",
    )
    parser.add_argument("directory", help="the sharded checkpoint directory")
    parser.add_argument("output", help="the .ckpt file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the consolidate command; a checkpoint that cannot be used exits with status 2 and the reason."""
    parser = _parser()
    args = parser.parse_args(argv)
    problem = _not_a_directory(Path(args.directory))
    if problem is not None:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    from lightning_pstar.checkpoint.io import CheckpointError
    from lightning_pstar.checkpoint.sharded import consolidate

    try:
        consolidate(args.directory, args.output)
    except CheckpointError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(f"wrote {args.output}")
    return 0
