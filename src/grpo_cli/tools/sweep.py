"""A sweep (`grpo-train -m`) as one table: a row per job with its swept overrides and its
run's summary, the order that ranks them, and the grid of a two-key heatmap. Pure: the rows
are built by report.py from each job folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from grpo_cli.run_summary import RunSummary, mean


@dataclass(frozen=True)
class SweepRow:
    job: str  # the job's folder name: "0", "1", ...
    overrides: dict[str, str]
    summary: Optional[RunSummary]  # None: the job failed
    failure: str = ""  # why, when it failed


def swept_keys(rows: list[SweepRow]) -> list[str]:
    """Override keys whose value differs between the jobs that set them, in command-line order.
    (A job whose overrides.yaml is missing sets none: it must not make every key look swept.)"""
    keys = list(dict.fromkeys(key for row in rows for key in row.overrides))
    return [key for key in keys if len({row.overrides[key] for row in rows if key in row.overrides}) > 1]


def ranking(rows: list[SweepRow]) -> tuple[str, str]:
    """(RunSummary field, its label) that ranks the jobs: the final greedy eval accuracy, or the
    final sampled reward when no job ran an eval. One metric for all rows: mixing the two in
    one ordering would compare unlike numbers."""
    if any(row.summary and row.summary.eval_final is not None for row in rows):
        return "eval_final", "final eval accuracy"
    return "reward_last", "final mean reward"


def sort_sweep(rows: list[SweepRow]) -> list[SweepRow]:
    """Best first by `ranking`; jobs without the number (failed ones too) last, in folder order."""
    metric, _ = ranking(rows)

    def key(row: SweepRow) -> tuple[float, tuple[int, int, str]]:
        value = getattr(row.summary, metric) if row.summary else None
        return (-value if value is not None else math.inf, job_order(row.job))

    return sorted(rows, key=key)


def job_order(name: str) -> tuple[int, int, str]:
    """Hydra's job folders by number (job 10 after job 9), anything else after them by name."""
    return (0, int(name), name) if name.isdigit() else (1, 0, name)


SWEEP_METRICS = ("final mean reward", "best mean reward", "final eval accuracy", "final KL", "mean step time (s)")


def sweep_table(rows: list[SweepRow]) -> tuple[list[str], list[list[Any]]]:
    """(header, cells) with the raw values: strings for job and overrides, floats or None after."""
    keys = swept_keys(rows)
    header = ["job", *keys, "status", *SWEEP_METRICS]
    cells = []
    for row in rows:
        summary = row.summary
        numbers = (
            [None] * len(SWEEP_METRICS)
            if summary is None
            else [
                summary.reward_last,
                summary.reward_best,
                summary.eval_final,
                summary.kl_final,
                summary.time_means.get("time/step"),
            ]
        )
        status = "ok" if summary else f"failed: {row.failure}"
        cells.append([row.job, *(row.overrides.get(key, "") for key in keys), status, *numbers])
    return header, cells


@dataclass(frozen=True)
class Grid:
    x_key: str
    y_key: str
    x_values: list[str]
    y_values: list[str]
    cells: list[list[Optional[float]]]  # [len(y_values)][len(x_values)]; None: no finished job


def heatmap_grid(rows: list[SweepRow], x_key: str, y_key: str, metric: str) -> Grid:
    """The `metric` of each (x, y) pair of override values, averaged over any other swept key.

    Example: jobs (beta 0.01, G 2) -> 0.5, (0.01, 4) -> 0.7, (0.04, 2) -> 0.3 and (0.04, 4)
    failed give x_values ["0.01", "0.04"], y_values ["2", "4"], cells [[0.5, 0.3], [0.7, None]].
    """
    x_values, y_values = swept_values(rows, x_key), swept_values(rows, y_key)
    cells: list[list[Optional[float]]] = []
    for y in y_values:
        line = []
        for x in x_values:
            found = [
                getattr(row.summary, metric)
                for row in rows
                if row.summary and row.overrides.get(x_key) == x and row.overrides.get(y_key) == y
            ]
            line.append(mean([value for value in found if value is not None]))
        cells.append(line)
    return Grid(x_key, y_key, x_values, y_values, cells)


def swept_values(rows: list[SweepRow], key: str) -> list[str]:
    """The values `key` took, numbers by size (so 16 comes after 4), then others alphabetically."""

    def order(value: str) -> tuple[int, float, str]:
        try:
            return 0, float(value), value
        except ValueError:
            return 1, 0.0, value

    return sorted({row.overrides[key] for row in rows if key in row.overrides}, key=order)
