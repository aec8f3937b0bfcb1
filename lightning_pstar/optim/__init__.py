"""The optimizer facade: the user's Adam, AdamW or SGD stepped family by family on the chunks."""

from lightning_pstar.optim.optimizer import SUPPORTED_OPTIMIZERS, ChunkedOptimizer, GradientPolicy, NonFiniteStepError

__all__ = ["SUPPORTED_OPTIMIZERS", "ChunkedOptimizer", "GradientPolicy", "NonFiniteStepError"]
