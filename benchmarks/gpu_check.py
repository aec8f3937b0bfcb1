"""PatrickStar against its peers on one GPU, side by side on the same models, in one lent run of under 8 minutes.

    python benchmarks/gpu_check.py --json /tmp/gpu_check.json             # one H200 + 128 GiB host
    python benchmarks/gpu_check.py --tiny --json /tmp/gpu_check_tiny.json # CPU, tiny model, same code path

Every strategy trains the demo GPT at one rank in ``bf16-mixed`` with a fine-tuning-sized optimizer step:
``--accumulate`` micro-batches of ``--batch-size`` x ``--block-size`` tokens per step (default 4 x 8 x 1024 =
32,768 tokens), so the compute per optimizer step is what users run, not a step bound by host Adam alone.

- ``patrickstar-host``: PatrickStar with the optimizer states forced to the host. Where the strategy accepts
  ``optimizer_placement`` (checked with ``inspect.signature`` and the flat options), ``optimizer_placement="host"``
  with ``optimizer_overlap=--host-overlap`` (default "pipeline": "auto" would spend 15 steps timing both schedules);
  until then ``placement="static"`` with a chunk share of half the model data, which puts the optimizer side on
  the host (``StaticPlacement.optimizer_tier``) and keeps the param chunks on the device. The row says which.
- ``patrickstar``: PatrickStar's default placement (``auto``) and default device budget;
- ``fsdp-offload``: ``ModelParallelStrategy`` with ``fully_shard`` (``CPUOffloadPolicy``, bf16
  ``MixedPrecisionPolicy``) per block and at the root, built on the meta device, materialised on the host;
- ``fsdp``: the same FSDP2 module without offload (everything on the GPU);
- ``deepspeed-offload``: Lightning's ``deepspeed_stage_3_offload`` with ``DeepSpeedCPUAdam`` where DeepSpeed can
  run; the GPU box reaches no registry and the script installs nothing, so otherwise the row says precisely why
  (the import's error, or the worker's).

PatrickStar's rows skip the hand-back of the weights at the end (``hand_back_weights=False``, as a run whose
weights leave through a checkpoint does).

Sizes are GPT-3-like shapes (head size 128, vocabulary 50304, block 1024), bottom-up. A rung is tried only when
it is predicted to fit (so no time goes to sizes already ruled out), and a strategy climbs to the next rung only
after the previous one trained:

    activations  A = n_layer * 34 * b * T * n_embd + 10 * b * T * vocab      (one micro-batch, bf16)
    patrickstar:       lightning_pstar.planning.plan_capacity(device_memory = D - A, host_memory = H).fits
    patrickstar-host:  16 P <= H  and  plan_capacity(...).fits
    fsdp-offload:      16 P <= H  and  A + 4 U <= D   (U: parameters of the largest FSDP unit)
    deepspeed-offload: 18 P <= H  and  A + 4 U <= D
    fsdp:              16 P + A + 4 U <= D

Every run is a fresh process (``--worker``) with its own time cap (``--run-cap``, and never past the whole
check's ``--time-budget``). Its result line is printed the moment the worker reports it -- at the end of
training, before the teardown, with the peak RSS and device peaks read then -- and the worker gets
``--teardown-grace`` seconds to exit after it (else it is killed; its result stands).

Per run, after ``--warmup`` untimed optimizer steps: the median step time over ``--steps`` steps; tokens/s; MFU =
(6 P + 12 n_layer n_embd T) * tokens / step time against ``--peak-tflops`` (default from the GPU's name: 989 bf16
dense for H100/H200); the peak device bytes allocated and reserved (the same counters for every strategy); the
peak host RSS; the pinned bytes torch's host allocator held at its peak; and one more step's breakdown (forward,
backward, optimizer step; host<->device copies, host Adam and host waits from its profile: benchmarks/
_gpu_measure.py). The report ends with the largest model each strategy trained and PatrickStar's ratios against
each peer (tokens/s at every rung both trained, and largest model).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.config import FLAT_OPTIONS, parse_bytes
from lightning_pstar.demos import GPT, GPTConfig, GPTLightningModule, StdlibCharDataModule, gpt_num_params
from lightning_pstar.planning import plan_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its sibling modules
from _gpu_measure import Measure  # noqa: E402
from _launch import QUIET_TRAINER  # noqa: E402
from gpu_peers import DeepSpeedGPTModule, FSDPGPTModule, FSDPStrategy  # noqa: E402

STRATEGIES = ("patrickstar-host", "patrickstar", "fsdp-offload", "fsdp", "deepspeed-offload")
PSTAR = ("patrickstar-host", "patrickstar")
LADDER = ((24, 2048), (32, 2560), (32, 4096), (40, 5120), (48, 6144), (48, 7168))
"""(n_layer, n_embd) from 1.3B to 30B parameters; n_head = n_embd / 128."""
TINY_LADDER = ((2, 128),)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
"""Dense bf16 peak per GPU model (SXM parts)."""
RESULT_PREFIX = "GPU_CHECK_RESULT "


# ---- options --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--worker`` is internal (one run)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU, tiny model, few steps: the code path without a GPU")
    p.add_argument("--sizes", default=None, help="rungs as LAYERSxEMBD, comma-separated (default: the ladder)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated subset of {STRATEGIES}")
    p.add_argument("--batch-size", type=int, default=None, help="micro-batch (default 8; tiny 2)")
    p.add_argument("--accumulate", type=int, default=None, help="micro-batches per optimizer step (default 4; tiny 2)")
    p.add_argument("--block-size", type=int, default=None, help="sequence length (default 1024; tiny 32)")
    p.add_argument("--vocab-size", type=int, default=None, help="default 50304 (tiny 128)")
    p.add_argument("--steps", type=int, default=None, help="measured optimizer steps (default 2; tiny 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first optimizer steps, >= 1 (default 1)")
    p.add_argument("--device-memory", default=None, help="device budget D (default: 0.8 of the GPU; tiny 1GiB)")
    p.add_argument("--host-memory", default=None, help="host budget H (default: 0.8 of the RAM)")
    p.add_argument("--peak-tflops", type=float, default=None, help="for MFU (default: from the GPU's name)")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds after which no run starts (default 420)")
    p.add_argument("--run-cap", type=float, default=150.0, help="seconds one run may take (default 150)")
    p.add_argument("--teardown-grace", type=float, default=20.0, help="seconds a worker may take after its result")
    p.add_argument("--no-profile", action="store_true", help="no profile in the breakdown step (phases only)")
    p.add_argument(
        "--host-overlap",
        default="pipeline",
        choices=("pipeline", "off", "auto"),
        help="optimizer_overlap of the patrickstar-host rows (default pipeline: 'auto' times both schedules first)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tiny = {"batch_size": 2, "accumulate": 2, "block_size": 32, "vocab_size": 128, "steps": 1}
    full = {"batch_size": 8, "accumulate": 4, "block_size": 1024, "vocab_size": 50304, "steps": 2}
    for name, value in (tiny if args.tiny else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < 1 or args.warmup < 1 or args.accumulate < 1:
        p.error("--steps, --warmup and --accumulate must be >= 1 (PatrickStar's warm-up step is not timed)")
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


def host_optimizer_option() -> bool:
    """Whether PatrickStarStrategy accepts ``optimizer_placement`` (its signature, or its flat options)."""
    return "optimizer_placement" in inspect.signature(PatrickStarStrategy.__init__).parameters or (
        "optimizer_placement" in FLAT_OPTIONS
    )


def deepspeed_missing() -> str | None:
    """Why Lightning's deepspeed_stage_3_offload cannot run here, or None when DeepSpeed and its CPU Adam can."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as err:  # noqa: BLE001 - any failure to import is the reason reported
        return (
            f"deepspeed is not importable here ({type(err).__name__}: {err}); the GPU box reaches no registry and"
            " this script installs nothing (DeepSpeed's CPU Adam op also builds against the CUDA toolkit: a wheel"
            " carried in the tree would still need nvcc and ninja there)"
        )
    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        return "deepspeed is importable but its CPUAdamBuilder is not compatible with this machine (no compiler?)"
    return None


