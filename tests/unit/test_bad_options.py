"""Every option of PStarConfig given a wrong type or range is refused (issue 14), by every way of giving it.

Each (option, value) below goes in three ways: the strategy's flat keyword (``PatrickStarStrategy(chunk_size=...)``),
the nested config (``PStarConfig(chunks={"size": ...})``) and a mapping as a YAML/Hydra file gives it
(``PStarConfig.from_mapping``). Each must raise a ``ValueError`` at construction (before anything is built) whose
message names the option as it was given, the value (its ``repr``) and what is accepted ("must be ..." or "one
of ..."). The loss-scale fields go the same way, as ``loss_scale={...}`` and as ``LossScaleConfig(...)``.

OmegaConf's structured schema converts a few values exactly before the checks see them (the string "0.5" to
0.5, "yes" and 1 to True, as it does for every typed config file): those are accepted from a mapping only, and
checked to arrive as exactly that value.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from lightning_pstar import LossScaleConfig, PatrickStarStrategy, PStarConfig
from lightning_pstar.config import FLAT_OPTIONS

BAD: dict[str, list[Any]] = {
    "chunk_size": [0, -5, 10**13, 2**31 + 1, 2.5, "big", "1e3", None, True, [1]],
    "cpu_embedding": ["yes", 1, None, 0.5],
    "bucket_bytes": [-1, "-1MiB", "8 parsecs", "0 parsecs", 1.5, True, False, None, [1]],
    "device_memory_limit": [0, -1, "0GiB", "-1GiB", "8 parsecs", 1.5, True, [1]],
    "host_memory_limit": [0, -1, "8 parsecs", 1.5, True, [1]],
    "device_memory_fraction": [0, 1.5, -0.1, "0.5", None, True, math.nan, math.inf],
    "host_memory_fraction": [0, 1.5, "0.5", None, True, math.nan],
    "static_chunk_fraction": [0, 1.5, "0.5", None, math.nan],
    "warmup_chunk_fraction": [0, 1.5, "0.5", None, math.nan],
    "placement": ["fast", "AUTO ", 1, None, True],
    "optimizer_placement": ["gpu", "HOST ", 1, None, True],
    "optimizer_overlap": ["fast", "on", 0, None, True],
    "frozen_master": ["yes", 1, None],
    "nonfinite": ["crash", "RAISE", 1, None, True],
    "loss_scale": ["big", 5, [1]],
    "checkpoint": ["zip", None, 1, True],
    "host_malloc": ["fast", "CACHED", "", None, 1, True],
    "hand_back_weights": ["no", 0, None],
    "disk_path": ["", "  ", 5, True, [1], 1.5],
    "disk_memory_limit": [0, -1, "0GiB", "8 parsecs", 1.5, True, [1]],
}
BAD_LOSS_SCALE: dict[str, list[Any]] = {
    "initial_scale": [math.inf, math.nan, "big", 0, -1, None, True],
    "growth_factor": [1, 0.5, math.inf, "2", None, math.nan],
    "backoff_factor": [0, 1, 1.5, "0.5", None, math.nan],
    "growth_interval": [2.5, 0, -1, "10", True, None, 10.0],
    "min_scale": [0, 2.0**17, "1", None, math.nan, -1],
}
# converted exactly by OmegaConf's schema from a mapping (see the module docstring): option -> value -> result
CONVERTED_FROM_MAPPING: dict[tuple[str, str], Any] = {
    ("chunks.cpu_embedding", "'yes'"): True,
    ("chunks.cpu_embedding", "1"): True,
    ("mixed_precision.frozen_master", "'yes'"): True,
    ("mixed_precision.frozen_master", "1"): True,
    ("hand_back_weights", "'no'"): False,
    ("hand_back_weights", "0"): False,
    ("memory.device_fraction", "'0.5'"): 0.5,
    ("memory.host_fraction", "'0.5'"): 0.5,
    ("placement.static_chunk_fraction", "'0.5'"): 0.5,
    ("placement.warmup_chunk_fraction", "'0.5'"): 0.5,
    ("memory.disk_path", "5"): "5",
    ("memory.disk_path", "True"): "True",
    ("memory.disk_path", "1.5"): "1.5",
}
CASES = [(option, value) for option, values in BAD.items() for value in values]
LOSS_SCALE_CASES = [(field, value) for field, values in BAD_LOSS_SCALE.items() for value in values]


def assert_refused(build: Any, name: str, value: Any) -> str:
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert f"`{name}" in message, (name, message)
    assert repr(value) in message, (value, message)
    assert "must" in message or "one of" in message, message  # what is accepted
    return message


def _nested(path: str, value: Any) -> dict[str, Any]:
    section, _, leaf = path.partition(".")
    return {section: {leaf: value}} if leaf else {section: value}


def _get(config: PStarConfig, path: str) -> Any:
    obj: Any = config
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("option", "value"), CASES, ids=[f"{o}={v!r}" for o, v in CASES])
def test_bad_option_is_refused_naming_option_value_and_what_is_accepted(option: str, value: Any) -> None:
    path = FLAT_OPTIONS[option]
    assert_refused(lambda: PatrickStarStrategy(**{option: value}), option, value)
    assert_refused(lambda: PStarConfig(**_nested(path, value)), path, value)
    converted = CONVERTED_FROM_MAPPING.get((path, repr(value)), ...)
    if converted is ...:
        assert_refused(lambda: PStarConfig.from_mapping(_nested(path, value)), path, value)
    else:
        got = _get(PStarConfig.from_mapping(_nested(path, value)), path)
        assert got == converted and type(got) is type(converted), (path, value, got)


@pytest.mark.parametrize(("field", "value"), LOSS_SCALE_CASES, ids=[f"{f}={v!r}" for f, v in LOSS_SCALE_CASES])
def test_bad_loss_scale_field_is_refused_naming_it(field: str, value: Any) -> None:
    assert_refused(lambda: PatrickStarStrategy(loss_scale={field: value}), f"loss_scale.{field}", value)
    assert_refused(lambda: LossScaleConfig(**{field: value}), f"mixed_precision.loss_scale.{field}", value)


def test_the_sweep_covers_every_option() -> None:
    assert sorted(BAD) == sorted(FLAT_OPTIONS)
    assert sorted(BAD_LOSS_SCALE) == sorted(vars(LossScaleConfig()))
    print(f"bad options tried: {len(CASES)} x 3 ways + {len(LOSS_SCALE_CASES)} x 2 ways")
