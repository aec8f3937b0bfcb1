"""lightning_pstar.host_malloc ([Note: host malloc]): what PatrickStar tells glibc on a CPU run, once per process, and
when the engine does it. mallopt itself is replaced by a recorder (the real one is the process's, for every test)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric

from lightning_pstar import PatrickStarStrategy, glue, host_malloc
from lightning_pstar.fabric import PatrickStarFabricStrategy
from tests.helpers import FlatGPT, TinyLM, make_loader, make_trainer


class _Mallopt:
    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.result = result

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.result


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_malloc, "_applied", None)  # as in a new process


def test_cached_sets_both_thresholds_once_per_process(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    mallopt = _Mallopt()
    monkeypatch.setattr(host_malloc, "_mallopt", lambda: mallopt)
    assert host_malloc.keep_freed_host_memory({}) and host_malloc.keep_freed_host_memory({})
    # glibc's M_MMAP_THRESHOLD (-3) and M_TRIM_THRESHOLD (-1), each once: the second call changes nothing
    assert mallopt.calls == [(-3, 32 * 2**20), (-1, 2**30)]


def test_a_libc_without_mallopt_is_left_alone_with_a_warning(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(host_malloc, "_mallopt", lambda: None)
    with caplog.at_level(logging.WARNING, logger="lightning_pstar.host_malloc"):
        assert not host_malloc.keep_freed_host_memory({})
    assert "no mallopt" in caplog.text and "memory.host_malloc='system'" in caplog.text


def test_a_refused_setting_reports_that_it_is_not_in_effect(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_malloc, "_mallopt", lambda: _Mallopt(result=0))
    assert not host_malloc.keep_freed_host_memory({})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")
def test_the_real_libc_of_this_machine_accepts_it() -> None:
    """glibc (the CI's and every Linux wheel's C library) has mallopt and takes both values (what every CPU fit
    of this suite sets in its process anyway)."""
    mallopt = host_malloc._mallopt()
    assert mallopt is not None and mallopt(-3, 32 * 2**20) == 1 and mallopt(-1, 2**30) == 1


@pytest.mark.parametrize(
    ("environ", "reason"),
    [
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ set in the environment"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}, "GLIBC_TUNABLES set in the environment"),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "jemalloc preloaded (LD_PRELOAD)"),
    ],
)
def test_malloc_the_user_chose_is_left_alone(
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    environ: dict[str, str],
    reason: str,
) -> None:
    mallopt = _Mallopt()
    monkeypatch.setattr(host_malloc, "_mallopt", lambda: mallopt)
    with caplog.at_level(logging.DEBUG, logger="lightning_pstar.host_malloc"):
        assert not host_malloc.keep_freed_host_memory(environ)
    assert mallopt.calls == [] and reason in caplog.text and not host_malloc.applied()


def test_glibc_tunables_for_something_else_do_not_count(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    mallopt = _Mallopt()
    monkeypatch.setattr(host_malloc, "_mallopt", lambda: mallopt)
    assert host_malloc.keep_freed_host_memory({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "LD_PRELOAD": "libfoo.so"})
    assert len(mallopt.calls) == 2 and host_malloc.applied()


def test_a_half_taken_setting_says_what_is_in_effect(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class _TakesMmapOnly(_Mallopt):
        def __call__(self, param: int, value: int) -> int:
            super().__call__(param, value)
            return 1 if param == -3 else 0

    monkeypatch.setattr(host_malloc, "_mallopt", _TakesMmapOnly)
    with caplog.at_level(logging.WARNING, logger="lightning_pstar.host_malloc"):
        assert not host_malloc.keep_freed_host_memory({})
    assert "took the mmap threshold" in caplog.text and "refused the trim threshold" in caplog.text


def test_system_after_cached_in_one_process_says_it_cannot_undo_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(host_malloc, "_applied", True)  # an earlier run of this process kept freed memory
    with caplog.at_level(logging.WARNING, logger="lightning_pstar.glue"):
        trainer = make_trainer(strategy=PatrickStarStrategy(host_malloc="system"), max_steps=1)
        trainer.fit(TinyLM(), make_loader())
    assert "memory.host_malloc='system'" in caplog.text and "no way back" in caplog.text


def _record_the_switch(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The engine's calls of ``keep_freed_host_memory`` (recorded, not made)."""
    calls: list[int] = []
    monkeypatch.setattr(glue, "keep_freed_host_memory", lambda: calls.append(1) or True)
    return calls


def _options(option: str | None) -> dict[str, Any]:
    return {} if option is None else {"host_malloc": option}


@pytest.mark.parametrize(("option", "applied"), [(None, True), ("cached", True), ("system", False)])
def test_a_cpu_run_keeps_freed_host_memory_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, option: str | None, applied: bool
) -> None:
    calls = _record_the_switch(monkeypatch)
    trainer: L.Trainer = make_trainer(strategy=PatrickStarStrategy(**_options(option)), max_steps=1)
    trainer.fit(TinyLM(), make_loader())
    assert trainer.global_step == 1 and trainer.strategy.root_device == torch.device("cpu")
    assert calls == ([1] if applied else [])


@pytest.mark.parametrize(("option", "applied"), [(None, True), ("system", False)])
def test_a_fabric_cpu_run_goes_through_the_same_switch(
    monkeypatch: pytest.MonkeyPatch, option: str | None, applied: bool
) -> None:
    calls = _record_the_switch(monkeypatch)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy(**_options(option)))
    fabric.launch()
    fabric.setup_module(FlatGPT())
    assert calls == ([1] if applied else [])
