"""Watch the chunk engine from a Trainer: ``pstar/*`` metrics for the attached logger and the tide as a PNG.

    from lightning_pstar import PatrickStarStrategy
    from lightning_pstar.callbacks import PatrickStarMonitor

    trainer = L.Trainer(
        strategy=PatrickStarStrategy(device_memory_limit="8GiB"),
        callbacks=[PatrickStarMonitor(log_every_n_steps=50, save_tide_png="tide.png")],
    )

The *tide* is PatrickStar's picture of one iteration: at every moment (before a module's forward, before
its backward, the optimizer step) non-model memory (activations) rises and falls, and the room left for
chunks under the device budget is what remains. :func:`plot_tide` draws it from a
:class:`~lightning_pstar.report.MemoryReport` and needs no Trainer.

matplotlib is optional (``pip install lightning-pstar[plot]``) and is imported only when a plot is drawn.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_pstar.report import MemoryReport, format_bytes
from lightning_pstar.strategy import PatrickStarStrategy

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PatrickStarMonitor", "plot_tide", "tide_figure"]

log = logging.getLogger(__name__)

_MAX_TICK_LABELS = 24  # more moment labels than this are thinned so that they stay readable
_HEAD_ROOM = 1.25  # the y-axis ends this far above the highest value drawn: room for the legend
_BUDGET_ON_SCALE = 2.0  # a budget up to this multiple of the tide's peak is drawn as a line; higher, as a note
_AXIS_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_BUDGET_COLOUR = "#bc4b51"
_METRIC_NAMES = frozenset(
    f"pstar/{k}"
    for k in (
        "device_chunk_bytes",
        "host_chunk_bytes",
        "h2d_bytes",
        "d2h_bytes",
        "evictions",
        "moves_off_device",
        "prefetches",
        "peak_non_model_bytes",
        "nonfinite_skipped_steps",
    )
)


def _new_figure() -> Figure:
    """A figure drawn by the Agg backend, without touching pyplot's global state or the process's backend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "Plotting the PatrickStar tide needs matplotlib, which is not installed."
            " HINT: `pip install matplotlib` or install this package with the `plot` extra"
            " (`pip install lightning-pstar[plot]`)."
        ) from err
    figure = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(figure)  # attaches itself to the figure
    return figure


def plot_tide(report: MemoryReport, path: str | os.PathLike[str]) -> Path:
    """Save the tide of one iteration in ``report`` (see :func:`tide_figure`) as a PNG at ``path``; the path."""
    figure = tide_figure(report)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png", dpi=100)
    return target


def _check_moments(report: MemoryReport) -> None:
    non_model, chunks, labels = report.moment_non_model_bytes, report.moment_device_chunk_bytes, report.moment_labels
    if not non_model:
        raise ValueError(
            "The memory report has no moments to plot: the warm-up iteration has not run yet."
            " HINT: take the report after at least one training step (two for the chunk bytes), e.g. in"
            " `on_train_batch_end` or after `trainer.fit`."
        )
    if not len(non_model) == len(chunks) == len(labels):
        raise ValueError(
            f"The memory report's per-moment lists disagree in length: moment_non_model_bytes has"
            f" {len(non_model)}, moment_device_chunk_bytes {len(chunks)}, moment_labels {len(labels)}."
            " HINT: pass a report from `PatrickStarStrategy.memory_report()` unmodified."
        )


def _axis_unit(nbytes: float) -> tuple[str, int]:
    """The unit the y-axis counts in: the largest one ``nbytes`` reaches (bytes below one KiB)."""
    return next(((name, size) for name, size in _AXIS_UNITS if nbytes >= size), ("B", 1))


def _draw_budget(ax: Axes, budget: int, *, peak: int, size: int, on_scale: bool) -> None:
    """The device budget: a dashed line on the tide's scale, or a note when it is far above the tide."""
    label = f"device budget ({format_bytes(budget)})"
    if on_scale:
        ax.axhline(budget / size, color=_BUDGET_COLOUR, linestyle="--", label=label)
        return
    note = f"{label}: {budget / max(peak, 1):,.0f}x the tide's peak, above this plot"
    ax.text(0.01, 0.98, note, transform=ax.transAxes, va="top", color=_BUDGET_COLOUR)


