"""``python -m lightning_pstar.consolidate DIR OUT.ckpt``: a sharded checkpoint -> one consolidated file."""

from lightning_pstar.checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
