"""``python -m lightning_pstar.plan``: the capacity planner's command line (see :mod:`lightning_pstar.planning`)."""

from lightning_pstar.planning.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