def _plan(cfg: GPTConfig, device: int, host: int) -> Any:
    return plan_capacity(
        lambda: GPT(cfg), device_memory=device, host_memory=host, precision="bf16-mixed", search_largest=False
    )


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
    if run.strategy == "fsdp":
        return 16 * params + act + 4 * unit <= device, "device: 16 P + A + 4 U > D"
    if act >= device:
        return False, "device: A >= D"
    if run.strategy == "patrickstar-host" and 16 * params > run.host_memory:
        return False, "host: 16 P > H"
    plan = _plan(cfg, device - act, run.host_memory)
    return plan.fits, "; ".join(plan.reasons)


# ---- worker: one run ------------------------------------------------------------------------------------
def _pstar(run: Run, cfg: GPTConfig, args: argparse.Namespace) -> tuple[PatrickStarStrategy, str]:
    """The PatrickStar strategy of the run and how its optimizer placement was chosen."""
    options: dict[str, Any] = {"host_memory_limit": run.host_memory, "hand_back_weights": False}
    if run.device_memory is not None:
        options["device_memory_limit"] = run.device_memory
    if run.strategy == "patrickstar":
        return PatrickStarStrategy(**options), "default (auto)"
    if host_optimizer_option():
        options.update(optimizer_placement="host", optimizer_overlap=args.host_overlap)
        return PatrickStarStrategy(**options), f"optimizer_placement='host', optimizer_overlap={args.host_overlap!r}"
    device = run.device_memory if run.device_memory is not None else default_budgets(args)[0]
    model_data = _plan(cfg, 1 << 62, run.host_memory).model_data_bytes_per_rank
    fraction = min(1.0, model_data / 2 / device)
    options.update(placement="static", static_chunk_fraction=fraction, device_memory_limit=device)
    forced = f"placement='static', static_chunk_fraction={fraction:.3g} (no optimizer_placement option yet)"
    return PatrickStarStrategy(**options), forced


