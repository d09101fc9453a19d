"""grpo-report on hand-written run and sweep folders: the summary numbers (derived by hand in
the comments), the sweep table and its order, the heatmap grid, which plots are drawn, and the
messages for bad input. The real 2x2 sweep is reported on in tests/test_cli.py."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread
from rich.console import Console

from grpo_cli.run_summary import clean_rows, summarize_run, summary_table
from grpo_cli.tools.plots import plan_plots, rolling_mean
from grpo_cli.tools.report import main, report
from grpo_cli.tools.sweep import SweepRow, heatmap_grid, ranking, sort_sweep, sweep_table

GRPO_REPORT = str(Path(sys.executable).parent / "grpo-report")


def training_rows() -> list[dict]:
    """Step 0: eval 0.2. Steps 1-20: reward step/20, kl step/100 (null at 20), beta 0.04 then 0.02,
    fixed stage times, tokens/s 100 on odd steps and 300 on even ones; eval 0.6 at 10, 0.5 at 20.
    Steps 3 and 4 are written twice, as after a resume: the first copies (reward 1.5) are stale."""
    rows: list[dict] = [{"step": 0, "eval/accuracy": 0.2}]
    for step in range(1, 21):
        rows.append(
            {
                "step": step,
                "reward/mean": step / 20,
                "reward/exact_match/mean": step / 20,
                "kl": None if step == 20 else step / 100,
                "beta": 0.04 if step <= 10 else 0.02,
                "time/sample": 0.1,
                "time/reward": 0.02,
                "time/update": 0.3,
                "time/step": 0.42,
                "tokens_per_second": 100.0 if step % 2 else 300.0,
                "sampler/group_size": 8,
            }
        )
        if step in (10, 20):
            rows[-1]["eval/accuracy"] = 0.6 if step == 10 else 0.5
    stale = [{**rows[3], "reward/mean": 1.5}, {**rows[4], "reward/mean": 1.5}]
    return rows[:5] + stale + rows[3:]


def write_run(folder: Path, rows: list[dict], overrides: tuple[str, ...] = (), config: str = "") -> Path:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides) or "[]\n")
    if config:
        (folder / "config.yaml").write_text(config)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def quiet() -> Console:
    return Console(file=io.StringIO())  # not a terminal: the plain-line table


def test_clean_rows_keeps_the_last_copy_of_a_step_and_drops_nulls():
    rows = clean_rows([{"step": 2, "kl": 0.5}, {"step": 1, "kl": None, "loss": 1}, {"step": 2, "kl": 0.7}])
    assert rows == [{"step": 1, "loss": 1}, {"step": 2, "kl": 0.7}]


def test_summary_of_a_resumed_run_by_hand():
    summary = summarize_run(clean_rows(training_rows()))
    assert (summary.last_step, summary.train_steps, summary.window) == (20, 20, 2)  # window: 20 // 10
    assert summary.reward_first == pytest.approx((0.05 + 0.10) / 2)  # steps 1, 2: 0.075
    assert summary.reward_last == pytest.approx((0.95 + 1.00) / 2)  # steps 19, 20: 0.975
    assert (summary.reward_best, summary.reward_best_step) == (1.0, 20)  # the stale 1.5s are gone
    assert (summary.eval_before, summary.eval_final) == (0.2, 0.5)
    assert (summary.eval_best, summary.eval_best_step) == (0.6, 10)
    assert summary.kl_final == pytest.approx(0.19)  # step 20 logged null: step 19's
    assert summary.time_means == pytest.approx(
        {"time/step": 0.42, "time/sample": 0.1, "time/reward": 0.02, "time/update": 0.3}
    )
    assert summary.tokens_per_second == pytest.approx(200.0)  # ten steps at 100, ten at 300
    table = dict(summary_table(summary))
    assert table["mean reward, first -> last 2 steps"] == "0.075 -> 0.975"
    assert table["greedy eval accuracy, before -> final"] == "0.200 -> 0.500"
    assert table["mean step time"] == "0.420 s (sample 0.100 s, reward 0.020 s, update 0.300 s)"


def test_plots_merge_identical_lines_note_constant_panels_and_skip_what_is_absent():
    rows = clean_rows(training_rows())
    drawn, skipped = plan_plots(rows)
    plots = {plot.name: plot for plot in drawn}
    why = {plot.name: reason for plot, reason in skipped}
    # exact_match is the only reward function, so its line is the total's.
    assert [line.label for line in plots["reward"].panels[0].lines] == ["total (weighted) = exact_match"]
    assert [panel.ylabel for panel in plots["kl_beta"].panels] == ["KL", "beta"]  # beta changes at 11
    assert why["group_size"] == "group size G: 8 at every step"
    assert why["entropy"] == "metrics.jsonl has none of `entropy`"
    varying = [{**row, "sampler/group_size": 4 if row["step"] > 10 else 8} for row in rows]
    constant_beta = [{**row, "beta": 0.04} for row in rows if "beta" in row]
    assert "group_size" in {plot.name for plot in plan_plots(varying)[0]}
    kl_beta = next(plot for plot in plan_plots(constant_beta)[0] if plot.name == "kl_beta")
    assert [panel.ylabel for panel in kl_beta.panels] == ["KL"]
    assert kl_beta.notes == ("beta: 0.040 at every step",)


def test_rolling_mean():
    assert rolling_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]


def test_run_report_writes_report_md_and_readable_plots(tmp_path):
    run = write_run(
        tmp_path / "run",
        training_rows(),
        ("trainer.steps=20",),
        config="model: {name_or_path: builtin:tiny-addition}\ntrainer: {steps: 20, beta: 0.04, "
        "advantage: grpo}\nsampler: {group_size: 8}\n",
    )
    console = quiet()
    report(run, console)
    text = (run / "report.md").read_text()
    assert "| model.name_or_path | builtin:tiny-addition |" in text and "| trainer.advantage | grpo |" in text
    assert "Command-line overrides: `trainer.steps=20`" in text
    assert "| best eval accuracy (step) | 0.600 (step 10) |" in text
    assert "- Policy entropy of sampled tokens: metrics.jsonl has none of `entropy`." in text
    names = sorted(path.stem for path in (run / "plots").glob("*.png"))
    assert names == ["eval", "kl_beta", "reward", "step_time", "throughput"]
    for name in names:
        assert f"](plots/{name}.png)" in text
        image = imread(run / "plots" / f"{name}.png")
        assert image.shape[1] == 880 and image.shape[0] >= 450  # 8 x 110 dpi wide, one panel or more
        assert image.std() > 0.05  # not blank
    assert "  final KL                               0.1900" in console.file.getvalue()


def sweep_job(folder: Path, beta: str, group_size: str, rewards: tuple[float, float], eval_final: float) -> None:
    rows = [
        {"step": 0, "eval/accuracy": 0.3},
        {"step": 1, "reward/mean": rewards[0]},
        {"step": 2, "reward/mean": rewards[1], "eval/accuracy": eval_final},
    ]
    write_run(folder, rows, (f"trainer.beta={beta}", f"sampler.group_size={group_size}", "trainer.steps=2"))


@pytest.fixture
def sweep(tmp_path) -> Path:
    """A 2x2 sweep whose job 3 (beta 0.04, G 4) crashed before logging."""
    folder = tmp_path / "sweep"
    folder.mkdir()
    (folder / "multirun.yaml").write_text("hydra: {}\n")
    sweep_job(folder / "0", "0.01", "2", (0.2, 0.4), eval_final=0.5)
    sweep_job(folder / "1", "0.01", "4", (0.3, 0.5), eval_final=0.7)
    sweep_job(folder / "2", "0.04", "2", (0.6, 0.1), eval_final=0.6)
    (folder / "3" / ".hydra").mkdir(parents=True)
    (folder / "3" / ".hydra" / "overrides.yaml").write_text(
        "- trainer.beta=0.04\n- sampler.group_size=4\n- trainer.steps=2\n"
    )
    return folder


def test_sweep_table_sorted_by_eval_with_the_failed_job_last(sweep):
    console = quiet()
    report(sweep, console)
    with open(sweep / "sweep.csv") as handle:
        header, *rows = list(csv.reader(handle))
    # trainer.steps=2 is the same in every job: no column. Final reward: the last step (2 // 10 -> 1).
    assert header == [
        "job",
        "trainer.beta",
        "sampler.group_size",
        "status",
        "final mean reward",
        "best mean reward",
        "final eval accuracy",
        "final KL",
        "mean step time (s)",
    ]
    assert rows == [
        ["1", "0.01", "4", "ok", "0.5", "0.5", "0.7", "", ""],
        ["2", "0.04", "2", "ok", "0.1", "0.6", "0.6", "", ""],
        ["0", "0.01", "2", "ok", "0.4", "0.4", "0.5", "", ""],
        ["3", "0.04", "4", "failed: no metrics.jsonl", "", "", "", "", ""],
    ]
    text = (sweep / "report.md").read_text()
    assert "4 jobs, 1 failed" in text and "Sorted by final eval accuracy" in text
    assert "| 1 | 0.01 | 4 | ok | 0.500 | 0.500 | 0.700 | - | - |" in text
    assert "![final eval accuracy by trainer.beta and sampler.group_size](plots/heatmap.png)" in text
    assert imread(sweep / "plots" / "heatmap.png").shape[1] >= 500
    assert "  1    0.01          4                   ok" in console.file.getvalue()


def summary_row(job: str, eval_final: float | None = None, reward: float = 0.0, **overrides: str) -> SweepRow:
    row = {"step": 1, "reward/mean": reward, **({} if eval_final is None else {"eval/accuracy": eval_final})}
    return SweepRow(job, overrides, summarize_run([row]))


def test_heatmap_cells_of_the_2x2_sweep_and_the_mean_over_a_third_key(sweep):
    rows = [
        summary_row("0", 0.5, b="0.01", g="2"),
        summary_row("1", 0.7, b="0.01", g="4"),
        summary_row("2", 0.6, b="0.04", g="2"),
        SweepRow("3", {"b": "0.04", "g": "4"}, None, "crashed"),
    ]
    grid = heatmap_grid(rows, "b", "g", "eval_final")
    assert (grid.x_values, grid.y_values) == (["0.01", "0.04"], ["2", "4"])
    assert grid.cells == [[0.5, 0.6], [0.7, None]]  # [g][b]; the crashed job leaves its cell empty
    # A third key (seed): each cell is the mean over it. (b 0.01, g 2): seeds 0.2 and 0.4 -> 0.3.
    seeded = [
        summary_row(f"{i}", 0.2 * (i + 1), b=b, g=g, seed=s)
        for i, (b, g, s) in enumerate([("0.01", "2", "0"), ("0.01", "2", "1"), ("0.01", "16", "0")])
    ]
    grid = heatmap_grid(seeded, "b", "g", "eval_final")
    assert grid.y_values == ["2", "16"]  # by number, not "16" < "2"
    assert grid.cells == [[pytest.approx(0.3)], [pytest.approx(0.6)]]


def test_three_swept_keys_say_which_key_the_heatmap_averages(tmp_path):
    folder = tmp_path / "sweep3"
    for job, (beta, seed) in enumerate([("0.01", "0"), ("0.01", "1"), ("0.04", "0"), ("0.04", "1")]):
        write_run(
            folder / str(job),
            [{"step": 1, "reward/mean": 0.1 * job}],
            (
                f"trainer.beta={beta}",
                "sampler.group_size=2" if job % 2 else "sampler.group_size=4",
                f"trainer.seed={seed}",
            ),
        )
    report(folder, quiet())
    text = (folder / "report.md").read_text()
    assert "Sorted by final mean reward" in text  # no job ran an eval
    assert "Each cell is the mean over the other swept keys: trainer.seed." in text
    assert (folder / "plots" / "heatmap.png").is_file()


def test_without_eval_jobs_rank_by_final_reward():
    rows = [summary_row("0", reward=0.2), summary_row("1", reward=0.9), summary_row("2", reward=0.5)]
    assert ranking(rows) == ("reward_last", "final mean reward")
    assert [row.job for row in sort_sweep(rows)] == ["1", "2", "0"]
    header, cells = sweep_table(sort_sweep(rows))
    assert header[:2] == ["job", "status"]  # nothing swept: no override columns


@pytest.mark.parametrize(
    "case, named, said",
    [
        ("missing", "nowhere", "does not exist"),
        ("no_metrics", "empty_folder", "holds neither metrics.jsonl nor job folders"),
        ("empty", "metrics.jsonl", "is empty"),
        ("corrupt", "metrics.jsonl line 2", "is not a metrics row (not JSON"),
        ("not_an_object", "metrics.jsonl line 2", 'is not a metrics row (no integer "step")'),
    ],
)
def test_bad_input_exits_2_naming_the_file(tmp_path, capsys, case, named, said):
    target = {"missing": tmp_path / "nowhere", "no_metrics": tmp_path / "empty_folder"}.get(case, tmp_path / "run")
    if case == "no_metrics":
        target.mkdir()
    if case in ("empty", "corrupt", "not_an_object"):
        write_run(target, [])
        lines = {"corrupt": '{"step": 1}\n{"step": 2, "kl": 0.\n', "not_an_object": '{"step": 1}\n5\n', "empty": ""}
        (target / "metrics.jsonl").write_text(lines[case])
    with pytest.raises(SystemExit) as stopped:
        main([str(target)])
    assert stopped.value.code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert named in message and said in message and "Traceback" not in message


def test_the_console_script_reports_bad_input_without_a_traceback(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 3, "kl": 0.\n')
    result = subprocess.run([GRPO_REPORT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    message = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path / 'metrics.jsonl'} line 3 is not a metrics row" in message  # blank line 2 counts
    assert "Traceback" not in message


def test_help(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0 and "usage: grpo-report [-h] [--each-job] path" in capsys.readouterr().out
