"""What offload costs and buys on one GPU: PatrickStar with and without an offloading budget, FSDP2 with
``CPUOffloadPolicy``, Lightning's ``deepspeed_stage_3_offload`` and a no-offload baseline, on a GPT ladder.

    python benchmarks/gpu_check.py --json /tmp/gpu_check.json             # one H200, under 8 minutes
    python benchmarks/gpu_check.py --tiny --json /tmp/gpu_check_tiny.json # CPU, tiny model, same code path

Every strategy trains the demo GPT at one rank in ``bf16-mixed``:

- ``patrickstar``: ``PatrickStarStrategy(host_memory_limit=H)`` with its default device budget (0.8 of the GPU;
  unlimited on the simulated device of ``--tiny``): offloads only what does not fit;
- ``patrickstar-offload``: the same with ``device_memory_limit`` set so that the model data is 2-4x the budget
  (a third of it, or activations plus two chunk groups if that is more): every step moves chunks;
- ``fsdp-offload``: ``ModelParallelStrategy`` with ``fully_shard`` (``CPUOffloadPolicy``, bf16
  ``MixedPrecisionPolicy``) per block and at the root, built on the meta device, materialised on the host;
- ``deepspeed-offload``: Lightning's ``deepspeed_stage_3_offload`` with ``DeepSpeedCPUAdam``, where ``import
  deepspeed`` works; otherwise its rows say why not (the script never installs anything);
- ``baseline``: the same FSDP2 module without offload (everything on the GPU), at the sizes that fit.

Sizes are GPT-3-like shapes (head size 128, vocabulary 50304, block 1024) from 1.3B parameters up. A rung is
tried only when it is predicted to fit, so that no time goes to sizes the planner already rules out:

    activations  A = n_layer * 34 * b * T * n_embd + 10 * b * T * vocab      (bf16, no recomputation)
    patrickstar(-offload): lightning_pstar.planning.plan_capacity(device_memory = D - A, host_memory = H).fits
    fsdp-offload:      16 P <= H  and  A + 4 U <= D   (U: parameters of the largest FSDP unit)
    deepspeed-offload: 18 P <= H  and  A + 4 U <= D
    baseline:          16 P + A + 4 U <= D

Every run is a fresh process (``--worker``). The order serves a fixed time budget (``--time-budget``, default
420 s; no run starts after it, a running one is killed 30 s past it): each strategy's smallest rung, then its
ladder from the top down until a run trains (the largest it trains), then the rungs in between.

Per run, after ``--warmup`` untimed steps: the median step time over ``--steps`` steps; tokens/s; MFU =
(6 P + 12 n_layer n_embd T) * tokens / step time against ``--peak-tflops`` (default from the GPU's name: 989
bf16 dense for H100/H200); the peak device bytes (``torch.cuda.max_memory_allocated`` and ``_reserved``, the
same counters for every strategy: all allocate through torch's caching allocator); the host RSS peak; the
pinned bytes torch's host allocator held at its peak (``torch.cuda.host_memory_stats``); and the bytes moved
between host and device in one more step, profiled with ``torch.profiler`` (the ``gpu_memcpy`` events of its
trace, the same for every strategy; on the CPU of ``--tiny``, PatrickStar's own counters). ``--tiny`` runs
every path it can on the CPU with a tiny model (1 + ``--steps`` steps).
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
from typing_extensions import override

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.config import parse_bytes
from lightning_pstar.demos import GPT, GPTConfig, GPTLightningModule, StdlibCharDataModule, gpt_num_params
from lightning_pstar.demos.timing import StepTimer
from lightning_pstar.planning import plan_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its sibling module
from _launch import QUIET_TRAINER  # noqa: E402
from gpu_peers import DeepSpeedGPTModule, FSDPGPTModule, FSDPStrategy  # noqa: E402

STRATEGIES = ("patrickstar", "patrickstar-offload", "fsdp-offload", "deepspeed-offload", "baseline")
LADDER = ((24, 2048), (32, 2560), (36, 3072), (32, 4096), (36, 4608), (40, 5120), (40, 5632), (44, 6144), (48, 7168))
"""(n_layer, n_embd) from 1.3B to 30B parameters; n_head = n_embd / 128."""
TINY_LADDER = ((2, 128),)
OFFLOAD_RATIO = 3
"""patrickstar-offload: model data / device budget (the issue's 2-4x)."""
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
    p.add_argument("--no-profile", action="store_true", help="skip the profiled step that measures bytes moved")
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
    device_memory: int | None  # the strategy's device budget, bytes (None: its default)
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


def flops_per_token(cfg: GPTConfig) -> int:
    """Training FLOPs per token: 6 P for the weights plus 12 n_layer n_embd T for attention (PaLM, appendix B)."""
    return 6 * gpt_num_params(cfg) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def deepspeed_missing() -> str | None:
    """Why Lightning's deepspeed_stage_3_offload cannot run here, or None when ``import deepspeed`` works."""
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure to import is the reason reported
        return (
            f"deepspeed is not importable here ({type(err).__name__}: {err}); this script installs nothing:"
            " `pip install deepspeed` (its CPU Adam op builds against the CUDA toolkit) makes the rows run"
        )
    return None


def _plan(cfg: GPTConfig, device: int, host: int) -> Any:
    return plan_capacity(
        lambda: GPT(cfg), device_memory=device, host_memory=host, precision="bf16-mixed", search_largest=False
    )


def offload_budget(cfg: GPTConfig, run: Run, args: argparse.Namespace) -> tuple[int, float]:
    """patrickstar-offload's device budget and the model data / budget ratio it gives: a third of the model data,
    or activations plus the one module's chunks plus as much again where that is more."""
    ref = _plan(cfg, 1 << 62, run.host_memory)
    budget = max(
        ref.model_data_bytes_per_rank // OFFLOAD_RATIO,
        activation_bytes(cfg, args.batch_size) + 2 * ref.min_device_bytes,
    )
    return budget, ref.model_data_bytes_per_rank / budget


def predicted_fit(run: Run, args: argparse.Namespace, device: int) -> tuple[bool, str]:
    """Whether the rung should fit under the run's strategy (``device``: the GPU's budget D), and why not."""
    cfg = run.config(args)
    act = activation_bytes(cfg, args.batch_size)
    params = gpt_num_params(cfg)
    block = gpt_num_params(replace(cfg, n_layer=2)) - gpt_num_params(replace(cfg, n_layer=1))
    unit = max(block, params - cfg.n_layer * block)
    if run.strategy in ("fsdp-offload", "deepspeed-offload"):
        if run.strategy == "deepspeed-offload" and (missing := deepspeed_missing()):
            return False, missing
        host_bytes = (16 if run.strategy == "fsdp-offload" else 18) * params
        if host_bytes > run.host_memory:
            return False, f"host: {host_bytes // params} P > H"
        return act + 4 * unit <= device, "device: A + 4 U > D"
    if run.strategy == "baseline":
        return 16 * params + act + 4 * unit <= device, "device: 16 P + A + 4 U > D"
    budget = device if run.device_memory is None else run.device_memory
    if act >= budget:
        return False, "device: A >= D"
    if run.strategy == "patrickstar-offload":
        _, ratio = offload_budget(cfg, run, args)
        if not 2 <= ratio <= 4:
            return False, f"no budget forces offload here: model data is {ratio:.1f}x the smallest budget"
    plan = _plan(cfg, budget - act, run.host_memory)
    return plan.fits, "; ".join(plan.reasons)


# ---- worker: one run ------------------------------------------------------------------------------------
class MeasureCallback(StepTimer):
    """:class:`StepTimer` plus, after the timed steps, one profiled step that counts the bytes copied between
    host and device (CUDA), and PatrickStar's own transfer counters around the timed steps."""

    def __init__(self, warmup: int, timed: int, profile: bool) -> None:
        super().__init__()
        self.warmup = warmup
        self.timed = timed
        self.profile = profile and torch.cuda.is_available()
        self.transfers: list[int] = []
        self.profiled_bytes: int | None = None
        self._profiler: torch.profiler.profile | None = None

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, i)
        if self.profile and len(self.times) == self.warmup + self.timed:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._profiler.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self._profiler is not None:
            torch.cuda.synchronize()
            self._profiler.__exit__(None, None, None)
            self.profiled_bytes = memcpy_bytes(self._profiler)
            self._profiler = None
        super().on_train_batch_end(trainer, pl_module, outputs, batch, i)
        if isinstance(trainer.strategy, PatrickStarStrategy) and len(self.times) in (
            self.warmup,
            self.warmup + self.timed,
        ):
            report = trainer.strategy.memory_report()
            self.transfers.append(report.h2d_bytes + report.d2h_bytes)


