"""Auto (PatrickStar) against static (ZeRO-Offload style) placement and the optimum as the device budget shrinks.

    python benchmarks/placement.py                                     # bf16-mixed, budgets 1.0 ... 0.3
    python benchmarks/placement.py --budgets 1.0,0.5 --steps 20 --json /tmp/placement.json --check
    python benchmarks/placement.py --model shallow --budgets 0.25,0.5,0.75   # activations ~ model data

Method:

1. An unconstrained run (``placement="auto"``, no device budget) of the demo GPT measures the model data M
   (``model_data_bytes``: every chunk of every family, padding included) and the warm-up's peak of non-model
   memory P (``peak_non_model_bytes``); its losses are the reference.
2. For each budget fraction f the device budget is ``device_memory_limit = P + f * M`` and two runs train
   the same model on the same batches from the same seed:
   - ``static`` with ``static_chunk_fraction = 1 - P / limit``: chunks may use exactly what the peak of
     activations leaves, as a careful ZeRO-Offload user would configure it;
   - ``auto``: PatrickStar's trace-driven placement with the same budget.

Every run trains ``--warmup + --steps`` steps in a fresh Python process (``--no-isolate``: a fresh Trainer
in this process) with the same ``--chunk-size``, so every run has the same chunk layout. Reported per run:

- bytes moved per iteration: ``(h2d + d2h)`` read from ``memory_report()`` after the last step minus the same
  after the last warm-up step, divided by ``--steps``; evictions and prefetches per iteration likewise.
  Setup-time copies and the ``--warmup`` steps are excluded: the first iteration records the trace while
  chunks may use only a small share of the device, and the second fetches back what that share pushed out;
  the steady state starts after them (``moved_per_step`` in the JSON shows every step);
- the median wall time of the measured steps (training batch start to end: forward, backward, optimizer);
- whether every training loss, warm-up included, equals the unconstrained run's bit for bit.

The optimum: every run's ``memory_report()`` brackets the fewest bytes any placement could move per iteration
with its warm-up trace, budget and optimizer placement (``optimal_bytes_lower_bound`` and the feasible plan's
``optimal_bytes_upper_bound``, equal where the optimum is exact; see [Note: the yardstick] in
``lightning_pstar/runtime/yardstick.py``). The table compares both policies with the auto run's optimum (the
placement the engine chooses): ``auto/opt`` and ``static/opt`` divide by the lower bound, so a ratio is never
flattered by a loose bound.

``--model shallow`` trains a 2-layer GPT at batch 8, whose activations are about as large as its model data
(the demo GPT's are about twice its model data).

Targets: auto never moves more bytes than static at any budget, auto moves at most 1.15x the optimum, and at
f = 0.5 auto moves at most 0.5x what static moves on the demo GPT (0.7x on the shallow model). In mixed
precision (14 bytes/param, 2 of them the param chunk) every budget from f = 2/14 up holds all param chunks
beside the peak of activations, so neither policy evicts: static steps every family on the host (its param
chunk goes down with the gradient and comes back with the new weights), auto keeps the optimizer states of the
families that fit the margin on the device and those stop moving. The ratio is then the share of families
stepping on the host: at least 1 - (0.5 - 2/14) / (12/14) = 0.583 at f = 0.5, quantised by the family count
(26 families, 11 on the device: 0.586). Putting one more family's states (6 of its param chunk's bytes) on the
device saves 2 param chunks of traffic but needs 6 param chunks' room at the peak, whose evictions cost at least
one param chunk each: the trade never pays, so 0.5 is out of reach under these rules, and the yardstick (which
takes the optimizer placement as given) shows auto at the optimum.

The chunk size is chosen, unless given, as the one that wastes the fewest elements while leaving at least
``--min-families`` chunk families (placement needs units to move).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its sibling module
from _launch import QUIET_TRAINER  # noqa: E402

RESULT_PREFIX = "PLACEMENT_RESULT "
POLICIES = ("static", "auto")
TARGET_RATIO_AT_HALF = {"demo": 0.5, "shallow": 0.7}
TARGET_OF_OPTIMUM = 1.15
HALF = 0.5
MODELS = {"demo": {"n_layer": 4, "batch_size": 16}, "shallow": {"n_layer": 2, "batch_size": 8}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--child`` is internal (one measured run, its spec as JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--budgets",
        default="1.0,0.8,0.6,0.5,0.4,0.3",
        help="comma-separated fractions f of the model data the device budget holds beyond the peak of"
        " non-model memory: limit = P + f * M (default: 1.0,0.8,0.6,0.5,0.4,0.3)",
    )
    parser.add_argument("--steps", type=int, default=10, help="measured training steps per run (default: 10)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="steps run first and not measured (default: 2). The first records PatrickStar's trace while chunks"
        " may use only a small share of the device; the second fetches back what that share pushed out",
    )
    parser.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=["bf16-mixed", "16-mixed", "32-true"],
        help="Trainer precision of every run (default: bf16-mixed)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="demo",
        help="demo: the 4-layer demo GPT at batch 16; shallow: 2 layers at batch 8, activations about as large as"
        " the model data (--n-layer and --batch-size override either)",
    )
    parser.add_argument("--n-layer", type=int, default=None)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="chunk size in elements (default: the least wasteful size leaving --min-families families)",
    )
    parser.add_argument("--min-families", type=int, default=16, help="fewest chunk families (default: 16)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads in each run (default: torch's choice)",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each measurement in a fresh Python process (default: on)",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = MODELS[args.model]
    args.n_layer = preset["n_layer"] if args.n_layer is None else args.n_layer
    args.batch_size = preset["batch_size"] if args.batch_size is None else args.batch_size
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step is PatrickStar's warm-up)")
    try:
        args.budget_fractions = [float(f) for f in args.budgets.split(",") if f.strip()]
    except ValueError:
        parser.error(f"--budgets must be comma-separated numbers, got {args.budgets!r}")
    if not args.budget_fractions or any(not 0 < f <= 4 for f in args.budget_fractions):
        parser.error(f"--budgets must be fractions in (0, 4], got {args.budgets!r}")
    if args.chunk_size is not None and args.chunk_size < 1:
        parser.error("--chunk-size must be >= 1")
    from lightning_pstar.demos.corpus import VOCAB

    if args.vocab_size < len(VOCAB):
        parser.error(f"--vocab-size must cover the corpus's {len(VOCAB)} symbols, got {args.vocab_size}")
    if args.min_families < 1:
        parser.error("--min-families must be >= 1")
    return args


# --------------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------------


def choose_chunk_size(args: argparse.Namespace) -> dict[str, Any]:
    """The chunk size of every run and what its layout looks like (no memory is allocated)."""
    import torch

    from lightning_pstar.demos import GPT
    from lightning_pstar.planning.layout import ALIGN, ParamSpec, plan_layout

    with torch.device("meta"):
        model = GPT(gpt_config(args))
    specs = [ParamSpec(name=n, numel=p.numel(), trainable=True) for n, p in model.named_parameters()]
    if args.chunk_size is not None:
        sizes = [args.chunk_size]
    else:
        total = sum(s.numel for s in specs)
        largest = max(s.numel for s in specs)
        high = max(ALIGN, total // args.min_families // ALIGN * ALIGN)
        low = max(ALIGN, min(high, largest // 4 // ALIGN * ALIGN))
        step = max(ALIGN, (high - low) // 512 // ALIGN * ALIGN)
        sizes = list(range(low, high + 1, step))
    best = None
    for size in sizes:
        layout = plan_layout(specs, size)
        enough = len(layout.chunks) >= args.min_families or args.chunk_size is not None
        # fewest wasted elements; ties go to the larger chunk (fewer, larger copies)
        if enough and (best is None or layout.capacity_elements <= best.capacity_elements):
            best = layout
    if best is None:
        raise SystemExit(
            f"no chunk size leaves {args.min_families} chunk families for this model."
            " HINT: lower --min-families or pass --chunk-size."
        )
    return {
        "chunk_size": best.chunk_size,
        "families": len(best.chunks),
        "utilisation": best.utilisation,
        "num_params": best.payload_elements,
    }


def gpt_config(args: argparse.Namespace) -> Any:
    from lightning_pstar.demos import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )


# --------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------


def run_one(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    """Train once with the placement in ``spec`` in this process and return the measurements."""
    # Imported here so that the parent process stays light and each child pays its own import cost.
    import lightning as L
    import torch

    from lightning_pstar import PatrickStarStrategy
    from lightning_pstar.demos import GPTLightningModule, StdlibCharDataModule

    class Probe(L.Callback):
        """Loss, wall time and the engine's cumulative counters after every training batch."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.times: list[float] = []
            self.counters: list[dict[str, int]] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
        ) -> None:
            self.times.append(time.perf_counter() - self._start)
            self.losses.append(float(outputs["loss"]))  # fp32 -> float is exact; JSON round-trips it exactly
            strategy = trainer.strategy
            assert isinstance(strategy, PatrickStarStrategy)
            report = strategy.memory_report()
            self.counters.append(
                {
                    "h2d": report.h2d_bytes,
                    "d2h": report.d2h_bytes,
                    "evictions": report.evictions,
                    "prefetches": report.prefetches,
                    "clean": report.clean_moves,
                    "dirty": report.dirty_moves,
                }
            )

    if args.threads is not None:
        # Through the environment as well: Lightning's DDP-based strategies reset the thread count at their
        # first setup in a process unless OMP_NUM_THREADS is set, and runs with different thread counts may
        # reduce in a different order (and then differ in their last bits)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    total_steps = args.warmup + args.steps
    datamodule = StdlibCharDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        # enough text that no batch repeats within the run, and little more
        max_chars=max(50_000, 2 * total_steps * args.batch_size * (args.block_size + 1)),
        val_fraction=0.05,
    )
    config = gpt_config(args)
    module = GPTLightningModule(
        vocab_size=config.vocab_size,
        block_size=config.block_size,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        warmup_steps=min(10, total_steps),
        fused=True,
        meta_init=True,
    )
    strategy = PatrickStarStrategy(
        placement=spec["placement"],
        device_memory_limit=spec["device_memory_limit"],
        static_chunk_fraction=spec["static_chunk_fraction"],
        chunk_size=args.chunk_size,
    )
    probe = Probe()
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=total_steps,
        **QUIET_TRAINER,
        # A DDPStrategy subclass would otherwise get a DistributedSampler even at one rank.
        use_distributed_sampler=False,
        callbacks=[probe],
    )
    trainer.fit(module, datamodule=datamodule)
    report = strategy.memory_report()
    if len(probe.losses) != total_steps:
        raise RuntimeError(f"expected {total_steps} training steps, ran {len(probe.losses)}")

    first, last = probe.counters[args.warmup - 1], probe.counters[-1]

    def per_step(key: str) -> float:
        return (last[key] - first[key]) / args.steps

    return {
        **spec,
        "losses": probe.losses,
        "median_step_s": statistics.median(probe.times[args.warmup :]),
        "step_times_s": probe.times,
        "h2d_per_iter": per_step("h2d"),
        "d2h_per_iter": per_step("d2h"),
        "moved_per_iter": per_step("h2d") + per_step("d2h"),
        "evictions_per_iter": per_step("evictions"),
        "prefetches_per_iter": per_step("prefetches"),
        "clean_moves_per_iter": per_step("clean"),
        "dirty_moves_per_iter": per_step("dirty"),
        "optimal_lower": report.optimal_bytes_lower_bound,
        "optimal_upper": report.optimal_bytes_upper_bound,
        "optimal": report.optimal_bytes_per_iteration,
        "report_moved_per_iter": report.moved_bytes_per_iteration,
        "evictions_total": report.evictions,
        # bytes moved by each step, warm-up included (the first also counts the copies made at setup)
        "moved_per_step": [
            c["h2d"] + c["d2h"] - (p["h2d"] + p["d2h"])
            for p, c in zip([{"h2d": 0, "d2h": 0}, *probe.counters[:-1]], probe.counters, strict=True)
        ],
        "model_data_bytes": report.model_data_bytes,
        "peak_non_model_bytes": report.peak_non_model_bytes,
        "optimizer_tier": report.optimizer_tier,
        "num_chunks": report.num_chunks,
        "device": str(trainer.strategy.root_device),
        "threads": torch.get_num_threads(),
    }


