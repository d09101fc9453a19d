"""What a user must be able to trust, each attack or fault provoked for real: a checkpoint from
someone else runs no code when resumed (docs/ERRORS.md quotes the messages these tests see)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from grpo_cli.checkpoint import STATE_FILE, load_trainer_state, set_rng_state
from grpo_cli.pipeline import run
from helpers import config, input_error


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
    run(config(tiny_model_dir, "trainer.steps=1", "trainer.checkpoint_every=1", "data.eval_size=0",
               f"trainer.output_dir={folder}"))
    return folder


def test_the_trainer_state_a_run_writes_loads_weights_only(one_step_run):
    checkpoint = one_step_run / "checkpoints" / "step-000001"
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)  # no allow-list
    assert state["step"] == 1 and set(state["rng"]) >= {"python", "numpy", "torch"}
    assert load_trainer_state(checkpoint)["data"] == state["data"]


def test_resuming_a_checkpoint_whose_state_runs_code_refuses_it_and_runs_nothing(one_step_run, tmp_path,
                                                                              tiny_model_dir):
    hostile = tmp_path / "hostile"
    (hostile / "checkpoints").mkdir(parents=True)
    checkpoint = hostile / "checkpoints" / "step-000001"
    shutil.copytree(one_step_run / "checkpoints" / "step-000001", checkpoint)
    marker = tmp_path / "the-code-ran"
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    torch.save({**state, "data": RunsACommand(f"touch {marker}")}, checkpoint / STATE_FILE)

    message = input_error("grpo-train", f"model.name_or_path={tiny_model_dir}", "trainer.steps=2",
                          "data.eval_size=0", "trainer.resume=true", f"hydra.run.dir={hostile}", cwd=tmp_path)
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
