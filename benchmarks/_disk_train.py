"""Part 2 of ``benchmarks/disk_tier.py``: the demo GPT trained with a host budget below its optimizer states.

The demo GPT (``--n-layer`` x ``--n-embd``, fused AdamW, ``--precision``) trains ``--train-steps`` steps on the
simulated device with every optimizer-state family stepped on the host (``optimizer_placement="host"``) and a host
budget of ``--host-fraction`` of its fp32 masters and optimizer states: once without the disk tier (refused at setup,
with the figures), once with it (``disk_path`` = the measured directory). Printed: model data, the host budget, the
families on disk, peak RSS of the process, bytes read and written per iteration, achieved GB/s, page-cache growth,
and the optimizer step's median time against the longer of its disk time and its Adam time (the pipeline overlaps
them: the issue's target is at most 1.15x). Not a public module.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.config import parse_bytes
from lightning_pstar.demos import GPTConfig, gpt_num_params
from lightning_pstar.demos.module import GPTLightningModule
from lightning_pstar.planning.requirements import MemoryBudgetError

QUIET = {
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


class StepProbe(L.Callback):
    """Per optimizer step (after the first, the warm-up): its wall time (``on_before_optimizer_step`` to the batch's
    end), the disk tier's busy seconds and the pipeline's Adam seconds during it."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.disk_s: list[float] = []
        self.adam_s: list[float] = []
        self._start: tuple[float, float, float] | None = None
        self.report: Any = None

    @staticmethod
    def _counters(trainer: L.Trainer) -> tuple[float, float]:
        manager = trainer.strategy._manager  # type: ignore[attr-defined]
        disk = manager.disk.store.stats().busy_seconds if manager.disk is not None else 0.0
        return disk, manager.pipeline.times.adam

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = (time.perf_counter(), *self._counters(trainer))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._start is None or trainer.global_step <= 1:
            self._start = None
            return
        t0, d0, a0 = self._start
        disk, adam = self._counters(trainer)
        self.step_s.append(time.perf_counter() - t0)
        self.disk_s.append(disk - d0)
        self.adam_s.append(adam - a0)
        self._start = None

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.report = trainer.strategy.memory_report()  # type: ignore[attr-defined]


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    return {"vocab_size": args.vocab, "block_size": args.block, "n_layer": args.n_layer, "n_head": args.n_head,
            "n_embd": args.n_embd}  # fmt: skip


def _module(args: argparse.Namespace) -> GPTLightningModule:
    """Built on the meta device and materialised chunk by chunk by the strategy (a model larger than RAM is never
    whole in fp32 in host memory)."""
    torch.manual_seed(0)
    return GPTLightningModule(**_sizes(args), meta_init=True)


def _loader(args: argparse.Namespace) -> DataLoader:
    n = (args.train_steps + 1) * args.batch_size
    x = torch.randint(0, args.vocab, (n, args.block), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=args.batch_size)


