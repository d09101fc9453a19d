"""A run that is stopped, killed or starved of disk loses minutes, not the run: checkpoints that
survive kill -9 at any point of a save, disk-full errors that say what survived, the best
checkpoints kept, and SIGINT / SIGTERM that checkpoint and exit cleanly."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from grpo_cli import checkpoint as checkpoint_module
from grpo_cli.checkpoint import (
    CheckpointError,
    best_checkpoint,
    checkpoints_to_delete,
    complete_checkpoints,
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
)
from grpo_cli.logs import read_metrics
from helpers import GRPO_TRAIN, computed_rows, grpo_train

QUICK = ["data.prompts_per_step=2", "sampler.group_size=2", "data.eval_size=0", "trainer.log_every=1"]


def fake_checkpoints(root: Path, rewards: list[float]) -> list[Path]:
    folders = []
    for step, reward in enumerate(rewards, start=1):
        folder = root / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": step, "reward_mean": reward}))
        folders.append(folder)
    return folders


def test_keep_last_and_keep_best(tmp_path):
    # rewards by step 1..6: 0.1 0.9 0.3 0.8 0.2 0.4; keep_last 2 -> steps 5, 6; keep_best 2 ->
    # steps 2 (0.9) and 4 (0.8); so steps 1 and 3 go.
    folders = fake_checkpoints(tmp_path, [0.1, 0.9, 0.3, 0.8, 0.2, 0.4])
    assert [p.name for p in checkpoints_to_delete(folders, 2, 2)] == ["step-000001", "step-000003"]
    assert [p.name for p in checkpoints_to_delete(folders, 2, 0)] == [f"step-00000{i}" for i in (1, 2, 3, 4)]
    assert checkpoints_to_delete(folders, 6, 0) == []


def tiny_save_arguments(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return policy, tokenizer


def test_best_checkpoint_survives_rotation(tmp_path, tiny_model_dir):
    policy, tokenizer = tiny_save_arguments(tiny_model_dir)
    for step, reward in enumerate([0.2, 0.9, 0.1, 0.3], start=1):
        save_checkpoint(
            tmp_path, step, policy, tokenizer, {"data": {}}, {"reward_mean": reward}, keep_last=1, keep_best=1
        )
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000002", "step-000004"]
    assert best_checkpoint(tmp_path).name == "step-000002"
    assert latest_checkpoint(tmp_path).name == "step-000004"


def test_disk_full_while_saving_keeps_the_previous_checkpoint_and_says_so(tmp_path, tiny_model_dir, monkeypatch):
    policy, tokenizer = tiny_save_arguments(tiny_model_dir)
    first = save_checkpoint(tmp_path, 1, policy, tokenizer, {"data": {}}, {"reward_mean": 0.5}, keep_last=3)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module.torch, "save", no_space)
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(tmp_path, 2, policy, tokenizer, {"data": {}}, {"reward_mean": 0.6}, keep_last=3)
    message = str(caught.value)
    assert "No space left on device" in message and str(first) in message and "is intact" in message
    monkeypatch.undo()
    assert complete_checkpoints(tmp_path) == [first]
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))  # the partial copy is gone
    assert load_trainer_state(first)["step"] == 1


# Each point of a save at which the child kills itself with SIGKILL: (function, call number).
KILL_POINTS = [
    ("save_pretrained", 1),  # in the middle of writing the weights
    ("torch_save", 1),  # weights and tokenizer written, trainer state not
    ("write_text", 1),  # everything but meta.json
    ("fsync", 1),  # all written, nothing flushed
    ("replace", 1),  # flushed, not yet renamed into place
    ("rmtree", 1),  # clearing an old partial copy, before anything is written
    ("rmtree", 2),  # renamed into place; rotation of old checkpoints not done
]

KILLER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from grpo_cli import checkpoint

    model_dir, out, point, nth = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    checkpoint.save_checkpoint(out, 1, policy, tokenizer, {"data": {"position": 1}}, {"reward_mean": 0.1}, keep_last=1)
    calls = {"n": 0}

    def killing(original):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        return wrapped

    if point == "save_pretrained":
        original = policy.save_pretrained
        def partial_save(folder, **kwargs):  # half a weights file, then death
            (Path(folder) / "model.safetensors").write_bytes(b"\\0" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)
        policy.save_pretrained = partial_save
    elif point == "torch_save":
        checkpoint.torch.save = killing(torch.save)
    elif point == "write_text":
        Path.write_text = killing(Path.write_text)
    elif point == "fsync":
        checkpoint._fsync_tree = killing(checkpoint._fsync_tree)
    elif point == "replace":
        checkpoint.os.replace = killing(os.replace)
    elif point == "rmtree":
        checkpoint.shutil.rmtree = killing(checkpoint.shutil.rmtree)
    checkpoint.save_checkpoint(out, 2, policy, tokenizer, {"data": {"position": 2}}, {"reward_mean": 0.2}, keep_last=1)
    print("finished without being killed")
""")


