"""Trainer callbacks the engine cannot follow, refused before anything changes.

[Note: callbacks refused at setup_environment]
The strategy's ``setup_environment`` runs before any callback's ``setup`` hook, so a refusal there leaves the
model exactly as the user built it. ``BaseFinetuning`` (``BackboneFinetuning`` and user subclasses) freezes
modules in its ``setup`` and, epochs later, unfreezes them and calls ``optimizer.add_param_group``; chunk
families and their optimizer states are laid out once at setup, so the run would train for epochs and then
fail in the middle. Lightning refuses ``BatchSizeFinder`` for every ``DDPStrategy`` subclass itself; it is
named here too so the message says what to do instead.

In 16-mixed and bf16-mixed the model's parameters are compute-dtype copies of the fp32 masters, and the masters are
the weights that steps, checkpoints and the model handed back at the end hold. ``StochasticWeightAveraging`` writes
the averaged weights into the parameters in its ``on_train_end``, outside any forward, so only the rounded copies
would hold them and the trained model would silently be the last step's, not the average: refused in mixed
precision (in 32-true the parameters are the masters and it matches plain Lightning).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.callbacks import BaseFinetuning, BatchSizeFinder, Callback, StochasticWeightAveraging

__all__ = ["refuse_unsupported_callbacks"]


def refuse_unsupported_callbacks(callbacks: Sequence[Callback], *, precision: str) -> None:
    """Raise a ``ValueError`` naming the first callback in ``callbacks`` the strategy cannot train with in
    ``precision`` (the Trainer's precision string)."""
    for callback in callbacks:
        name = type(callback).__name__
        if isinstance(callback, StochasticWeightAveraging) and precision != "32-true":
            raise ValueError(
                f"`{name}` writes the averaged weights into the parameters at the end of training, and in"
                f" precision={precision!r} PatrickStar's parameters are rounded copies of fp32 master weights, which"
                " the write would not reach (the model would silently keep the last step's weights). Nothing was"
                " changed. HINT: train with precision='32-true' to use stochastic weight averaging, or remove the"
                " callback."
            )
        if isinstance(callback, BaseFinetuning):
            raise ValueError(
                f"`{name}` (a `BaseFinetuning` callback) unfreezes modules during training and adds their"
                " parameters with `optimizer.add_param_group`, and PatrickStar lays out chunks and optimizer"
                " states once at setup, so parameter groups cannot be added mid-training. Nothing was changed."
                " HINT: fine-tune in two runs: `fit` with the backbone frozen (requires_grad=False before `fit`),"
                " then a new Trainer and `fit` with it unfrozen and in `configure_optimizers` (a group with its"
                " own lr), loading the first run's weights; or remove the callback."
            )
        if isinstance(callback, BatchSizeFinder):
            raise ValueError(
                f"`{name}` retries training steps with growing batch sizes until one runs out of memory,"
                " and Lightning supports it only for non-distributed strategies (PatrickStar is a DDPStrategy)."
                " Nothing was changed. HINT: find the batch size with `strategy='auto'` and the same model, then"
                " train under PatrickStar with that batch size (remove the callback)."
            )