def _strategy_and_module(run: Run, args: argparse.Namespace, total: int) -> tuple[Any, L.LightningModule, str]:
    cfg = run.config(args)
    sizes: dict[str, Any] = {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    if run.strategy in PSTAR:
        strategy, placement = _pstar(run, cfg, args)
        return strategy, GPTLightningModule(**sizes, warmup_steps=total, fused=True, meta_init=True), placement
    if run.strategy == "deepspeed-offload":
        return "deepspeed_stage_3_offload", DeepSpeedGPTModule(**sizes, warmup_steps=total), "DeepSpeedCPUAdam"
    offload = run.strategy == "fsdp-offload"
    module = FSDPGPTModule(offload=offload, param_dtype=torch.bfloat16, **sizes, warmup_steps=total, fused=True)
    return FSDPStrategy(offload=offload, data_parallel_size=1), module, "host" if offload else "device"


def run_worker(run: Run, args: argparse.Namespace) -> None:
    """Train ``run`` in this process; its result line is printed at the end of training, before teardown."""
    L.seed_everything(1234, verbose=False)
    cfg = run.config(args)
    steps = args.warmup + args.steps + 1  # the last one is the breakdown step
    micro = steps * args.accumulate
    datamodule = StdlibCharDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        max_chars=max(100_000, 2 * micro * args.batch_size * (args.block_size + 1)),
        val_fraction=0.05,
    )
    strategy, module, placement = _strategy_and_module(run, args, steps)
    tokens = args.accumulate * args.batch_size * args.block_size

    def report(measured: dict[str, Any]) -> None:
        times = measured.pop("step_times_s")
        step = statistics.median(times[args.warmup : args.warmup + args.steps])
        result = {
            "step_time_s": step,
            "tokens_per_s": tokens / step,
            "tflops": flops_per_token(cfg) * tokens / step / 1e12,
            "optimizer_placement": placement,
            "device_memory_limit": run.device_memory,
            **measured,
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)

    measure = Measure(warmup=args.warmup, timed=args.steps, profile=not args.no_profile, report=report)
    measure.extra = _pstar_extra
    trainer = L.Trainer(
        accelerator="cpu" if args.tiny else "auto",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        accumulate_grad_batches=args.accumulate,
        **QUIET_TRAINER,
        use_distributed_sampler=False,
        callbacks=[measure],
    )
    trainer.fit(module, datamodule=datamodule)


def _pstar_extra(trainer: L.Trainer) -> dict[str, Any]:
    """PatrickStar's own figures, read before teardown: where its optimizer ran, bytes it moved, pinned bytes."""
    if not isinstance(trainer.strategy, PatrickStarStrategy):
        return {}
    report = trainer.strategy.memory_report()
    return {
        "optimizer_ran_on": report.optimizer_tier,
        "counted_moved_bytes": report.h2d_bytes + report.d2h_bytes,
        "engine_pinned_bytes": report.pinned_bytes,
        "optimizer_schedule": report.optimizer_schedule,
        "host_step_jobs": report.host_step_jobs,
        "host_steps_in_backward": report.host_steps_in_backward,
        "host_copies_back_in_backward": report.host_copies_back_in_backward,
        "host_sums_in_backward": report.host_sums_in_backward,
        "step_stage_seconds": report.step_stage_seconds,
    }


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


