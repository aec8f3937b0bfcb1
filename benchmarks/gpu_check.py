"""Model FLOPs utilisation and the largest trainable demo GPT on one GPU: PatrickStar against FSDP2 CPU offload.

    python benchmarks/gpu_check.py --json /tmp/gpu_check.json             # one large GPU, about 8 minutes
    python benchmarks/gpu_check.py --tiny --json /tmp/gpu_check_tiny.json # CPU, tiny model, same code path

Both strategies train the demo GPT at one rank in ``bf16-mixed``:

- ``patrickstar``: ``PatrickStarStrategy(device_memory_limit=D, host_memory_limit=H)``;
- ``fsdp-offload``: ``ModelParallelStrategy`` with ``fully_shard`` (``CPUOffloadPolicy``, bf16
  ``MixedPrecisionPolicy``) on every block and the root, built on the meta device and materialised into its
  host-resident shards (the full model never exists on the GPU).

Sizes are a ladder of GPT-3-like shapes (head size 128, vocabulary 50304, block 1024) from 1.3B parameters up;
a rung is tried only when it is predicted to fit D (default: 0.8 of the GPU, the strategy's default) plus H
(default: 0.8 of the RAM), so that no run can take the machine's host memory down:

    activations  A = n_layer * 34 * b * T * n_embd + 10 * b * T * vocab      (bf16, no recomputation)
    patrickstar:  lightning_pstar.planning.plan_capacity(device_memory = D - A, host_memory = H).fits
    fsdp-offload: 16 P <= H  and  A + 4 U <= D   (U: parameters of the largest FSDP unit, bf16 params + grads)

Every run is a fresh process (``--worker``), so a run that fails (out of memory) leaves nothing behind. The
order serves a fixed time budget (``--time-budget``, default 420 s; no run starts after it and a running one is
killed 30 s past it): first the smallest rung of each strategy, then each strategy's ladder from the top down
until one run trains (the largest it trains), then the rungs in between while time is left.

Per run: the median step time over ``--steps`` measured steps after ``--warmup`` untimed ones, tokens/s,
``TFLOPS = 6 * P * tokens / step time`` (the demo GPT recomputes nothing, so nothing is added; attention's own
FLOPs are left out, as in the usual 6 P estimate), MFU against ``--peak-tflops`` (default: from the GPU's
name, 989 for H100/H200, 312 for A100), peak CUDA memory, peak RSS and, for PatrickStar, bytes moved between
the tiers per step. ``--tiny`` runs the same path on the CPU with a tiny model (n_layer 2, n_embd 64, 1 + 2
steps) and a 1 GiB simulated device, so that the script cannot rot on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from typing_extensions import override

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.config import parse_bytes
from lightning_pstar.demos import GPT, GPTConfig, GPTLightningModule, StdlibCharDataModule, gpt_num_params
from lightning_pstar.demos.timing import StepTimer
from lightning_pstar.planning import plan_capacity

STRATEGIES = ("patrickstar", "fsdp-offload")
LADDER = ((24, 2048), (32, 2560), (36, 3072), (32, 4096), (36, 4608), (40, 5120), (40, 5632), (44, 6144), (48, 7168))
"""(n_layer, n_embd) from 1.3B to 30B parameters; n_head = n_embd / 128."""
TINY_LADDER = ((2, 64),)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
"""Dense bf16 peak per GPU model (SXM parts)."""
GRACE_S = 30.0
RESULT_PREFIX = "GPU_CHECK_RESULT "


# ---- options --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--worker`` is internal (one run)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU, tiny model, few steps: the code path without a GPU")
    p.add_argument("--sizes", default=None, help="rungs as LAYERSxEMBD, comma-separated (default: the ladder)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated subset of {STRATEGIES}")
    p.add_argument("--batch-size", type=int, default=None, help="micro-batch (default 4; tiny 4)")
    p.add_argument("--block-size", type=int, default=None, help="sequence length (default 1024; tiny 32)")
    p.add_argument("--vocab-size", type=int, default=None, help="default 50304 (tiny 128)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 3; tiny 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps, >= 1 (default 1)")
    p.add_argument("--device-memory", default=None, help="device budget D (default: 0.8 of the GPU; tiny 1GiB)")
    p.add_argument("--host-memory", default=None, help="host budget H (default: 0.8 of the RAM)")
    p.add_argument("--peak-tflops", type=float, default=None, help="for MFU (default: from the GPU's name)")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds after which no run starts (default: 420)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tiny = {"batch_size": 4, "block_size": 32, "vocab_size": 128, "steps": 2}
    full = {"batch_size": 4, "block_size": 1024, "vocab_size": 50304, "steps": 3}
    for name, value in (tiny if args.tiny else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (PatrickStar's warm-up step is not timed)")
    args.strategy_list = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not args.strategy_list or set(args.strategy_list) - set(STRATEGIES):
        p.error(f"--strategies must name some of {list(STRATEGIES)}, got {args.strategies!r}")
    try:
        args.ladder = _parse_sizes(args.sizes) if args.sizes else list(TINY_LADDER if args.tiny else LADDER)
    except ValueError as err:
        p.error(str(err))
    return args


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    rungs = []
    for item in text.split(","):
        layers, _, embd = item.strip().lower().partition("x")
        if not (layers.isdigit() and embd.isdigit()):
            raise ValueError(f"--sizes: {item!r} is not LAYERSxEMBD, e.g. 24x2048")
        rungs.append((int(layers), int(embd)))
    return sorted(rungs, key=lambda r: r[0] * r[1] ** 2)


@dataclass(kw_only=True)
class Run:
    """One training run: a strategy on one rung of the ladder."""

    strategy: str
    n_layer: int
    n_embd: int
    device_memory: int  # D, bytes
    host_memory: int  # H, bytes

    def config(self, args: argparse.Namespace) -> GPTConfig:
        head = 128 if self.n_embd % 128 == 0 and self.n_embd >= 128 else 32
        return GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=self.n_layer,
                         n_head=self.n_embd // head, n_embd=self.n_embd)  # fmt: skip


# ---- prediction -----------------------------------------------------------------------------------------
def activation_bytes(cfg: GPTConfig, batch: int) -> int:
    """Activations of one micro-batch kept for backward (see the module docstring)."""
    tokens = batch * cfg.block_size
    return cfg.n_layer * 34 * tokens * cfg.n_embd + 10 * tokens * cfg.vocab_size


def predicted_fit(run: Run, args: argparse.Namespace) -> tuple[bool, str]:
    """Whether the rung should fit D + H under the run's strategy, and why not."""
    cfg = run.config(args)
    act = activation_bytes(cfg, args.batch_size)
    if run.strategy == "fsdp-offload":
        block = gpt_num_params(replace(cfg, n_layer=2)) - gpt_num_params(replace(cfg, n_layer=1))
        unit = max(block, gpt_num_params(cfg) - cfg.n_layer * block)
        if 16 * gpt_num_params(cfg) > run.host_memory:
            return False, "host: 16 P > H"
        return act + 4 * unit <= run.device_memory, "device: A + 4 U > D"
    if act >= run.device_memory:
        return False, "device: A >= D"
    plan = plan_capacity(
        lambda: GPT(cfg), device_memory=run.device_memory - act, host_memory=run.host_memory,
        precision="bf16-mixed", search_largest=False,
    )  # fmt: skip
    return plan.fits, "; ".join(plan.reasons)


