"""What the run shows and keeps: rich console, `metrics.jsonl`, TensorBoard scalars.

Every step appends one JSON object to `OUTPUT_DIR/metrics.jsonl` and writes the same scalars to
TensorBoard (`OUTPUT_DIR/tensorboard`). The console gets a progress bar with ETA and the last
step's key numbers when it is a terminal, a plain line every `log_every` steps always, and a
summary table at the end.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

METRICS_FILE = "metrics.jsonl"
# The numbers shown on the progress bar and in each log line, with their short labels.
KEY_NUMBERS = {
    "reward/mean": "reward",
    "kl": "kl",
    "advantage/zero_std_fraction": "zero-std",
    "completion/length_mean": "len",
    "time/step": "s/step",
}


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def resident_memory_gb() -> float:
    """This process's resident memory now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunLogger:
    def __init__(self, output_dir: Path, total_steps: int, start_step: int, log_every: int,
                 console: Console | None = None):
        self.output_dir = output_dir
        self.console = console or Console()
        self.log_every = log_every
        metrics_path = output_dir / METRICS_FILE
        # On resume, drop rows the stopped run wrote after its last checkpoint: they are redone.
        kept = [row for row in read_metrics(output_dir) if row.get("step", 0) <= start_step]
        metrics_path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        self.history: list[dict[str, Any]] = kept
        self.metrics_file = metrics_path.open("a", encoding="utf-8")
        self.tensorboard = self._open_tensorboard(output_dir / "tensorboard")
        self.progress = Progress(
            TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[numbers]}"),
            console=self.console, transient=False, disable=not self.console.is_terminal,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, numbers="")
        self.progress.start()

    @staticmethod
    def _open_tensorboard(folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is a dependency, but a broken install must not stop training
            return None
        return SummaryWriter(log_dir=str(folder))

    def print(self, message: str) -> None:
        self.console.print(message)

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        self.history.append(row)
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.tensorboard.add_scalar(key, value, step)
        numbers = "  ".join(f"{label} {_format(row[key])}" for key, label in KEY_NUMBERS.items() if key in row)
        self.progress.update(self.task, completed=step, numbers=numbers)
        if step % self.log_every == 0 or "eval/accuracy" in row:
            extra = f"  eval {row['eval/accuracy']:.3f}" if "eval/accuracy" in row else ""
            self.console.print(f"step {step}  {numbers}{extra}", highlight=False)

    def close(self) -> None:
        self.progress.stop()
        self.metrics_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

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


def window_mean(history: list[dict[str, Any]], key: str, first: bool, size: int) -> float | None:
    """Mean of `key` over the first or last `size` rows that have it."""
    values = [row[key] for row in history if key in row]
    values = values[:size] if first else values[-size:]
    return sum(values) / len(values) if values else None
