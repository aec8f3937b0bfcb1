"""What the test files share: test models, token data, trainer harnesses, references and parity assertions.

Import it as ``tests.helpers`` (``from tests.helpers.runs import fit``): pytest puts the repository root on
``sys.path`` (``pythonpath = ["."]`` in pyproject.toml) and ``tests`` is a namespace package, so no
``tests/__init__.py`` is needed and the test files keep their rootdir-relative module names. A process started
by a distributed test finds it too: ``spawn`` children inherit ``sys.path``, and scripts get the repository
root on ``PYTHONPATH``.

- :mod:`tests.helpers.models`: TinyGPT, FlatGPT, MultiUse, MoE and their sizes;
- :mod:`tests.helpers.data`: deterministic token data;
- :mod:`tests.helpers.runs`: optimizers, the TinyLM and LM modules, LossRecorder, quiet trainers, ``fit``;
- :mod:`tests.helpers.references`: plain-PyTorch reference loops;
- :mod:`tests.helpers.asserts`: loss and state-dict parity, evictions.
- :mod:`tests.helpers.fake_comm`: a recording fake communicator for process-free sharding tests.

The names below are re-exported for ``from tests.helpers import ...``.
"""

from tests.helpers.asserts import (
    LOSS_RTOL,
    assert_evicted,
    assert_losses_close,
    assert_runs_bitwise,
    assert_same_run,
    assert_states_close,
    assert_states_equal,
    max_rel_diff,
    optimizer_state,
)
from tests.helpers.data import DATA_SEED, make_dataset, make_loader
from tests.helpers.models import (
    BLOCK,
    N_EMBD,
    N_HEAD,
    N_LAYER,
    SEED,
    VOCAB,
    Block,
    FlatGPT,
    MoE,
    MultiUse,
    TinyGPT,
    build_model,
    lm_loss,
)
from tests.helpers.references import ReferenceRun, reference_mixed_precision
from tests.helpers.runs import (
    LM,
    STEPS,
    FitResult,
    LossRecorder,
    OptimSpec,
    TinyLM,
    fit,
    fit_steps,
    make_optimizer,
    make_scheduler,
    make_trainer,
    quiet_trainer_options,
    tight,
)

__all__ = [
    "BLOCK",
    "DATA_SEED",
    "LM",
    "LOSS_RTOL",
    "N_EMBD",
    "N_HEAD",
    "N_LAYER",
    "SEED",
    "STEPS",
    "VOCAB",
    "Block",
    "FitResult",
    "FlatGPT",
    "LossRecorder",
    "MoE",
    "MultiUse",
    "OptimSpec",
    "ReferenceRun",
    "TinyGPT",
    "TinyLM",
    "assert_evicted",
    "assert_losses_close",
    "assert_runs_bitwise",
    "assert_same_run",
    "assert_states_close",
    "assert_states_equal",
    "build_model",
    "fit",
    "fit_steps",
    "lm_loss",
    "make_dataset",
    "make_loader",
    "make_optimizer",
    "make_scheduler",
    "make_trainer",
    "max_rel_diff",
    "optimizer_state",
    "quiet_trainer_options",
    "reference_mixed_precision",
    "tight",
]
