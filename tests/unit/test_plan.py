"""Unit tests of lightning_pstar.planning: the capacity planner prices exactly what the engine allocates, decides
fit / no fit at the boundary, finds the largest GPT that fits, never allocates weights, and its command line
reports figures or a clear argparse-style error."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pstar.config import PStarConfig
from lightning_pstar.demos.gpt import GPT, GPTConfig, gpt_num_params
from lightning_pstar.planning import CapacityPlan, bytes_per_element, main, plan_capacity
from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.manager import ChunkManager

ROOT = Path(__file__).resolve().parents[2]
GPT_SMALL = ROOT / "configs" / "model" / "gpt_small.yaml"
BIG = "1TiB"
_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
_KINDS = {
    "adam": [ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ],
    "sgd-momentum": [ChunkKind.EXP_AVG],
    "sgd": [],
}


class _Tied(nn.Module):
    """Embedding tied to the output head (as nanoGPT's wte / lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight


def _mlp() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])


def _frozen() -> nn.Module:
    model = _mlp()
    model[1].requires_grad_(False)
    model[3].weight.requires_grad_(False)
    return model


def _frozen_tied() -> nn.Module:
    model = _Tied()
    model.emb.requires_grad_(False)  # the tied weight is frozen under both names
    model.body[0].requires_grad_(False)
    return model


def _tiny_gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))


def _engine_report(
    factory: Callable[[], nn.Module], *, precision: str, optimizer: str, chunk_size: int | str, accumulates: bool
) -> tuple[int, ChunkManager]:
    torch.manual_seed(0)
    manager = ChunkManager(
        factory(),
        config=PStarConfig.from_flat(chunk_size=chunk_size, device_memory_limit="1GiB", host_memory_limit="1GiB"),
        compute_dtype=_DTYPES[precision],
        device=torch.device("cpu"),
        precision=precision,
        accumulates=accumulates,
    )
    manager.materialise()
    manager.add_optimizer_chunks(_KINDS[optimizer])
    return manager.memory_report().model_data_bytes, manager


@pytest.mark.parametrize(
    ("factory", "precision", "optimizer", "chunk_size", "accumulate"),
    [
        (_Tied, "bf16-mixed", "adam", "auto", 1),
        (_Tied, "bf16-mixed", "adam", 96, 1),
        (_mlp, "32-true", "adam", "auto", 1),
        (_frozen, "32-true", "adam", 80, 1),
        (_frozen, "bf16-mixed", "sgd-momentum", "auto", 1),
        (_frozen_tied, "16-mixed", "sgd", 64, 1),
        (_frozen_tied, "32-true", "sgd-momentum", "auto", 1),
        (_Tied, "bf16-mixed", "adam", 72, 4),  # mixed precision accumulation adds fp32 gradient sums
        (_frozen, "32-true", "sgd", 80, 4),  # 32-true accumulates in its grad chunk: no extra bytes
        (_tiny_gpt, "bf16-mixed", "adam", "auto", 1),
        (_tiny_gpt, "32-true", "adam", 1000, 1),
    ],
)
def test_model_data_bytes_match_the_engine(
    factory: Callable[[], nn.Module], precision: str, optimizer: str, chunk_size: int | str, accumulate: int
) -> None:
    engine_bytes, manager = _engine_report(
        factory, precision=precision, optimizer=optimizer, chunk_size=chunk_size, accumulates=accumulate > 1
    )
    # the planner gets the same model, once as a plain module and once built by itself on the meta device
    for target in (factory(), factory):
        plan = plan_capacity(
            target,
            device_memory="1GiB",
            host_memory="1GiB",
            precision=precision,
            chunk_size=chunk_size,
            optimizer=optimizer,
            accumulate_grad_batches=accumulate,
        )
        assert plan.model_data_bytes == engine_bytes
        assert plan.model_data_bytes_per_rank == engine_bytes
        assert plan.chunk_size == manager.layout.chunk_size
        assert plan.num_chunks == len(manager.families)
        assert plan.chunk_utilisation == pytest.approx(manager.layout.utilisation)
        assert plan.num_params == sum(r.slot.numel for r in manager.records)
        assert (plan.min_device_bytes, plan.min_device_module) == manager.setup_plan.module_need
        kinds = plan.param_chunk_bytes + plan.master_bytes + plan.grad_bytes + plan.optimizer_state_bytes
        kinds += plan.frozen_master_bytes
        assert kinds == plan.model_data_bytes
        assert plan.fits


