"""What a user must be able to trust, each attack or fault provoked for real:
- a checkpoint from someone else runs no code when resumed;
- non-finite settings are refused, and non-finite weights are never saved nor resumed;
- a full disk costs the checkpoint being written, never the last complete one;
- two runs never share a folder;
- a damaged newest checkpoint is passed over, saying so; another model's is refused;
- a reward function that exits, hangs, returns a dict or edits its inputs costs its own scores.
docs/ERRORS.md quotes the messages these tests see.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_cli.checkpoint import (
    STATE_FILE,
    CheckpointError,
    checkpoint_damage,
    load_trainer_state,
    save_checkpoint,
    set_rng_state,
)
from grpo_cli.config import ConfigError
from grpo_cli.logs import read_metrics
from grpo_cli.models.loading import load_models
from grpo_cli.pipeline import run
from grpo_cli.rewards.api import RewardScorer, build_reward_functions, call_reward
from grpo_cli.run_lock import hold_run_folder
from grpo_cli.validation import validate
from helpers import GRPO_TRAIN, TESTS_DIR, config, input_error, run_script


class RunsACommand:
    """Pickles as a call of os.system: what a hostile trainer_state.pt holds."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, tiny_model_dir):
    """A 1-step run with its checkpoint: what a hostile file is put into."""
    folder = tmp_path_factory.mktemp("run")
    run(
        config(
            tiny_model_dir,
            "trainer.steps=1",
            "trainer.checkpoint_every=1",
            "data.eval_size=0",
            f"trainer.output_dir={folder}",
        )
    )
    return folder


def test_the_trainer_state_a_run_writes_loads_weights_only(one_step_run):
    checkpoint = one_step_run / "checkpoints" / "step-000001"
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)  # no allow-list
    assert state["step"] == 1 and set(state["rng"]) >= {"python", "numpy", "torch"}
    assert load_trainer_state(checkpoint)["data"] == state["data"]


def test_resuming_a_checkpoint_whose_state_runs_code_refuses_it_and_runs_nothing(
    one_step_run, tmp_path, tiny_model_dir
):
    hostile = tmp_path / "hostile"
    (hostile / "checkpoints").mkdir(parents=True)
    checkpoint = hostile / "checkpoints" / "step-000001"
    shutil.copytree(one_step_run / "checkpoints" / "step-000001", checkpoint)
    marker = tmp_path / "the-code-ran"
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    torch.save({**state, "data": RunsACommand(f"touch {marker}")}, checkpoint / STATE_FILE)

    message = input_error(
        "grpo-train",
        f"model.name_or_path={tiny_model_dir}",
        "trainer.steps=2",
        "data.eval_size=0",
        "trainer.resume=true",
        f"hydra.run.dir={hostile}",
        cwd=tmp_path,
    )
    assert not marker.exists()
    assert f"{checkpoint / STATE_FILE} holds a posix.system, not only tensors and plain values" in message
    assert "It was not loaded. Resume only from checkpoints a grpo-cli run wrote." in message


def test_a_checkpoint_of_an_older_grpo_cli_still_resumes(one_step_run, tmp_path):
    # Older runs saved numpy's RNG state as numpy's own tuple, an array inside: still loaded
    # weights-only (numpy's array reconstruction is allowed, nothing else), and restored.
    checkpoint = tmp_path / "old"
    shutil.copytree(one_step_run / "checkpoints" / "step-000001", checkpoint)
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    np.random.seed(7)
    legacy = np.random.get_state()  # ('MT19937', uint32 array, pos, has_gauss, gauss)
    expected = np.random.rand(3)
    torch.save({**state, "rng": {**state["rng"], "numpy": legacy}}, checkpoint / STATE_FILE)
    set_rng_state(load_trainer_state(checkpoint)["rng"])
    assert np.array_equal(np.random.rand(3), expected)


# ---------------------------------------------------------------- non-finite settings and weights


