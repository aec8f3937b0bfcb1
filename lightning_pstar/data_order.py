"""The data order at one rank: the batches ``strategy="auto"`` sees. The Trainer strategy turns Lightning's
``DistributedSampler`` injection off (:func:`keep_data_order`), the Fabric strategy gives no
``distributed_sampler_kwargs``; both for the reasons in [Note: one rank, auto's batches].
"""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["keep_data_order"]


def keep_data_order(trainer: pl.Trainer, world_size: int) -> None:
    """At one rank, see the batches ``strategy="auto"`` sees: no ``DistributedSampler`` is injected.

    [Note: one rank, auto's batches]
    Lightning injects a ``DistributedSampler`` for every ``DDPStrategy`` subclass when
    ``use_distributed_sampler`` is on (the default), even at world size 1, where it only reorders the data:
    for training it always shuffles (``shuffle=True`` whatever the loader's sampler; seed ``PL_GLOBAL_SEED``
    or 0), so a shuffled loader draws another permutation than ``auto``'s ``RandomSampler``, an unshuffled
    one is shuffled, and a user comparing against ``strategy="auto"`` sees different losses from identical
    weights. At one rank the Trainer's switch is turned off for this run (the only place Lightning reads it
    is ``_DataConnector._requires_distributed_sampler``); a ``DistributedSampler`` the user puts in a
    ``DataLoader`` is kept, as Lightning keeps it. Several ranks are left as ``ddp`` has them. A one-rank
    run that must see the global batches of a W-rank run (a W-rank checkpoint resumed at one rank) puts in
    ``DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)`` (the same seed): the permutation that
    W ranks split, rank r taking every W-th index from r.
    """
    if world_size == 1:
        trainer._accelerator_connector.use_distributed_sampler = False