# ---- worker: one run ------------------------------------------------------------------------------------
class TransferTimer(StepTimer):
    """:class:`StepTimer` plus PatrickStar's transfer counters after the last warm-up batch and the last batch."""

    def __init__(self, warmup: int) -> None:
        super().__init__()
        self.warmup = warmup
        self.transfers: list[int] = []

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, i)
        if isinstance(trainer.strategy, PatrickStarStrategy) and len(self.times) in (self.warmup, trainer.max_steps):
            report = trainer.strategy.memory_report()
            self.transfers.append(report.h2d_bytes + report.d2h_bytes)


class FSDPOffloadGPTModule(GPTLightningModule):
    """The demo GPT under FSDP2 with CPU offload: built on the meta device, sharded per block and at the root,
    materialised into host-resident shards."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs, meta_init=True)  # the GPT is built in configure_model, never in __init__

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        mesh = self.device_mesh
        assert mesh is not None, "ModelParallelStrategy sets the device mesh before configure_model"
        with torch.device("meta"):
            model = GPT(self.gpt_config)
        device = self.trainer.strategy.root_device
        options: dict[str, Any] = {
            "mesh": mesh["data_parallel"],
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda"),
        }
        for block in model.h:
            fully_shard(block, **options)
        fully_shard(model, **options)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for module in model.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    module.reset_parameters()  # type: ignore[operator]
        self.model = model


class FSDPOffloadStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (pure data parallel) that leaves the offloaded shards on the host."""

    def __init__(self) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=1)

    @override
    def model_to_device(self) -> None:
        pass  # CPUOffloadPolicy: shards live on the host; FSDP copies each unit to the device for compute


