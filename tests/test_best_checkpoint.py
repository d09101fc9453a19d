"""Eval metrics apart from the training reward (eval.functions), the best checkpoint by any logged
metric (trainer.best_metric, keep_best) and `grpo-export RUN --best`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_cli.checkpoint import best_checkpoint, checkpoints_to_delete
from grpo_cli.config import ConfigError
from grpo_cli.logs import read_metrics
from grpo_cli.pipeline import run
from grpo_cli.tools.export import ExportError, export, find_checkpoint
from grpo_cli.validation import validate
from helpers import ALTERNATING_REWARD, config

# The greedy eval's score by eval call: before training, then after steps 1..4. Step 2 is the best.
SCRIPTED = [0.1, 0.3, 0.9, 0.2, 0.4]
_calls: list[int] = []


def scripted_eval(prompts, completions, **_):
    """An eval metric with a known course, one value per eval call (each call scores every eval
    prompt: eval.size is at most one greedy batch)."""
    value = SCRIPTED[min(len(_calls), len(SCRIPTED) - 1)]
    _calls.append(1)
    return [value] * len(completions)


EVAL_FUNCTIONS = (
    "eval.functions=[{_target_: test_best_checkpoint.scripted_eval, name: scripted},"
    " {_target_: grpo_cli.rewards.length_penalty, target: 0, coef: 0.25}]"
)


@pytest.fixture(scope="module")
def ranked_run(tmp_path_factory, tiny_model_dir):
    """4 steps trained on the alternating reward, evaluated on the scripted metric after each,
    a checkpoint at each, the newest and the best by eval/accuracy kept."""
    _calls.clear()
    folder = tmp_path_factory.mktemp("best") / "run"
    run(
        config(
            tiny_model_dir,
            ALTERNATING_REWARD,
            EVAL_FUNCTIONS,
            "trainer.steps=4",
            "trainer.eval_every=1",
            "trainer.checkpoint_every=1",
            "trainer.keep_last=1",
            "trainer.keep_best=1",
            "trainer.best_metric=eval/accuracy",
            "data.eval_size=4",
            f"trainer.output_dir={folder}",
        )
    )
    return folder


def test_eval_functions_are_logged_as_eval_metrics_apart_from_the_training_rewards(ranked_run):
    rows = read_metrics(ranked_run)
    evals = [row for row in rows if "eval/accuracy" in row]
    assert [row["step"] for row in evals] == [0, 1, 2, 3, 4]
    assert [row["eval/accuracy"] for row in evals] == pytest.approx(SCRIPTED)  # the first eval function
    assert all(row["eval/scripted"] == row["eval/accuracy"] for row in evals)
    assert all(row["eval/length_penalty"] < 0 for row in evals)  # every greedy reply has tokens
    for row in evals:  # eval/reward: the eval functions' weighted sum (weights 1)
        assert row["eval/reward"] == pytest.approx(row["eval/scripted"] + row["eval/length_penalty"])
    trained = [row for row in rows if "reward/mean" in row]
    assert "reward/alternating_reward/mean" in trained[0] and "eval/alternating_reward" not in evals[0]
    assert not any(key.startswith("reward/scripted") for key in trained[0])


def test_keep_best_keeps_the_best_by_the_eval_metric_and_export_best_takes_it(ranked_run, tmp_path):
    kept = sorted(path.name for path in (ranked_run / "checkpoints").glob("step-*"))
    assert kept == ["step-000002", "step-000004"]  # the best (0.9) and the newest
    meta = json.loads((ranked_run / "checkpoints" / "step-000002" / "meta.json").read_text())
    assert (meta["best_metric"], meta["best_value"]) == ("eval/accuracy", pytest.approx(0.9))
    assert best_checkpoint(ranked_run).name == "step-000002"
    assert find_checkpoint(ranked_run).name == "step-000004"  # without --best: the newest
    assert export(ranked_run, tmp_path / "out", best=True).name == "step-000002"
    assert (tmp_path / "out" / "config.json").is_file()
    with pytest.raises(ExportError, match="--best picks among a run's checkpoints"):
        find_checkpoint(ranked_run / "checkpoints" / "step-000004", best=True)


def checkpoints_with(root: Path, metas: list[dict]) -> list[Path]:
    folders = []
    for step, meta in enumerate(metas, start=1):
        folder = root / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": step, **meta}))
        folders.append(folder)
    return folders


def test_checkpoints_rank_by_their_metric_in_its_direction(tmp_path):
    def ranked(metric: str, mode: str, values: list) -> dict:
        return [{"best_metric": metric, "best_metric_mode": mode, "best_value": v, "reward_mean": 0.0} for v in values]

    # min (e.g. kl): step 3's 0.01 is the best; the newest (step 5) is kept by keep_last
    folders = checkpoints_with(tmp_path / "min", ranked("kl", "min", [0.5, 0.2, 0.01, 0.3, 0.9]))
    assert [p.name for p in checkpoints_to_delete(folders, 1, 1)] == ["step-000001", "step-000002", "step-000004"]
    # an eval metric at a step without eval has no value: never the best
    folders = checkpoints_with(tmp_path / "none", ranked("eval/accuracy", "max", [None, 0.4, None, 0.6, None]))
    assert [p.name for p in checkpoints_to_delete(folders, 1, 1)] == ["step-000001", "step-000002", "step-000003"]
    # a resume with another best_metric: the old metric's checkpoints are not compared
    mixed = ranked("reward/mean", "max", [0.99]) + ranked("eval/accuracy", "max", [0.2, 0.1])
    folders = checkpoints_with(tmp_path / "mixed", mixed)
    assert [p.name for p in checkpoints_to_delete(folders, 1, 1)] == ["step-000001"]
    # checkpoints written before best_metric existed rank by their reward_mean, as they did
    folders = checkpoints_with(tmp_path / "old", [{"reward_mean": r} for r in (0.3, 0.8, 0.1)])
    assert [p.name for p in checkpoints_to_delete(folders, 1, 1)] == ["step-000001"]


def test_export_best_says_when_no_checkpoint_has_a_value(tmp_path):
    folder = tmp_path / "run"
    metas = [{"best_metric": "eval/accuracy", "best_metric_mode": "max", "best_value": None, "reward_mean": 0.1}]
    for path in checkpoints_with(folder / "checkpoints", metas):
        (path / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(ExportError, match="No checkpoint of .* has a value of eval/accuracy"):
        find_checkpoint(folder, best=True)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.best_metric=eval/accuracy", "trainer.eval_every=0"], "only checkpoints at eval steps"),
        (
            ["trainer.best_metric=eval/accuracy", "trainer.eval_every=20", "trainer.checkpoint_every=50"],
            "checkpoint_every to a multiple of eval_every",
        ),
        (["trainer.best_metric_mode=lowest"], "trainer.best_metric_mode='lowest' must be max or min"),
        (["eval.functions=[]"], "eval.functions is empty"),
        (["eval.functions=[{weight: 1}]"], "eval.functions[0]={'weight': 1} needs a _target_"),
    ],
)
def test_bad_best_metric_and_eval_settings_are_refused(tiny_model_dir, overrides, expected):
    with pytest.raises(ConfigError) as caught:
        validate(config(tiny_model_dir, *overrides), check_files=False)
    assert expected in str(caught.value)


def test_a_best_metric_the_run_does_not_log_stops_it_after_the_first_step(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="trainer.best_metric=reward/maen is not a metric this run logs") as caught:
        run(
            config(
                tiny_model_dir, "trainer.best_metric=reward/maen", "trainer.steps=3", f"trainer.output_dir={tmp_path}"
            )
        )
    assert "reward/mean" in str(caught.value)
    assert not (tmp_path / "checkpoints").exists()


def test_an_eval_function_that_cannot_be_imported_is_named_before_loading(tiny_model_dir, tmp_path):
    overrides = ("eval.functions=[{_target_: nowhere.score}]", f"trainer.output_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"eval.functions\[0\]._target_=nowhere.score: cannot import it"):
        run(config(tiny_model_dir, *overrides))
