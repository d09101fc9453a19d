"""`grpo-report PATH`: turn a finished run folder, or a sweep folder, into report.md and plots.

    grpo-report outputs/2025-01-01/12-00-00   # a run: report.md, plots/*.png
    grpo-report multirun/2025-01-01/12-00-00  # a sweep (grpo-train -m): report.md, sweep.csv,
                                              # plots/heatmap.png when two keys were swept

A folder with metrics.jsonl is a run; one whose subfolders (Hydra's job folders 0, 1, ...) hold
one is a sweep. The numbers come from run_summary.py and sweep.py, the pictures from plots.py;
this module finds the folders, writes the files and prints the table. Bad input (no such folder, no
metrics, a corrupt line) ends with one message naming the file, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from grpo_cli.console import conversation_lines
from grpo_cli.logs import METRICS_FILE, SAMPLES_FILE, read_metrics
from grpo_cli.run_summary import (
    ReportError,
    RunData,
    RunSummary,
    load_run,
    number,
    read_overrides,
    steps_phrase,
    summarize_run,
    summary_table,
)
from grpo_cli.tools.plots import draw_heatmap, draw_plot, plan_plots
from grpo_cli.tools.sweep import (
    SweepRow,
    heatmap_grid,
    job_order,
    ranking,
    sort_sweep,
    sweep_table,
    swept_keys,
    swept_values,
)

REPORT_FILE = "report.md"
SWEEP_CSV = "sweep.csv"
PLOTS_DIR = "plots"
INPUT_ERROR_EXIT_CODE = 2  # as grpo-train: bad input is the user's to fix
# config.yaml keys shown at the top of a run's report, in this order.
SETTINGS = (
    "model.name_or_path",
    "model.lora.enabled",
    "data.path",
    "data.prompts_per_step",
    "sampler.group_size",
    "sampler.temperature",
    "sampler.max_new_tokens",
    "trainer.steps",
    "optimizer.lr",
    "optimizer.scheduler",
    "trainer.beta",
    "trainer.kl_estimator",
    "trainer.advantage",
    "trainer.loss_aggregation",
    "trainer.clip_eps",
    "trainer.clip_eps_high",
    "trainer.num_iterations",
    "trainer.filter_zero_std",
    "trainer.mask_truncated",
    "reward.functions",
)
ABSENT = object()
WHAT_TO_GIVE = (
    "Give a run folder (grpo-train's hydra.run.dir, holding metrics.jsonl) or a sweep folder "
    "(the hydra.sweep.dir of grpo-train -m, holding job folders 0, 1, ...)."
)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="grpo-report",
        description="Write report.md and PNG plots for a grpo-train run folder, or a sweep table "
        "(report.md, sweep.csv, plots/heatmap.png) for a grpo-train -m sweep folder.",
    )
    parser.add_argument(
        "path", type=Path, help="a run folder (holds metrics.jsonl) or a sweep folder (holds job folders 0, 1, ...)"
    )
    parser.add_argument(
        "--each-job", action="store_true", help="for a sweep: also write each finished job's own report.md and plots"
    )
    args = parser.parse_args(argv)
    try:
        report(args.path, Console(), each_job=args.each_job)
    except ReportError as error:
        fail(str(error))
    except OSError as error:  # e.g. a read-only folder: say where, not a traceback
        fail(
            f"Cannot write {error.filename}: {error.strerror}. Make the folder writable, or copy "
            "the run folder somewhere you can write and report on the copy."
        )


def fail(message: str) -> NoReturn:
    console = Console(stderr=True, highlight=False, soft_wrap=True)  # paths stay whole when copied
    console.print("[bold red]grpo-report: error[/]", end=" ")
    console.print(message, markup=False)
    sys.exit(INPUT_ERROR_EXIT_CODE)


def report(path: Path, console: Console, each_job: bool = False) -> Path:
    """Write the report for a run or a sweep folder; returns the report.md written."""
    if path.is_file() and path.name == METRICS_FILE:
        path = path.parent
    if not path.exists():
        raise ReportError(f"{path} does not exist. {WHAT_TO_GIVE}")
    if not path.is_dir():
        raise ReportError(f"{path} is a file, not a folder. {WHAT_TO_GIVE}")
    if (path / METRICS_FILE).is_file():
        run = load_run(path)
        summary = write_run_report(run)
        print_table(console, f"grpo-report: {path}", ["metric", "value"], summary_table(summary))
    else:
        jobs = job_folders(path)
        if not jobs:
            raise ReportError(
                f"{path} holds neither {METRICS_FILE} nor job folders with one. {WHAT_TO_GIVE} A run "
                "that crashed before its first step has no metrics: its log in the folder says why."
            )
        rows = write_sweep_report(path, jobs, each_job)
        header, cells = sweep_table(rows)
        print_table(console, f"grpo-report: sweep {path}", header, text_cells(cells))
    console.print(f"Wrote {path / REPORT_FILE}", highlight=False, soft_wrap=True)
    return path / REPORT_FILE


def job_folders(folder: Path) -> list[Path]:
    """Hydra's job folders of a sweep, in job order: the subfolders with metrics.jsonl or a
    .hydra folder (a job that crashed before logging has only the latter). Empty when no job
    has metrics and there is no multirun.yaml: then this is not a sweep."""
    candidates = [
        child
        for child in folder.iterdir()
        if child.is_dir()
        and not child.name.startswith(".")
        and ((child / METRICS_FILE).is_file() or (child / ".hydra").is_dir())
    ]
    if not (folder / "multirun.yaml").is_file() and not any((c / METRICS_FILE).is_file() for c in candidates):
        return []
    return sorted(candidates, key=lambda child: job_order(child.name))


def write_run_report(run: RunData) -> RunSummary:
    summary = summarize_run(run.rows)
    plots_dir = run.folder / PLOTS_DIR
    plots_dir.mkdir(exist_ok=True)
    drawn, skipped = plan_plots(run.rows)
    for plot in drawn:
        draw_plot(plot, run.rows, plots_dir / f"{plot.name}.png")
    overrides = ", ".join(f"`{key}={value}`" for key, value in run.overrides.items()) or "none"
    lines = [
        f"# GRPO run report: {run.folder.resolve().name}",
        "",
        f"Run folder: `{run.folder.resolve()}`  ",
        f"Command-line overrides: {overrides}",
        "",
        "## Settings (config.yaml)",
        "",
    ]
    if run.config is None:
        lines.append("config.yaml is missing or unreadable: the settings are unknown.")
    else:
        lines += markdown_table(["key", "value"], settings(run.config))
    lines += [
        "",
        "## Summary",
        "",
        *markdown_table(["metric", "value"], summary_table(summary)),
        "",
        f"First and last: the mean of `reward/mean` over the first and last {steps_phrase(summary.window)} "
        '(a tenth of the steps, 1 to 50). Eval: greedy accuracy on the held-out prompts; "before" '
        "is step 0, before any update. Times and tokens/s: means over all steps.",
        "",
        "## Plots",
        "",
    ]
    for plot in drawn:
        lines += [f"![{plot.title}]({PLOTS_DIR}/{plot.name}.png)", ""]
    if skipped:
        lines += ["Not drawn:", "", *(f"- {plot.title}: {why}." for plot, why in skipped)]
    lines += ["", "## Samples", "", *sample_lines(run.folder)]
    (run.folder / REPORT_FILE).write_text("\n".join(lines) + "\n")
    return summary


def sample_lines(folder: Path) -> list[str]:
    """The last logged step's groups from samples.jsonl: each completion (or multi-turn, its whole
    conversation, one message a line) with its reward and advantage."""
    try:
        entries = [entry for entry in read_metrics(folder, SAMPLES_FILE) if isinstance(entry, dict)]
        last = max(entry["step"] for entry in entries) if entries else None
        shown = [entry for entry in entries if entry["step"] == last]
        lines = []
        for entry in shown:
            answer = f" · answer `{entry['answer']}`" if entry.get("answer") is not None else ""
            lines += [f"### Step {entry['step']}{answer}", "", "Prompt:", "", *fenced(entry["prompt"]), ""]
            for index, (reward, advantage) in enumerate(zip(entry["rewards"], entry["advantages"])):
                cut = " · truncated" if entry["truncated"][index] else ""
                lines += [f"Completion {index} · reward {number(reward)} · advantage {number(advantage)}{cut}", ""]
                lines += [*fenced("\n".join(conversation_lines(entry, index))), ""]
    except (ValueError, KeyError, TypeError, IndexError) as error:  # a cut-off or foreign line
        return [f"{SAMPLES_FILE} is unreadable ({type(error).__name__}: {error}): no samples shown."]
    if not shown:
        return [f"No {SAMPLES_FILE} groups: the run logged none (trainer.sample_every=0, or it stopped first)."]
    return lines


def fenced(text: str) -> list[str]:
    """`text` as a markdown code block, fenced longer than any backtick run inside it."""
    fence = "`" * max(3, 1 + max((len(run) for run in text.split() if set(run) == {"`"}), default=0))
    return [fence, text, fence]


def settings(config: DictConfig) -> list[tuple[str, str]]:
    """(key, value) of each SETTINGS key the config has; reward functions as `name x weight`."""
    found = []
    for key in SETTINGS:
        value = OmegaConf.select(config, key, default=ABSENT)
        if value is ABSENT:
            continue
        if key == "reward.functions" and isinstance(value, ListConfig):  # grpo_cli.rewards.exact_match -> exact_match
            text = ", ".join(
                f"{str(function.get('_target_')).rsplit('.', 1)[-1]} x{function.get('weight', 1.0)}"
                for function in value
            )
        elif isinstance(value, (DictConfig, ListConfig)):  # e.g. a beta schedule {start, end, ...}
            text = json.dumps(OmegaConf.to_container(value))
        else:
            text = "null" if value is None else str(value)
        found.append((key, text))
    return found


def write_sweep_report(folder: Path, jobs: list[Path], each_job: bool) -> list[SweepRow]:
    rows = []
    for job in jobs:
        try:
            run = load_run(job)
        except ReportError as error:  # a crashed job is a result of the sweep, not bad input
            rows.append(SweepRow(job.name, read_overrides(job), None, error.reason))
            continue
        summary = write_run_report(run) if each_job else summarize_run(run.rows)
        rows.append(SweepRow(job.name, run.overrides, summary))
    rows = sort_sweep(rows)
    header, cells = sweep_table(rows)
    with open(folder / SWEEP_CSV, "w", newline="") as handle:
        csv.writer(handle).writerows([header, *([("" if c is None else c) for c in line] for line in cells)])

    keys = swept_keys(rows)
    metric, metric_label = ranking(rows)
    failed = sum(row.summary is None for row in rows)
    windows = {row.summary.window for row in rows if row.summary}
    window = windows.pop() if len(windows) == 1 else None
    last = "last tenth of its steps (1 to 50)" if window is None else f"last {steps_phrase(window)}"
    swept = ", ".join(f"`{key}` ({', '.join(swept_values(rows, key))})" for key in keys)
    lines = [
        f"# GRPO sweep report: {folder.resolve().name}",
        "",
        f"Sweep folder: `{folder.resolve()}`; {len(rows)} jobs, {failed} failed. "
        f"Swept: {swept or 'nothing (all jobs share their overrides)'}.",
        "",
        f"Sorted by {metric_label}, best first. Final mean reward: the mean of `reward/mean` over each "
        f"job's {last}; final eval accuracy: its last greedy eval; final KL: its last step's; mean "
        f"step time: over all its steps. The same table with full precision: [{SWEEP_CSV}]({SWEEP_CSV}).",
        "",
        *markdown_table(header, text_cells(cells)),
        "",
        "## Heatmap",
        "",
    ]
    lines.append(write_heatmap(folder, rows, keys, metric, metric_label))
    (folder / REPORT_FILE).write_text("\n".join(lines) + "\n")
    return rows


def write_heatmap(folder: Path, rows: list[SweepRow], keys: list[str], metric: str, metric_label: str) -> str:
    """Draw plots/heatmap.png of the first two swept keys when there are two or more; returns
    the report.md paragraph (the image, or why there is none)."""
    if len(keys) < 2:
        return f"No heatmap: it needs two swept keys, this sweep varied {len(keys)} ({', '.join(keys) or '-'})."
    if not any(row.summary for row in rows):
        return "No heatmap: no job finished."
    x_key, y_key, others = keys[0], keys[1], keys[2:]
    grid = heatmap_grid(rows, x_key, y_key, metric)
    title = f"{metric_label} by {x_key} and {y_key}"
    (folder / PLOTS_DIR).mkdir(exist_ok=True)
    draw_heatmap(grid, metric_label, others, folder / PLOTS_DIR / "heatmap.png")
    averaged = f" Each cell is the mean over the other swept keys: {', '.join(others)}." if others else ""
    return (
        f'![{title}]({PLOTS_DIR}/heatmap.png)\n\nCells: {metric_label}; grey "no result": no job of '
        f"that pair finished.{averaged}"
    )


def text_cells(cells: list[list[Any]]) -> list[list[str]]:
    """The sweep table's raw cells as text: strings as they are, numbers by `number`, None "-"."""
    return [[cell if isinstance(cell, str) else number(cell) for cell in line] for line in cells]


def markdown_table(header: list[str], rows: list[Any]) -> list[str]:
    def line(cells: Any) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(row) for row in rows)]


def print_table(console: Console, title: str, header: list[str], rows: list[Any]) -> None:
    """A rich table on a terminal; plain aligned lines otherwise (logs and CI never wrap them)."""
    if console.is_terminal:
        table = Table(title=title)
        for name in header:
            table.add_column(name, min_width=min(len(name), 20))  # override keys stay readable
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    widths = [max(len(str(line[index])) for line in [header, *rows]) for index in range(len(header))]
    console.print(title, highlight=False, markup=False, soft_wrap=True)
    for line in [header, *rows]:
        text = "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip()
        console.print(f"  {text}", highlight=False, markup=False, soft_wrap=True)


if __name__ == "__main__":
    main()
