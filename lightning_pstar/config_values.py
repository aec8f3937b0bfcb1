"""The value checks behind :mod:`lightning_pstar.config`: byte counts, numbers, flags, enums, unknown names and
sections given as dicts.

Each check names the option, the value and what is accepted, so that every way of configuring the strategy
(keywords, a ``PStarConfig``, an OmegaConf or Hydra config) fails with the same message.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Mapping
from dataclasses import fields
from enum import Enum
from typing import TypeVar

__all__ = ["UnknownOptionError", "parse_bytes"]


class UnknownOptionError(ValueError, TypeError):
    """A misspelled or unknown option. A ``ValueError`` like every configuration error, and a ``TypeError``
    like Python's own error for an unexpected keyword argument, so callers catching either still catch it."""


# [Note: enums in OmegaConf]
# OmegaConf looks enum members up by *name* ("AUTO"), while YAML files and the strategy's keywords use the
# values ("auto"). Each member therefore has a lower-case alias equal to its value: OmegaConf structured
# configs accept `policy: auto`, and iteration (`list(Placement)`) still yields each member once.
# `from_mapping` converts by value itself, so it accepts exactly the values.
class _ValueEnum(str, Enum):
    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def coerce(cls: type[_E], value: object, *, name: str) -> _E:
        """``value`` (a member or its value string) as a member; anything else raises naming ``name``."""
        if isinstance(value, cls):
            return value
        for member in cls:
            if isinstance(value, str) and value == member.value:
                return member
        accepted = [m.value for m in cls]
        raise ValueError(f"`{name}` must be one of {accepted}, got {value!r}.")


_S = TypeVar("_S")
_E = TypeVar("_E", bound=_ValueEnum)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str) -> int:
    """Turn ``123``, ``"512MiB"``, ``"8GiB"`` or ``"1.5GB"`` into a positive number of bytes.

    ``name`` is the option being parsed; it is named in the error.
    """
    if isinstance(value, bool):
        raise ValueError(f"`{name}` must be a byte count such as 8589934592 or '8GiB', got {value!r}.")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _BYTES_RE.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"`{name}` must be a byte count such as 8589934592 or '8GiB', got {value!r}."
                " HINT: accepted units are B, KB, MB, GB, TB, KiB, MiB, GiB, TiB."
            )
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError(
            f"`{name}` must be an int or a string such as '8GiB' (a byte count), got {value!r}"
            f" ({type(value).__name__})."
        )
    if nbytes <= 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}.")
    return nbytes


# ---- value checks (each names the option, the value and what is accepted) ------------------------------------
def _number(value: object, *, name: str, accepted: str) -> float:
    # bool is an int in Python, but `device_fraction=True` is a mistake, never a number
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{name}` must be a number {accepted}, got {value!r} ({type(value).__name__}).")
    return float(value)


def _fraction(value: object, *, name: str) -> float:
    number = _number(value, name=name, accepted="in (0, 1]")
    if not 0 < number <= 1:
        raise ValueError(f"`{name}` must be in (0, 1], got {value!r}.")
    return number


def _flag(value: object, *, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be true or false, got {value!r}.")
    return value


def _byte_limit(value: object, *, name: str) -> int | str | None:
    if value is not None:
        parse_bytes(value, name=name)  # type: ignore[arg-type]  # parse_bytes names any other type
    return value  # type: ignore[return-value]


def _unknown(key: str, candidates: Mapping[str, str], *, hint: str) -> UnknownOptionError:
    """The error for an unknown option ``key`` (dotted): ``candidates`` maps accepted names to suggestions."""
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(candidates), n=1)
    guess = f" (did you mean {candidates[close[0]]}?)" if close else ""
    return UnknownOptionError(f"Unknown PatrickStar option `{key}`{guess}. HINT: {hint}")


def _section(value: object, cls: type[_S], *, name: str) -> _S:
    """``value`` as a ``cls`` section: an instance, or a mapping of its fields (unknown keys raise)."""
    if isinstance(value, Mapping):
        known = sorted(f.name for f in fields(cls))  # type: ignore[arg-type]
        for key in value:
            if key not in known:
                suggestions = {k: f"`{name}.{k}`" for k in known}
                raise _unknown(f"{name}.{key}", suggestions, hint=f"the options of `{name}` are {known}.")
        return cls(**value)
    if not isinstance(value, cls):
        raise ValueError(f"`{name}` must be a {cls.__name__} or a dict of its options, got {value!r}.")
    return value


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith("lightning_pstar"):
        frame, level = frame.f_back, level + 1
    return level