def measure(args: argparse.Namespace, raw_argv: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    """One run, in a fresh interpreter (``--isolate``) or in this process."""
    print(f"running {spec['label']} ...", flush=True)
    if not args.isolate:
        try:
            return run_one(args, spec)
        except Exception as err:  # reported in the table like a failed child, with its traceback
            import traceback

            return {**spec, "error": f"{type(err).__name__}: {err}", "log": traceback.format_exc()}
    cmd = [sys.executable, str(Path(__file__).resolve()), *raw_argv, "--child", json.dumps(spec)]
    env = dict(os.environ)
    # make the repository importable when the package is not installed (a plain checkout)
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    if args.threads is not None:
        # Lightning's DDP-based strategies reset the thread count at setup unless OMP_NUM_THREADS is set
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout[-2000:] + proc.stderr[-6000:]).strip()
        return {**spec, "error": f"exit code {proc.returncode}: {tail.splitlines()[-1] if tail else ''}", "log": tail}
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def run_spec(label: str, placement: str, limit: int | None, static_fraction: float = 1.0) -> dict[str, Any]:
    return {
        "label": label,
        "placement": placement,
        "device_memory_limit": limit,
        "static_chunk_fraction": static_fraction,
    }


def static_fraction_for(limit: int, non_model_peak: int) -> float:
    """``static_chunk_fraction`` that leaves exactly ``non_model_peak`` of ``limit`` to activations."""
    fraction = (limit - non_model_peak) / limit
    while int(limit * fraction) < limit - non_model_peak:  # float rounding must not shrink the chunks' share
        fraction = math.nextafter(fraction, 1.0)
    return min(1.0, fraction)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def optimum_at(rows: list[dict[str, Any]], budget: float) -> tuple[int, int] | None:
    """The auto run's bracket of the optimum at ``budget`` (lower, upper), None when unknown."""
    for r in rows:
        if r["budget"] == budget and r["placement"] == "auto" and "error" not in r:
            if r.get("optimal_lower") is not None and r.get("optimal_upper") is not None:
                return r["optimal_lower"], r["optimal_upper"]
    return None


