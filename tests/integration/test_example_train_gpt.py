"""End-to-end runs of examples/train_gpt.py (the Hydra app) in a subprocess, as a user runs it.

The one-process runs (every test here but the 2-rank one, which takes both cores) start together from the module's
fixture, and each test waits for its own: [Note: one-process runs started together] in tests/helpers/together.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_pstar.demos import GPTLightningModule
from tests.helpers.together import Command, Started, selected_tests

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "examples" / "train_gpt.py"


def _example_command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "+experiment=tiny", f"hydra.run.dir={run_dir}", *overrides]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The script must find the package whether or not it is pip-installed in this interpreter.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run_example(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """Run the example with ``+experiment=tiny`` and its outputs under ``run_dir``."""
    cmd = _example_command(run_dir, *overrides)
    return subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=300, check=False)


MISSPELLED = "+strategy.chunk_sise=5"
# the one-process runs, by the test that checks each: the example's overrides, or None for the overhead benchmark
ONE_PROCESS_RUNS: dict[str, tuple[str, ...] | None] = {
    "test_tiny_run_with_patrickstar_prints_report_and_saves_a_plain_checkpoint": (),
    "test_tiny_run_with_sharded_checkpoints_samples_from_the_consolidated_file": ("strategy.checkpoint=sharded",),
    "test_tiny_run_with_plain_lightning": ("strategy=auto",),
    "test_misspelled_strategy_option_fails_naming_it": (MISSPELLED,),
    "test_overhead_benchmark_runs_both_strategies_and_writes_json": None,
}


def _overhead_command(out: Path) -> list[str]:
    # benchmarks/overhead.py shares the demos with the example; the smallest sizes keep this a smoke test.
    return [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "overhead.py"),
        *("--steps", "2", "--warmup", "1", "--n-layer", "1", "--n-head", "2", "--n-embd", "32"),
        *("--block-size", "16", "--batch-size", "4", "--json", str(out)),
    ]


@dataclass
class Runs:
    """The started runs and the directory under which each test's run writes (``root / <test name>``)."""

    started: Started
    root: Path

    def wait(self, name: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        """The finished run of test ``name`` and the directory its outputs are under."""
        return self.started.wait(name), self.root / name


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    root = tmp_path_factory.mktemp("examples")
    commands = {}
    for name in selected_tests(request) & set(ONE_PROCESS_RUNS):
        (root / name).mkdir()
        overrides = ONE_PROCESS_RUNS[name]
        if overrides is None:
            commands[name] = Command(args=_overhead_command(root / name / "overhead.json"), cwd=REPO_ROOT)
        else:
            commands[name] = Command(args=_example_command(root / name / "run", *overrides), env=_env(), cwd=REPO_ROOT)
    runs = Started(commands)
    yield Runs(started=runs, root=root)
    runs.close()


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return (
        f"exit code {proc.returncode}\n--- stdout (tail) ---\n{proc.stdout[-3000:]}"
        f"\n--- stderr (tail) ---\n{proc.stderr[-5000:]}"
    )


@pytest.mark.slow
def test_tiny_run_with_patrickstar_prints_report_and_saves_a_plain_checkpoint(started: Runs) -> None:
    proc, where = started.wait("test_tiny_run_with_patrickstar_prints_report_and_saves_a_plain_checkpoint")
    run_dir = where / "run"
    assert proc.returncode == 0, _explain(proc)
    assert "memory report" in proc.stdout.lower(), _explain(proc)
    assert "train_loss:" in proc.stdout

    checkpoints = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert checkpoints, f"no checkpoint under {run_dir}:\n{_explain(proc)}"
    assert any(str(path) in proc.stdout for path in checkpoints), "the checkpoint path is not printed"

    # The checkpoint is an ordinary Lightning checkpoint: the model's own parameter names, no trace of chunks,
    # loadable into a module built without any strategy.
    state_dict = torch.load(checkpoints[0], map_location="cpu", weights_only=False)["state_dict"]
    assert "model.wte.weight" in state_dict and "model.h.0.attn.c_attn.weight" in state_dict
    module = GPTLightningModule.load_from_checkpoint(checkpoints[0], map_location="cpu")
    assert module.model is not None
    assert module.model.lm_head.weight is module.model.wte.weight
    torch.testing.assert_close(module.model.wte.weight, state_dict["model.wte.weight"].float())


@pytest.mark.slow
def test_tiny_run_with_sharded_checkpoints_samples_from_the_consolidated_file(started: Runs) -> None:
    proc, where = started.wait("test_tiny_run_with_sharded_checkpoints_samples_from_the_consolidated_file")
    run_dir = where / "run"
    assert proc.returncode == 0, _explain(proc)
    last = run_dir / "checkpoints" / "last.ckpt"
    consolidated = run_dir / "consolidated" / "last.ckpt"
    assert last.is_dir() and consolidated.is_file(), _explain(proc)
    assert f"last checkpoint (sharded: a directory): {last}" in proc.stdout
    assert f"last checkpoint, consolidated into one file: {consolidated}" in proc.stdout
    assert "sample from the last checkpoint, loaded without any strategy:" in proc.stdout
    module = GPTLightningModule.load_from_checkpoint(consolidated, map_location="cpu")
    assert module.model is not None and module.model.lm_head.weight is module.model.wte.weight


@pytest.mark.slow
def test_two_ranks_print_once_with_a_line_per_rank(tmp_path: Path) -> None:
    """Issue 30: every rank runs the script, rank 0 alone prints the config, the summary, the report (once) and
    the per-rank table."""
    proc = run_example(tmp_path / "run", "trainer.devices=2", "trainer.accelerator=cpu")
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout + proc.stderr
    for once in ("config:", "PatrickStar memory report", "train_loss:", "final val_loss:", "run directory:"):
        assert out.count(once) == 1, f"{once!r} printed {out.count(once)} times\n{_explain(proc)}"
    assert "per rank:" in proc.stdout and "total model data over 2 ranks" in proc.stdout, _explain(proc)


@pytest.mark.slow
def test_tiny_run_with_plain_lightning(started: Runs) -> None:
    proc, where = started.wait("test_tiny_run_with_plain_lightning")
    assert proc.returncode == 0, _explain(proc)
    assert "memory report" not in proc.stdout.lower()
    assert list((where / "run" / "checkpoints").glob("*.ckpt"))
    # trainer.precision=auto is resolved by the script, in one line that says why
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("precision: ")]
    assert line.startswith(("precision: bf16-mixed (auto: ", "precision: 32-true (auto: ")), line
    assert "final val_loss: " in proc.stdout and "(perplexity " in proc.stdout


