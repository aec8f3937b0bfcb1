"""End-to-end runs of examples/train_gpt.py (the Hydra app) in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_pstar.demos import GPTLightningModule

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "examples" / "train_gpt.py"


def run_example(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """Run the example with ``+experiment=tiny`` and its outputs under ``run_dir``."""
    env = dict(os.environ)
    # The script must find the package whether or not it is pip-installed in this interpreter.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, str(SCRIPT), "+experiment=tiny", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return (
        f"exit code {proc.returncode}\n--- stdout (tail) ---\n{proc.stdout[-3000:]}"
        f"\n--- stderr (tail) ---\n{proc.stderr[-5000:]}"
    )


@pytest.mark.slow
def test_tiny_run_with_patrickstar_prints_report_and_saves_a_plain_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_example(run_dir)
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
def test_tiny_run_with_sharded_checkpoints_samples_from_the_consolidated_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_example(run_dir, "strategy.checkpoint=sharded")
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
def test_tiny_run_with_plain_lightning(tmp_path: Path) -> None:
    proc = run_example(tmp_path / "run", "strategy=auto")
    assert proc.returncode == 0, _explain(proc)
    assert "memory report" not in proc.stdout.lower()
    assert list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    # trainer.precision=auto is resolved by the script, in one line that says why
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("precision: ")]
    assert line.startswith(("precision: bf16-mixed (auto: ", "precision: 32-true (auto: ")), line
    assert "final val_loss: " in proc.stdout and "(perplexity " in proc.stdout


@pytest.mark.slow  # the example end to end; tests/unit/test_config.py checks the misspelled key is named
@pytest.mark.parametrize("override", ["+strategy.chunk_sise=5"])
def test_misspelled_strategy_option_fails_naming_it(tmp_path: Path, override: str) -> None:
    proc = run_example(tmp_path / "run", override)
    assert proc.returncode != 0, _explain(proc)
    output = proc.stdout + proc.stderr
    # Hydra echoes the overrides when a job fails; the key must also be named by the error itself.
    named = [line for line in output.splitlines() if "chunk_sise" in line and "overrides" not in line]
    assert named, _explain(proc)
    # It fails while building the strategy, before any training.
    assert "train_loss:" not in proc.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_overhead_benchmark_runs_both_strategies_and_writes_json(tmp_path: Path) -> None:
    # benchmarks/overhead.py shares the demos with the example; the smallest sizes keep this a smoke test.
    out = tmp_path / "overhead.json"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "overhead.py"),
        *("--steps", "2", "--warmup", "1", "--n-layer", "1", "--n-head", "2", "--n-embd", "32"),
        *("--block-size", "16", "--batch-size", "4", "--json", str(out)),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, _explain(proc)
    assert "step-time ratio patrickstar/plain" in proc.stdout and "model data bytes/param" in proc.stdout
    results = {r["strategy"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"auto", "patrickstar"}
    for result in results.values():
        assert result["steps"] == 2 and result["median_step_s"] > 0 and result["peak_rss_bytes"] > 0
    # Plain Lightning in bf16-mixed holds fp32 parameters, fp32 gradients and two fp32 Adam states.
    assert results["auto"]["model_data_bytes_per_param"] == pytest.approx(16.0)
    assert results["patrickstar"]["model_data_bytes_per_param"] > 0