def ratio(moved: float, base: float) -> float:
    return moved / base if base else (1.0 if moved == 0 else math.inf)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'f':>5} {'limit':>11} {'policy':<7} {'static frac':>11} {'moved/iter':>12} {'optimum/iter':>21}"
        f" {'x opt':>6} {'h2d/iter':>11} {'d2h/iter':>11} {'clean/dirty':>11} {'evict/iter':>10}"
        f" {'prefetch/iter':>13} {'median step':>12}  {'losses == unconstrained':<23}  optimizer on"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        frac = f"{r['static_chunk_fraction']:.4f}" if r["placement"] == "static" else "-"
        lead = f"{r['budget']:>5.2f} {mib(r['device_memory_limit']):>11} {r['placement']:<7} {frac:>11}"
        if "error" in r:
            print(f"{lead} FAILED: {r['error']}")
            continue
        bracket = optimum_at(rows, r["budget"])
        if bracket is None:
            opt, times = "unknown", "-"
        else:
            low, high = bracket
            opt = mib(low) if low == high else f"{low / 2**20:.2f}..{high / 2**20:.2f} MiB"
            times = f"{ratio(r['moved_per_iter'], low):.3f}"
        moves = f"{r['clean_moves_per_iter']:.1f}/{r['dirty_moves_per_iter']:.1f}"
        print(
            f"{lead} {mib(r['moved_per_iter']):>12} {opt:>21} {times:>6} {mib(r['h2d_per_iter']):>11}"
            f" {mib(r['d2h_per_iter']):>11} {moves:>11} {r['evictions_per_iter']:>10.1f}"
            f" {r['prefetches_per_iter']:>13.1f} {r['median_step_s'] * 1e3:>9.1f} ms  {str(r['losses_equal']):<23}"
            f"  {r['optimizer_tier']}"
        )
    print()


