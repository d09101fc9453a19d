"""What a run shows and keeps: TensorBoard files that TensorBoard's own reader understands,
samples.jsonl, the logger group (jsonl only; wandb and MLflow through recording stand-ins), the
live panel, periodic eval with pass@k and a held-out slice."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

from grpo_cli.config import ConfigError
from grpo_cli.console import status_lines, status_panel
from grpo_cli.logs import SAMPLES_FILE, read_metrics
from grpo_cli.pipeline import run
from grpo_cli.validation import validate
from helpers import config

FAKE_PACKAGES = str(Path(__file__).resolve().parent / "fake_packages")
FAKE_NAMES = ("wandb", "mlflow")


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("logging") / "run"
    run(
        config(
            tiny_model_dir,
            "logger.tensorboard=true",
            "trainer.steps=4",
            "trainer.sample_every=2",
            "trainer.sample_prompts=2",
            "trainer.eval_every=2",
            "trainer.eval_pass_at_k=true",
            "data.eval_size=6",
            "trainer.checkpoint_every=0",
            f"trainer.output_dir={folder}",
        )
    )
    return folder


def test_tensorboard_scalars_and_sample_texts_read_back_with_tensorboards_reader(tensorboard_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    rows = {row["step"]: row for row in read_metrics(tensorboard_run)}
    tags = events.Tags()
    for key in (
        "reward/mean",
        "kl",
        "beta",
        "clip/fraction",
        "entropy",
        "advantage/zero_std_fraction",
        "completion/length_mean",
        "time/sample",
        "time/update",
        "sampler/group_size",
    ):
        assert key in tags["scalars"], key
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [1, 2, 3, 4]
        assert [s.value for s in scalars] == pytest.approx([rows[s.step][key] for s in scalars])  # float32
    eval_steps = [s.step for s in events.Scalars("eval/accuracy")]
    assert eval_steps == [0, 2, 4]  # before training, then every 2 steps
    assert "samples/text_summary" in tags["tensors"]  # the text plugin's tag
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [2, 4]
    assert "advantage" in texts[0].tensor_proto.string_val[0].decode()


def test_samples_jsonl_holds_the_configured_groups(tensorboard_run):
    entries = read_metrics(tensorboard_run, SAMPLES_FILE)
    assert [entry["step"] for entry in entries] == [2, 2, 4, 4]  # sample_every 2, sample_prompts 2
    for entry in entries:
        assert len(entry["completions"]) == len(entry["rewards"]) == len(entry["advantages"]) == 4  # G
        assert set(entry["per_function"]) == {"exact_match"}
        assert entry["prompt"].startswith("Question: what is") and entry["answer"].isdigit()
        # grpo advantages are centred within the group (all zero when the rewards are equal)
        assert sum(entry["advantages"]) == pytest.approx(0.0, abs=1e-5)


def test_eval_logs_pass_at_k_on_eval_steps(tensorboard_run):
    rows = read_metrics(tensorboard_run)
    evals = [row for row in rows if "eval/accuracy" in row]
    assert [row["step"] for row in evals] == [0, 2, 4]
    for row in evals:
        assert 0.0 <= row["eval/pass_at_k"] <= 1.0
    assert all("eval/pass_at_k" not in row for row in rows if row["step"] in (1, 3))


def test_pass_at_k_samples_a_training_steps_prompts_at_a_time(tmp_path, tiny_model_dir, monkeypatch):
    # 5 eval prompts x G: in generate calls of data.prompts_per_step = 2 prompts, as a training
    # step samples, so eval never needs more memory than the plan's sampling row.
    from grpo_cli.sampling.fast import FastSampler  # the default sampler

    prompts_per_call, sample = [], FastSampler.sample

    def counting(self, policy, batch, group_size=None):
        prompts_per_call.append(batch.size)
        return sample(self, policy, batch, group_size)

    monkeypatch.setattr(FastSampler, "sample", counting)
    run(
        config(
            tiny_model_dir,
            "logger.tensorboard=false",
            "trainer.steps=1",
            "trainer.eval_pass_at_k=true",
            "data.eval_size=5",
            "trainer.checkpoint_every=0",
            f"trainer.output_dir={tmp_path}",
        )
    )
    assert prompts_per_call == [2, 2, 1] + [2] + [2, 2, 1]  # eval before, the step, eval after


def test_logger_jsonl_writes_no_tensorboard_files(tmp_path, tiny_model_dir):
    run(
        config(
            tiny_model_dir,
            "logger.tensorboard=false",
            "trainer.steps=1",
            "data.eval_size=2",
            f"trainer.output_dir={tmp_path}",
        )
    )
    assert not (tmp_path / "tensorboard").exists()
    assert [row["step"] for row in read_metrics(tmp_path)] == [0, 1]


def test_a_logger_whose_package_is_missing_is_named_before_anything_loads(tiny_model_dir):
    cfg = config(tiny_model_dir, "logger.wandb=true", "logger.mlflow=true")
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    message = str(error.value)
    assert "logger.wandb=true, but the `wandb` package is not installed" in message
    assert "logger.mlflow=true, but the `mlflow` package is not installed" in message
    assert "logger=tensorboard or logger=jsonl" in message


@pytest.fixture
def fake_loggers(monkeypatch):
    """The stand-ins as `wandb` and `mlflow`, for one test only: off sys.path and out of
    sys.modules after it, as importlib.util.find_spec looks in sys.modules first, and a stand-in
    left there reads as installed to every later test (the missing-logger check among them)."""
    monkeypatch.syspath_prepend(FAKE_PACKAGES)
    import mlflow
    import wandb

    yield wandb, mlflow
    for name in [name for name in sys.modules if name.split(".")[0] in FAKE_NAMES]:
        del sys.modules[name]


def test_wandb_and_mlflow_receive_every_step_and_the_samples(tmp_path, tiny_model_dir, fake_loggers):
    wandb, mlflow = fake_loggers
    wandb.calls.clear(), mlflow.calls.clear()
    folder = tmp_path / "run"
    run(
        config(
            tiny_model_dir,
            "logger.wandb=true",
            "logger.mlflow=true",
            "logger.tensorboard=false",
            "logger.project=demo",
            "trainer.steps=2",
            "trainer.sample_every=2",
            "data.eval_size=2",
            f"trainer.output_dir={folder}",
        )
    )
    init = wandb.calls[0]
    assert init[0] == "init" and init[1]["project"] == "demo" and init[1]["name"] == "run"
    assert init[1]["config"]["trainer"]["steps"] == 2 and init[1]["resume"] == "allow"
    logged = [(call[2], call[1]) for call in wandb.calls if call[0] == "log"]
    assert [step for step, _ in logged] == [0, 1, 2, 2]  # eval before, 2 steps, the samples table
    assert "reward/mean" in logged[1][1] and isinstance(logged[3][1]["samples"], wandb.Table)
    assert wandb.calls[-1] == ("finish",)
    assert mlflow.calls[:3] == [("set_experiment", "demo"), ("start_run", None, "run"), ("log_dict", "config.json")]
    steps = [call[2] for call in mlflow.calls if call[0] == "log_metrics"]
    assert steps == [0, 1, 2]
    assert any(call[0] == "log_text" and call[2] == "samples/step-000002.txt" for call in mlflow.calls)
    assert (folder / "mlflow_run_id.txt").read_text() == "fake-run-1"  # a resume continues this run


def test_eval_holdout_evaluates_on_rows_kept_out_of_training(tmp_path, tiny_model_dir):
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Question: what is {a} + 1? Answer:", "answer": str(a + 1)}) + "\n"
            for a in range(10)
        )
    )
    run(
        config(
            tiny_model_dir,
            f"data.path={data}",
            "data.eval_holdout=3",
            "trainer.steps=1",
            f"trainer.output_dir={tmp_path / 'run'}",
        )
    )
    first = read_metrics(tmp_path / "run")[0]
    assert first["step"] == 0 and "eval/accuracy" in first  # a file without eval_path is evaluated


ROW = {
    "step": 12,
    "reward/mean": 0.75,
    "reward/std": 0.25,
    "reward/exact_match/mean": 0.75,
    "kl": 0.0123,
    "beta": 0.04,
    "clip/fraction": 0.05,
    "clip/high_fraction": 0.03,
    "clip/low_fraction": 0.02,
    "entropy": 1.5,
    "advantage/zero_std_fraction": 0.25,
    "completion/length_mean": 5.5,
    "completion/length_max": 8,
    "completion/truncated_fraction": 0.125,
    "time/step": 1.5,
    "time/sample": 1.0,
    "time/reward": 0.1,
    "time/update": 0.4,
    "tokens_per_second": 350.0,
    "sampler/group_size": 8,
}


def test_the_status_panel_shows_every_number_the_issue_names():
    lines = dict(status_lines(ROW, {"step": 10, "eval/accuracy": 0.6}))
    assert lines["reward"] == "0.75 ± 0.25   (exact_match 0.75)"
    assert lines["KL / beta"] == "0.0123 / 0.04"
    assert lines["clip fraction"] == "5% (high 3%, low 2%)"
    assert lines["zero-std groups"] == "25%"
    assert lines["completion length"] == "mean 5.5, max 8, truncated 12%"
    assert lines["step time"] == "1.5 s = sample 1 + reward 0.1 + update 0.4"
    assert lines["tokens / s"] == "350"
    assert lines["group size"] == "8" and lines["eval accuracy"] == "0.6 (step 10)"
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    console.print(status_panel("progress", ROW, None, ["KL has been rising for 20 steps"]))
    shown = console.file.getvalue()
    assert "warning: KL has been rising for 20 steps" in shown and "entropy" in shown


def test_a_metrics_file_of_an_older_release_reads_under_todays_names(tmp_path):
    # clip_fraction was renamed clip/fraction (beside clip/high_fraction): grpo-report and a
    # resume read an old run's rows under the new name.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "clip_fraction": 0.25, "kl": 0.01}\n')
    assert read_metrics(tmp_path) == [{"step": 1, "kl": 0.01, "clip/fraction": 0.25}]
