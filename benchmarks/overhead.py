"""Overhead of PatrickStar against plain Lightning when the model fits the device budget.

    python benchmarks/overhead.py                                   # bf16-mixed, 30 measured steps
    python benchmarks/overhead.py --precision 32-true --n-layer 6 --json /tmp/overhead.json

Each strategy trains the demo GPT for ``--warmup + --steps`` steps in a fresh Python process, so that peak
RSS (``ru_maxrss``) belongs to that run alone and no allocator or thread-pool state leaks from one run into
the next. A callback times every training batch (forward, backward and optimizer step, without data loading);
the first ``--warmup`` batches are dropped (PatrickStar records its trace there; allocators and kernels
warm up in both), and the median of the rest is reported. With ``--repeats N`` each strategy runs N times,
interleaved with the other, and its fastest run counts: a run slowed by other processes on a shared machine
says nothing about the strategy. ``--threads 1`` makes the timings far steadier on a busy machine (two
threads waiting on each other lose much more time to a third process than one thread does).

    python benchmarks/overhead.py --repeats 3 --threads 1      # on a machine shared with other jobs

Model data per parameter is measured, not assumed: for PatrickStar it comes from ``memory_report()`` (all
chunk storage in all tiers over unique parameter elements); for plain Lightning it is the bytes of the
parameters, one gradient per parameter, and every tensor in the optimizer state, over the same count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import QUIET_TRAINER, importable_env  # noqa: E402

STRATEGIES = ("auto", "patrickstar")
RESULT_PREFIX = "OVERHEAD_RESULT "
MAX_STEP_TIME_RATIO = 1.10
MIXED_BYTES_PER_PARAM = 14.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--child`` is internal (one measured run)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="measured training steps per run (default: 30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps run first and not timed (default: 5)")
    parser.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=["bf16-mixed", "16-mixed", "32-true"],
        help="Trainer precision for both runs (default: bf16-mixed)",
    )
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument(
        "--chunk-size", default="auto", help="PatrickStar chunk_size: elements or 'auto' (default: auto)"
    )
    parser.add_argument(
        "--placement",
        default=None,
        choices=["auto", "static"],
        help="PatrickStar placement policy (default: the strategy's default)",
    )
    parser.add_argument(
        "--device-memory-limit",
        default=None,
        help="PatrickStar device budget, e.g. '256MiB' (default: none, the model fits)",
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated (default: auto,patrickstar)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per strategy, interleaved; the run with the lowest median counts (default: 1). On a shared"
        " machine more repeats filter out runs slowed by other processes",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads in each run (default: torch's choice). 1 makes timings far less sensitive"
        " to other processes on a busy machine",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--child", choices=STRATEGIES, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1 and --warmup >= 0")
    unknown = set(args.strategies.split(",")) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {list(STRATEGIES)}")
    return args


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """Train once with ``args.child`` in this process and return the measurements."""
    # Imported here so that the parent process stays light and each child pays its own import cost.
    import lightning as L
    import torch

    from lightning_pstar.demos import GPTLightningModule, StdlibCharDataModule
    from lightning_pstar.demos.timing import StepTimer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    total_steps = args.warmup + args.steps
    datamodule = StdlibCharDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        # Enough text that no batch repeats within the run, and little more.
        max_chars=max(200_000, 2 * total_steps * args.batch_size * (args.block_size + 1)),
        val_fraction=0.05,
    )
    module = GPTLightningModule(
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        warmup_steps=min(10, total_steps),
        fused=True,
        meta_init=True,
    )
    strategy: Any = args.child
    if args.child == "patrickstar":
        from lightning_pstar import PatrickStarStrategy

        options: dict[str, Any] = {"chunk_size": args.chunk_size, "device_memory_limit": args.device_memory_limit}
        if args.placement is not None:
            options["placement"] = args.placement
        strategy = PatrickStarStrategy(**options)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=total_steps,
        **QUIET_TRAINER,
        # A DDPStrategy subclass (PatrickStar) would otherwise get a DistributedSampler even at one rank,
        # so the two runs would read different batches.
        use_distributed_sampler=False,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=datamodule)

    measured = timer.times[args.warmup :]
    num_params = sum(p.numel() for p in module.parameters())  # parameters() yields the tied weight once
    result: dict[str, Any] = {
        "strategy": args.child,
        "precision": args.precision,
        "steps": len(measured),
        "warmup": args.warmup,
        "median_step_s": statistics.median(measured),
        "step_times_s": measured,
        # Linux reports ru_maxrss in KiB.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "num_params": num_params,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(trainer.strategy.root_device),
    }
    if trainer.strategy.root_device.type == "cuda":
        result["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(trainer.strategy.root_device)
    memory_report = getattr(trainer.strategy, "memory_report", None)
    if callable(memory_report):
        report = memory_report()
        is_instance = dataclasses.is_dataclass(report) and not isinstance(report, type)
        result["memory_report"] = dataclasses.asdict(report) if is_instance else repr(report)
        result["model_data_bytes_per_param"] = float(report.model_data_bytes_per_param)
    else:
        params = {id(p): p for p in module.parameters()}.values()
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        # One gradient per parameter in the parameter's dtype: what plain PyTorch holds at the peak of each
        # step, even though Lightning may have freed them by now.
        grad_bytes = param_bytes
        state_bytes = sum(
            t.numel() * t.element_size()
            for optimizer in trainer.optimizers
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        result["model_data_bytes_per_param"] = (param_bytes + grad_bytes + state_bytes) / num_params
    return result


def spawn(args: argparse.Namespace, strategy: str, argv: list[str]) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter and parse its result line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", strategy]
    env = importable_env(dict(os.environ))  # a plain checkout works without installing the package
    if args.threads is not None:
        # Through the environment as well: Lightning's DDP-based strategies (PatrickStar among them) reset the
        # thread count at setup unless OMP_NUM_THREADS is set.
        env["OMP_NUM_THREADS"] = str(args.threads)
    print(f"running {strategy} ({args.warmup} warm-up + {args.steps} measured steps) ...", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"the {strategy} run failed with exit code {proc.returncode}; its output is above")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def report(results: list[dict[str, Any]], precision: str) -> bool:
    """Print the comparison table and the targets; return whether every target is met."""
    by_name = {r["strategy"]: r for r in results}
    base = by_name.get("auto")
    on_cuda = any("peak_cuda_allocated_bytes" in r for r in results)
    header = f"{'strategy':<12} {'precision':<11} {'median step':>12} {'vs plain':>9} {'peak RSS':>10}"
    header += f" {'bytes/param':>12}" + (f" {'peak CUDA':>10}" if on_cuda else "")
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = r["median_step_s"] / base["median_step_s"] if base else float("nan")
        print(
            f"{r['strategy']:<12} {r['precision']:<11} {r['median_step_s'] * 1e3:>9.1f} ms {ratio:>8.3f}x"
            f" {r['peak_rss_bytes'] / 2**20:>6.0f} MiB {r['model_data_bytes_per_param']:>12.2f}"
            + (f" {r.get('peak_cuda_allocated_bytes', 0) / 2**20:>6.0f} MiB" if on_cuda else "")
        )
    print()
    ok = True
    pstar = by_name.get("patrickstar")
    if pstar is not None and base is not None:
        ratio = pstar["median_step_s"] / base["median_step_s"]
        passed = ratio <= MAX_STEP_TIME_RATIO
        ok &= passed
        print(
            f"step-time ratio patrickstar/plain: {ratio:.3f} (target <= {MAX_STEP_TIME_RATIO:.2f}): {_verdict(passed)}"
        )
    if pstar is not None and precision != "32-true":
        bpp = pstar["model_data_bytes_per_param"]
        passed = abs(bpp - MIXED_BYTES_PER_PARAM) < 0.5
        ok &= passed
        print(
            f"model data bytes/param: {bpp:.2f}"
            f" (target {MIXED_BYTES_PER_PARAM:.0f} in mixed precision): {_verdict(passed)}"
        )
    return ok


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def main(argv: list[str] | None = None) -> int:
    """Parent: one child per strategy, then the table. Child: one run, printed as a JSON line."""
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.child is not None:
        print(RESULT_PREFIX + json.dumps(run_child(args)), flush=True)
        return 0
    names = args.strategies.split(",")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    # Interleaved (a, b, a, b, ...) so that a slow phase of the machine hits both strategies alike.
    for _ in range(args.repeats):
        for name in names:
            runs[name].append(spawn(args, name, raw))
    results = [min(runs[name], key=lambda r: r["median_step_s"]) for name in names]
    for result in results:
        result["repeat_medians_s"] = [r["median_step_s"] for r in runs[result["strategy"]]]
    ok = report(results, args.precision)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2)
        )
        print(f"results written to {args.json}")
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