def run_worker(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``run`` in this process and return its measurements."""
    L.seed_everything(1234, verbose=False)
    cfg = run.config(args)
    total = args.warmup + args.steps
    datamodule = StdlibCharDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        max_chars=max(100_000, 2 * total * args.batch_size * (args.block_size + 1)),
        val_fraction=0.05,
    )
    sizes = {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    if run.strategy == "patrickstar":
        module: GPTLightningModule = GPTLightningModule(**sizes, warmup_steps=total, fused=True, meta_init=True)
        strategy: Any = PatrickStarStrategy(device_memory_limit=run.device_memory, host_memory_limit=run.host_memory)
    else:
        module = FSDPOffloadGPTModule(**sizes, warmup_steps=total, fused=True)
        strategy = FSDPOffloadStrategy()
    timer = TransferTimer(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu" if args.tiny else "auto",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=total,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=datamodule)
    step = statistics.median(timer.times[args.warmup :])
    params = gpt_num_params(cfg)
    tokens = args.batch_size * args.block_size
    result: dict[str, Any] = {
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "tflops": 6 * params * tokens / step / 1e12,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "moved_bytes_per_step": None,
    }
    if isinstance(trainer.strategy, PatrickStarStrategy):
        result["moved_bytes_per_step"] = (timer.transfers[-1] - timer.transfers[0]) // args.steps
    return result


# ---- parent ---------------------------------------------------------------------------------------------
def default_budgets(args: argparse.Namespace) -> tuple[int, int]:
    """(D, H) in bytes: the flags, else 0.8 of the GPU (tiny: 1 GiB simulated) and 0.8 of the RAM."""
    if args.device_memory is not None:
        device = parse_bytes(args.device_memory, name="--device-memory")
    elif not args.tiny and torch.cuda.is_available():
        device = int(0.8 * torch.cuda.get_device_properties(0).total_memory)
    else:
        device = 1 << 30
    if args.host_memory is not None:
        host = parse_bytes(args.host_memory, name="--host-memory")
    else:
        host = int(0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return device, host


def peak_tflops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops is not None:
        return args.peak_tflops
    if args.tiny or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def spawn(run: Run, args: argparse.Namespace, raw: list[str], timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; a failure comes back as ``{"error": ...}``."""
    env = dict(os.environ)
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    if args.tiny:
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), *raw, "--worker", json.dumps(asdict(run))]
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"error": f"killed after {timeout:.0f} s (time budget)"}
        out.seek(0)
        text = out.read().decode(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT_PREFIX) :])
    errors = [line for line in text.splitlines() if "Error" in line or "error" in line]
    return {"error": f"exit code {proc.returncode}: " + (errors[-1].strip() if errors else text[-300:].strip())}


def run_ladders(args: argparse.Namespace, raw: list[str]) -> list[dict[str, Any]]:
    """Predict every (strategy, rung), then train those predicted to fit, in the order that serves the time
    budget: each strategy's smallest rung; its ladder top-down until a run trains; the rungs in between."""
    device, host = default_budgets(args)
    start = time.monotonic()
    entries: dict[tuple[str, int, int], dict[str, Any]] = {}
    ladders: dict[str, list[Run]] = {}
    for strategy in args.strategy_list:
        ladders[strategy] = []
        for n_layer, n_embd in args.ladder:
            run = Run(strategy=strategy, n_layer=n_layer, n_embd=n_embd, device_memory=device, host_memory=host)
            fit, why = predicted_fit(run, args)
            entries[(strategy, n_layer, n_embd)] = {"run": run, "predicted_fit": fit, "why_not": "" if fit else why}
            if fit:
                ladders[strategy].append(run)

    def attempt(run: Run) -> bool:
        entry = entries[(run.strategy, run.n_layer, run.n_embd)]
        if "result" not in entry:
            elapsed = time.monotonic() - start
            if elapsed > args.time_budget:
                return False  # reported as skipped
            print(f"[{elapsed:5.0f} s] {run.strategy} n_layer={run.n_layer} n_embd={run.n_embd} ...", flush=True)
            entry["result"] = spawn(run, args, raw, timeout=args.time_budget + GRACE_S - elapsed)
        return "error" not in entry["result"]

    smallest_ok = {strategy: bool(ladder) and attempt(ladder[0]) for strategy, ladder in ladders.items()}
    for strategy, ladder in ladders.items():
        # a strategy that cannot train the smallest rung will not train a larger one: no time spent on it
        if smallest_ok[strategy]:
            next((run for run in reversed(ladder[1:]) if attempt(run)), None)
    for rung in range(len(args.ladder)):
        for ladder in ladders.values():
            if rung < len(ladder):
                attempt(ladder[rung])
    return [_row(entry, args) for entry in entries.values()]


