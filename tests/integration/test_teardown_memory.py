"""Issue 12, item 5: handing the weights back at teardown streams family by family, so the host never holds the
chunks and a full copy of the model at once. Measured in a fresh process: its resident-set high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs``) rises during ``restore_module`` by less than two chunk
families, where the copy-everything-then-free order rose by the whole model. The process runs with a fixed
glibc mmap threshold (``MALLOC_MMAP_THRESHOLD_``): buffers of chunk size are then mapped and unmapped as they
are allocated and freed, so the figure is what the engine holds, not what glibc's adaptive threshold keeps
cached in its heap (without it one run in three showed up to seven families retained by malloc).

The two processes start together from the module's fixture (each measures its own high-water mark): [Note:
one-process runs started together] in tests/helpers/together.py."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.together import Command, Started, selected_tests

REPO_ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    from lightning_pstar.checkpoint.model_state import restore_module
    from lightning_pstar.config import PStarConfig
    from lightning_pstar.runtime.manager import ChunkManager

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    torch.manual_seed(0)
    layers, width = 24, 1024
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])  # 25M fp32 parameters, 100 MB
    expected = [p.detach().clone() for p in model.parameters()]
    capacity = width * width + width  # one layer per chunk family
    config = PStarConfig.from_flat(chunk_size=capacity)
    manager = ChunkManager(model, config=config, compute_dtype=torch.float32, device=torch.device("cpu"))
    manager.materialise()
    family_bytes = sum(c.nbytes for c in manager.families[0].chunks.values())
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    assert status("VmHWM") <= before + (1 << 20), (status("VmHWM"), before)
    restore_module(manager, torch.device("cpu"))
    rise = status("VmHWM") - before
    exact = all(torch.equal(p.detach(), e) for p, e in zip(model.parameters(), expected, strict=True))
    model_bytes = sum(e.numel() * e.element_size() for e in expected)
    print(json.dumps({"rise": rise, "family_bytes": family_bytes, "model_bytes": model_bytes, "exact": exact}))
    """
)


def _clear_refs_allowed() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@pytest.mark.slow  # a fresh process with a 100 MB model; every quick Trainer test hands weights back
@pytest.mark.skipif(not _clear_refs_allowed(), reason="/proc/self/clear_refs cannot reset VmHWM here")
def test_teardown_rss_rise_stays_below_two_chunk_families(started: Started) -> None:
    done = started.wait("test_teardown_rss_rise_stays_below_two_chunk_families")
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["exact"]  # the module got its weights back, bit for bit
    assert figures["model_bytes"] > 10 * figures["family_bytes"]  # the model dominates: a full copy would show
    assert figures["rise"] < 2 * figures["family_bytes"], figures


_SCRIPT_WITH_OPTIMIZER = textwrap.dedent(
    """
    import json
    import torch
    from torch import nn
    from lightning_pstar.config import PStarConfig
    from lightning_pstar.glue import hand_back
    from lightning_pstar.optim import ChunkedOptimizer
    from lightning_pstar.runtime.hooks import ModelHooks
    from lightning_pstar.runtime.manager import ChunkManager

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    torch.manual_seed(0)
    layers, width = 16, 1024
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])  # 16.8M parameters
    capacity = width * width + width  # one layer per chunk family
    manager = ChunkManager(
        model, config=PStarConfig.from_flat(chunk_size=capacity), compute_dtype=torch.float32,
        device=torch.device("cpu"),
    )
    manager.materialise()
    hooks = ModelHooks(manager)
    hooks.install()
    user = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = ChunkedOptimizer(user, manager)
    manager.begin_training_batch()
    with hooks.saved_tensors():
        loss = model(torch.randn(4, width)).square().mean()
    manager.begin_backward()
    loss.backward()
    manager.finish_backward()
    optimizer.step()
    optimizer.zero_grad()
    manager.end_warmup_if_recording()
    expected_weights = [p.detach().clone() for p in model.parameters()]
    expected_state = optimizer.state_dict()  # the reference (held before the measurement starts)
    family_bytes = sum(c.nbytes for c in manager.families[0].chunks.values())
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    hand_back(manager, hooks, [optimizer], failed=False)
    rise = status("VmHWM") - before
    state = user.state_dict()
    exact = all(torch.equal(p.detach(), e) for p, e in zip(model.parameters(), expected_weights, strict=True))
    exact = exact and state["param_groups"] == expected_state["param_groups"]
    for index, entry in expected_state["state"].items():
        exact = exact and all(torch.equal(state["state"][index][k], v) for k, v in entry.items())
    exact = exact and len(state["state"]) == len(expected_state["state"]) == 2 * layers
    state_bytes = sum(v.numel() * v.element_size() for e in state["state"].values() for v in e.values())
    print(json.dumps({"rise": rise, "family_bytes": family_bytes, "state_bytes": state_bytes, "exact": exact}))
    """
)


def _command(script: str) -> Command:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 17)
    return Command(args=[sys.executable, "-c", script], env=env)


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest) -> Iterator[Started]:
    """The scripts of the selected tests, started together; each test waits for its own."""
    scripts = {
        "test_teardown_rss_rise_stays_below_two_chunk_families": _SCRIPT,
        "test_hand_back_streams_the_optimizer_states_too": _SCRIPT_WITH_OPTIMIZER,
    }
    runs = Started({name: _command(scripts[name]) for name in selected_tests(request) & set(scripts)})
    yield runs
    runs.close()


@pytest.mark.slow  # a fresh process with a 100 MB model; every quick Trainer test hands weights back
@pytest.mark.skipif(not _clear_refs_allowed(), reason="/proc/self/clear_refs cannot reset VmHWM here")
def test_hand_back_streams_the_optimizer_states_too(started: Started) -> None:
    """The hand-back at teardown gives the user's optimizer its states family by family with the weights: the
    high-water mark rises by less than two families, where reading every state dict first rose by all the
    optimizer states (8 bytes per parameter)."""
    done = started.wait("test_hand_back_streams_the_optimizer_states_too")
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["exact"]  # weights and optimizer states handed back bit for bit
    assert figures["state_bytes"] > 6 * figures["family_bytes"]  # a second copy of the states would show
    assert figures["rise"] < 2 * figures["family_bytes"], figures
