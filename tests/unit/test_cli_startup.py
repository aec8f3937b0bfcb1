"""Issue 30: the command lines answer at once.

``python -m lightning_pstar.plan`` and ``python -m lightning_pstar.consolidate`` read their arguments before
Lightning is imported ([Note: command lines without Lightning] in ``lightning_pstar/__init__.py``): ``--help``
and a wrong argument finish without ``lightning`` among the imported modules. A file handed to ``consolidate``
is named as not a sharded directory (and said to be consolidated already when it is).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_pstar
from lightning_pstar.checkpoint.cli import main as consolidate_main

ROOT = Path(__file__).resolve().parents[2]


def _run_command(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime -m ...`` from the repository root; the result and the modules it imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, imported


def _lightning_modules(imported: set[str]) -> list[str]:
    return sorted(m for m in imported if m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")))


@pytest.mark.parametrize(
    ("argv", "status"),
    # a fresh interpreter each (torch's import): the quick subset runs one command per CLI and each exit status,
    # the full suite both answers of both commands (the same parse-before-import path)
    [
        pytest.param(("lightning_pstar.plan", "--help"), 0, marks=pytest.mark.slow),
        (("lightning_pstar.plan", "configs/model/gpt_small.yaml", "--device-memory", "lots"), 2),
        (("lightning_pstar.consolidate", "--help"), 0),
        pytest.param(("lightning_pstar.consolidate",), 2, marks=pytest.mark.slow),
    ],
)
def test_commands_answer_without_importing_lightning(argv: tuple[str, ...], status: int) -> None:
    done, imported = _run_command(*argv)
    assert done.returncode == status, done.stderr[-2000:]
    assert "usage: python -m lightning_pstar." in done.stdout + done.stderr
    assert "lightning_pstar" in imported  # the measurement saw the package itself
    assert _lightning_modules(imported) == []


@pytest.mark.parametrize(
    ("orig_argv", "expected"),
    [
        (["python", "-m", "lightning_pstar.plan", "--help"], True),
        (["python", "-X", "importtime", "-m", "lightning_pstar.consolidate"], True),
        (["python", "-mlightning_pstar.plan"], True),
        (["python", "-m", "pytest", "-m", "lightning_pstar.plan"], False),
        (["python", "train.py", "-m", "lightning_pstar.plan"], False),
        (["python", "-c", "import lightning_pstar", "-m", "lightning_pstar.plan"], False),
        (["python"], False),
    ],
)
def test_only_the_commands_defer_the_registration(orig_argv: list[str], expected: bool) -> None:
    assert lightning_pstar._started_as_command(orig_argv) is expected


def test_consolidate_names_a_consolidated_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 0}, ckpt)
    with pytest.raises(SystemExit) as exit_info:
        consolidate_main([str(ckpt), str(tmp_path / "out.ckpt")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "is a file (already a consolidated checkpoint), not a sharded checkpoint directory" in err
    assert "meta.pt" not in err
    assert not (tmp_path / "out.ckpt").exists()


def test_consolidate_names_any_other_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    with pytest.raises(SystemExit) as exit_info:
        consolidate_main([str(text), str(tmp_path / "out.ckpt")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "is a file (not a torch checkpoint" in err and "not a sharded checkpoint directory" in err
    assert "HINT: pass the directory" in err
