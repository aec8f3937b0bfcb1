"""lightning_pstar: PatrickStar chunk-based memory management as a Lightning strategy.

Importing the package registers the strategy names ``"patrickstar"`` and ``"patrickstar_spawn"`` with
Lightning's Trainer and with Fabric, so ``Trainer(strategy="patrickstar")`` and ``Fabric(strategy="patrickstar")``
work after ``import lightning_pstar`` (the Fabric glue is :mod:`lightning_pstar.fabric`). A misspelled name
(``strategy="patrickstr"``) gets Lightning's own "invalid strategy name" error: Lightning checks the name
against its registry before any strategy code runs and offers no hook to suggest the close match.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_pstar.callbacks import PatrickStarMonitor, plot_tide
from lightning_pstar.config import LossScaleConfig, Placement, PStarConfig
from lightning_pstar.fabric import PatrickStarFabricPrecision, PatrickStarFabricStrategy
from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.report import MemoryReport
from lightning_pstar.strategy import PatrickStarStrategy

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

PatrickStarStrategy.register_strategies(StrategyRegistry)
PatrickStarFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