@pytest.mark.slow  # seven child processes: in `make test`, not in the quick loop
@pytest.mark.parametrize("point,nth", KILL_POINTS, ids=[f"{point}-{nth}" for point, nth in KILL_POINTS])
def test_kill_9_at_any_point_of_a_save_leaves_a_loadable_checkpoint(tmp_path, tiny_model_dir, point, nth):
    from transformers import AutoModelForCausalLM

    result = subprocess.run(
        [sys.executable, "-c", KILLER, str(tiny_model_dir), str(tmp_path), point, str(nth)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    newest = latest_checkpoint(tmp_path)
    assert newest is not None and newest.name in ("step-000001", "step-000002")
    # Killed before the rename: the old one is newest; after it: the new one is complete.
    expected = "step-000002" if (point, nth) == ("rmtree", 2) else "step-000001"
    assert newest.name == expected
    state = load_trainer_state(newest)
    assert state["data"]["position"] == int(newest.name[-1])
    model = AutoModelForCausalLM.from_pretrained(newest)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def wait_for_rows(run_dir: Path, count: int, process: subprocess.Popen, limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"grpo-train ended early: {process.communicate()}")
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError("no metrics rows in time")


def start(run_dir: Path, steps: int, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            GRPO_TRAIN,
            *QUICK,
            f"trainer.steps={steps}",
            "trainer.checkpoint_every=0",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.slow  # three real runs per signal
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_checkpoints_the_step_and_resume_matches_an_unbroken_run(tmp_path, tiny_model_dir, stop_signal):
    steps = 12
    unbroken = tmp_path / "unbroken"
    grpo_train(*QUICK, f"trainer.steps={steps}", "trainer.checkpoint_every=0", f"hydra.run.dir={unbroken}")
    run_dir = tmp_path / "stopped"
    process = start(run_dir, steps)
    wait_for_rows(run_dir, 2, process)
    process.send_signal(stop_signal)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-2000:]
    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert 1 <= stopped_at < steps
    output = " ".join(stdout.split())
    assert f"Stopped by {signal.Signals(stop_signal).name} after step {stopped_at}" in output
    assert "trainer.resume=true" in output
    assert latest_checkpoint(run_dir).name == f"step-{stopped_at:06d}"
    grpo_train(
        *QUICK,
        f"trainer.steps={steps}",
        "trainer.checkpoint_every=0",
        "trainer.resume=true",
        f"hydra.run.dir={run_dir}",
    )

    assert computed_rows(read_metrics(run_dir)) == computed_rows(read_metrics(unbroken))


@pytest.mark.slow
def test_a_second_sigint_stops_at_once(tmp_path, tiny_model_dir):
    # Long steps (256 completions of up to 64 tokens), so both signals land in the same step;
    # the pause lets the first one be handled before the second (pending signals merge).
    run_dir = tmp_path / "twice"
    process = start(
        run_dir,
        100,
        "data.prompts_per_step=32",
        "sampler.group_size=8",
        "sampler.max_new_tokens=64",
        "sampler.min_new_tokens=64",
    )
    wait_for_rows(run_dir, 1, process)
    time.sleep(0.5)  # into step 2 (seconds long): a signal right at the end of step 1 would stop there
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr[-2000:]
    assert "Interrupted during step" in " ".join(stdout.split())
