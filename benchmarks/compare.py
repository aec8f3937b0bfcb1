"""PatrickStar against Lightning's own strategies: speed and memory of the same training, and model scale.

    python benchmarks/compare.py                                     # every strategy, then the scale table
    python benchmarks/compare.py --quick --json /tmp/compare.json --plot /tmp/compare.png
    python benchmarks/compare.py --strategies auto,patrickstar-1 --quick      # a subset
    python benchmarks/compare.py --scale-only --scale-device-memory 80GiB --scale-host-memory 1TiB

**Training runs.** The demo GPT trains on the standard-library corpus, same sizes, seed and per-rank batch,
with in turn (``--strategies`` picks a subset; the default runs all):

- ``auto``: Lightning's default strategy, one process;
- ``ddp``: ``--ranks`` processes (gloo on CPU);
- ``fsdp``: FSDP2 at ``--ranks`` processes: ``ModelParallelStrategy`` with ``fully_shard`` on every block
  and the root in ``configure_model`` (Lightning's ``fsdp`` refuses the CPU), with ``CPUOffloadPolicy``; if
  the offloaded run fails it is repeated without offload and the table says so;
- ``patrickstar-1`` / ``patrickstar-2``: PatrickStar at one and ``--ranks`` processes, unconstrained, and
  ``patrickstar-1-limited`` / ``patrickstar-2-limited`` with ``device_memory_limit = P + 0.4 M`` (``--limit-
  fraction``), where P (``peak_non_model_bytes``) and M (``model_data_bytes``, per rank) come from the
  unconstrained run at the same number of ranks: only 40% of the model data fits, the rest is offloaded.

Each run starts fresh processes of this script (``--worker``), one per rank, with the environment of a
torchrun job, so that peak RSS (``ru_maxrss``, read in each rank) belongs to that run alone. Every process
gets one intra-op thread (``--threads``): a rank stands for one device, so a 2-rank run uses twice the compute
of a 1-rank run, as on accelerators, and one thread per process keeps timings steady on a shared machine (two
threads waiting on each other lose far more to a third process than one does). A callback times each
training batch (forward, backward, optimizer step); the first ``--warmup`` batches are dropped (PatrickStar
records its trace there) and the median of the rest counts (the slowest rank's median). Reported per run:

- ``tokens_per_s``: ranks x batch x block_size / step time; ``vs auto`` is its ratio to ``auto``'s;
- ``peak_rss_bytes``: the largest peak RSS of the run's ranks. On a machine without an accelerator the
  simulated device lives in host RAM too, so offloading does not lower it;
- ``model_data_bytes_per_param``: model data held by ONE rank / parameters of the model, measured: for
  PatrickStar every chunk the rank allocated (``memory_report().model_data_bytes``), for the others the
  rank's (local shard of) parameters, one gradient per parameter and the optimizer states. Expected: auto
  and ddp 16 (fp32 AdamW: 4 param + 4 grad + 8 states), fsdp 16 / ranks, PatrickStar 14 / ranks in mixed
  precision. The table shows the all-ranks figure (x ranks for sharded strategies) beside it;
- ``h2d_bytes_per_step`` / ``d2h_bytes_per_step``: PatrickStar's transfers between tiers over the measured
  steps / steps (the busiest rank); null for the other strategies, which have no tiers on a CPU.

**Scale.** The largest member of the demo GPT family (depth and width grow together from GPT-2 small's
shape, head size 64: ``n_layer = k, n_embd = 64 k``) that each strategy can train with the same budgets per
rank: ``--scale-device-memory`` D per rank and ``--scale-host-memory`` H per node (H / ranks per rank). A
micro-batch of ``--scale-batch-size`` x ``--scale-block-size`` tokens needs activations (no recomputation,
bf16, attention without the T x T scores)

    A = n_layer * 34 * b * T * n_embd + 10 * b * T * vocab_size        (bytes; 10: bf16 logits + fp32 copy + grad)

and the strategies need
    auto / ddp:    16 P + A <= D                                   (everything on the device; host unused)
    fsdp offload:  16 P / ranks <= H / ranks  and  A + 4 U <= D    (states on the host; U: parameters of the
                                                                    largest FSDP unit, bf16 params + grads)
    patrickstar:   lightning_pstar.planning.plan_capacity(device_memory = D - A, host_memory = H / ranks).fits
                   (14 B/param in chunks over both tiers, padding included, and one module's chunks on D)

Found by a doubling-then-bisection search over k (the planner, no training). Printed next to the paper's
2.27x-2.5x over DeepSpeed and this project's target: at least 2.5x ddp/auto, and above fsdp offload.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.demos import GPT, GPTConfig, GPTLightningModule, StdlibCharDataModule, gpt_num_params
from lightning_pstar.demos.timing import StepTimer
from lightning_pstar.planning import plan_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    QUIET_TRAINER,
    add_host_malloc_option,
    apply_host_malloc,
    free_port,
    importable_env,
    pstar_host_malloc,
    rank_env,
)
from gpu_peers import FSDPGPTModule, FSDPStrategy  # noqa: E402

RUN_KEYS = (
    "auto",
    "ddp",
    "fsdp",
    "patrickstar-1",
    "patrickstar-1-limited",
    "patrickstar-2",
    "patrickstar-2-limited",
)
PAPER_RATIO = "2.27x-2.5x (PatrickStar over DeepSpeed, arXiv 2108.05818)"
TARGET_RATIO_VS_AUTO = 2.5
ADAMW_FP32_BYTES = 16  # 4 param + 4 grad + 8 Adam states
QUICK = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64, "batch_size": 8, "steps": 4, "warmup": 2}
RUN_TIMEOUT_S = 600.0


# ---- options --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--worker`` and ``--result`` are internal (one rank of one run)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"tiny model, few steps (< 5 min on 2 cores): {QUICK}")
    p.add_argument("--n-layer", type=int, default=None, help="default 4 (quick: 2)")
    p.add_argument("--n-embd", type=int, default=None, help="default 192 (quick: 64)")
    p.add_argument("--n-head", type=int, default=None, help="default 4 (quick: 2)")
    p.add_argument("--block-size", type=int, default=None, help="default 128 (quick: 64)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank; default 16 (quick: 8)")
    p.add_argument("--steps", type=int, default=None, help="measured steps; default 10 (quick: 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps, >= 1; default 3 (quick: 2)")
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32-true"])
    p.add_argument("--ranks", type=int, default=2, help="processes of the multi-rank runs (default: 2)")
    p.add_argument("--strategies", default=",".join(RUN_KEYS), help=f"comma-separated subset of {RUN_KEYS}")
    p.add_argument("--limit-fraction", type=float, default=0.4, help="share of model data the limit leaves")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per process (default: 1)")
    add_host_malloc_option(p)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG bar chart")
    p.add_argument("--no-scale", action="store_true", help="skip the model-scale table")
    p.add_argument("--scale-only", action="store_true", help="only the model-scale table (no training)")
    p.add_argument("--scale-device-memory", default="32GiB", help="device budget per rank (default: 32GiB)")
    p.add_argument("--scale-host-memory", default="240GiB", help="host budget per node (default: 240GiB)")
    p.add_argument("--scale-ranks", type=int, default=8, help="ranks per node of the scale table (default: 8)")
    p.add_argument("--scale-batch-size", type=int, default=1, help="micro-batch per rank (default: 1)")
    p.add_argument("--scale-block-size", type=int, default=1024)
    p.add_argument("--scale-vocab-size", type=int, default=50304)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else {"n_layer": 4, "n_embd": 192, "n_head": 4, "block_size": 128}
    defaults = {"batch_size": 16, "steps": 10, "warmup": 3, **defaults}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < 1 or args.warmup < 1 or args.ranks < 2 or args.scale_ranks < 1:
        p.error("--steps and --warmup must be >= 1 (PatrickStar's warm-up step is not timed), --ranks >= 2")
    if not 0.0 < args.limit_fraction < 1.0:
        p.error(f"--limit-fraction must be in (0, 1), got {args.limit_fraction}")
    keys = [k.strip() for k in args.strategies.split(",") if k.strip()]
    unknown = sorted(set(keys) - set(RUN_KEYS) - {"patrickstar"})
    if unknown:
        p.error(f"unknown strategies {unknown}; choose from {list(RUN_KEYS)} ('patrickstar' means all four)")
    args.run_keys = [k for k in RUN_KEYS if k in keys or ("patrickstar" in keys and k.startswith("patrickstar"))]
    return args


@dataclass(kw_only=True)
class RunSpec:
    """One training run (all of its ranks)."""

    key: str  # one of RUN_KEYS
    strategy: str  # auto | ddp | fsdp | patrickstar
    world_size: int
    device_memory_limit: int | None = None  # PatrickStar only
    offload: bool = False  # FSDP only: CPUOffloadPolicy


# ---- worker: one rank of one run ------------------------------------------------------------------------
class TransferTimer(StepTimer):
    """:class:`StepTimer` plus PatrickStar's transfer counters after the last warm-up batch and the last batch."""

    def __init__(self, warmup: int) -> None:
        super().__init__()
        self.warmup = warmup
        self.transfers: list[tuple[int, int]] = []

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, i)
        if isinstance(trainer.strategy, PatrickStarStrategy) and len(self.times) in (self.warmup, trainer.max_steps):
            report = trainer.strategy.memory_report()
            self.transfers.append((report.h2d_bytes, report.d2h_bytes))


