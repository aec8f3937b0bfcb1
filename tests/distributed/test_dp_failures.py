"""A failing rank fails the whole run, quickly and with its own error text; a model that differs between
ranks fails at setup with the engine's error naming both ranks' figures. Nothing may hang.

"Quickly" is measured from the moment of the failure (the failing rank writes its ``time.monotonic()``), not
from the start, so that slow imports on a busy machine do not count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import WorkerFailure, run_isolated, run_ranks
from workloads import N_EMBD, RunSpec, fit_in_driver, fit_in_rank, num_params

pytestmark = pytest.mark.slow  # every test here trains on spawned ranks: tens of seconds each

FAIL_STEP = 3
WITHIN_S = 60.0
"""Every process must have ended this long after the failure."""
INJECTED = f"injected failure on rank 1 at step {FAIL_STEP}"


def _seconds_after_failure(spec: RunSpec, ended_at: float) -> float:
    assert spec.failure_time_path.exists(), "the failure was never injected"
    return ended_at - float(spec.failure_time_path.read_text())


def test_exception_on_one_rank_ends_every_rank(tmp_path: Path) -> None:
    """Rank 1 raises in ``training_step``; rank 0, which waits for it in a collective, must end by itself."""
    spec = RunSpec(tag="fail", out_dir=str(tmp_path), steps=10, accumulate=2, fail_rank=1, fail_step=FAIL_STEP)
    # grace: how long the launcher lets the other rank run after the first failure before it kills it
    with pytest.raises(WorkerFailure, match=INJECTED) as info:
        run_ranks(fit_in_rank, 2, [spec], grace=WITHIN_S)
    for outcome in info.value.outcomes:
        assert not outcome.killed, f"rank {outcome.rank} did not end by itself:\n{info.value}"
        assert outcome.exitcode != 0, f"rank {outcome.rank} reported success"
        assert _seconds_after_failure(spec, outcome.ended_at) < WITHIN_S, outcome.describe()
    assert "RuntimeError: " + INJECTED in info.value.outcome(1).error
    assert not spec.record_path(0).exists() and not spec.record_path(1).exists()


def test_exception_on_one_rank_under_the_spawn_launcher(tmp_path: Path) -> None:
    """The same through ``patrickstar_spawn``: Lightning's launcher re-raises rank 1's error in the main process."""
    spec = RunSpec(
        tag="fail",
        out_dir=str(tmp_path),
        strategy="patrickstar_spawn",
        steps=10,
        accumulate=2,
        fail_rank=1,
        fail_step=FAIL_STEP,
    )
    with pytest.raises(WorkerFailure, match=INJECTED) as info:
        run_isolated(fit_in_driver, [spec])
    (driver,) = info.value.outcomes
    assert not driver.killed, driver.describe()
    assert _seconds_after_failure(spec, driver.ended_at) < WITHIN_S, driver.describe()


def test_model_that_differs_between_ranks_fails_at_setup(tmp_path: Path) -> None:
    wide = N_EMBD + 16
    spec = RunSpec(tag="mismatch", out_dir=str(tmp_path), n_embd_by_rank={1: wide})
    with pytest.raises(WorkerFailure) as info:
        run_ranks(fit_in_rank, 2, [spec], grace=WITHIN_S)
    narrow_elems, wide_elems = f"{num_params(N_EMBD):,}", f"{num_params(wide):,}"
    for outcome in info.value.outcomes:
        assert not outcome.killed, f"rank {outcome.rank} did not end by itself:\n{info.value}"
        error = outcome.error
        assert "ValueError: The model differs between ranks" in error, error
        assert "rank 0 has" in error and "rank 1 has" in error, error
        assert narrow_elems in error and wide_elems in error, error
        assert "HINT:" in error
    assert not spec.record_path(0).exists() and not spec.record_path(1).exists()