def memcpy_bytes(prof: torch.profiler.profile) -> int | None:
    """Bytes of the host<->device copies in a profile (the ``gpu_memcpy`` events of its chrome trace)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoD" not in e.get("name", "")]
    return sum(int(e.get("args", {}).get("bytes", 0)) for e in copies) if copies else None


def _strategy_and_module(run: Run, sizes: dict[str, Any], total: int) -> tuple[Any, GPTLightningModule]:
    if run.strategy.startswith("patrickstar"):
        module = GPTLightningModule(**sizes, warmup_steps=total, fused=True, meta_init=True)
        return PatrickStarStrategy(device_memory_limit=run.device_memory, host_memory_limit=run.host_memory), module
    if run.strategy == "deepspeed-offload":
        return "deepspeed_stage_3_offload", DeepSpeedGPTModule(**sizes, warmup_steps=total)
    offload = run.strategy == "fsdp-offload"
    module = FSDPGPTModule(offload=offload, param_dtype=torch.bfloat16, **sizes, warmup_steps=total, fused=True)
    return FSDPStrategy(offload=offload, data_parallel_size=1), module


def run_worker(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``run`` in this process and return its measurements."""
    L.seed_everything(1234, verbose=False)
    cfg = run.config(args)
    profile = not args.no_profile and not args.tiny
    total = args.warmup + args.steps + (1 if profile else 0)
    datamodule = StdlibCharDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        max_chars=max(100_000, 2 * total * args.batch_size * (args.block_size + 1)),
        val_fraction=0.05,
    )
    sizes: dict[str, Any] = {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    strategy, module = _strategy_and_module(run, sizes, total)
    timer = MeasureCallback(args.warmup, args.steps, profile)
    trainer = L.Trainer(
        accelerator="cpu" if args.tiny else "auto",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=total,
        **QUIET_TRAINER,
        use_distributed_sampler=False,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=datamodule)
    step = statistics.median(timer.times[args.warmup : args.warmup + args.steps])
    tokens = args.batch_size * args.block_size
    cuda = torch.cuda.is_available() and not args.tiny
    result: dict[str, Any] = {
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "tflops": flops_per_token(cfg) * tokens / step / 1e12,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_cuda_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "pinned_bytes": torch.cuda.host_memory_stats().get("allocated_bytes.peak") if cuda else None,
        "moved_bytes_per_step": timer.profiled_bytes,
        "device_memory_limit": run.device_memory,
    }
    if isinstance(trainer.strategy, PatrickStarStrategy):
        counted = (timer.transfers[-1] - timer.transfers[0]) // args.steps
        result["counted_moved_bytes_per_step"] = counted  # the engine's own counters, CPU and GPU alike
        if result["moved_bytes_per_step"] is None:
            result["moved_bytes_per_step"] = counted
        if not cuda:
            result["pinned_bytes"] = trainer.strategy.memory_report().pinned_bytes
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
            run = Run(strategy=strategy, n_layer=n_layer, n_embd=n_embd, device_memory=None, host_memory=host)
            if strategy == "patrickstar" and (args.device_memory is not None or not args.tiny):
                run = replace(run, device_memory=device)  # D: the strategy's default unless --device-memory
            if strategy == "patrickstar-offload":
                run = replace(run, device_memory=offload_budget(run.config(args), run, args)[0])
            fit, why = predicted_fit(run, args, device)
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
    elif entry["why_not"].startswith("deepspeed is not importable"):
        result = {"error": f"not run: {entry['why_not']}"}
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
        "device_memory_limit": run.device_memory,
        **dict.fromkeys(("step_time_s", "tokens_per_s", "tflops", "mfu", "peak_rss_bytes", "peak_cuda_bytes")),
        **dict.fromkeys(("peak_cuda_reserved_bytes", "pinned_bytes", "moved_bytes_per_step")),
        "model_data_over_budget": None,
        "error": result.get("error"),
    }
    if run.strategy == "patrickstar-offload":
        row["model_data_over_budget"] = round(offload_budget(cfg, run, args)[1], 2)
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
    head = f"{'strategy':<19} {'n_layer':>7} {'n_embd':>6} {'params':>15} {'step':>9} {'tok/s':>8} {'TFLOPS':>7}"
    head += f" {'MFU':>6} {'CUDA peak':>10} {'RSS peak':>10} {'pinned':>10} {'moved/step':>11}  status"
    print(head + "\n" + "-" * len(head))

    for r in rows:
        status = "trained" if r["trained"] else (r["error"] or r["why_not"] or "not run")
        step = f"{r['step_time_s']:.3f} s" if r["step_time_s"] is not None else "-"
        tok = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] is not None else "-"
        tfl = f"{r['tflops']:.2f}" if r["tflops"] is not None else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"{r['strategy']:<19} {r['n_layer']:>7} {r['n_embd']:>6} {r['params']:>15,} {step:>9} {tok:>8}"
              f" {tfl:>7} {mfu:>6} {gib(r['peak_cuda_bytes']):>10} {gib(r['peak_rss_bytes']):>10}"
              f" {gib(r['pinned_bytes']):>10}"
              f" {gib(r['moved_bytes_per_step']):>11}  {status}")  # fmt: skip
    largest = {}
    for strategy in args.strategy_list:
        trained = [r for r in rows if r["strategy"] == strategy and r["trained"]]
        best = max(trained, key=lambda r: r["params"]) if trained else None
        largest[strategy] = None if best is None else {k: best[k] for k in ("n_layer", "n_embd", "params")}
        print(f"largest trained with {strategy}: " + (f"{best['params']:,} parameters" if best else "none"))
    missing = deepspeed_missing() if "deepspeed-offload" in args.strategy_list else None
    if missing:
        print(f"deepspeed-offload: not run: {missing}")
    return {
        "deepspeed": missing or "available",
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
    # every strategy that some rung was predicted to fit trained one (deepspeed may be absent: its rows say so)
    runnable = {r["strategy"] for r in rows if r["predicted_fit"]}
    return 0 if all(document["largest"][s] is not None for s in runnable) else 1


if __name__ == "__main__":
    sys.exit(main())