_PARAM_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": None}


def build_run(spec: RunSpec, args: argparse.Namespace) -> tuple[L.LightningModule, Any]:
    """The LightningModule and the Trainer strategy of one run."""
    sizes = {"vocab_size": args.vocab_size, "block_size": args.block_size, "n_layer": args.n_layer}
    sizes.update(n_head=args.n_head, n_embd=args.n_embd, warmup_steps=min(10, args.warmup + args.steps))
    module: GPTLightningModule
    if spec.strategy == "fsdp":
        module = FSDPGPTModule(offload=spec.offload, param_dtype=_PARAM_DTYPE[args.precision], **sizes, fused=True)
        return module, FSDPStrategy(offload=spec.offload, data_parallel_size=spec.world_size)
    module = GPTLightningModule(**sizes, fused=True, meta_init=True)
    if spec.strategy == "patrickstar":
        return module, PatrickStarStrategy(device_memory_limit=spec.device_memory_limit, **pstar_host_malloc())
    return module, spec.strategy


def model_data_bytes(trainer: L.Trainer, module: L.LightningModule) -> int:
    """Model data this rank holds: PatrickStar's chunks, else local parameters + one gradient each + states."""
    if isinstance(trainer.strategy, PatrickStarStrategy):
        return trainer.strategy.memory_report().model_data_bytes

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = {id(p): local(p) for p in module.parameters()}.values()
    param_bytes = sum(t.numel() * t.element_size() for t in params)
    states = [s for opt in trainer.optimizers for state in opt.state.values() for s in state.values()]
    state_bytes = sum(local(s).numel() * local(s).element_size() for s in states if torch.is_tensor(s) and s.dim())
    return 2 * param_bytes + state_bytes  # gradients: one per parameter, in the parameter's dtype


