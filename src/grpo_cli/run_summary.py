"""What `grpo-report` reads and computes for one run, apart from what it draws and writes:
a run folder -> its metrics rows, config and overrides; the rows -> one summary and its table.

Everything below `read_overrides` is pure (rows in, numbers out), so tests feed it hand-written
rows. sweep.py builds a sweep's table from these summaries.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_cli.logs import METRICS_FILE, read_metrics

MetricsRow = dict[str, float]  # {"step": 3, "reward/mean": 0.25, ...}, finite numbers only


class ReportError(Exception):
    """Input grpo-report cannot use. `message` is the paragraph for the user; `reason` a few
    words for the "failed" cell of a sweep table."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


@dataclass
class RunData:
    folder: Path
    rows: list[MetricsRow]  # one per step, ascending; step 0 = the eval before training
    config: Optional[DictConfig]  # config.yaml, None when absent or unreadable
    overrides: dict[str, str]  # .hydra/overrides.yaml: {"trainer.beta": "0.01", ...}


def load_run(folder: Path) -> RunData:
    """Read a run folder; raises ReportError naming the file (and line) when metrics are unusable."""
    path = folder / METRICS_FILE
    if not path.is_file():
        raise ReportError(f"{folder} holds no {METRICS_FILE}.", f"no {METRICS_FILE}")
    try:
        raw = read_metrics(folder)
        usable = all(isinstance(row, dict) and isinstance(row.get("step"), int) for row in raw)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        usable = False
    if not usable:
        number, problem = first_bad_line(path)
        raise ReportError(
            f"{path} line {number} is not a metrics row ({problem}). Each line must be one JSON "
            'object with an integer "step", as grpo-train writes it. A run killed while writing '
            "can leave a cut-off last line: delete that line and run grpo-report again.",
            f"{METRICS_FILE} line {number} is corrupt",
        )
    if not raw:
        raise ReportError(
            f"{path} is empty: the run stopped before logging its first step. Look at the run's "
            "log in that folder for why, or point grpo-report at a run that has trained.",
            f"{METRICS_FILE} is empty",
        )
    return RunData(folder, clean_rows(raw), _load_yaml(folder / "config.yaml"), read_overrides(folder))


def first_bad_line(path: Path) -> tuple[int, str]:
    """(line number, what is wrong) of the first line that is not a JSON object with a "step"."""
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            return number, f"not JSON: {error}"
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            return number, 'no integer "step"'
    return len(lines), "unreadable"


def _load_yaml(path: Path) -> Any:
    try:
        return OmegaConf.load(path) if path.is_file() else None
    except Exception:  # a half-written or hand-edited file: the report says "unknown" instead
        return None


def read_overrides(folder: Path) -> dict[str, str]:
    """.hydra/overrides.yaml -> {key: value as typed}: `- +trainer.x=1` -> {"trainer.x": "1"};
    {} when there is none (a run started from code)."""
    overrides = _load_yaml(folder / ".hydra" / "overrides.yaml")
    if not isinstance(overrides, ListConfig):
        return {}
    parsed = {}
    for override in overrides:
        key, _, value = str(override).partition("=")
        parsed[key.lstrip("+")] = value
    return parsed


def clean_rows(raw: list[dict[str, Any]]) -> list[MetricsRow]:
    """One row per step (the last one written: a resume rewrites steps), ascending, with nulls
    and NaN dropped so that one missing value neither breaks a mean nor a plotted line."""
    by_step: dict[int, MetricsRow] = {}
    for row in raw:
        by_step[row["step"]] = {
            key: value
            for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        }
    return [by_step[step] for step in sorted(by_step)]


