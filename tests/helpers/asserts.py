"""Parity assertions: losses against a reference, state dicts close or bitwise equal, evictions that happened.

Every assertion names what differs (the step, the tensor, by how much) and takes a ``what`` that says which run
it checks, so a failing parametrised test reads without a debugger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lightning_pstar import PatrickStarStrategy
from tests.helpers.runs import FitResult

LOSS_RTOL = 1e-5
"""32-true runs give plain Lightning's losses within this (they are bitwise equal on one machine)."""


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest ``|a_i - b_i| / |b_i|`` (lengths must match)."""
    assert len(a) == len(b), f"length mismatch: {len(a)} vs {len(b)}"
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def assert_losses_close(got: Sequence[float], ref: Sequence[float], *, rtol: float, what: str) -> None:
    """As many losses as the reference, each within ``rtol`` of it (relative to the reference)."""
    assert len(got) == len(ref), f"{what}: {len(got)} losses vs {len(ref)}"
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {i}: patrickstar {a!r} vs plain Lightning {b!r}"


def assert_states_close(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    *,
    what: str,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """The same keys, and every tensor of ``want`` close to ``got``'s (``torch.testing.assert_close``)."""
    assert sorted(got) == sorted(want), f"{what}: state_dict keys differ: {sorted(set(got) ^ set(want))}"
    for name, value in want.items():

        def message(detail: str, name: str = name) -> str:
            return f"{what}: final {name}: {detail}"

        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=message)


def assert_states_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], *, what: str) -> None:
    """The same keys, and every tensor bit for bit the same, in the same dtype."""
    assert sorted(got) == sorted(want), f"{what}: state_dict keys differ: {sorted(set(got) ^ set(want))}"
    for name, value in want.items():
        assert got[name].dtype == value.dtype, f"{what}: {name}: {got[name].dtype} vs {value.dtype}"
        assert torch.equal(got[name], value), f"{what}: {name} differs by {(got[name] - value).abs().max():.3e}"


def optimizer_state(result: FitResult) -> dict[str, torch.Tensor]:
    """The user's optimizer state after training (after the hand-back), flat: ``<index>/<field>`` -> tensor."""
    state = result.trainer.optimizers[0].state_dict()["state"]
    return {f"{i}/{k}": v for i, entry in state.items() for k, v in entry.items()}


def assert_runs_bitwise(got: FitResult, want: FitResult, what: str) -> None:
    """The same losses, final weights and optimizer states, bit for bit (one schedule against another)."""
    assert got.losses == want.losses, f"{what}: losses differ"
    assert_states_equal(got.final, want.final, what=f"{what}: weights")
    assert_states_equal(optimizer_state(got), optimizer_state(want), what=f"{what}: optimizer states")


def assert_same_run(got: FitResult, ref: FitResult, *, what: str, rtol: float = LOSS_RTOL) -> None:
    """Every loss within ``rtol`` of the reference, and the final weights (and buffers) close to it."""
    assert_losses_close(got.losses, ref.losses, rtol=rtol, what=what)
    assert_states_close(got.final, ref.final, what=what)


def assert_evicted(strategy: PatrickStarStrategy) -> None:
    """The device budget forced at least one eviction, and chunks never exceeded it."""
    report = strategy.memory_report()
    assert report.evictions > 0, f"the budget never forced an eviction:\n{report}"
    assert report.device_memory_limit is not None
    assert report.peak_device_chunk_bytes <= report.device_memory_limit, report