def tide_figure(report: MemoryReport) -> Figure:
    """The tide of one iteration in ``report`` as a matplotlib figure (Agg backend; pyplot is not touched).

    Per moment of the warm-up trace, labelled as in ``report.moment_labels``: non-model memory (bottom) with
    the chunk bytes on the device stacked on top (as measured in the last iteration the engine followed the
    trace). The y-axis scales to that data. The device budget is a dashed horizontal line when it is at most
    twice the tide's peak, and a note naming it otherwise (a budget of gigabytes over a tide of megabytes
    would flatten the tide to nothing). Chunk bytes are zero at moments the engine has not passed since the
    warm-up, so a report taken after the second training iteration shows the full picture.
    """
    _check_moments(report)
    non_model, chunks, labels = report.moment_non_model_bytes, report.moment_device_chunk_bytes, report.moment_labels
    peak = max(a + b for a, b in zip(non_model, chunks, strict=True))
    budget = report.device_memory_limit
    on_scale = budget is not None and budget <= _BUDGET_ON_SCALE * max(peak, 1)
    top = max(peak, budget if on_scale and budget is not None else 0, 1)
    unit, size = _axis_unit(top)

    figure = _new_figure()
    ax = figure.add_subplot()
    x = list(range(len(non_model)))
    ax.stackplot(
        x,
        [b / size for b in non_model],
        [b / size for b in chunks],
        labels=["non-model (activations)", "chunks on device"],
        colors=["#f4a259", "#5b8e7d"],
        alpha=0.85,
        step="mid",
    )
    if budget is not None:
        _draw_budget(ax, budget, peak=peak, size=size, on_scale=on_scale)
    stride = max(1, -(-len(labels) // _MAX_TICK_LABELS))  # ceil division
    ticks = x[::stride]
    if ticks[-1] != x[-1] and x[-1] - ticks[-1] >= stride / 2:
        ticks.append(x[-1])  # the optimizer step, unless its label would collide with the previous one
    ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=60, ha="right", fontsize=8)
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set_xlabel("moment of the iteration")
    ax.set_ylabel(unit)
    ax.set_ylim(0, top / size * _HEAD_ROOM)
    ax.set_title(
        f"PatrickStar tide, placement {report.placement}: model data {format_bytes(report.model_data_bytes)},"
        f" peak non-model {format_bytes(report.peak_non_model_bytes)}\noptimizer on {report.optimizer_tier}"
    )
    ax.legend(loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    return figure


class PatrickStarMonitor(pl.Callback):
    """Log the chunk engine's figures and save the tide of an iteration as a PNG.

    Every ``log_every_n_steps`` optimizer steps it logs, through ``LightningModule.log_dict`` (so to
    whatever logger the Trainer has):

    - ``pstar/device_chunk_bytes``, ``pstar/host_chunk_bytes``: chunk bytes on each tier now;
    - ``pstar/h2d_bytes``, ``pstar/d2h_bytes``, ``pstar/evictions``, ``pstar/prefetches``: bytes copied and
      chunks evicted or prefetched *since the previous log* (since the start of training for the first);
    - ``pstar/peak_non_model_bytes``: the warm-up's peak of non-model memory;
    - ``pstar/nonfinite_skipped_steps``: steps not applied for a non-finite loss or gradient since the start of
      training (``mixed_precision.nonfinite="skip"``).

    Lightning forwards step metrics to the logger only every ``Trainer(log_every_n_steps=...)`` steps, so
    that number should divide this callback's; a warning says so otherwise.

    Args:
        log_every_n_steps: optimizer steps between two logs; 0 turns logging off.
        save_tide_png: where to save the tide (see :func:`plot_tide`) once the first iteration after the
            warm-up has run (or at the end of training if it never does); None saves nothing. Needs matplotlib.

    With any other strategy than :class:`~lightning_pstar.PatrickStarStrategy` it warns once and does nothing.
    """

    def __init__(self, log_every_n_steps: int = 50, save_tide_png: str | os.PathLike[str] | None = None) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 0:
            raise ValueError(
                f"`log_every_n_steps` must be an int >= 0, got {log_every_n_steps!r}."
                " HINT: use e.g. 50, or 0 to log nothing."
            )
        self.log_every_n_steps = log_every_n_steps
        self.save_tide_png: Path | None = None if save_tide_png is None else Path(save_tide_png)
        if self.save_tide_png is not None:
            _new_figure()  # fail now, not after an hour of training, when matplotlib is missing
        self.tide_saved = False
        self._active = False
        self._warned = False
        self._last: dict[str, int] = {}  # cumulative counters at the previous log
        self._last_global_step = 0
        self._sent = False  # pstar/* values were logged at the previous batch

    # ---- hooks ----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = isinstance(trainer.strategy, PatrickStarStrategy)
        if not self._active:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"PatrickStarMonitor does nothing with strategy {type(trainer.strategy).__name__}: it watches"
                    " the chunk engine of a PatrickStarStrategy. HINT: pass"
                    " `strategy=lightning_pstar.PatrickStarStrategy(...)` (or 'patrickstar') to the Trainer, or"
                    " remove the callback."
                )
            return
        n = self.log_every_n_steps
        every: int = getattr(trainer, "log_every_n_steps", 1)  # set by Lightning's logger connector, untyped
        if n and trainer.loggers and (every == 0 or n % every):
            rank_zero_warn(
                f"PatrickStarMonitor logs every {n} steps but the Trainer sends step metrics to its logger only"
                f" every {every} steps, so some pstar/* values never reach the logger."
                f" HINT: use a Trainer(log_every_n_steps=...) that divides {n}."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._last = self._counters(self._report(trainer))
        self._last_global_step = trainer.global_step
        self.tide_saved = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._sent:
            self._forget_sent_metrics(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        step = trainer.global_step
        stepped = step != self._last_global_step  # this micro-batch ended with an optimizer step
        self._last_global_step = step
        if not stepped:
            return
        n = self.log_every_n_steps
        if n and step % n == 0 and trainer.loggers:
            self._log(trainer, pl_module)
        # the warm-up is the first iteration; the second one is the first that follows the plan
        if self.save_tide_png is not None and not self.tide_saved and step >= 2:
            self._save_tide(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self.save_tide_png is not None and not self.tide_saved:
            self._save_tide(trainer)

    # ---- helpers --------------------------------------------------------------------------------------
    @staticmethod
    def _report(trainer: pl.Trainer) -> MemoryReport:
        strategy = trainer.strategy
        assert isinstance(strategy, PatrickStarStrategy)
        return strategy.memory_report()

    @staticmethod
    def _counters(report: MemoryReport) -> dict[str, int]:
        return {
            "h2d_bytes": report.h2d_bytes,
            "d2h_bytes": report.d2h_bytes,
            "evictions": report.evictions,
            "moves_off_device": report.moves_off_device,
            "prefetches": report.prefetches,
        }

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = self._report(trainer)
        counters = self._counters(report)
        values: dict[str, int] = {
            "device_chunk_bytes": report.device_chunk_bytes,
            "host_chunk_bytes": report.host_chunk_bytes,
            **{k: v - self._last.get(k, 0) for k, v in counters.items()},
            "peak_non_model_bytes": report.peak_non_model_bytes,
            "nonfinite_skipped_steps": report.nonfinite_skipped_steps,  # since the start of training
        }
        self._last = counters
        self._sent = True
        # float64: Lightning turns plain numbers into float32, which cannot hold byte counts above 16 MiB exactly
        metrics = {f"pstar/{k}": torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
        assert set(metrics) == _METRIC_NAMES
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def _forget_sent_metrics(self, trainer: pl.Trainer) -> None:
        """Drop this callback's values from Lightning's step results once the logger has had them.

        Lightning keeps a value logged with ``on_step=True`` until the epoch ends and sends it again at every
        later logging step. Ours are logged only every ``log_every_n_steps`` and several are windows ("since
        the previous log"): a value sent twice would count the same bytes twice in the logger.
        """
        self._sent = False
        results = getattr(trainer, "_results", None)  # Lightning's result collection (no public handle)
        if results is None:
            return
        for metric in results.values():
            if metric.meta.name in _METRIC_NAMES:
                metric.reset()

    def _save_tide(self, trainer: pl.Trainer) -> None:
        assert self.save_tide_png is not None
        report = self._report(trainer)
        if not report.moment_labels:
            rank_zero_warn(
                "PatrickStarMonitor saved no tide: training ended before the warm-up iteration completed."
                " HINT: train for at least two steps."
            )
            return
        if trainer.is_global_zero:
            path = plot_tide(report, self.save_tide_png)
            log.info("PatrickStar tide saved to %s", path)
        self.tide_saved = True
