"""What the run shows and keeps: the console, `metrics.jsonl`, `samples.jsonl`, and the logger
backends of the `logger` group (TensorBoard; Weights & Biases and MLflow when selected).

Every step appends one JSON object to `OUTPUT_DIR/metrics.jsonl` and hands the same scalars to
each backend. On a terminal the console shows a live panel (console.py): progress with ETA, the
last step's numbers and the warnings of health.py; otherwise a plain line every `log_every`
steps. Warnings are printed once, when they appear. Every `trainer.sample_every` steps a few
groups of completions go to `samples.jsonl`, the console and TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from grpo_cli.console import plain_line, samples_table, samples_text, status_panel
from grpo_cli.safety.health import HISTORY_NEEDED, health_warnings

if TYPE_CHECKING:  # read_metrics is used by grpo-report, which should not wait for torch to import
    from grpo_cli.config import LoggerConfig

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def resident_memory_gb() -> float:
    """This process's resident memory now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


# Metrics renamed since a release wrote them: old name -> new name.
RENAMED_METRICS = {"clip_fraction": "clip/fraction"}


def read_metrics(output_dir: Path, name: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (or samples.jsonl), oldest first; [] if there is none."""
    path = Path(output_dir) / name
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # A run of an older grpo-cli reads under today's names (reports, resume). A line that is not
    # an object is left as it is, for the caller to name (grpo-report: "not a metrics row").
    for row in rows:
        for old_name, new_name in RENAMED_METRICS.items():
            if isinstance(row, dict) and old_name in row:
                row[new_name] = row.pop(old_name)
    return rows


def _truncate_to_step(output_dir: Path, name: str, last_step: int) -> list[dict[str, Any]]:
    """On resume, drop rows the stopped run wrote after its last checkpoint: they are redone."""
    kept = [row for row in read_metrics(output_dir, name) if row.get("step", 0) <= last_step]
    (output_dir / name).write_text("".join(json.dumps(row) + "\n" for row in kept))
    return kept


class RunLogger:
    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        start_step: int,
        log_every: int,
        backends: LoggerConfig | None = None,
        config: Optional[dict[str, Any]] = None,
        console: Console | None = None,
    ):
        self.output_dir = output_dir
        self.console = console or Console()
        self.log_every = log_every
        self.history = _truncate_to_step(output_dir, METRICS_FILE, start_step)
        _truncate_to_step(output_dir, SAMPLES_FILE, start_step)
        self.metrics_file = (output_dir / METRICS_FILE).open("a", encoding="utf-8")
        self.samples_file = (output_dir / SAMPLES_FILE).open("a", encoding="utf-8")
        from grpo_cli.config import LoggerConfig
        from grpo_cli.log_backends import open_backends

        self.backends = open_backends(backends or LoggerConfig(), output_dir, start_step, config or {})
        self.warnings: dict[str, str] = {}  # kind -> message, the patterns present at the last step
        self.last_eval: Optional[dict[str, Any]] = next(
            (r for r in reversed(self.history) if "eval/accuracy" in r), None
        )
        self.progress = Progress(
            TextColumn("[bold]GRPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step)
        self.live: Optional[Live] = None
        if self.console.is_terminal:
            self.live = Live(
                status_panel(self.progress, None, None, []), console=self.console, refresh_per_second=4, transient=False
            )
            self.live.start()

    def print(self, message: str) -> None:
        self.console.print(message)

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        self.history.append(row)
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        scalars = {
            k: v
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        for backend in self.backends:
            backend.log_scalars(scalars, step)
        if "eval/accuracy" in row:
            self.last_eval = row
        warnings = dict(health_warnings(self.history[-HISTORY_NEEDED:]))  # the tail: constant work per step
        for kind, message in warnings.items():
            if kind not in self.warnings:  # printed when it appears, not every step it lasts
                self.console.print(f"[bold yellow]step {step} warning:[/] {message}", highlight=False, soft_wrap=True)
        self.warnings = warnings
        self.progress.update(self.task, completed=step)
        if self.live is not None:
            self.live.update(status_panel(self.progress, row, self.last_eval, list(self.warnings.values())))
        if step % self.log_every == 0 or "eval/accuracy" in row:
            self.console.print(plain_line(row), highlight=False, soft_wrap=True)

    def log_samples(self, entries: list[dict[str, Any]]) -> None:
        """Groups of one step (console.sample_entries): samples.jsonl, the console, the backends."""
        for entry in entries:
            self.samples_file.write(json.dumps(entry) + "\n")
            if self.console.is_terminal:
                self.console.print(samples_table(entry))
            else:
                self.console.print(samples_text(entry), highlight=False, markup=False, soft_wrap=True)
        self.samples_file.flush()
        if entries:
            for backend in self.backends:
                backend.log_samples(entries, entries[0]["step"])

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        self.metrics_file.close()
        self.samples_file.close()
        for backend in self.backends:
            backend.close()
        self.backends = []

    def summary(self, rows: dict[str, str]) -> None:
        if not self.console.is_terminal:  # logs and CI: plain lines that never wrap or truncate
            self.console.print("grpo-train summary", highlight=False)
            for key, value in rows.items():
                self.console.print(f"  {key}: {value}", highlight=False, soft_wrap=True)
            return
        table = Table(title="grpo-train summary", show_header=False)
        for key, value in rows.items():
            table.add_row(key, value)
        self.console.print(table)


class QuietLogger:
    """RunLogger's stand-in on the other ranks of a torchrun job: rank 0 alone prints and writes."""

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []

    def print(self, message: str) -> None:
        pass

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        self.history.append({"step": step, **metrics})

    def log_samples(self, entries: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass

    def summary(self, rows: dict[str, str]) -> None:
        pass