@pytest.mark.parametrize(
    "override,expected",
    [
        ("optimizer.lr=inf", "optimizer.lr=inf must be a finite number."),
        ("optimizer.lr=nan", "optimizer.lr=nan must be a finite number."),
        ("optimizer.weight_decay=nan", "optimizer.weight_decay=nan must be a finite number."),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1 must be >= 0"),
        ("optimizer.betas=[2,2]", "optimizer.betas=[2.0, 2.0] must be two numbers in [0, 1)"),
        ("sampler.temperature=inf", "sampler.temperature=inf must be a finite number."),
        ("trainer.std_eps=inf", "trainer.std_eps=inf must be a finite number."),
        ("trainer.memory_budget_gb=nan", "trainer.memory_budget_gb=nan must be a finite number."),
        ("trainer.seed=-1", "trainer.seed=-1 must be in [0, 2^32)"),
        ("trainer.log_every=0", "trainer.log_every=0 must be at least 1"),
        ("reward.timeout_s=-1", "reward.timeout_s=-1.0 must be >= 0"),
    ],
)
def test_non_finite_and_out_of_range_settings_are_refused(tiny_model_dir, override, expected):
    # Before: lr=inf passed, turned every weight into NaN and exited 0; seed=-1 and log_every=0
    # crashed with a traceback; the others trained nothing, silently.
    with pytest.raises(ConfigError) as error:
        validate(config(tiny_model_dir, override), check_files=False)
    assert expected in str(error.value)


def test_an_infinite_learning_rate_is_refused_by_grpo_train(tmp_path):
    message = input_error("grpo-train", "optimizer.lr=inf", cwd=tmp_path)
    assert "optimizer.lr=inf must be a finite number." in message


def test_weights_that_hold_nan_are_never_saved_and_the_good_checkpoints_stay(tmp_path, tiny_model_dir):
    models = load_models(config(tiny_model_dir).model, 0.0, torch.device("cpu"))
    save_checkpoint(tmp_path, 1, models.policy, models.tokenizer, {}, {"reward_mean": 0.5}, keep_last=1)
    with torch.no_grad():
        next(models.policy.parameters())[0, 0] = math.nan
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(tmp_path, 2, models.policy, models.tokenizer, {}, {"reward_mean": 0.9}, keep_last=1)
    assert "The policy's weights hold NaN or inf at step 2 (model.embed_tokens.weight)" in str(error.value)
    assert f"the newest checkpoint, {tmp_path / 'checkpoints' / 'step-000001'}, is kept" in str(error.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000001"
    ]  # keep_last=1 deleted nothing