class _Embedded(_Tied):
    """A tied token embedding (stays in the chunks), an untied position embedding, a frozen segment one."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(16, 8)
        self.seg = nn.Embedding(4, 8)
        self.seg.requires_grad_(False)


def test_cpu_embedding_keeps_untied_embeddings_out_of_the_chunks() -> None:
    torch.manual_seed(0)
    manager = ChunkManager(
        _Embedded(),
        config=PStarConfig.from_flat(
            chunk_size=96, device_memory_limit="1GiB", host_memory_limit="1GiB", cpu_embedding=True
        ),
        compute_dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    manager.materialise()
    manager.add_optimizer_chunks(_KINDS["adam"])
    plan = plan_capacity(_Embedded, device_memory="1GiB", host_memory="1GiB", chunk_size=96, cpu_embedding=True)
    assert sorted(manager.host_params) == ["pos.weight", "seg.weight"]
    assert plan.model_data_bytes == manager.memory_report().model_data_bytes
    assert (plan.min_device_bytes, plan.min_device_module) == manager.setup_plan.module_need
    assert plan.host_embedding_params == 16 * 8 + 4 * 8
    assert plan.host_embedding_bytes == 16 * 8 * (4 + 4 + 8) + 4 * 8 * 4  # fp32 weight, grad, Adam; frozen: weight
    assert plan.num_params == sum(p.numel() for p in _Embedded().parameters())
    # the model data fits the warm-up's share of the budget: under 'auto' the optimizer side starts and steps on
    # the device ([Note: the host need] in planning/tiers.py), and under 'static' all chunks fit the budget
    assert plan.host_model_data_bytes == plan.host_embedding_bytes
    static = plan_capacity(
        _Embedded, device_memory="1GiB", host_memory="1GiB", chunk_size=96, cpu_embedding=True, placement="static"
    )
    assert static.host_model_data_bytes == static.host_embedding_bytes
    chunks_only = plan_capacity(_Embedded, device_memory="1GiB", host_memory="1GiB", chunk_size=96)
    assert chunks_only.host_embedding_bytes == 0 and chunks_only.model_data_bytes > plan.model_data_bytes
    # the host must hold the embeddings whatever the device budget
    tight = plan_capacity(
        _Embedded, device_memory="1GiB", host_memory=plan.host_embedding_bytes - 1, chunk_size=96, cpu_embedding=True
    )
    assert not tight.fits and "host-resident embeddings" in tight.reasons[0]


class _FakeComm:
    """What ``ChunkManager``'s constructor reads of a communicator: this rank and the number of ranks. No process
    group: the engines built with it are never materialised, so nothing is ever gathered or reduced."""

    def __init__(self, world_size: int) -> None:
        self.rank = 0
        self.world_size = world_size
        self.group = None
        self.gathered_bytes = 0
        self.reduced_bytes = 0


def _engine_setup(
    factory: Callable[[], nn.Module],
    *,
    device: int | str,
    host: int | str,
    world_size: int,
    precision: str,
    chunk_size: int | str,
    cpu_embedding: bool,
) -> ChunkManager:
    """The engine's setup of ``factory()`` as rank 0 of ``world_size``: plans and checks the budgets, allocates
    nothing."""
    torch.manual_seed(0)
    config = PStarConfig.from_flat(
        chunk_size=chunk_size, device_memory_limit=device, host_memory_limit=host, cpu_embedding=cpu_embedding
    )
    return ChunkManager(
        factory(),
        config=config,
        compute_dtype=_DTYPES[precision],
        device=torch.device("cpu"),
        precision=precision,
        world_size=world_size,
        comm=_FakeComm(world_size),  # type: ignore[arg-type]  # duck-typed
    )


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("cpu_embedding", [False, True])
@pytest.mark.parametrize(
    ("factory", "precision", "chunk_size"),
    [
        (_Embedded, "bf16-mixed", 96),
        (_frozen_tied, "16-mixed", "auto"),
        (_tiny_gpt, "32-true", 1000),
        (_tiny_gpt, "bf16-mixed", "auto"),
    ],
)
def test_planner_figures_are_the_engines(
    factory: Callable[[], nn.Module], precision: str, chunk_size: int | str, cpu_embedding: bool, world_size: int
) -> None:
    """Same model, same options: the planner's minimum device need and its module, model data per rank and host
    need are the engine's setup figures, and the engine refuses exactly the budgets the planner says do not fit."""

    def plan(device: int | str, host: int | str) -> CapacityPlan:
        return plan_capacity(
            factory,
            device_memory=device,
            host_memory=host,
            world_size=world_size,
            precision=precision,
            chunk_size=chunk_size,
            cpu_embedding=cpu_embedding,
        )

    def engine(device: int | str, host: int | str) -> ChunkManager:
        return _engine_setup(
            factory,
            device=device,
            host=host,
            world_size=world_size,
            precision=precision,
            chunk_size=chunk_size,
            cpu_embedding=cpu_embedding,
        )

    # a device budget of one module's chunks sends the rest of the model data to the host
    device = plan(BIG, BIG).min_device_bytes
    planned, manager = plan(device, BIG), engine(device, BIG)
    assert planned.fits and planned.host_model_data_bytes > 0
    assert (planned.chunk_size, planned.num_chunks) == (manager.layout.chunk_size, len(manager.layout.chunks))
    assert planned.bytes_per_element == manager.setup_plan.bpe
    assert (planned.min_device_bytes, planned.min_device_module) == manager.setup_plan.module_need
    assert planned.model_data_bytes_per_rank == manager.setup_plan.model_data_bytes
    assert planned.host_embedding_params == sum(p.numel() for p in manager.host_params.values())
    assert (planned.host_embedding_params > 0) == (cpu_embedding and factory is not _frozen_tied)
    # the host need: the engine accepts it as the host budget and refuses one byte less, naming the same figure
    host = planned.host_model_data_bytes
    engine(device, host)
    with pytest.raises(MemoryBudgetError, match=f"leaves {host:,} bytes"):
        engine(device, host - 1)
    assert plan(device, host).fits and not plan(device, host - 1).fits
    if chunk_size != "auto":  # "auto" lays the model out anew for another device budget
        need = planned.min_device_bytes
        with pytest.raises(MemoryBudgetError, match=f"module '{planned.min_device_module}' needs .* of {need:,} bytes"):
            engine(need - 1, BIG)
        assert not plan(need - 1, BIG).fits_min_device