def _fit(
    args: argparse.Namespace, *, host_budget: int, device_budget: int, chunk_size: int, disk: str | None
) -> dict[str, Any]:
    options: dict[str, Any] = {"disk_path": disk} if disk is not None else {}
    strategy = PatrickStarStrategy(
        optimizer_placement="host",
        chunk_size=chunk_size,
        host_memory_limit=host_budget,
        device_memory_limit=device_budget,  # holds the model: the host budget bounds what the host step keeps there
        hand_back_weights=False,  # nothing reads the weights after the run (a model beyond RAM could not take them)
        **options,
    )
    probe = StepProbe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.train_steps,
        callbacks=[probe],
        **QUIET,
    )
    cached = cached_bytes()
    try:
        trainer.fit(_module(args), train_dataloaders=_loader(args))
    except MemoryBudgetError as err:
        return {"disk_tier": disk is not None, "completed": False, "refused": str(err).split(" HINT")[0]}
    report = probe.report
    step = statistics.median(probe.step_s) if probe.step_s else 0.0
    disk_s = statistics.median(probe.disk_s) if probe.disk_s else 0.0
    adam_s = statistics.median(probe.adam_s) if probe.adam_s else 0.0
    return {
        "disk_tier": disk is not None,
        "completed": True,
        "disk_families": report.disk_families,
        "disk_chunk_bytes": report.disk_chunk_bytes,
        "read_bytes_per_iteration": report.disk_read_bytes_per_iteration,
        "written_bytes_per_iteration": report.disk_written_bytes_per_iteration,
        "read_gbps": report.disk_read_gbps,
        "write_gbps": report.disk_write_gbps,
        "step_ms": 1e3 * step,
        "disk_ms": 1e3 * disk_s,
        "adam_ms": 1e3 * adam_s,
        "step_over_bound": step / max(disk_s, adam_s) if max(disk_s, adam_s) > 0 else 0.0,
        "page_cache_growth_bytes": cached_bytes() - cached,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def cached_bytes() -> int:
    """``Cached`` of ``/proc/meminfo``: the page cache."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def run_training(args: argparse.Namespace, disk_dir: str) -> dict[str, Any]:
    """Both runs (with the disk tier first, so the process's peak RSS is its own) and the model's figures."""
    params = gpt_num_params(GPTConfig(**_sizes(args)))
    state_bytes = params * (12 if args.precision != "32-true" else 8)  # fp32 master (mixed) and two Adam states
    host_budget = (
        parse_bytes(args.host_budget, name="--host-budget")
        if args.host_budget
        else int(args.host_fraction * state_bytes)
    )
    chunk_size = max(1024, -(-params // args.families))
    model_bytes = params * (2 + 12 if args.precision != "32-true" else 16)
    device_budget = (
        parse_bytes(args.device_budget, name="--device-budget") if args.device_budget else 4 * model_bytes + (256 << 20)
    )
    budgets = {"host_budget": host_budget, "device_budget": device_budget, "chunk_size": chunk_size}
    with_disk = _fit(args, **budgets, disk=disk_dir)
    without = _fit(args, **budgets, disk=None) if not args.skip_without else None
    return {
        "params": params,
        "precision": args.precision,
        "model_data_bytes": model_bytes,
        "optimizer_state_bytes": state_bytes,
        "host_budget_bytes": host_budget,
        "device_budget_bytes": device_budget,
        "physical_ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "chunk_size": chunk_size,
        "runs": [r for r in (with_disk, without) if r is not None],
    }


def print_training(result: dict[str, Any]) -> None:
    mib = 1 << 20
    print(
        f"\ndemo GPT, {result['params']:,} parameters, {result['precision']}: model data"
        f" {result['model_data_bytes'] / mib:.1f} MiB, optimizer states {result['optimizer_state_bytes'] / mib:.1f}"
        f" MiB, host budget {result['host_budget_bytes'] / mib:.1f} MiB, device budget"
        f" {result['device_budget_bytes'] / mib:.1f} MiB; model data / physical RAM"
        f" {result['model_data_bytes'] / result['physical_ram_bytes']:.2f}"
    )
    for r in result["runs"]:
        name = "with disk tier" if r["disk_tier"] else "without disk tier"
        if not r["completed"]:
            print(f"  {name}: refused at setup: {r['refused']}")
            continue
        per_it = (
            f"{(r['read_bytes_per_iteration'] or 0) / mib:.1f} / {(r['written_bytes_per_iteration'] or 0) / mib:.1f}"
        )
        print(
            f"  {name}: {r['disk_families']} families on disk ({r['disk_chunk_bytes'] / mib:.1f} MiB), peak RSS"
            f" {r['peak_rss_bytes'] / mib:.0f} MiB, read / written per iteration {per_it} MiB, read"
            f" {r['read_gbps']:.2f} GB/s, write {r['write_gbps']:.2f} GB/s, page cache"
            f" {r['page_cache_growth_bytes'] / mib:+.1f} MiB"
        )
        print(
            f"  step {r['step_ms']:.1f} ms against max(disk {r['disk_ms']:.1f} ms, Adam {r['adam_ms']:.1f} ms):"
            f" {r['step_over_bound']:.2f}x"
        )