def run_worker(spec: RunSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Train one rank of ``spec`` in this process and return its measurements."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    L.seed_everything(args.seed, verbose=False)
    total = args.warmup + args.steps
    datamodule = StdlibCharDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        max_chars=max(100_000, 2 * total * spec.world_size * args.batch_size * (args.block_size + 1)),
        val_fraction=0.05,
    )
    module, strategy = build_run(spec, args)
    timer = TransferTimer(args.warmup)
    trainer = L.Trainer(
        accelerator="auto",
        devices=spec.world_size,
        strategy=strategy,
        precision=args.precision,
        max_steps=total,
        **QUIET_TRAINER,
        # One process: no DistributedSampler (a DDPStrategy subclass would add one and change the data order).
        use_distributed_sampler=spec.world_size > 1,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=datamodule)
    result: dict[str, Any] = {
        "rank": trainer.global_rank,
        "median_step_s": statistics.median(timer.times[args.warmup :]),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "model_data_bytes": model_data_bytes(trainer, module),
        "threads": torch.get_num_threads(),
    }
    if isinstance(trainer.strategy, PatrickStarStrategy):
        report = trainer.strategy.memory_report()
        (h2d0, d2h0), (h2d1, d2h1) = timer.transfers
        result.update(h2d_bytes_per_step=(h2d1 - h2d0) // args.steps, d2h_bytes_per_step=(d2h1 - d2h0) // args.steps)
        result.update(peak_non_model_bytes=report.peak_non_model_bytes, evictions=report.evictions)
    return result


# ---- parent: launching runs -----------------------------------------------------------------------------
class RunFailed(RuntimeError):
    """A rank of a run exited with an error; the message holds the ranks' output tails."""


def launch(spec: RunSpec, args: argparse.Namespace, raw_argv: list[str]) -> list[dict[str, Any]]:
    """Start one process per rank (torchrun's environment), wait for all, return the ranks' results."""
    workdir = Path(tempfile.mkdtemp(prefix="pstar_compare_"))
    port = free_port()
    threads = args.threads or 1
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for rank in range(spec.world_size):
            env = importable_env(dict(os.environ, **rank_env(rank, spec.world_size, port, threads)))
            cmd = [sys.executable, str(Path(__file__).resolve()), *raw_argv, "--worker", json.dumps(asdict(spec))]
            log = workdir / f"rank{rank}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen([*cmd, "--result", str(workdir / f"rank{rank}.json")], env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            procs.append((proc, log))
        _wait_all(procs, spec)
        return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(spec.world_size)]
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_all(procs: list[tuple[subprocess.Popen[bytes], Path]], spec: RunSpec) -> None:
    """Return when every rank exited with 0; raise RunFailed on the first failure or at the timeout."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while any(proc.poll() is None for proc, _ in procs):
        failed = any(proc.returncode not in (None, 0) for proc, _ in procs)
        if failed or time.monotonic() > deadline:
            time.sleep(0 if not failed else 2.0)  # let the other ranks notice and write their errors
            break
        time.sleep(0.1)
    if all(proc.returncode == 0 for proc, _ in procs):
        return
    tails = []
    for rank, (proc, log) in enumerate(procs):
        text = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        tails.append(f"--- rank {rank}: exit code {proc.poll()}\n{text}")
    raise RunFailed(f"run {spec.key} failed\n" + "\n".join(tails))


def summarise(spec: RunSpec, ranks: list[dict[str, Any]], args: argparse.Namespace, params: int) -> dict[str, Any]:
    """The JSON record of one run (the keys of the published format, in its order) plus display-only extras."""
    step = max(r["median_step_s"] for r in ranks)
    per_rank = max(r["model_data_bytes"] for r in ranks)
    is_pstar = spec.strategy == "patrickstar"
    record: dict[str, Any] = {
        "strategy": spec.strategy,
        "world_size": spec.world_size,
        "precision": args.precision,
        "device_memory_limit": spec.device_memory_limit,
        "step_time_s": step,
        "tokens_per_s": spec.world_size * args.batch_size * args.block_size / step,
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "model_data_bytes_per_param": per_rank / params,
        "h2d_bytes_per_step": max(r["h2d_bytes_per_step"] for r in ranks) if is_pstar else None,
        "d2h_bytes_per_step": max(r["d2h_bytes_per_step"] for r in ranks) if is_pstar else None,
    }
    extras = {
        "key": spec.key,
        "all_ranks_bytes_per_param": sum(r["model_data_bytes"] for r in ranks) / params,
        "model_data_bytes_per_rank": per_rank,
        "peak_non_model_bytes": max(r.get("peak_non_model_bytes", 0) for r in ranks),
        "threads": ranks[0]["threads"],
        "note": "CPU offload" if spec.offload else "",
    }
    return {"record": record, "extras": extras}


def run_all(args: argparse.Namespace, raw_argv: list[str], params: int) -> list[dict[str, Any]]:
    """Every selected run in RUN_KEYS order; a limited run first runs its unconstrained twin for the limit."""
    done: dict[str, dict[str, Any]] = {}
    wanted = list(args.run_keys)
    for key in wanted:
        if key.endswith("-limited") and key.removesuffix("-limited") not in done:
            twin = key.removesuffix("-limited")
            done[twin] = _measure(_spec(twin, args, done), args, raw_argv, params)
        if key not in done:
            done[key] = _measure(_spec(key, args, done), args, raw_argv, params)
    return [done[k] for k in RUN_KEYS if k in done]


def _spec(key: str, args: argparse.Namespace, done: dict[str, dict[str, Any]]) -> RunSpec:
    if key == "auto":
        return RunSpec(key=key, strategy="auto", world_size=1)
    if key in ("ddp", "fsdp"):
        return RunSpec(key=key, strategy=key, world_size=args.ranks, offload=key == "fsdp")
    world = 1 if key.startswith("patrickstar-1") else args.ranks
    if not key.endswith("-limited"):
        return RunSpec(key=key, strategy="patrickstar", world_size=world)
    twin = done[key.removesuffix("-limited")]["extras"]
    limit = twin["peak_non_model_bytes"] + math.ceil(args.limit_fraction * twin["model_data_bytes_per_rank"])
    return RunSpec(key=key, strategy="patrickstar", world_size=world, device_memory_limit=limit)


def _measure(spec: RunSpec, args: argparse.Namespace, raw_argv: list[str], params: int) -> dict[str, Any]:
    limit = f", device_memory_limit={spec.device_memory_limit:,} B" if spec.device_memory_limit else ""
    print(f"running {spec.key} ({spec.world_size} rank(s){limit}) ...", flush=True)
    try:
        ranks = launch(spec, args, raw_argv)
    except RunFailed as err:
        if not spec.offload:
            raise
        print(f"  FSDP with CPUOffloadPolicy failed; repeating without offload. Its error:\n{str(err)[-1500:]}")
        spec = replace(spec, offload=False)
        ranks = launch(spec, args, raw_argv)
        out = summarise(spec, ranks, args, params)
        out["extras"]["note"] = "no offload (CPUOffloadPolicy failed)"
        return out
    return summarise(spec, ranks, args, params)


# ---- scale: the largest family member each strategy can train (planner and arithmetic, no training) -----
@dataclass(kw_only=True)
class Budget:
    """Budgets and micro-batch of the scale table."""

    device: int  # bytes per rank
    host: int  # bytes per node
    ranks: int
    batch: int
    block: int
    vocab: int
    precision: str


def family_member(k: int, budget: Budget) -> GPTConfig:
    """GPT-2 small's shape grown in depth and width together: n_layer = k, n_embd = 64 k, head size 64."""
    return GPTConfig(vocab_size=budget.vocab, block_size=budget.block, n_layer=k, n_head=k, n_embd=64 * k)