def test_bytes_per_element_of_the_design() -> None:
    assert bytes_per_element("bf16-mixed", "adam").trainable == 14  # 2 + 4 + 4 + 4
    assert bytes_per_element("32-true", "adam").trainable == 16  # 4 + 4 (grad chunk) + 8
    assert bytes_per_element("16-mixed", "sgd-momentum").trainable == 10
    assert bytes_per_element("bf16-mixed", "sgd", accumulates=True).trainable == 10
    assert bytes_per_element("bf16-mixed", "adam").frozen == 6  # bf16 chunk + fp32 copy on the host
    assert bytes_per_element("bf16-mixed", "adam", frozen_master=False).frozen == 2
    assert bytes_per_element("32-true", "adam").frozen == 4
    with pytest.raises(ValueError, match="`precision` must be one of .*'bf16-true'.*HINT"):
        bytes_per_element("bf16-true", "adam")
    with pytest.raises(ValueError, match="`optimizer` must be one of .*'lion'.*HINT"):
        bytes_per_element("bf16-mixed", "lion")


def _plan(device: int | str, host: int | str, **kwargs: object) -> CapacityPlan:
    return plan_capacity(_frozen_tied, device_memory=device, host_memory=host, chunk_size=64, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("world_size", [1, 2])
def test_fits_on_both_sides_of_the_boundary(world_size: int) -> None:
    ref = _plan(BIG, BIG, world_size=world_size)
    need, total = ref.min_device_bytes, ref.model_data_bytes_per_rank
    assert 0 < need < total
    # offloaded, the optimizer side starts on the host: the device budget takes param chunks only (issue 12)
    host = _plan(need, BIG, world_size=world_size).host_model_data_bytes
    exact = _plan(need, host, world_size=world_size)
    assert exact.fits and exact.reasons == []
    assert exact.host_model_data_bytes == total - exact.device_model_data_bytes + exact.host_temporary_bytes
    assert exact.device_model_data_bytes <= need and exact.host_model_data_bytes >= total - need
    short_host = _plan(need, host - 1, world_size=world_size)
    assert not short_host.fits and not short_host.fits_model_data and short_host.fits_min_device
    assert "device + host budget" in short_host.reasons[0]
    short_device = _plan(need - 1, BIG, world_size=world_size)
    assert not short_device.fits and short_device.fits_model_data and not short_device.fits_min_device
    assert f"module '{ref.min_device_module}'" in short_device.reasons[0]


def test_per_rank_bytes_are_whole_chunk_groups() -> None:
    def plan(world_size: int, factory: Callable[[], nn.Module] = _mlp) -> CapacityPlan:
        return plan_capacity(factory, device_memory=BIG, host_memory=BIG, chunk_size=80, world_size=world_size)

    one, two = plan(1), plan(2)
    assert (one.num_chunks, two.num_chunks) == (5, 6)  # padded with an empty family to a multiple of 2
    assert one.model_data_bytes == 5 * 80 * 14 and two.model_data_bytes == 6 * 80 * 14
    assert two.model_data_bytes_per_rank == 3 * 80 * 14  # each rank owns 3 whole families
    assert two.min_device_bytes == 2 * one.min_device_bytes  # a chunk is gathered with its whole group of 2
    # frozen families are cheaper: the rank that owns the most bytes sets the figure
    mixed = plan(2, _frozen)
    assert mixed.model_data_bytes / 2 <= mixed.model_data_bytes_per_rank < mixed.model_data_bytes


CLI_ARGS = [str(GPT_SMALL.relative_to(ROOT)), "--device-memory", "1GiB", "--host-memory", "4GiB"]


@pytest.fixture(scope="module", autouse=True)
def cli_run() -> Iterator[subprocess.Popen[str]]:
    """``python -m lightning_pstar.plan`` in a subprocess, started before the module's first test so that
    its interpreter start-up (importing torch and Lightning) overlaps with the other tests."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "lightning_pstar.plan", *CLI_ARGS]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def _gpt_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("vocab_size: 64\nblock_size: 32\nn_layer: 2\nn_head: 2\nn_embd: 32\nlr: 1.0e-3\n")
    return path


@pytest.mark.parametrize(
    ("scale", "chunk_size", "device", "host"),
    [("both", "auto", "4MiB", "12MiB"), ("n_layer", "auto", "512KiB", "1MiB"), ("n_embd", 4096, "4MiB", "12MiB")],
)
def test_largest_model_fits_and_the_next_size_up_does_not(
    tmp_path: Path, scale: str, chunk_size: int | str, device: str, host: str
) -> None:
    path = _gpt_yaml(tmp_path)
    budgets = {"device_memory": device, "host_memory": host, "chunk_size": chunk_size}
    plan = plan_capacity(str(path), scale=scale, **budgets)  # type: ignore[arg-type]
    largest = plan.largest
    assert largest is not None and largest.config is not None and largest.next_config is not None
    assert not largest.at_search_limit and largest.scale == scale
    sizes = ("n_layer", "n_embd", "n_head")
    best = {k: largest.config[k] for k in sizes}
    nxt = {k: largest.next_config[k] for k in sizes}
    assert best != nxt and gpt_num_params(GPTConfig(**largest.next_config)) > largest.num_params
    assert largest.num_params > plan.num_params  # the budgets allow more than the given model
    again = plan_capacity(str(path), overrides=best, search_largest=False, **budgets)  # type: ignore[arg-type]
    assert again.fits and again.num_params == largest.num_params
    up = plan_capacity(str(path), overrides=nxt, search_largest=False, **budgets)  # type: ignore[arg-type]
    assert not up.fits and up.reasons == largest.next_reasons


def test_largest_model_search_downward_and_when_nothing_fits(tmp_path: Path) -> None:
    path = _gpt_yaml(tmp_path)
    big = {"n_layer": 12, "n_embd": 64, "n_head": 2}
    plan = plan_capacity(str(path), device_memory="2MiB", host_memory="3MiB", overrides=big, scale="n_layer")
    assert not plan.fits
    assert plan.largest is not None and plan.largest.config is not None
    assert 1 <= plan.largest.config["n_layer"] < 12
    # the embeddings alone exceed the budgets: not even one layer fits
    none = plan_capacity(str(path), device_memory="1KiB", host_memory="1KiB", scale="n_layer")
    assert none.largest is not None and none.largest.config is None
    assert "does not fit" in str(none)


def test_planning_a_10b_gpt_allocates_no_weights(tmp_path: Path) -> None:
    config = GPTConfig(vocab_size=50304, block_size=2048, n_layer=50, n_head=32, n_embd=4096)
    sizes = {k: getattr(config, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    start = time.process_time()  # CPU time: a loaded machine stretches wall time, not the work done
    plan = plan_capacity(
        str(_gpt_yaml(tmp_path)), device_memory="80GiB", host_memory="512GiB", overrides=sizes, search_largest=False
    )
    elapsed = time.process_time() - start
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert plan.num_params == gpt_num_params(config) > 10**10
    assert plan.model_data_bytes > 14 * 10**10 and plan.fits
    assert plan.param_chunk_bytes > 2 * 10**10  # bf16 weights alone would be 20 GB ...
    assert peak_after - peak_before < 2**30  # ... and the process peak grew by less than 1 GiB
    assert elapsed < 10, f"planning took {elapsed:.1f} s of CPU time"


def test_cli_prints_the_plan(cli_run: subprocess.Popen[str]) -> None:
    stdout, stderr = cli_run.communicate(timeout=120)
    assert cli_run.returncode == 0, stderr
    plan = plan_capacity(CLI_ARGS[0], device_memory="1GiB", host_memory="4GiB", search_largest=False)
    assert f"{plan.num_params:,}" in stdout
    assert f"{plan.model_data_bytes:,} B" in stdout
    assert f"{plan.num_chunks} x {plan.chunk_size:,} elements (auto)" in stdout
    assert f"utilisation {plan.chunk_utilisation:.1%}" in stdout
    assert f"{plan.bytes_per_param:.2f} B/param" in stdout
    assert "fp32 masters" in stdout and "adam states" in stdout
    assert "fits                   yes" in stdout
    assert "largest that fits" in stdout and "does not" in stdout


@pytest.mark.parametrize(("factory", "chunk_size"), [(_Tied, 72), (_frozen_tied, 64), (_mlp, "auto")])
def test_the_chunk_line_says_what_the_memory_report_says(
    factory: Callable[[], nn.Module], chunk_size: int | str
) -> None:
    """Issue 30: a parameter larger than ``chunk_size`` gets a family of its own; the plan's chunk line counts
    those as the engine's memory report does (``10: 8 of 4,096 elements, 2 larger (up to 65,536)``)."""
    _, manager = _engine_report(
        factory, precision="32-true", optimizer="adam", chunk_size=chunk_size, accumulates=False
    )
    report = manager.memory_report()
    plan = plan_capacity(
        factory(), device_memory="1GiB", host_memory="1GiB", precision="32-true", chunk_size=chunk_size
    )
    assert (plan.larger_chunks, plan.largest_chunk) == (report.larger_chunks, report.largest_chunk)
    (report_line,) = [line for line in str(report).splitlines() if "chunks (families)" in line]
    said = report_line.split("chunks (families)", 1)[1].strip()
    if chunk_size == "auto":
        said = said.replace(" elements", " elements (auto)", 1)
    (plan_line,) = [line for line in str(plan).splitlines() if line.strip().startswith("chunks ")]
    assert plan_line.split("chunks", 1)[1].strip().startswith(said + ", "), (plan_line, report_line)
    assert ("larger (up to" in said) == (report.larger_chunks > 0)


def test_cli_exit_status_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    base = [str(GPT_SMALL), "--no-largest", "--chunk-size", "50000", "--precision", "32-true"]
    assert main([*base, "--device-memory", "1GiB", "--host-memory", "1GiB", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"fits": true' in out and '"chunk_size": 50000' in out
    assert main([*base, "--device-memory", "1MiB", "--host-memory", "1MiB"]) == 1
    assert "fits                   NO: " in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nosuch_pkg.models:build"], r"Unknown model target 'nosuch_pkg.models:build'.*HINT"),
        (["lightning_pstar.planning:nothing"], r"has no attribute 'nothing'"),
        (["not-a-target"], r"Unknown model target 'not-a-target'.*HINT"),
        (["missing.yaml"], r"Model config 'missing.yaml' does not exist"),
        ([str(GPT_SMALL), "--set", "n_layers=3"], r"Unknown GPT size\(s\) \['n_layers'\].*HINT"),
        ([str(GPT_SMALL), "--set", "n_head=5"], r"`n_embd` \(192\) must be divisible by `n_head` \(5\)"),
        ([str(GPT_SMALL), "--device-memory", "8Gx"], r"argument --device-memory: invalid byte size '8Gx'.*HINT"),
        ([str(GPT_SMALL), "--host-memory=-1GiB"], r"argument --host-memory: invalid byte size '-1GiB'"),
        ([str(GPT_SMALL), "--chunk-size", "big"], r"argument --chunk-size: invalid chunk size 'big'"),
        ([str(GPT_SMALL), "--precision", "fp8"], r"argument --precision: invalid choice: 'fp8'"),
        ([str(GPT_SMALL), "--world-size", "0"], r"`world_size` must be a positive int, got 0"),
    ],
)
def test_cli_bad_input_exits_with_status_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    budgets = ["--device-memory", "1GiB", "--host-memory", "4GiB"]
    with pytest.raises(SystemExit) as exit_info:
        main([*budgets, *argv])  # a later --device-memory / --host-memory wins
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m lightning_pstar.plan" in err
    assert re.search(message, err, flags=re.S), err


@pytest.mark.parametrize("factory", [_tiny_gpt, _Tied])
def test_a_cuda_plan_takes_the_engines_cuda_chunk_sizes(factory: Callable[[], nn.Module]) -> None:
    """On CUDA the engine picks pinned-memory-friendly (power-of-two) chunk sizes; the planner asked for
    ``device_type='cuda'`` predicts that layout, and ``'cpu'`` the simulated device's (issue 12: the numbers the
    planner promises are the engine's)."""
    from lightning_pstar.planning.requirements import chunk_layout, collect_parameters

    named = collect_parameters(factory(), exclude=set())
    expected = {}
    for device_type in ("cuda", "cpu"):
        layout = chunk_layout(
            named,
            chunk_elements=None,
            device_budget=1 << 30,
            compute_itemsize=2,
            world_size=1,
            allocator_friendly=device_type == "cuda",
        )
        plan = plan_capacity(
            factory, device_memory="1GiB", host_memory="1GiB", search_largest=False, device_type=device_type
        )
        assert (plan.chunk_size, plan.num_chunks) == (layout.chunk_size, len(layout.chunks))
        assert plan.chunk_utilisation == pytest.approx(layout.utilisation)
        expected[device_type] = plan.chunk_size
    assert expected["cuda"] & (expected["cuda"] - 1) == 0  # a power of two
    with pytest.raises(ValueError, match="device_type"):
        plan_capacity(factory, device_memory="1GiB", host_memory="1GiB", device_type="tpu")


def test_optimizer_placement_and_overlap_as_the_engine_takes_them(capsys: pytest.CaptureFixture[str]) -> None:
    """The planner takes the strategy's optimizer_placement and optimizer_overlap: "device" does not fit where the
    model data exceeds the device budget (the engine refuses it at setup), "host" starts the optimizer side on the
    host, and the serial step's disk tier loads one family at a time (fewer host buffers than the pipeline's)."""
    common = {"precision": "bf16-mixed", "device_type": "cpu", "search_largest": False, "chunk_size": 1 << 18}
    overrides = {"n_layer": 4, "n_embd": 256}
    roomy = plan_capacity(str(GPT_SMALL), overrides=overrides, device_memory="8GiB", host_memory="8GiB", **common)
    assert roomy.fits and not roomy.optimizer_on_host
    host = plan_capacity(
        str(GPT_SMALL),
        overrides=overrides,
        device_memory="8GiB",
        host_memory="8GiB",
        optimizer_placement="host",
        **common,
    )
    assert host.fits and host.optimizer_on_host and "starts on the host (optimizer_placement='host')" in str(host)
    tight = {"device_memory": "4MiB", "host_memory": "8GiB"}
    device = plan_capacity(str(GPT_SMALL), overrides=overrides, optimizer_placement="device", **tight, **common)
    assert not device.fits and any("optimizer_placement='device'" in r for r in device.reasons)
    disk = {"device_memory": "64MiB", "host_memory": "12MiB", "disk_memory": "1GiB", "optimizer_placement": "host"}
    piped = plan_capacity(str(GPT_SMALL), overrides=overrides, optimizer_overlap="pipeline", **disk, **common)
    serial = plan_capacity(str(GPT_SMALL), overrides=overrides, optimizer_overlap="off", **disk, **common)
    assert piped.disk_families > 0 and serial.disk_families > 0
    assert serial.disk_buffer_bytes < piped.disk_buffer_bytes
    with pytest.raises(ValueError, match="optimizer_overlap"):
        plan_capacity(str(GPT_SMALL), device_memory="1GiB", host_memory="1GiB", optimizer_overlap="sometimes")
    assert main([str(GPT_SMALL), "--no-largest", "--device-memory", "1GiB", "--host-memory", "1GiB",
                 "--optimizer-overlap", "off"]) == 0  # fmt: skip
    assert "host-side families: serial (optimizer_overlap='off')" in capsys.readouterr().out