@pytest.mark.slow  # the example end to end; tests/unit/test_config.py checks the misspelled key is named
def test_misspelled_strategy_option_fails_naming_it(started: Runs) -> None:
    proc, where = started.wait("test_misspelled_strategy_option_fails_naming_it")  # with MISSPELLED
    assert proc.returncode != 0, _explain(proc)
    output = proc.stdout + proc.stderr
    # Hydra echoes the overrides when a job fails; the key must also be named by the error itself.
    named = [line for line in output.splitlines() if "chunk_sise" in line and "overrides" not in line]
    assert named, _explain(proc)
    # It fails while building the strategy, before any training.
    assert "train_loss:" not in proc.stdout
    assert not (where / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_overhead_benchmark_runs_both_strategies_and_writes_json(started: Runs) -> None:
    proc, where = started.wait("test_overhead_benchmark_runs_both_strategies_and_writes_json")
    out = where / "overhead.json"
    assert proc.returncode == 0, _explain(proc)
    assert "step-time ratio patrickstar/plain" in proc.stdout and "model data bytes/param" in proc.stdout
    results = {r["strategy"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"auto", "patrickstar"}
    for result in results.values():
        assert result["steps"] == 2 and result["median_step_s"] > 0 and result["peak_rss_bytes"] > 0
    # Plain Lightning in bf16-mixed holds fp32 parameters, fp32 gradients and two fp32 Adam states.
    assert results["auto"]["model_data_bytes_per_param"] == pytest.approx(16.0)
    assert results["patrickstar"]["model_data_bytes_per_param"] > 0