def activation_bytes(cfg: GPTConfig, budget: Budget) -> int:
    """Activations of one micro-batch kept for backward (see the module docstring)."""
    tokens = budget.batch * budget.block
    return cfg.n_layer * 34 * tokens * cfg.n_embd + 10 * tokens * cfg.vocab_size


def _largest_unit_params(cfg: GPTConfig) -> int:
    """Parameters of the largest FSDP unit: one block, or the root (embeddings and the final LayerNorm)."""
    block = gpt_num_params(replace(cfg, n_layer=2)) - gpt_num_params(replace(cfg, n_layer=1))
    return max(block, gpt_num_params(cfg) - cfg.n_layer * block)


def fits(strategy: str, ranks: int, cfg: GPTConfig, budget: Budget) -> tuple[bool, str]:
    """Whether ``strategy`` at ``ranks`` can train ``cfg`` under ``budget``, and the binding constraint."""
    params, act, host = gpt_num_params(cfg), activation_bytes(cfg, budget), budget.host // ranks
    if strategy in ("auto", "ddp"):
        return ADAMW_FP32_BYTES * params + act <= budget.device, "device: 16 P + A"
    if strategy == "fsdp-offload":
        if ADAMW_FP32_BYTES * params // ranks > host:
            return False, "host: 16 P / ranks"
        return act + 4 * _largest_unit_params(cfg) <= budget.device, "device: A + 4 U"
    if act >= budget.device:
        return False, "device: A"
    plan = plan_capacity(
        lambda: GPT(cfg), device_memory=budget.device - act, host_memory=host, world_size=ranks,
        precision=budget.precision, search_largest=False,
    )  # fmt: skip
    return plan.fits, "; ".join(plan.reasons) or "fits"


