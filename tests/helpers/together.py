"""Start the one-process command lines of a test module together, and let each test wait for its own.

[Note: one-process runs started together] An example or a benchmark run in a subprocess is one interpreter that
imports torch and Lightning and works on one core (``OMP_NUM_THREADS=1``, tests/conftest.py), so on 2 cores one
run at a time leaves a core idle. A module whose tests each run such a command starts the commands of the tests
selected in this session together from a module-scoped fixture (:func:`selected_tests` says which); each test
then waits for its own (:meth:`Started.wait`) and checks it as before. Only commands that work on one core
belong here: a 2-rank run takes both cores, and a timing the test asserts on would suffer from the neighbour.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["Command", "Started", "selected_tests"]

HANG_S = 600.0
"""A guard against a hung run, counted from when the test starts waiting; not a speed check."""


@dataclass(kw_only=True)
class Command:
    """One command line to start: its arguments, environment (None: this process's) and working directory."""

    args: Sequence[str]
    env: Mapping[str, str] | None = None
    cwd: Path | None = None


def selected_tests(request: pytest.FixtureRequest) -> set[str]:
    """The names (without parameters) of the tests of the requesting module that this session runs."""
    module = request.module
    return {item.originalname for item in request.session.items if getattr(item, "module", None) is module}


class Started:
    """The commands, by name, started at construction; :meth:`close` kills those nobody waited for."""

    def __init__(self, commands: Mapping[str, Command]) -> None:
        self._procs: dict[str, subprocess.Popen[str]] = {}
        try:
            for name, command in commands.items():
                self._procs[name] = subprocess.Popen(
                    list(command.args),
                    cwd=command.cwd,
                    env=None if command.env is None else dict(command.env),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
        except BaseException:
            self.close()
            raise

    def wait(self, name: str, timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
        """The finished run ``name`` (killed after ``timeout`` seconds of waiting: the test then fails on it)."""
        proc = self._procs.pop(name)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n[killed after waiting {timeout:.0f} s for it]"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        for proc in self._procs.values():  # runs whose test never waited for them (a failed or interrupted session)
            proc.kill()
            proc.communicate()
        self._procs.clear()