def spawn(
    run: Run, args: argparse.Namespace, raw: list[str], cap: float, on_result: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter, within ``cap`` seconds. Its result goes to ``on_result`` as soon
    as the worker prints it (the worker then has ``--teardown-grace`` seconds to exit) and is returned with how
    the worker ended; a failure comes back as ``{"error": ...}``."""
    env = dict(os.environ)
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    if args.tiny:
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), *raw, "--worker", json.dumps(asdict(run))]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    result: dict[str, Any] | None = None
    deadline = start + cap
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(timeout=min(left, 5.0)) and proc.poll() is not None:
                break
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
                result["result_after_s"] = round(time.monotonic() - start, 1)
                on_result(result)  # printed now, before the worker's teardown
                deadline = min(deadline, time.monotonic() + args.teardown_grace)
            else:
                tail = (tail + [line.rstrip()])[-40:]
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if result is not None:
        exit_s = time.monotonic() - start
        result["teardown"] = "exited" if proc.returncode == 0 else f"exit code {proc.returncode} after its result"
        result["run_s"] = round(exit_s, 1)
        return result
    if time.monotonic() >= start + cap:
        return {"error": f"killed after {cap:.0f} s (its time cap)"}
    errors = [line for line in tail if "Error" in line or "error" in line]
    return {"error": f"exit code {proc.returncode}: " + (errors[-1].strip() if errors else " | ".join(tail[-3:]))}


def run_ladders(args: argparse.Namespace, raw: list[str]) -> list[dict[str, Any]]:
    """Predict every (strategy, rung), then train bottom-up, rung by rung, each strategy side by side on the same
    model; a strategy climbs only while it trains. Every row is printed as soon as its run reports."""
    device, host = default_budgets(args)
    start = time.monotonic()
    entries: dict[tuple[str, int, int], dict[str, Any]] = {}
    for n_layer, n_embd in args.ladder:
        for strategy in args.strategy_list:
            run = Run(strategy=strategy, n_layer=n_layer, n_embd=n_embd, device_memory=None, host_memory=host)
            if strategy in PSTAR and (args.device_memory is not None or not args.tiny):
                run = replace(run, device_memory=device)  # D: the strategy's default unless --device-memory
            fit, why = predicted_fit(run, args, device)
            entries[(strategy, n_layer, n_embd)] = {"run": run, "predicted_fit": fit, "why_not": "" if fit else why}
    print(_header(args), flush=True)
    climbing = set(args.strategy_list)
    for n_layer, n_embd in args.ladder:
        for strategy in args.strategy_list:
            entry = entries[(strategy, n_layer, n_embd)]
            if strategy not in climbing or not entry["predicted_fit"]:
                continue
            left = args.time_budget - (time.monotonic() - start)
            if left <= 0:
                continue  # reported as skipped
            printed: list[bool] = []

            def show(result: dict[str, Any], entry: dict[str, Any] = entry, printed: list[bool] = printed) -> None:
                print(_line(_row({**entry, "result": result}, args)), flush=True)
                printed.append(True)

            entry["result"] = spawn(entry["run"], args, raw, cap=min(args.run_cap, left + GRACE_S), on_result=show)
            if "error" in entry["result"]:
                climbing.discard(strategy)  # a larger model will not train where this one did not
            if not printed:
                show(entry["result"])
    return [_row(entry, args) for entry in entries.values()]


GRACE_S = 30.0
"""A run started just before the time budget ends may run this long past it."""


def _row(entry: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    run: Run = entry["run"]
    cfg = run.config(args)
    if "result" in entry:
        result = entry["result"]
    elif entry["predicted_fit"]:
        result = {"error": "skipped: time budget spent, or a smaller rung did not train"}
    elif entry["why_not"].startswith("deepspeed is"):
        result = {"error": f"not run: {entry['why_not']}"}
    else:
        result = {"error": f"not tried: predicted not to fit ({entry['why_not']})"}
    row: dict[str, Any] = {
        "strategy": run.strategy,
        "n_layer": cfg.n_layer,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "params": gpt_num_params(cfg),
        "tokens_per_step": args.accumulate * args.batch_size * args.block_size,
        "predicted_fit": entry["predicted_fit"],
        "why_not": entry["why_not"],
        "trained": "error" not in result,
        "device_memory_limit": run.device_memory,
        **dict.fromkeys(("step_time_s", "tokens_per_s", "tflops", "mfu", "peak_rss_bytes", "peak_cuda_bytes")),
        **dict.fromkeys(("peak_cuda_reserved_bytes", "pinned_bytes", "optimizer_placement", "breakdown")),
        "error": result.get("error"),
    }
    row.update({k: v for k, v in result.items() if k != "error"})
    peak = peak_tflops(args)
    if row["tflops"] is not None and peak:
        row["mfu"] = row["tflops"] / peak
    return row


def gib(n: int | None) -> str:
    """Bytes for the table: GiB, or MiB below one GiB; '-' for none."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _header(args: argparse.Namespace) -> str:
    device, host = default_budgets(args)
    where = "CPU (tiny)" if args.tiny or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    head = f"{'strategy':<18} {'params':>15} {'step':>9} {'tok/s':>9} {'MFU':>6} {'alloc peak':>10}"
    head += f" {'resv peak':>10} {'RSS peak':>10}  fwd / bwd / opt | copies / host Adam / waits (s)  status"
    return (
        f"{where}: D {gib(device)}, H {gib(host)}, {args.accumulate} x {args.batch_size} x {args.block_size} tokens"
        f" per optimizer step, bf16-mixed, {args.warmup} warm-up + {args.steps} timed + 1 breakdown step\n"
        + head
        + "\n"
        + "-" * len(head)
    )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _line(r: dict[str, Any]) -> str:
    status = "trained" if r["trained"] else (r["error"] or r["why_not"] or "not run")
    step = f"{r['step_time_s']:.3f} s" if r["step_time_s"] is not None else "-"
    tok = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] is not None else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
    b = r["breakdown"] or {}
    parts = " / ".join(_s(b.get(k)) for k in ("forward_s", "backward_s", "optimizer_s"))
    parts += " | " + " / ".join(_s(b.get(k)) for k in ("transfers_s", "host_adam_s", "waits_s"))
    return (
        f"{r['strategy']:<18} {r['params']:>15,} {step:>9} {tok:>9} {mfu:>6} {gib(r['peak_cuda_bytes']):>10}"
        f" {gib(r['peak_cuda_reserved_bytes']):>10} {gib(r['peak_rss_bytes']):>10}  {parts}  {status}"
    )


