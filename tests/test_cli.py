"""End to end through the real `grpo-train` entry point: run dir, metrics, checkpoints, resume,
sweeps, LoRA, and clear errors for bad input."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from grpo_cli.logs import read_metrics
from helpers import ALTERNATING_REWARD, TESTS_DIR, computed_rows, grpo_train

# Small and quick: 4 prompts x G=4, 6 eval prompts.
QUICK = ["data.prompts_per_step=4", "sampler.group_size=4", "data.eval_size=6", "trainer.log_every=1"]
GRPO_REPORT = str(Path(sys.executable).parent / "grpo-report")


@pytest.fixture(scope="module")
def three_step_run(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    result = grpo_train(
        *QUICK, "trainer.steps=3", "trainer.checkpoint_every=2", "trainer.keep_last=5", f"hydra.run.dir={run_dir}"
    )
    return run_dir, result


def test_run_dir_holds_config_metrics_and_checkpoints(three_step_run):
    run_dir, result = three_step_run
    assert "grpo-train summary" in result.stdout
    assert (run_dir / "config.yaml").is_file() and (run_dir / ".hydra" / "overrides.yaml").is_file()
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]  # row 0: the greedy eval before training
    required = [
        "reward/mean",
        "reward/std",
        "reward/exact_match/mean",
        "reward/exact_match/std",
        "reward/exact_match/errors",
        "advantage/std",
        "advantage/zero_std_fraction",
        "kl",
        "clip/fraction",
        "loss",
        "entropy",
        "grad_norm",
        "completion/length_mean",
        "completion/length_max",
        "completion/truncated_fraction",
        "lr",
        "beta",
        "time/step",
        "time/sample",
        "time/reward",
        "time/update",
        "tokens_per_second",
    ]
    for row in rows[1:]:
        missing = [key for key in required if key not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        # k3 = e^d - d - 1 >= 0, but in float32 it rounds to about -6e-8 where d is tiny.
        assert 0.0 <= row["reward/mean"] <= 1.0 and row["kl"] > -1e-6
        assert 1 <= row["completion/length_max"] <= 8
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step-000002", "step-000003"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_checkpoint_is_a_loadable_hugging_face_folder(three_step_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = three_step_run[0] / "checkpoints" / "step-000003"
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["step"] == 3 and {"reward_mean", "kl", "beta"} <= set(meta)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config.model_type == "qwen2" and tokenizer.eos_token == "<|endoftext|>"


@pytest.mark.slow
def test_resume_continues_step_counter_optimizer_and_metrics_exactly(three_step_run, tmp_path):
    # A copy: resuming extends the run folder in place, and the other tests read the 3-step run.
    # Nothing in it names its own folder (resume reads the command line, not config.yaml).
    run_dir = tmp_path / "resumed"
    shutil.copytree(three_step_run[0], run_dir)
    result = grpo_train(
        *QUICK,
        "trainer.steps=5",
        "trainer.checkpoint_every=2",
        "trainer.keep_last=5",
        "trainer.resume=true",
        f"hydra.run.dir={run_dir}",
    )
    folded = "".join(result.stdout.split())  # the console folds a path longer than its 80 columns
    assert "Resuming from" in result.stdout and "resumed/checkpoints/step-000003" in folded
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4, 5]
    state = torch.load(run_dir / "checkpoints" / "step-000005" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 5
    adam_steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert adam_steps == {5.0}  # 3 steps before the stop + 2 after: the moments were restored
    assert state["data"]["position"] == 5 * 4 % 100 and state["data"]["epoch"] == 0

    # The same 5 steps without a stop: steps 4 and 5 must match exactly.
    unbroken = tmp_path / "unbroken"
    grpo_train(*QUICK, "trainer.steps=5", "trainer.checkpoint_every=0", f"hydra.run.dir={unbroken}")
    expected = read_metrics(unbroken)
    assert computed_rows(rows[4:]) == computed_rows(expected[4:])


def test_resume_from_a_given_checkpoint_folder(three_step_run, tmp_path):
    checkpoint = three_step_run[0] / "checkpoints" / "step-000002"
    result = grpo_train(
        *QUICK, "trainer.steps=3", f"trainer.resume={checkpoint}", f"hydra.run.dir={tmp_path / 'rollback'}"
    )
    assert "(step 2)" in " ".join(result.stdout.split())  # the console wraps a long run folder's path
    assert [row["step"] for row in read_metrics(tmp_path / "rollback")] == [3]


@pytest.mark.slow  # about a minute: make test runs it
def test_multirun_sweep_writes_one_run_dir_per_job(tmp_path, tiny_model_dir):
    sweep = tmp_path / "sweep"
    grpo_train(
        "-m", *QUICK, "trainer.beta=0.01,0.04", "sampler.group_size=2,4", "trainer.steps=2", f"hydra.sweep.dir={sweep}"
    )
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert len(jobs) == 4
    seen = set()
    for job in jobs:
        config = OmegaConf.load(job / "config.yaml")
        rows = read_metrics(job)
        assert [row["step"] for row in rows] == [0, 1, 2]
        assert rows[1]["beta"] == config.trainer.beta
        seen.add((config.trainer.beta, config.sampler.group_size))
    assert seen == {(0.01, 2), (0.01, 4), (0.04, 2), (0.04, 4)}

    # grpo-report on this sweep and on one of its jobs (here, not on a second sweep: CI time):
    # a G = 4 job, whose first step has a learning signal. With G = 2 here every group's rewards
    # agree at both steps, the gradient is exactly 0 while the policy equals the reference, and
    # the KL stays 0: nothing moves to plot (it moved only by rounding before the log-probs ran
    # through the head by chunks, which compute the policy's and the reference's alike).
    job = next(job for job in jobs if read_metrics(job)[1]["sampler/group_size"] == 4)
    for folder in (sweep, job):
        result = subprocess.run([GRPO_REPORT, str(folder)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    assert (sweep / "report.md").is_file() and (sweep / "plots" / "heatmap.png").is_file()
    with open(sweep / "sweep.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 4 and {row["status"] for row in table} == {"ok"}
    assert {(row["trainer.beta"], row["sampler.group_size"]) for row in table} == {
        ("0.01", "2"),
        ("0.01", "4"),
        ("0.04", "2"),
        ("0.04", "4"),
    }
    accuracies = [float(row["final eval accuracy"]) for row in table]
    assert accuracies == sorted(accuracies, reverse=True)
    images = re.findall(r"\]\((plots/\w+\.png)\)", (job / "report.md").read_text())
    assert "plots/kl_beta.png" in images and all((job / image).is_file() for image in images)


def test_lora_run_saves_a_peft_adapter_that_loads(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "lora"
    grpo_train(
        *QUICK,
        "trainer.steps=2",
        "model.lora.enabled=true",
        "model.lora.r=4",
        "optimizer.lr=1e-3",
        ALTERNATING_REWARD,
        f"hydra.run.dir={run_dir}",  # step 1 has a gradient
        env={"PYTHONPATH": TESTS_DIR},
    )
    checkpoint = run_dir / "checkpoints" / "step-000002"
    assert (checkpoint / "adapter_config.json").is_file()
    assert not (checkpoint / "model.safetensors").exists()  # the adapter only, not the base
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), checkpoint)
    assert any("lora_A" in name for name, _ in model.named_parameters())
    rows = read_metrics(run_dir)
    # Step 1 moved B off 0 (Adam's first step moves every entry by about lr), so step 2's policy
    # differs from the reference, the base with the adapter off: a reference that kept the
    # adapter on would give a KL of 0 (to float32 rounding, about 1e-7).
    assert rows[-1]["kl"] > 1e-4


@pytest.mark.slow  # about a minute: make test runs it
def test_dapo_with_a_beta_schedule_logs_the_beta_in_force_and_the_sampling_rounds(tmp_path, tiny_model_dir):
    # algorithm=dapo sets beta 0; the command line wins with a schedule: 0.04 at the first
    # update, 0.02 after 1 of 2 warmup steps, 0.0 from the third step on.
    run_dir = tmp_path / "dapo"
    grpo_train(
        *QUICK,
        "algorithm=dapo",
        "trainer.steps=3",
        "trainer.num_iterations=2",
        "trainer.beta={start: 0.04, end: 0.0, warmup_steps: 2}",
        f"hydra.run.dir={run_dir}",
    )
    rows = read_metrics(run_dir)[1:]
    assert [row["beta"] for row in rows] == pytest.approx([0.04, 0.02, 0.0])
    for row in rows:
        assert row["sampling/informative_groups"] <= 4 and row["sampling/sampled_groups"] >= 4
        assert {"clip/high_fraction", "clip/low_fraction", "ratio/max_deviation"} <= set(row)
    saved = OmegaConf.load(run_dir / "config.yaml").trainer
    assert (saved.loss_aggregation, saved.clip_eps_high, saved.mask_truncated) == ("token_mean", 0.28, True)


def test_two_weighted_rewards_with_normalize_each_log_both_functions(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "two"
    grpo_train(*QUICK, "trainer.steps=2", "reward=math", "reward.normalize_each=true", f"hydra.run.dir={run_dir}")
    rows = read_metrics(run_dir)
    for row in rows[1:]:
        for name in ("math_accuracy", "format_reward"):
            assert {f"reward/{name}/mean", f"reward/{name}/std", f"reward/{name}/errors"} <= set(row)
            assert row[f"reward/{name}/errors"] == 0
    assert "eval/math_accuracy" in rows[-1] and "eval/format_reward" in rows[-1]
    assert rows[-1]["eval/accuracy"] == rows[-1]["eval/math_accuracy"]


def test_a_reward_that_always_fails_stops_the_run_naming_it(tmp_path, tiny_model_dir):
    result = grpo_train(
        *QUICK,
        "trainer.steps=2",
        "data.eval_size=0",
        "reward.functions=[{_target_: test_rewards.always_raises, weight: 1.0}]",
        f"hydra.run.dir={tmp_path / 'bad'}",
        check=False,
        env={"PYTHONPATH": TESTS_DIR},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    message = " ".join(result.stderr.split())  # the console wraps long lines
    assert "always_raises failed on 16 of 16 completions" in message
    assert "RuntimeError: boom" in message and "Traceback" not in message


def test_missing_model_fails_fast_with_a_clear_message(tmp_path):
    result = grpo_train(
        "model.name_or_path=Qwen/Qwen2.5-7B-Instruct", "trainer.steps=1", f"hydra.run.dir={tmp_path}", check=False
    )
    assert result.returncode == 2
    assert "model.name_or_path=Qwen/Qwen2.5-7B-Instruct" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_math_7b_preset_without_its_files_names_what_is_missing(tmp_path):
    result = grpo_train("conf=math_7b", f"hydra.run.dir={tmp_path}", check=False, cwd=tmp_path)
    assert result.returncode == 2
    assert "data/gsm8k/train.jsonl does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_value_exits_2_naming_the_key(tmp_path):
    result = grpo_train("sampler.group_size=1", f"hydra.run.dir={tmp_path}", check=False)
    assert result.returncode == 2 and "sampler.group_size=1" in result.stderr


def test_help_and_printing_the_composed_config():
    help_text = grpo_train("--help").stdout
    assert (
        "grpo-train" in help_text
        and "conf: code_7b, math_0.5b, math_7b, smollm2_arithmetic, smollm2_calculator, tiny" in help_text
    )
    assert "algorithm: cispo, dapo, dr_grpo, grpo, gspo, rloo, sapo" in help_text
    for key in ("loss: clip", "importance_sampling_level: token", "delta: null", "dual_clip: null"):
        assert key in help_text  # the objectives' keys (issue 23), with their defaults
    assert "sapo_temperature_neg: 1.05" in help_text and "cispo_ratio_max: 5.0" in help_text
    printed = grpo_train("--cfg", "job", "conf=math_7b").stdout
    assert "name_or_path: Qwen/Qwen2.5-7B-Instruct" in printed
    completion = grpo_train("--shell-completion", "install=bash").stdout
    assert "hydra_bash_completion" in completion