def check_targets(rows: list[dict[str, Any]], model: str = "demo") -> tuple[bool, list[str]]:
    """Evaluate the targets; return whether all hold and one line per target."""
    lines: list[str] = []
    ok = True
    failed = [r for r in rows if "error" in r]
    if failed:
        ok = False
        lines.append(f"every run completed: FAIL ({', '.join(r['label'] for r in failed)})")
    by_budget: dict[float, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            by_budget.setdefault(r["budget"], {})[r["placement"]] = r
    worse = []
    for f, pair in sorted(by_budget.items(), reverse=True):
        if len(pair) == 2 and pair["auto"]["moved_per_iter"] > pair["static"]["moved_per_iter"]:
            worse.append(f"f={f:g}")
    ok &= not worse
    lines.append(
        f"auto never moves more than static: {_verdict(not worse)}" + (f" ({', '.join(worse)})" if worse else "")
    )
    far = []
    for f, pair in sorted(by_budget.items(), reverse=True):
        bracket = optimum_at(rows, f)
        if "auto" in pair and bracket is not None:
            times = ratio(pair["auto"]["moved_per_iter"], bracket[0])
            if times > TARGET_OF_OPTIMUM:
                far.append(f"f={f:g}: {times:.3f}")
    ok &= not far
    lines.append(
        f"auto within {TARGET_OF_OPTIMUM}x of the optimum (its lower bound): {_verdict(not far)}"
        + (f" ({', '.join(far)})" if far else "")
    )
    half = by_budget.get(HALF, {})
    target = TARGET_RATIO_AT_HALF.get(model, TARGET_RATIO_AT_HALF["demo"])
    if len(half) == 2:
        times = ratio(half["auto"]["moved_per_iter"], half["static"]["moved_per_iter"])
        passed = times <= target
        ok &= passed
        lines.append(f"at f={HALF:g} auto/static bytes moved: {times:.3f} (target <= {target}): {_verdict(passed)}")
    else:
        lines.append(f"at f={HALF:g} auto/static bytes moved: not measured (add {HALF:g} to --budgets)")
    mismatched = [r["label"] for r in rows if "error" not in r and not r["losses_equal"]]
    ok &= not mismatched
    lines.append(
        f"losses == unconstrained in every run: {_verdict(not mismatched)}"
        + (f" ({', '.join(mismatched)})" if mismatched else "")
    )
    return ok, lines


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def main(argv: list[str] | None = None) -> int:
    """Parent: the unconstrained run, then static and auto per budget, then the table and the targets."""
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.child is not None:
        print(RESULT_PREFIX + json.dumps(run_one(args, json.loads(args.child))), flush=True)
        return 0

    layout = choose_chunk_size(args)
    if args.chunk_size is None:
        args.chunk_size = layout["chunk_size"]
        raw = [*raw, "--chunk-size", str(args.chunk_size)]
    print(
        f"{args.model} GPT: {layout['num_params']:,} parameters, n_layer={args.n_layer} n_embd={args.n_embd}"
        f" block={args.block_size} batch={args.batch_size}, {args.precision};"
        f" chunk_size {args.chunk_size:,} -> {layout['families']} families"
        f" ({layout['utilisation']:.1%} utilisation); {args.warmup} warm-up + {args.steps} measured steps per run"
    )
    base = measure(args, raw, run_spec("unconstrained", "auto", None))
    if "error" in base:
        sys.stderr.write(base.get("log", "") + "\n")
        raise SystemExit(f"the unconstrained run failed: {base['error']}")
    model_data, peak = base["model_data_bytes"], base["peak_non_model_bytes"]
    print(
        f"unconstrained: model data M = {mib(model_data)}, peak non-model P = {mib(peak)},"
        f" {base['median_step_s'] * 1e3:.1f} ms/step"
    )

    rows: list[dict[str, Any]] = []
    for f in args.budget_fractions:
        limit = int(peak + f * model_data)
        for placement in POLICIES:
            fraction = static_fraction_for(limit, peak) if placement == "static" else 1.0
            row = measure(args, raw, run_spec(f"{placement} f={f:g}", placement, limit, fraction))
            row["budget"] = f
            if "error" not in row:
                row["losses_equal"] = row["losses"] == base["losses"]
            rows.append(row)

    print_table(rows)
    print(
        "bytes moved per iteration = (h2d + d2h after the last step - after the last warm-up step) / measured steps;"
        " optimum: the auto run's yardstick (one value: exact; a..b: lower and upper bound), x opt = moved / lower"
        " bound; clean/dirty: moves off the device without / with a copy per iteration; median step over the"
        " measured steps"
    )
    ok, lines = check_targets(rows, args.model)
    for line in lines:
        print(line)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "layout": layout,
            "unconstrained": base,
            "rows": rows,
            "targets": lines,
            "ok": ok,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"results written to {args.json}")
    if any("error" in r for r in rows):
        for r in rows:
            if "error" in r:
                sys.stderr.write(f"--- {r['label']} ---\n{r.get('log', '')}\n")
        return 1
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