@pytest.mark.slow  # a grpo-train run in a child process: make test runs it
def test_resuming_a_checkpoint_whose_weights_hold_nan_is_refused(one_step_run, tmp_path, tiny_model_dir):
    run_dir = tmp_path / "nan"
    shutil.copytree(one_step_run, run_dir, ignore=shutil.ignore_patterns("metrics.jsonl", "*.log"))
    weights_file = run_dir / "checkpoints" / "step-000001" / "model.safetensors"
    weights = load_file(weights_file)
    weights["model.norm.weight"][0] = math.nan
    save_file(weights, weights_file, metadata={"format": "pt"})
    message = input_error(
        "grpo-train",
        f"model.name_or_path={tiny_model_dir}",
        "trainer.steps=2",
        "data.eval_size=0",
        "trainer.resume=true",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert "holds NaN or inf weights (model.norm.weight); a run cannot continue from it." in message


# ---------------------------------------------------------------- reward functions that misbehave


def exits(prompts, completions, **_):
    sys.exit(3)  # as some libraries do on an error


def hangs(prompts, completions, **_):
    time.sleep(3600)


def as_dict(prompts, completions, **_):
    return {text: 1.0 for text in completions}


def edits_the_completions(prompts, completions, **_):
    completions[:] = ["edited"] * len(completions)
    return [0.0] * len(completions)


def counts_edited(prompts, completions, **_):
    return [float(text == "edited") for text in completions]


def test_a_reward_that_calls_sys_exit_stops_the_run_with_its_name(tmp_path):
    # Before: exit code 0, no message, no checkpoint (and in a -m sweep no later job ran).
    message = input_error(
        "grpo-train",
        "reward.functions=[{_target_: test_trust.exits, weight: 1.0}]",
        "trainer.steps=2",
        "data.eval_size=0",
        cwd=tmp_path,
        env={"PYTHONPATH": TESTS_DIR},
    )
    assert "Reward function exits failed on 128 of 128 completions" in message
    assert "the first failure: raised SystemExit: 3." in message


@pytest.mark.slow  # a grpo-train run in a child process: make test runs it
def test_a_reward_that_hangs_is_cut_off_at_its_timeout(tmp_path):
    started = time.monotonic()
    message = input_error(
        "grpo-train",
        "reward.functions=[{_target_: test_trust.hangs, weight: 1.0}]",
        "reward.timeout_s=1",
        "trainer.steps=2",
        "data.eval_size=0",
        cwd=tmp_path,
        env={"PYTHONPATH": TESTS_DIR},
    )
    assert time.monotonic() - started < 120  # one second of the hang, not an hour
    assert "Reward function hangs failed on 128 of 128 completions" in message
    assert "the first failure: ran longer than reward.timeout_s=1 s on 128 completions." in message


def test_a_reward_that_returns_a_dict_loses_its_scores_instead_of_scoring_the_keys():
    function = build_reward_functions([{"_target_": "test_trust.as_dict"}])[0]
    result = call_reward(function, ["p", "p"], ["a", "b"], {})
    assert result == (
        [None, None],
        2,
        "returned a dict; a reward function returns a list of one number (or None) per completion",
    )


def test_a_reward_that_edits_the_completions_does_not_change_what_the_next_one_scores():
    scorer = RewardScorer([{"_target_": "test_trust.edits_the_completions"}, {"_target_": "test_trust.counts_edited"}])
    completions = ["a", "b"]
    rewards = scorer.score_texts(["p", "p"], completions, {}, (1, 2))
    assert rewards.per_function["counts_edited"].tolist() == [[0.0, 0.0]] and completions == ["a", "b"]


# ---------------------------------------------------------------- a full disk


@pytest.mark.slow  # a grpo-train run in a child process: make test runs it
def test_a_full_disk_at_a_checkpoint_keeps_the_last_complete_one_and_says_so(tmp_path):
    # A 12 MB tmpfs as the run folder's disk, in a mount namespace of its own: step 1's checkpoint
    # (7.3 MB: weights, Adam's two moments) fits, step 2's does not. torch.save reports it as a
    # RuntimeError ("[enforce fail at inline_container.cc:672] unexpected pos"), which used to end
    # the run with a traceback and leave .partial-step-000002 filling the disk.
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (
        f"mount -t tmpfs -o size=12m tmpfs {disk} || exit 97\n"
        f"{GRPO_TRAIN} trainer.steps=2 trainer.checkpoint_every=1 data.eval_size=0 "
        f"hydra.run.dir={disk}/run 2>{disk}/stderr\n"
        f'echo "exit $?"; ls -a {disk}/run/checkpoints; cat {disk}/stderr\n'
    )
    result = subprocess.run(
        ["unshare", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr  # 97: this machine lets no test mount a small disk
    output = " ".join(result.stdout.split())
    assert "exit 2" in output and "Traceback" not in output, output[-3000:]
    assert ". .. step-000001 " in output  # no .partial-step-000002 left
    run = disk / "run" / "checkpoints"
    assert (
        f"Could not write checkpoint {run / 'step-000002'}: No space left on device. The partial copy "
        f"was removed and the newest complete checkpoint, {run / 'step-000001'}, is intact."
    ) in output


# ---------------------------------------------------------------- two runs in one folder

HOLDS_THE_FOLDER = """
import sys, time
from pathlib import Path
from grpo_cli.run_lock import hold_run_folder
with hold_run_folder(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_second_run_in_a_folder_in_use_is_refused_with_the_other_runs_pid(tmp_path):
    # Before: both ran, interleaving metrics.jsonl, and collided on checkpoints.
    folder = tmp_path / "run"
    with hold_run_folder(folder):  # this test process is the first run
        message = input_error("grpo-train", "trainer.steps=1", f"hydra.run.dir={folder}", cwd=tmp_path)
    assert f"{folder} is in use by another grpo-train run (pid {os.getpid()} on " in message
    assert "Wait for it to end (or stop it), or give this run another folder (hydra.run.dir=...)." in message
    assert not (folder / "metrics.jsonl").exists()  # the second run wrote nothing


def test_the_lock_goes_with_its_run_even_after_kill_9(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDS_THE_FOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on "):
            with hold_run_folder(folder):
                pass
    finally:
        holder.kill()
        holder.wait()
    with hold_run_folder(folder):  # no stale lock to clean up
        pass


# ---------------------------------------------------------------- damaged checkpoints, another model's


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("two")
    run(
        config(
            tiny_model_dir,
            "trainer.steps=2",
            "trainer.checkpoint_every=1",
            "trainer.keep_last=2",
            "data.eval_size=0",
            f"trainer.output_dir={folder}",
        )
    )
    return folder


def cut_in_half(path):
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


DAMAGES = {  # how a checkpoint is damaged -> what the run says of it (how it starts)
    "cut-off weights": (
        lambda c: cut_in_half(c / "model.safetensors"),
        "model.safetensors is cut off or damaged (Error while deserializing header: incomplete "
        "metadata, file not fully covered)",
    ),
    "garbage trainer state": (
        lambda c: (c / STATE_FILE).write_bytes(b"not a checkpoint" * 8),
        "trainer_state.pt cannot be read: it is cut off, or not a file torch.save wrote",
    ),
    "no config.json": (
        lambda c: (c / "config.json").unlink(),
        "it has no config.json (nor adapter_config.json): no model can be loaded from it",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_resume_passes_over_a_damaged_newest_checkpoint_saying_so(
    two_checkpoints, tmp_path, tiny_model_dir, capsys, damage
):
    # Before: each crashed the resumed run with a traceback.
    folder = tmp_path / "run"
    shutil.copytree(two_checkpoints, folder)
    damaged = folder / "checkpoints" / "step-000002"
    spoil, reason = DAMAGES[damage]
    spoil(damaged)
    with pytest.raises(ConfigError) as error:  # named by path: refused, with the reason
        validate(config(tiny_model_dir, f"trainer.resume={damaged}", f"trainer.output_dir={folder}"))
    assert f"trainer.resume={damaged}: the checkpoint cannot be resumed: {reason}" in str(error.value)

    result = run(
        config(
            tiny_model_dir,
            "trainer.steps=3",
            "trainer.checkpoint_every=1",
            "trainer.keep_last=2",
            "data.eval_size=0",
            "trainer.resume=true",
            f"trainer.output_dir={folder}",
        )
    )
    printed = "".join(capsys.readouterr().out.split())  # the console folds lines longer than 80 columns
    assert "".join(f"Skipping checkpoint {damaged}: {reason}".split()) in printed
    assert "Resumingfromthenewestonebeforeitthatloads." in printed
    assert "".join(f"Resuming from {folder / 'checkpoints' / 'step-000001'} (step 1).".split()) in printed
    assert result.last_checkpoint.name == "step-000003" and checkpoint_damage(damaged) is None  # step 2 redone


def test_a_checkpoint_of_another_model_is_refused_before_anything_loads(two_checkpoints, tmp_path, tiny_model_dir):
    # Copied away from its run (no config.yaml beside it), full weights of the tiny model, resumed
    # with another base: before, it passed validation and the run crashed in the embedding.
    checkpoint = tmp_path / "copied" / "step-000002"
    shutil.copytree(two_checkpoints / "checkpoints" / "step-000002", checkpoint)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    shape = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**shape, "hidden_size": 64}))
    with pytest.raises(ConfigError) as error:
        validate(
            config(
                tiny_model_dir,
                f"model.name_or_path={other}",
                f"trainer.resume={checkpoint}",
                f"trainer.output_dir={tmp_path / 'new'}",
            )
        )
    assert (
        f"trainer.resume={checkpoint}: the checkpoint is another model than model.name_or_path={other} "
        "(hidden_size 128 against 64)"
    ) in str(error.value)


def test_a_model_folder_whose_config_transformers_rejects_is_named_with_the_reason(tmp_path, tiny_model_dir):
    # transformers 5 checks a config's fields against each other (StrictDataclassError, no
    # ValueError): before, validate ended in its traceback.
    other = tmp_path / "model"
    shutil.copytree(tiny_model_dir, other)
    shape = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**shape, "num_hidden_layers": 2}))  # 4 layer_types
    with pytest.raises(ConfigError) as error:
        validate(config(tiny_model_dir, f"model.name_or_path={other}"))
    assert f"model.name_or_path={other}: {other / 'config.json'} cannot be read (" in str(error.value)
    assert "`num_hidden_layers` (2) must be equal to the number of `layer_types` (4)" in str(error.value)


def exits_on_seed_1(prompts, completions, seed, **_):
    if seed == 1:
        sys.exit(3)
    return [0.0] * len(completions)


@pytest.mark.slow  # a grpo-train run in a child process: make test runs it
def test_a_sweep_job_that_fails_leaves_the_others_running_and_the_sweep_exits_2(tmp_path):
    # Before: a job's failure (a reward's sys.exit here; any bad input) ended the whole sweep there.
    sweep = tmp_path / "sweep"
    result = run_script(
        "grpo-train",
        "-m",
        "trainer.seed=1,0",
        "trainer.steps=1",
        "data.eval_size=0",
        "reward.functions=[{_target_: test_trust.exits_on_seed_1, weight: 1.0, seed: ${trainer.seed}}]",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        check=False,
        env={"PYTHONPATH": TESTS_DIR},
    )
    stderr = " ".join(result.stderr.split())
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr, stderr[-3000:]
    assert "Reward function exits_on_seed_1 failed on 128 of 128 completions" in stderr  # job 0, seed 1
    assert "a job of the sweep stopped (the others ran; each failure is printed above)." in stderr
    assert [row["step"] for row in read_metrics(sweep / "1")] == [1]  # job 1, seed 0, ran to its end
