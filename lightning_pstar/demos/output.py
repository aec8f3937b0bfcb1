"""What the examples print, once: the first process prints, the others stay quiet.

A multi-rank run starts the example once per rank (Lightning's and Fabric's launchers, torchrun, SLURM). Before
the Trainer or Fabric knows the ranks, the launcher's environment does (``rank_zero_only.rank``, which Lightning
sets from ``RANK``/``LOCAL_RANK``/``SLURM_PROCID`` at import and again when the processes start); after it,
``is_global_zero`` decides. At the end rank 0 prints its memory report and, with several ranks, one line per rank.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only

__all__ = ["first_process", "rank_reports"]


def first_process() -> bool:
    """Whether this process is rank 0 of the run (or the only process)."""
    return getattr(rank_zero_only, "rank", 0) == 0


def rank_reports(strategy: Any) -> str | None:
    """Rank 0's memory report and, with several ranks, the per-rank summary table; None for another strategy.

    Call it on every rank: while the engine is up ``memory_report_all`` is a collective (after ``fit`` it returns
    the reports gathered at teardown without communicating).
    """
    report_all = getattr(strategy, "memory_report_all", None)
    if not callable(report_all):
        return None
    reports = report_all()
    text = str(reports[0])
    if len(reports) > 1:
        text += "\nper rank:\n" + strategy.format_rank_summary(reports)
    return text