def largest(strategy: str, ranks: int, budget: Budget) -> dict[str, Any]:
    """Doubling, then bisection, over the family index k for the largest member that fits."""

    def ok(k: int) -> bool:
        return fits(strategy, ranks, family_member(k, budget), budget)[0]

    if not ok(1):
        return {"strategy": strategy, "world_size": ranks, "config": None, "params": 0, "next_reason": ""}
    lo, hi = 1, 2
    while ok(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    cfg = family_member(lo, budget)
    return {
        "strategy": strategy,
        "world_size": ranks,
        "config": {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")},
        "params": gpt_num_params(cfg),
        "next_reason": fits(strategy, ranks, family_member(hi, budget), budget)[1],
    }


def scale_table(args: argparse.Namespace) -> dict[str, Any]:
    """The largest trainable member per strategy and its ratio to auto's."""
    from lightning_pstar.config import parse_bytes

    budget = Budget(
        device=parse_bytes(args.scale_device_memory, name="--scale-device-memory"),
        host=parse_bytes(args.scale_host_memory, name="--scale-host-memory"),
        ranks=args.scale_ranks,
        batch=args.scale_batch_size,
        block=args.scale_block_size,
        vocab=args.scale_vocab_size,
        precision=args.precision,
    )
    n = budget.ranks
    rows = [
        largest("auto", 1, budget),
        largest("ddp", n, budget),
        largest("fsdp-offload", 1, budget),
        *([largest("fsdp-offload", n, budget)] if n > 1 else []),
        largest("patrickstar", 1, budget),
        *([largest("patrickstar", n, budget)] if n > 1 else []),
    ]
    base = rows[0]["params"]
    for row in rows:
        row["ratio_vs_auto"] = row["params"] / base if base else None
    return {"budget": asdict(budget), "rows": rows}


# ---- output ---------------------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_runs(runs: list[dict[str, Any]], args: argparse.Namespace, params: int) -> None:
    """The training table."""
    base = next((r["record"]["tokens_per_s"] for r in runs if r["record"]["strategy"] == "auto"), None)
    head = (f"{'run':<22} {'strategy':<11} {'ranks':>5} {'precision':<10} {'dev limit':>11} {'step':>9}"
            f" {'tokens/s':>9} {'vs auto':>7} {'RSS/rank':>11} {'B/param rank':>12} {'all ranks':>9}"
            f" {'moved/step':>11}  note")  # fmt: skip
    print(f"\nmodel: GPT(n_layer={args.n_layer}, n_embd={args.n_embd}, n_head={args.n_head}, vocab={args.vocab_size},"
          f" block={args.block_size}), {params:,} parameters; batch {args.batch_size} per rank;"
          f" {args.warmup} warm-up + {args.steps} measured steps (median)")  # fmt: skip
    print(head + "\n" + "-" * len(head))
    for run in runs:
        r, x = run["record"], run["extras"]
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        limit = _mib(r["device_memory_limit"]) if r["device_memory_limit"] else "-"
        moved = _mib(r["h2d_bytes_per_step"] + r["d2h_bytes_per_step"]) if r["h2d_bytes_per_step"] is not None else "-"
        print(f"{x['key']:<22} {r['strategy']:<11} {r['world_size']:>5} {r['precision']:<10} {limit:>11}"
              f" {r['step_time_s'] * 1e3:>6.1f} ms {r['tokens_per_s']:>9.0f} {ratio:>7} {_mib(r['peak_rss_bytes']):>11}"
              f" {r['model_data_bytes_per_param']:>12.2f} {x['all_ranks_bytes_per_param']:>9.2f} {moved:>11}"
              f"  {x['note']}")  # fmt: skip
    print("(B/param rank: model data one rank holds / parameters; all ranks: summed over ranks. RSS includes the"
          " simulated device on a CPU. moved/step: PatrickStar host<->device bytes per measured step.)")  # fmt: skip


def print_scale(scale: dict[str, Any]) -> None:
    """The scale table, its formulas and the targets."""
    b = scale["budget"]
    print(f"\nscale: largest trainable GPT(n_layer=k, n_embd=64k, n_head=k, vocab={b['vocab']}, block={b['block']}),"
          f" device {b['device'] / 2**30:.0f} GiB per rank, host {b['host'] / 2**30:.0f} GiB per node,"
          f" micro-batch {b['batch']} x {b['block']}, {b['precision']}")  # fmt: skip
    head = (
        f"{'strategy':<14} {'ranks':>5} {'n_layer':>7} {'n_embd':>7} {'params':>16} {'vs auto':>8}  next size fails on"
    )
    print(head + "\n" + "-" * len(head))
    for r in scale["rows"]:
        c = r["config"] or {"n_layer": 0, "n_embd": 0}
        shown = f"{r['ratio_vs_auto']:.2f}x" if r["ratio_vs_auto"] is not None else "-"
        print(f"{r['strategy']:<14} {r['world_size']:>5} {c['n_layer']:>7} {c['n_embd']:>7} {r['params']:>16,}"
              f" {shown:>8}  {r['next_reason']}")  # fmt: skip
    print("formulas (P params, A activations = n_layer*34*b*T*n_embd + 10*b*T*vocab, D device/rank, H host/node):")
    print("  auto/ddp: 16 P + A <= D | fsdp offload: 16 P/ranks <= H/ranks and A + 4 U <= D (U: largest unit)")
    print("  patrickstar: plan_capacity(device_memory=D - A, host_memory=H/ranks, world_size=ranks).fits")
    rows = {(r["strategy"], r["world_size"]): r for r in scale["rows"]}

    def ratio(big: dict[str, Any], small: dict[str, Any]) -> float:
        return big["params"] / small["params"] if small["params"] else math.inf

    n = b["ranks"]
    pstar, ddp, fsdp = rows[("patrickstar", n)], rows[("ddp", n)], rows[("fsdp-offload", n)]
    vs_ddp, vs_fsdp = ratio(pstar, ddp), ratio(pstar, fsdp)
    print(f"patrickstar at 1 rank: {ratio(rows[('patrickstar', 1)], rows[('auto', 1)]):.2f}x auto,"
          f" {ratio(rows[('patrickstar', 1)], rows[('fsdp-offload', 1)]):.2f}x fsdp offload")  # fmt: skip
    print(f"patrickstar at {n} rank(s): {vs_ddp:.2f}x ddp/auto, {vs_fsdp:.2f}x fsdp offload; paper: {PAPER_RATIO}")
    print(f"target: >= {TARGET_RATIO_VS_AUTO}x ddp/auto: {'PASS' if vs_ddp >= TARGET_RATIO_VS_AUTO else 'FAIL'};"
          f" above fsdp offload: {'PASS' if vs_fsdp > 1.0 else 'FAIL'}")  # fmt: skip


def plot(runs: list[dict[str, Any]], scale: dict[str, Any] | None, path: Path) -> None:
    """Bars per run: throughput, peak RSS and model data per rank; and the scale ratios when measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[list[str], list[float], str]] = []
    if runs:
        labels = [r["extras"]["key"] for r in runs]
        panels += [
            (labels, [r["record"]["tokens_per_s"] for r in runs], "throughput (tokens/s, all ranks)"),
            (labels, [r["record"]["peak_rss_bytes"] / 2**20 for r in runs], "peak RSS per rank (MiB)"),
            (labels, [r["record"]["model_data_bytes_per_param"] for r in runs], "model data per rank (B/param)"),
        ]
    if scale is not None:
        rows = scale["rows"]
        labels = [f"{r['strategy']}-{r['world_size']}" for r in rows]
        panels.append((labels, [r["ratio_vs_auto"] or 0.0 for r in rows], "largest trainable model / auto's"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    for ax, (labels, values, title) in zip(axes[0], panels, strict=True):
        ax.bar(labels, values, color="tab:blue")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Parent: runs, then tables, JSON and plot. Worker: one rank of one run, its result written as JSON."""
    raw = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(raw)
    apply_host_malloc(args.host_malloc)  # the ranks apply it ([Note: --host-malloc cached] in _launch.py)
    if args.worker is not None:
        apply_host_malloc()
        result = run_worker(RunSpec(**json.loads(args.worker)), args)
        args.result.write_text(json.dumps(result))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Lightning leaves the group alive; a gloo group torn down by the interpreter's exit sometimes aborts
            # the process ("terminate called without an active exception", exit -6, seen on a ddp run)
            torch.distributed.destroy_process_group()
        return 0
    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)  # fmt: skip
    params = gpt_num_params(cfg)
    start = time.monotonic()
    runs = [] if args.scale_only else run_all(args, raw, params)
    if runs:
        print_runs(runs, args, params)
    scale = None if args.no_scale else scale_table(args)
    if scale is not None:
        print_scale(scale)
    print(f"\ntotal wall time {time.monotonic() - start:.0f} s")
    if args.json is not None:
        model = {"params": params, **{k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")}}
        model.update(block_size=args.block_size, batch_size_per_rank=args.batch_size, steps=args.steps,
                     warmup=args.warmup)  # fmt: skip
        out: dict[str, Any] = {"model": model, "runs": [r["record"] for r in runs]}
        if scale is not None:
            out["scale"] = scale
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
        print(f"results written to {args.json}")
    if args.plot is not None:
        plot(runs, scale, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
