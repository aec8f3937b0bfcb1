"""lightning_pstar: PatrickStar chunk-based memory management as a Lightning strategy.

Importing the package registers the strategy names ``"patrickstar"`` and ``"patrickstar_spawn"`` with
Lightning's Trainer and with Fabric, so ``Trainer(strategy="patrickstar")`` and ``Fabric(strategy="patrickstar")``
work after ``import lightning_pstar`` (the Fabric glue is :mod:`lightning_pstar.fabric`). A misspelled name
(``strategy="patrickstr"``) gets Lightning's own "invalid strategy name" error: Lightning checks the name
against its registry before any strategy code runs and offers no hook to suggest the close match.

[Note: command lines without Lightning]
``python -m lightning_pstar.plan`` and ``python -m lightning_pstar.consolidate`` import this package before their
own module, and importing Lightning takes seconds to tens of seconds on a busy machine: ``--help`` and a
misspelled argument would wait for it. When the interpreter was started as one of those commands
(``sys.orig_argv``), this package defers its public names and the registration to the first attribute
access (module ``__getattr__``), and the commands import what they need after their arguments are read.
Every other import registers the strategy names at once, as before.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__all__ = [
    "LossScaleConfig",
    "MemoryBudgetError",
    "MemoryReport",
    "PStarConfig",
    "PatrickStarPrecision",
    "PatrickStarFabricPrecision",
    "PatrickStarFabricStrategy",
    "PatrickStarMonitor",
    "PatrickStarStrategy",
    "Placement",
    "plot_tide",
]
__version__ = "0.1.0.dev0"  # pyproject.toml's version (tests/unit/test_package.py checks that they agree)

_COMMANDS = ("lightning_pstar.plan", "lightning_pstar.consolidate")
"""Modules run with ``python -m`` that must answer ``--help`` without importing Lightning."""

_HOMES = {
    "LossScaleConfig": "lightning_pstar.config",
    "Placement": "lightning_pstar.config",
    "PStarConfig": "lightning_pstar.config",
    "MemoryBudgetError": "lightning_pstar.planning.requirements",
    "MemoryReport": "lightning_pstar.report",
    "PatrickStarPrecision": "lightning_pstar.precision",
    "PatrickStarFabricPrecision": "lightning_pstar.precision",
    "PatrickStarFabricStrategy": "lightning_pstar.fabric",
    "PatrickStarMonitor": "lightning_pstar.callbacks",
    "plot_tide": "lightning_pstar.callbacks",
    "PatrickStarStrategy": "lightning_pstar.strategy",
}


def _started_as_command(orig_argv: list[str]) -> bool:
    """Whether the interpreter runs ``python -m <one of _COMMANDS>`` (see [Note: command lines without Lightning])."""
    args = iter(orig_argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None) in _COMMANDS
        if arg.startswith("-m"):
            return arg[2:] in _COMMANDS
        if arg in ("-X", "-W", "--check-hash-based-pycs"):
            next(args, None)  # the option's own value
        elif arg == "-c" or not arg.startswith("-"):
            return False  # a command or a script path: python's own options end here
    return False


def _register() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_pstar.fabric import PatrickStarFabricStrategy
    from lightning_pstar.strategy import PatrickStarStrategy

    PatrickStarStrategy.register_strategies(StrategyRegistry)  # idempotent (glue.register_names)
    PatrickStarFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)


if TYPE_CHECKING or not _started_as_command(getattr(sys, "orig_argv", [])):
    from lightning_pstar.callbacks import PatrickStarMonitor, plot_tide
    from lightning_pstar.config import LossScaleConfig, Placement, PStarConfig
    from lightning_pstar.fabric import PatrickStarFabricStrategy
    from lightning_pstar.planning.requirements import MemoryBudgetError
    from lightning_pstar.precision import PatrickStarFabricPrecision, PatrickStarPrecision
    from lightning_pstar.report import MemoryReport
    from lightning_pstar.strategy import PatrickStarStrategy

    _register()
else:

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'lightning_pstar' has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        _register()
        globals()[name] = value
        return value