def _row(entry: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    run: Run = entry["run"]
    cfg = run.config(args)
    if "result" in entry:
        result = entry["result"]
    elif entry["predicted_fit"]:
        result = {"error": "skipped: time budget spent"}
    else:
        result = {"error": f"not tried: predicted not to fit ({entry['why_not']})"}
    peak = peak_tflops(args)
    row = {
        "strategy": run.strategy,
        "n_layer": cfg.n_layer,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "params": gpt_num_params(cfg),
        "predicted_fit": entry["predicted_fit"],
        "why_not": entry["why_not"],
        "trained": "error" not in result,
        **{k: None for k in ("step_time_s", "tokens_per_s", "tflops", "mfu", "peak_rss_bytes", "peak_cuda_bytes")},
        "moved_bytes_per_step": None,
        "error": result.get("error"),
    }
    row.update({k: v for k, v in result.items() if k != "error"})
    if row["tflops"] is not None and peak:
        row["mfu"] = row["tflops"] / peak
    return row


def gib(n: int | None) -> str:
    """Bytes for the table: GiB, or MiB below one GiB; '-' for none."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table and the largest model each strategy trained; return the JSON document."""
    device, host = default_budgets(args)
    where = "CPU (tiny)" if args.tiny or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    print(f"\n{where}: D {gib(device)}, H {gib(host)}, micro-batch {args.batch_size} x"
          f" {args.block_size}, bf16-mixed, {args.warmup} warm-up + {args.steps} measured steps")  # fmt: skip
    head = f"{'strategy':<13} {'n_layer':>7} {'n_embd':>6} {'params':>15} {'step':>9} {'tok/s':>8} {'TFLOPS':>7}"
    head += f" {'MFU':>6} {'CUDA peak':>10} {'RSS peak':>10} {'moved/step':>11}  status"
    print(head + "\n" + "-" * len(head))

    for r in rows:
        status = "trained" if r["trained"] else (r["error"] or r["why_not"] or "not run")
        step = f"{r['step_time_s']:.3f} s" if r["step_time_s"] is not None else "-"
        tok = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] is not None else "-"
        tfl = f"{r['tflops']:.2f}" if r["tflops"] is not None else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"{r['strategy']:<13} {r['n_layer']:>7} {r['n_embd']:>6} {r['params']:>15,} {step:>9} {tok:>8}"
              f" {tfl:>7} {mfu:>6} {gib(r['peak_cuda_bytes']):>10} {gib(r['peak_rss_bytes']):>10}"
              f" {gib(r['moved_bytes_per_step']):>11}  {status}")  # fmt: skip
    largest = {}
    for strategy in args.strategy_list:
        trained = [r for r in rows if r["strategy"] == strategy and r["trained"]]
        best = max(trained, key=lambda r: r["params"]) if trained else None
        largest[strategy] = None if best is None else {k: best[k] for k in ("n_layer", "n_embd", "params")}
        print(f"largest trained with {strategy}: " + (f"{best['params']:,} parameters" if best else "none"))
    return {
        "device": where,
        "device_memory": device,
        "host_memory": host,
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "peak_tflops": peak_tflops(args),
        "runs": rows,
        "largest": largest,
    }


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(raw)
    if args.worker is not None:
        print(RESULT_PREFIX + json.dumps(run_worker(Run(**json.loads(args.worker)), args)), flush=True)
        return 0
    rows = run_ladders(args, raw)
    document = report(rows, args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2))
        print(f"results written to {args.json}")
    return 0 if all(v is not None for v in document["largest"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
