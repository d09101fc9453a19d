"""The PNG plots of `grpo-report`: one run's metrics by step, and a sweep's heatmap.

Which plots a run gets, and what each shows, is decided by `plan_plots` from the rows alone
(pure, tested without drawing); `draw_plot` and `draw_heatmap` only render. Figures are made with
`matplotlib.figure.Figure`, not pyplot: no display, no global figure list to leak, and the Agg
backend whatever the user's matplotlibrc says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from matplotlib import colormaps
from matplotlib.figure import Figure

from grpo_cli.run_summary import MetricsRow, number, series, summary_window
from grpo_cli.tools.sweep import Grid

PANEL_SIZE = (8.0, 3.4)  # inches per panel at 110 dpi: 880 px wide, labels at 10 pt stay legible
DPI = 110


@dataclass(frozen=True)
class Line:
    key: str  # the metric, e.g. "reward/mean"
    label: str  # its legend entry


@dataclass(frozen=True)
class Panel:
    ylabel: str
    lines: tuple[Line, ...]
    style: str = "line"  # "line"; "markers" for sparse eval points; "stacked" for parts of a whole
    smooth: bool = False  # noisy per-step numbers: draw a rolling mean over the faint raw line
    legend: bool = False  # set by plan_plots: the run logged more than one of `lines`


@dataclass(frozen=True)
class Plot:
    name: str  # the file: plots/<name>.png
    title: str
    panels: tuple[Panel, ...]
    notes: tuple[str, ...] = ()  # panels left out because nothing moved: "beta: 0.040 at every step"


def catalogue(keys: set[str]) -> list[Plot]:
    """Every plot a run can have; `keys` (the metric names it logged) names the reward functions."""
    functions = sorted(
        key.split("/")[1] for key in keys if key.startswith("reward/") and key.endswith("/mean") and key.count("/") == 2
    )
    evaluated = sorted(
        key.split("/")[1]
        for key in keys
        if key.startswith("eval/") and key not in ("eval/accuracy", "eval/reward", "eval/pass_at_k")
    )
    # With one reward function eval/<fn> is eval/accuracy again: only several deserve their lines.
    eval_functions = [Line(f"eval/{name}", name) for name in evaluated] if len(evaluated) > 1 else []
    return [
        Plot(
            "reward",
            "Sampled reward",
            (
                Panel(
                    "reward",
                    (
                        Line("reward/mean", "total (weighted)"),
                        *(Line(f"reward/{name}/mean", name) for name in functions),
                    ),
                    smooth=True,
                ),
            ),
        ),
        Plot(
            "eval",
            "Greedy eval",
            (
                Panel(
                    "score",
                    (
                        Line("eval/accuracy", "accuracy"),
                        Line("eval/reward", "reward"),
                        Line("eval/pass_at_k", "pass@k"),
                        *eval_functions,
                    ),
                    style="markers",
                ),
            ),
        ),
        Plot(
            "kl_beta",
            "KL to the reference, and beta",
            (Panel("KL", (Line("kl", "kl"),)), Panel("beta", (Line("beta", "beta"),))),
        ),
        Plot(
            "clipping",
            "Tokens whose ratio was clipped",
            (
                Panel(
                    "fraction of tokens",
                    (
                        Line("clip/fraction", "total"),
                        Line("clip/high_fraction", "high (ratio > 1 + eps)"),
                        Line("clip/low_fraction", "low (ratio < 1 - eps)"),
                    ),
                ),
            ),
        ),
        Plot("entropy", "Policy entropy of sampled tokens", (Panel("entropy (nats)", (Line("entropy", "entropy"),)),)),
        Plot(
            "zero_std",
            "Groups whose rewards all agree (no learning signal)",
            (Panel("fraction of groups", (Line("advantage/zero_std_fraction", "zero-std groups"),), smooth=True),),
        ),
        Plot(
            "completion",
            "Completion length and truncation",
            (
                Panel("tokens", (Line("completion/length_mean", "mean"), Line("completion/length_max", "max"))),
                Panel("truncated fraction", (Line("completion/truncated_fraction", "truncated"),), smooth=True),
            ),
        ),
        Plot(
            "step_time",
            "Time per step, by stage",
            (
                Panel(
                    "seconds",
                    (Line("time/sample", "sample"), Line("time/reward", "reward"), Line("time/update", "update")),
                    style="stacked",
                ),
            ),
        ),
        Plot(
            "optimizer",
            "Loss, gradient norm and learning rate",
            (
                Panel("loss", (Line("loss", "loss"),)),
                Panel("grad norm", (Line("grad_norm", "grad norm"),)),
                Panel("learning rate", (Line("lr", "lr"),)),
            ),
        ),
        Plot(
            "throughput",
            "Throughput and memory",
            (
                Panel("tokens/s (sampling)", (Line("tokens_per_second", "tokens/s"),)),
                Panel("resident memory (GB)", (Line("memory/rss_gb", "RSS"),)),
            ),
        ),
        Plot("group_size", "Group size G by step", (Panel("group size G", (Line("sampler/group_size", "G"),)),)),
    ]


def plan_plots(rows: list[MetricsRow]) -> tuple[list[Plot], list[tuple[Plot, str]]]:
    """(plots to draw, trimmed to what the run logged; (skipped plot, why) pairs).

    Trimming keeps a figure about what moved: a line identical to an earlier one in its panel is
    merged into that line's label (one reward function of weight 1 *is* the total), and a panel
    that is one value throughout (a constant beta or learning rate) becomes a note in the title.
    A plot with nothing that moved (no clipping at all, a fixed group size) is skipped, its
    note as the reason.
    """
    keys = {key for row in rows for key in row}
    drawn, skipped = [], []
    for plot in catalogue(keys):
        panels = [trimmed for panel in plot.panels if (trimmed := _merge_twins(panel, rows, keys))]
        if not panels:
            wanted = ", ".join(f"`{line.key}`" for panel in plot.panels for line in panel.lines)
            skipped.append((plot, f"metrics.jsonl has none of {wanted}"))
            continue
        notes, varying = [], []
        for panel in panels:
            values = {value for line in panel.lines for value in series(rows, line.key)[1]}
            if len(values) == 1:
                notes.append(f"{panel.ylabel}: {number(values.pop())} at every step")
            else:
                varying.append(panel)
        if varying:
            drawn.append(replace(plot, panels=tuple(varying), notes=tuple(notes)))
        else:
            skipped.append((plot, "; ".join(notes)))
    return drawn, skipped


def _merge_twins(panel: Panel, rows: list[MetricsRow], keys: set[str]) -> Optional[Panel]:
    """The panel with only its logged lines, each identical pair as one line "a = b"; None if none."""
    logged = [line for line in panel.lines if line.key in keys]
    kept: list[Line] = []
    for line in logged:
        values = series(rows, line.key)
        twin = next((index for index, other in enumerate(kept) if series(rows, other.key) == values), None)
        if twin is None:
            kept.append(line)
        else:
            kept[twin] = replace(kept[twin], label=f"{kept[twin].label} = {line.label}")
    # A merged line keeps its legend: "accuracy = reward" is worth saying.
    return replace(panel, lines=tuple(kept), legend=len(logged) > 1) if kept else None


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean: [1, 2, 3, 4] with window 2 -> [1, 1.5, 2.5, 3.5]."""
    means, total = [], 0.0
    for index, value in enumerate(values):
        total += value - (values[index - window] if index >= window else 0.0)
        means.append(total / min(index + 1, window))
    return means


