"""benchmarks/placement.py end to end on a tiny GPT, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "placement.py"
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--batch-size", "4"]


@pytest.mark.slow  # a benchmark end to end; tests/unit/test_placement.py covers both policies quickly
def test_placement_benchmark_runs_both_policies_with_unchanged_losses(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "placement.json"
    # --no-isolate: one interpreter for all five runs (fresh Trainers), which keeps this test fast; the
    # measured bytes and losses do not depend on it. One thread: tiny kernels on a busy machine run far
    # faster without two threads contending for two cores
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--budgets",
        "1.0,0.5",
        "--steps",
        "4",
        "--threads",
        "1",
        *TINY,
        "--no-isolate",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    explain = (
        f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
    assert proc.returncode == 0, explain

    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "losses == unconstrained" in line)
    rows = []
    for line in lines[header + 2 :]:
        if not line.strip():
            break
        rows.append(line.split())
    # columns: f, limit value, limit unit, policy, ...
    assert sorted((row[0], row[3]) for row in rows) == [
        ("0.50", "auto"),
        ("0.50", "static"),
        ("1.00", "auto"),
        ("1.00", "static"),
    ], explain
    for line in lines[header + 2 : header + 2 + len(rows)]:
        assert "  True  " in line and "False" not in line and "FAILED" not in line, line
    assert "losses == unconstrained in every run: PASS" in proc.stdout, explain
    assert "auto never moves more than static: PASS" in proc.stdout, explain

    result = json.loads(out.read_text())
    assert [(r["budget"], r["placement"]) for r in result["rows"]] == [
        (1.0, "static"),
        (1.0, "auto"),
        (0.5, "static"),
        (0.5, "auto"),
    ]
    assert all(r["losses_equal"] for r in result["rows"])
    assert result["layout"]["families"] >= 8
    half = {r["placement"]: r for r in result["rows"] if r["budget"] == 0.5}
    # under a budget below the model data, static offloads the optimizer and moves bytes every iteration
    assert half["static"]["moved_per_iter"] > 0
    assert half["auto"]["moved_per_iter"] <= half["static"]["moved_per_iter"]
    # the yardstick: every budgeted run brackets the optimum, and no run moved fewer bytes than its lower bound
    for r in result["rows"]:
        assert r["optimal_lower"] is not None and r["optimal_upper"] is not None, r["label"]
        assert 0 <= r["optimal_lower"] <= r["optimal_upper"], r["label"]
        assert r["optimal_lower"] <= r["report_moved_per_iter"], r["label"]
    assert "auto within 1.15x of the optimum" in proc.stdout, explain