def ratios(rows: list[dict[str, Any]], largest: dict[str, Any]) -> list[dict[str, Any]]:
    """PatrickStar (each of its rows) against each peer: tokens/s at every rung both trained, and the largest
    model each trained."""
    out = []
    trained = {(r["strategy"], r["params"]): r for r in rows if r["trained"]}
    for mine in PSTAR:
        for peer in (s for s in STRATEGIES if s not in PSTAR):
            per_rung = {
                str(params): trained[(mine, params)]["tokens_per_s"] / trained[(peer, params)]["tokens_per_s"]
                for (name, params) in trained
                if name == mine and (peer, params) in trained
            }
            big_mine, big_peer = largest.get(mine), largest.get(peer)
            size = big_mine["params"] / big_peer["params"] if big_mine and big_peer else None
            out.append({"patrickstar": mine, "peer": peer, "tokens_per_s": per_rung, "largest_model": size})
    return out


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 10**8 else f"{params / 1e6:.2f}M"


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Print the largest model each strategy trained and PatrickStar's ratios; return the JSON document."""
    device, host = default_budgets(args)
    print("\nall rows:")
    for r in rows:
        print(_line(r))
    largest: dict[str, Any] = {}
    for strategy in args.strategy_list:
        done = [r for r in rows if r["strategy"] == strategy and r["trained"]]
        best = max(done, key=lambda r: r["params"]) if done else None
        largest[strategy] = None if best is None else {k: best[k] for k in ("n_layer", "n_embd", "params")}
        print(f"largest trained with {strategy}: " + (f"{best['params']:,} parameters" if best else "none"))
    table = ratios(rows, largest)
    for ratio in table:
        rungs = ", ".join(f"{_count(int(p))}: {v:.2f}x" for p, v in ratio["tokens_per_s"].items())
        size = f"{ratio['largest_model']:.2f}x" if ratio["largest_model"] is not None else "-"
        print(f"{ratio['patrickstar']} / {ratio['peer']}: tokens/s {rungs or 'no common rung'}; largest model {size}")
    missing = deepspeed_missing() if "deepspeed-offload" in args.strategy_list else None
    if missing:
        print(f"deepspeed-offload: not run: {missing}")
    return {
        "deepspeed": missing or "available",
        "optimizer_placement_option": host_optimizer_option(),
        "device": "CPU (tiny)" if args.tiny or not torch.cuda.is_available() else torch.cuda.get_device_name(0),
        "device_memory": device,
        "host_memory": host,
        "batch_size": args.batch_size,
        "accumulate": args.accumulate,
        "block_size": args.block_size,
        "peak_tflops": peak_tflops(args),
        "runs": rows,
        "largest": largest,
        "ratios": table,
    }


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(raw)
    if args.worker is not None:
        run_worker(Run(**json.loads(args.worker)), args)
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
