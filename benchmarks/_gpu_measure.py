"""What benchmarks/gpu_check.py measures inside one training run (the worker's side; not a public module).

:class:`Measure` times every optimizer step (all its micro-batches: gradient accumulation), and after the timed
steps runs one more step as the *breakdown step*: synchronised at the phase boundaries (forward, backward, the
optimizer step) and profiled, so its parts add up to its own time (which exceeds the timed median by the cost of
profiling). From its profile: the host<->device copies (bytes, and device time), the host Adam (CPU time of
torch's fused Adam kernels on host tensors), and the host waiting for the device (``cudaStreamSynchronize`` /
``cudaEventSynchronize``; the boundary synchronisations use ``cudaDeviceSynchronize`` and are not counted). At
``on_train_end`` -- before the strategy's teardown -- it reads the peaks (RSS, CUDA allocated and reserved) and
hands the result to ``report``, which prints it at once: a run killed in its teardown has already reported.
"""

from __future__ import annotations

import json
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

__all__ = ["Measure", "trace_figures"]

_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize")
_HOST_ADAM = ("aten::_fused_adamw_", "aten::_fused_adam_")


def trace_figures(events: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """From a chrome trace's events: bytes and device seconds of host<->device copies, CPU seconds of host Adam,
    seconds the host waited on the device."""
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoD" not in e.get("name", "")]
    adam = [e for e in events if e.get("cat") == "cpu_op" and e.get("name") in _HOST_ADAM]
    waits = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in _WAITS]
    return {
        "moved_bytes_per_step": sum(int(e.get("args", {}).get("bytes", 0)) for e in copies) if copies else None,
        "transfers_s": sum(float(e.get("dur", 0)) for e in copies) / 1e6 if copies else None,
        "host_adam_s": sum(float(e.get("dur", 0)) for e in adam) / 1e6 if adam else None,
        "waits_s": sum(float(e.get("dur", 0)) for e in waits) / 1e6,
    }


class Measure(L.Callback):
    """Step times, the breakdown step and the peaks, for ``warmup`` + ``timed`` + 1 optimizer steps."""

    def __init__(self, *, warmup: int, timed: int, profile: bool, report: Callable[[dict[str, Any]], None]) -> None:
        self.warmup = warmup
        self.timed = timed
        self.profile = profile
        self.report = report
        self.step_times: list[float] = []  # per optimizer step, every micro-batch included
        self.phases = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
        self.figures: dict[str, Any] = {}
        self.extra: Callable[[L.Trainer], dict[str, Any]] = lambda trainer: {}
        self._step_start: float | None = None
        self._mark = 0.0
        self._profiler: torch.profiler.profile | None = None

    def _now(self, trainer: L.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    @property
    def _breakdown(self) -> bool:
        return len(self.step_times) == self.warmup + self.timed

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        now = self._now(trainer)
        if self._step_start is None:
            self._step_start = now
            if self._breakdown and self.profile:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if trainer.strategy.root_device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self._profiler = torch.profiler.profile(activities=activities)
                self._profiler.__enter__()
        self._mark = now

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._phase(trainer, "forward_s")

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._phase(trainer, "backward_s")

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._mark = self._now(trainer) if self._breakdown else self._mark

    def _phase(self, trainer: L.Trainer, name: str) -> None:
        if self._breakdown:
            now = self._now(trainer)
            self.phases[name] += now - self._mark
            self._mark = now

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if (i + 1) % trainer.accumulate_grad_batches != 0:
            return  # a micro-batch inside the optimizer step
        now = self._now(trainer)
        assert self._step_start is not None
        if self._breakdown:
            self.phases["optimizer_s"] += now - self._mark
            if self._profiler is not None:
                self._profiler.__exit__(None, None, None)
                self.figures = _figures(self._profiler)
                self._profiler = None
        self.step_times.append(now - self._step_start)
        self._step_start = None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Before the strategy's teardown: the peaks, then the result, printed now."""
        cuda = trainer.strategy.root_device.type == "cuda"
        result: dict[str, Any] = {
            "step_times_s": self.step_times,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
            "peak_cuda_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_cuda_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "pinned_bytes": torch.cuda.host_memory_stats().get("reserved_bytes.peak") if cuda else None,
            "breakdown": {**self.phases, **self.figures},
            **self.extra(trainer),
        }
        self.report(result)


def _figures(prof: torch.profiler.profile) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return trace_figures(events)
