"""The package's own metadata and registration agree with pyproject.toml and the README."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest

import lightning_pstar

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_pyprojects() -> None:
    match = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert match is not None
    assert lightning_pstar.__version__ == match.group(1)


def test_a_misspelled_strategy_name_gets_lightnings_own_error() -> None:
    """Documented in lightning_pstar/__init__.py: Lightning rejects the name before any strategy code runs."""
    with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='patrickstr'`"):
        L.Trainer(strategy="patrickstr", logger=False)
    assert isinstance(L.Trainer(strategy="patrickstar", logger=False).strategy, lightning_pstar.PatrickStarStrategy)
