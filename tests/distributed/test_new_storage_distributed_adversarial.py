"""Two ranks: a parameter given new storage mid-run (``p.data = W``) cannot be adopted (its fp32 master and optimizer
states live on one rank): both ranks must raise NewStorageError naming it, with the weights of before the
assignment, and neither may hang in a collective the other never joins.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from launch import run_ranks

pytestmark = pytest.mark.slow  # trains on spawned ranks

STEPS = 4
ASSIGN_AT = 2


def _assign_in_rank(rank: int, world_size: int, hook: str) -> dict[str, Any]:
    from lightning_pstar import PatrickStarStrategy
    from lightning_pstar.runtime.new_storage import NewStorageError
    from tests.helpers.data import make_loader
    from tests.helpers.runs import LM, quiet_trainer_options
    from tests.integration.test_new_storage_adversarial import E, Net

    seen: dict[str, Any] = {}

    class Assign(L.Callback):
        def _assign(self, pl_module: L.LightningModule) -> None:
            net = pl_module.net  # type: ignore[attr-defined]
            state = pl_module.trainer.strategy.lightning_module_state_dict()
            seen["before"] = state.get("net.lin.weight")  # rank 0's consolidated state; others get {}
            net.lin.weight.data = torch.full((E, E), 0.5)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if hook == "batch_start" and idx == ASSIGN_AT:
                self._assign(pl_module)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if hook == "batch_end" and args[-1] == ASSIGN_AT:
                self._assign(pl_module)

    module = LM(Net)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=PatrickStarStrategy(chunk_size=256),
        precision="32-true",
        max_steps=STEPS,
        callbacks=[Assign()],
        limit_val_batches=0,
        **quiet_trainer_options(),
    )
    try:
        trainer.fit(module, train_dataloaders=make_loader(n_seq=4 * world_size * STEPS))
    except NewStorageError as err:
        after = module.net.lin.weight.detach().clone()
        return {"error": str(err), "after": after, "before": seen["before"]}
    return {"error": None}


@pytest.mark.parametrize("hook", ["batch_start", "batch_end"])
def test_assignment_raises_on_both_ranks_without_hanging(hook: str) -> None:
    results = run_ranks(_assign_in_rank, 2, hook, timeout=240)
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} trained on"
        assert "'net.lin.weight'" in result["error"] and "several ranks" in result["error"], result["error"]
        assert "HINT" in result["error"]
        # the consolidated state is rank 0's; every rank gets the weights of before the assignment back
        assert torch.equal(result["after"], results[0]["before"]), f"rank {rank}: not the weight before the assignment"
