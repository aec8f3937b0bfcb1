"""Writes outside a forward in bf16-mixed on CUDA ([Note: writes outside a forward] in runtime/outside_writes.py):
the param slot lives on the device and its fp32 master on the host (a budget offloads it), and the comparison
crosses the two. Skipped without CUDA."""

from __future__ import annotations

import pytest

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.outside_writes import OutsideWriteError
from tests.helpers.models import TinyGPT
from tests.helpers.runs import LM, fit_steps
from tests.integration.test_outside_writes import WritesAt, _frozen_block

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("frozen", [False, True])
def test_a_write_after_the_step_is_refused_on_cuda(frozen: bool) -> None:
    strategy = PatrickStarStrategy(optimizer_placement="host", chunk_size=4096)
    with pytest.raises(OutsideWriteError, match="written in place outside"):
        fit_steps(LM(_frozen_block), strategy, precision="bf16-mixed", steps=5, accelerator="cuda",
                  callbacks=[WritesAt("on_train_batch_end", frozen=frozen)])  # fmt: skip


def test_a_write_while_the_slot_holds_the_gradient_is_kept_on_cuda() -> None:
    writes = WritesAt("on_before_optimizer_step", value=0.0)
    strategy = PatrickStarStrategy(optimizer_placement="host", chunk_size=4096)
    run = fit_steps(LM(TinyGPT), strategy, precision="bf16-mixed", steps=4, accelerator="cuda", callbacks=[writes])
    assert float(run.final["net.lm_head.weight"].abs().max()) <= 1.5 * 3e-3