def series(rows: list[MetricsRow], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have `key`."""
    present = [row for row in rows if key in row]
    return [int(row["step"]) for row in present], [row[key] for row in present]


def summary_window(train_steps: int) -> int:
    """How many steps "first" and "last" average over: a tenth of the run, 1 to 50, as in
    grpo-train's closing summary."""
    return max(1, min(50, train_steps // 10))


@dataclass(frozen=True)
class RunSummary:
    last_step: int
    train_steps: int  # rows with a sampled reward (step 0 is eval only)
    window: int  # steps averaged for reward_first / reward_last
    reward_first: Optional[float]  # mean reward/mean over the first `window` steps
    reward_last: Optional[float]  # ... over the last `window` steps
    reward_best: Optional[float]  # the highest reward/mean of one step
    reward_best_step: Optional[int]
    eval_before: Optional[float]  # eval/accuracy at step 0, before any update
    eval_final: Optional[float]  # the last eval/accuracy logged
    eval_best: Optional[float]
    eval_best_step: Optional[int]
    kl_final: Optional[float]
    time_means: dict[str, float] = field(default_factory=dict)  # "time/step" -> mean seconds
    tokens_per_second: Optional[float] = None


TIME_KEYS = ("time/step", "time/sample", "time/reward", "time/update")


def summarize_run(rows: list[MetricsRow]) -> RunSummary:
    trained = [row for row in rows if "reward/mean" in row]
    window = summary_window(len(trained))
    reward_steps, rewards = series(rows, "reward/mean")
    eval_steps, accuracies = series(rows, "eval/accuracy")
    _, kls = series(rows, "kl")
    reward_best = max(rewards, default=None)
    eval_best = max(accuracies, default=None)
    before = rows[0].get("eval/accuracy") if rows and rows[0]["step"] == 0 else None
    time_means = {key: value for key in TIME_KEYS if (value := mean(series(rows, key)[1])) is not None}
    return RunSummary(
        last_step=int(rows[-1]["step"]) if rows else 0,
        train_steps=len(trained),
        window=window,
        reward_first=mean(rewards[:window]),
        reward_last=mean(rewards[-window:]),
        reward_best=reward_best,
        reward_best_step=None if reward_best is None else reward_steps[rewards.index(reward_best)],
        eval_before=before,
        eval_final=accuracies[-1] if accuracies else None,
        eval_best=eval_best,
        eval_best_step=None if eval_best is None else eval_steps[accuracies.index(eval_best)],
        kl_final=kls[-1] if kls else None,
        time_means=time_means,
        tokens_per_second=mean(series(rows, "tokens_per_second")[1]),
    )


def mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def number(value: Optional[float], digits: int = 3) -> str:
    """A table cell: `digits` decimals below 1 (0.290, 0.000), `digits` significant digits up
    to 1000 (2.00, 12.3), whole numbers above; tiny values in e-notation."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    size = abs(value)
    if size >= 1000:
        return f"{value:.0f}"
    if size >= 1:
        return f"{value:.{max(digits - 1 - int(math.log10(size)), 0)}f}"
    return f"{value:.{digits}f}" if size >= 1e-3 or value == 0 else f"{value:.{digits - 1}e}"


def steps_phrase(count: int) -> str:
    return "step" if count == 1 else f"{count} steps"


def summary_table(summary: RunSummary) -> list[tuple[str, str]]:
    """The summary as (label, value) rows, for report.md and the console."""
    times = summary.time_means
    split = ", ".join(f"{key.split('/')[1]} {number(times[key])} s" for key in TIME_KEYS[1:] if key in times)
    eval_change = f"{number(summary.eval_before)} -> {number(summary.eval_final)}"
    return [
        ("steps", f"{summary.last_step} ({summary.train_steps} with a sampled reward)"),
        (
            f"mean reward, first -> last {steps_phrase(summary.window)}",
            f"{number(summary.reward_first)} -> {number(summary.reward_last)}",
        ),
        ("best mean reward (step)", _at_step(summary.reward_best, summary.reward_best_step)),
        ("greedy eval accuracy, before -> final", eval_change),
        ("best eval accuracy (step)", _at_step(summary.eval_best, summary.eval_best_step)),
        ("final KL", number(summary.kl_final, 4)),
        ("mean step time", f"{number(times.get('time/step'))} s" + (f" ({split})" if split else "")),
        ("mean tokens/s (sampling)", number(summary.tokens_per_second)),
    ]


def _at_step(value: Optional[float], step: Optional[int]) -> str:
    return "-" if value is None else f"{number(value)} (step {step})"