def draw_plot(plot: Plot, rows: list[MetricsRow], path: Path) -> None:
    figure = Figure(figsize=(PANEL_SIZE[0], 1.2 + PANEL_SIZE[1] * len(plot.panels)), dpi=DPI, layout="constrained")
    axes = figure.subplots(len(plot.panels), 1, sharex=True, squeeze=False)[:, 0]
    figure.suptitle("\n".join([plot.title, *(f"({note})" for note in plot.notes)]), fontsize=13)
    for ax, panel in zip(axes, plot.panels):
        _draw_panel(ax, panel, rows)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    figure.savefig(path)


def _draw_panel(ax, panel: Panel, rows: list[MetricsRow]) -> None:
    if panel.style == "stacked":
        # Only the steps that logged every part, so each band sits on the right base.
        complete = [row for row in rows if all(line.key in row for line in panel.lines)]
        stacked = [[row[line.key] for row in complete] for line in panel.lines]
        ax.stackplot(
            [row["step"] for row in complete], *stacked, labels=[line.label for line in panel.lines], alpha=0.85
        )
        ax.legend(loc="upper left", ncols=len(panel.lines), fontsize=9)
        return
    window = summary_window(len(rows))  # the summary's "last N steps", so the two agree
    smooth = panel.smooth and window > 1
    for index, line in enumerate(panel.lines):
        steps, values = series(rows, line.key)
        color = f"C{index}"
        if panel.style == "markers":
            ax.plot(steps, values, marker="os^Dv"[index % 5], markersize=6, color=color, label=line.label)
        elif smooth:
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, rolling_mean(values, window), color=color, linewidth=2, label=line.label)
        else:
            ax.plot(steps, values, color=color, linewidth=1.5, label=line.label)
    if panel.legend or smooth:
        title = f"thick: mean of last {window} steps, faint: each step" if smooth else None
        ax.legend(loc="best", fontsize=9, title=title, title_fontsize=9)


def draw_heatmap(grid: Grid, metric_label: str, averaged_over: list[str], path: Path) -> None:
    """One cell per (x, y) pair, coloured and annotated with `metric_label`; grey "no result"
    where no job finished. `averaged_over`: the other swept keys, named in the title."""
    figure = Figure(
        figsize=(max(6.0, 1.3 * len(grid.x_values) + 3), max(4.0, 0.9 * len(grid.y_values) + 2.5)),
        dpi=DPI,
        layout="constrained",
    )
    ax = figure.subplots()
    values = [[math.nan if cell is None else cell for cell in line] for line in grid.cells]
    colors = colormaps["viridis"].with_extremes(bad="lightgray")  # cells no job finished
    image = ax.imshow(values, cmap=colors, aspect="auto", origin="lower")
    present = [cell for line in grid.cells for cell in line if cell is not None]
    middle = (min(present) + max(present)) / 2 if present else 0.0
    for y_index, line in enumerate(grid.cells):
        for x_index, cell in enumerate(line):
            # Dark text on the bright (high) end of viridis, white on the dark end.
            color = "white" if cell is not None and cell <= middle else "black"
            text = "no result" if cell is None else number(cell)
            ax.text(x_index, y_index, text, ha="center", va="center", fontsize=12, color=color)
    ax.set_xticks(range(len(grid.x_values)), grid.x_values)
    ax.set_yticks(range(len(grid.y_values)), grid.y_values)
    ax.set_xlabel(grid.x_key)
    ax.set_ylabel(grid.y_key)
    mean_over = f"\n(mean over {', '.join(averaged_over)})" if averaged_over else ""
    ax.set_title(f"{metric_label}\nby {grid.x_key} and {grid.y_key}{mean_over}")
    figure.colorbar(image, ax=ax, label=metric_label)
    figure.savefig(path)
