"""Unit tests of lightning_pstar.runtime.state: the transition table and its guard."""

from __future__ import annotations

import itertools

import pytest

from lightning_pstar.runtime.state import (
    ALLOWED_TRANSITIONS,
    ChunkState,
    GradLocation,
    InvalidTransitionError,
    MicroBatch,
    Phase,
    TensorState,
    Tier,
    check_transition,
)

_ALL_PAIRS = list(itertools.product(TensorState, TensorState))
_ALLOWED = sorted(ALLOWED_TRANSITIONS, key=lambda p: (p[0].value, p[1].value))
_FORBIDDEN = [p for p in _ALL_PAIRS if p not in ALLOWED_TRANSITIONS]


def _id(pair: tuple[TensorState, TensorState]) -> str:
    return f"{pair[0].value}->{pair[1].value}"


def test_table_only_holds_tensor_states_and_is_a_strict_subset() -> None:
    assert all(isinstance(a, TensorState) and isinstance(b, TensorState) for a, b in ALLOWED_TRANSITIONS)
    assert 0 < len(ALLOWED_TRANSITIONS) < len(_ALL_PAIRS)
    assert len(_ALLOWED) + len(_FORBIDDEN) == len(TensorState) ** 2 == 25


def test_table_contents() -> None:
    """The table as the engine relies on it (a change here must be deliberate)."""
    T = TensorState
    assert ALLOWED_TRANSITIONS == {
        (T.FREE, T.HOLD),
        (T.HOLD, T.COMPUTE),
        (T.HOLD_AFTER_FWD, T.COMPUTE),
        (T.COMPUTE, T.COMPUTE),
        (T.COMPUTE, T.HOLD_AFTER_FWD),
        (T.COMPUTE, T.HOLD),
        (T.COMPUTE, T.HOLD_AFTER_BWD),
        (T.HOLD_AFTER_FWD, T.HOLD_AFTER_BWD),
        (T.HOLD, T.HOLD_AFTER_BWD),
        (T.HOLD_AFTER_FWD, T.HOLD),
        (T.HOLD_AFTER_BWD, T.HOLD),
        (T.HOLD, T.HOLD),
    }


@pytest.mark.parametrize("pair", _ALLOWED, ids=_id)
def test_allowed_transitions_pass(pair: tuple[TensorState, TensorState]) -> None:
    check_transition(pair[0], pair[1], what="parameter 'w'")


@pytest.mark.parametrize("pair", _FORBIDDEN, ids=_id)
def test_every_other_transition_raises(pair: tuple[TensorState, TensorState]) -> None:
    current, new = pair
    with pytest.raises(InvalidTransitionError, match=rf"{current.value} -> {new.value} for parameter 'w' \(chunk 3\)"):
        check_transition(current, new, what="parameter 'w' (chunk 3)")


def test_invalid_transition_error_is_a_runtime_error() -> None:
    assert issubclass(InvalidTransitionError, RuntimeError)


@pytest.mark.parametrize(
    "pair",
    [
        (TensorState.HOLD_AFTER_BWD, TensorState.COMPUTE),
        (TensorState.COMPUTE, TensorState.FREE),
        (TensorState.HOLD, TensorState.FREE),
        (TensorState.FREE, TensorState.COMPUTE),
    ],
    ids=_id,
)
def test_documented_forbidden_transitions(pair: tuple[TensorState, TensorState]) -> None:
    assert pair not in ALLOWED_TRANSITIONS


def test_gradient_read_as_weight_has_a_hint() -> None:
    with pytest.raises(InvalidTransitionError) as info:
        check_transition(TensorState.HOLD_AFTER_BWD, TensorState.COMPUTE, what="parameter 'lm_head.weight'")
    message = str(info.value)
    assert "hold_after_bwd -> compute" in message
    assert "'lm_head.weight'" in message
    assert "gradient" in message
    assert "HINT:" in message


@pytest.mark.parametrize(
    "pair", [p for p in _FORBIDDEN if p != (TensorState.HOLD_AFTER_BWD, TensorState.COMPUTE)], ids=_id
)
def test_other_forbidden_transitions_have_no_gradient_hint(pair: tuple[TensorState, TensorState]) -> None:
    with pytest.raises(InvalidTransitionError) as info:
        check_transition(pair[0], pair[1], what="x")
    assert "HINT" not in str(info.value)


def test_enums_are_string_valued() -> None:
    assert Tier("device") is Tier.DEVICE and Tier("host") is Tier.HOST
    assert {s.value for s in ChunkState} == {"released", "compute", "hold"}
    assert Phase("eval") is Phase.EVAL and Phase.BACKWARD.training and not Phase.EVAL.training
    assert MicroBatch("accumulating") is MicroBatch.ACCUMULATING
    assert TensorState("hold_after_bwd") is TensorState.HOLD_AFTER_BWD


def test_grad_location_combines_both_places() -> None:
    both = GradLocation.PARAM_SLOT | GradLocation.GRAD_CHUNK
    assert GradLocation.PARAM_SLOT in both and GradLocation.GRAD_CHUNK in both
    assert GradLocation.PARAM_SLOT not in GradLocation.NONE and not GradLocation.NONE
    assert both & ~GradLocation.PARAM_SLOT is GradLocation.GRAD_CHUNK
