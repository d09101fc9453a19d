"""Adaptive group size: the rule by hand on crafted plateaus, then a real run whose reward is flat
(G goes up for `duration` steps and comes back, at the same steps after a resume)."""

from __future__ import annotations

import pytest

from grpo_cli.config import AdaptiveGroupConfig, ConfigError
from grpo_cli.logs import SAMPLES_FILE, read_metrics
from grpo_cli.pipeline import run
from grpo_cli.safety.adaptive import AdaptiveGroupState, next_group_size
from grpo_cli.validation import validate
from helpers import config

RULE = AdaptiveGroupConfig(enabled=True, patience=2, duration=2, factor=2, max_group_size=8, zero_std_fraction=0.9)


def group_sizes(rewards: list[float], zero_std: list[float], cfg: AdaptiveGroupConfig = RULE) -> list[int]:
    """The group size each step was sampled with, feeding the rule step by step (G starts at 4)."""
    state, used = AdaptiveGroupState(4, 4), []
    for step, (reward, fraction) in enumerate(zip(rewards, zero_std), start=1):
        used.append(state.group_size)
        next_group_size(cfg, state, 8, step, reward, fraction)
    return used


def test_a_reward_plateau_raises_the_group_size_for_duration_steps_then_restores_it():
    # Flat reward from step 1: step 1 sets the best, steps 2 and 3 do not beat it (patience 2),
    # so steps 4 and 5 sample G = 8; after step 5 G is 4 again and the counter restarts: steps 6
    # and 7 do not improve, so steps 8 and 9 are raised again.
    assert group_sizes([0.5] * 9, [0.0] * 9) == [4, 4, 4, 8, 8, 4, 4, 8, 8]


def test_an_improving_reward_keeps_the_group_size():
    assert group_sizes([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.0] * 6) == [4] * 6
    # improvements below min_improvement (0.01) do not count: 0.005 a step is a plateau
    assert group_sizes([0.5 + 0.005 * i for i in range(5)], [0.0] * 5) == [4, 4, 4, 8, 8]


def test_zero_std_groups_raise_it_even_while_the_reward_improves():
    # Mean zero-std fraction over the last 2 steps: step 1 -> (1.0) not yet 2 steps; step 2 ->
    # (1.0 + 0.95) / 2 = 0.975 > 0.9: raised for steps 3 and 4.
    assert group_sizes([0.1, 0.2, 0.3, 0.4, 0.5], [1.0, 0.95, 0.5, 0.5, 0.5]) == [4, 4, 8, 8, 4]
    assert group_sizes([0.1, 0.2, 0.3], [0.9, 0.9, 0.9]) == [4, 4, 4]  # 0.9 is not above 0.9


def test_each_change_is_recorded_with_its_reason():
    state = AdaptiveGroupState(4, 4)
    reasons = [next_group_size(RULE, state, 8, step, 0.5, 0.0) for step in range(1, 6)]
    assert reasons[:2] == [None, None] and reasons[3] is None
    assert reasons[2] == "group size raised to 8 for 2 steps: reward/mean has not improved for 2 steps"
    assert reasons[4] == "group size back to 4 after 2 raised steps"
    assert [(c["step"], c["group_size"]) for c in state.changes] == [(3, 8), (5, 4)]
    assert AdaptiveGroupState.from_state_dict(state.state_dict(), 4) == state  # saved in checkpoints


def test_validate_rejects_adaptive_settings_that_cannot_work(tiny_model_dir):
    cfg = config(
        tiny_model_dir,
        "sampler.adaptive.enabled=true",
        "sampler.adaptive.max_group_size=4",
        "sampler.adaptive.duration=0",
    )
    with pytest.raises(ConfigError) as error:
        validate(cfg, check_files=False)
    assert "sampler.adaptive.max_group_size=4 must exceed sampler.group_size=4" in str(error.value)
    assert "sampler.adaptive.duration=0 must be at least 1" in str(error.value)
    # 2 prompts x G 4 = 8 completions: micro-batches of 8 fit, but a raised step (2 x 6 = 12) does not
    cfg = config(
        tiny_model_dir,
        "sampler.adaptive.enabled=true",
        "sampler.adaptive.max_group_size=6",
        "trainer.micro_batch_size=8",
    )
    with pytest.raises(ConfigError, match=r"divide the completions of a raised step, data.prompts_per_step x 6 = 12"):
        validate(cfg, check_files=False)


def always_half(prompts, completions, **_):
    """The same reward for every completion: a plateau with no signal at all."""
    return [0.5] * len(completions)


ADAPTIVE_RUN = [
    "sampler.adaptive.enabled=true",
    "sampler.adaptive.patience=2",
    "sampler.adaptive.duration=2",
    "sampler.adaptive.max_group_size=8",
    "trainer.sample_every=1",
    "trainer.sample_prompts=1",
    "trainer.checkpoint_every=0",
    "data.eval_size=4",
]


def flat_run(tiny_model_dir, folder, *overrides):
    cfg = config(tiny_model_dir, *ADAPTIVE_RUN, f"trainer.output_dir={folder}", *overrides)
    cfg.reward.functions = [{"_target_": f"{__name__}.always_half", "weight": 1.0}]
    run(cfg)
    return [row for row in read_metrics(folder) if row["step"] > 0]


def test_a_flat_run_raises_and_restores_the_group_size_and_resumes_exactly(tmp_path, tiny_model_dir):
    # Every group is zero-std: after steps 1 and 2 the mean fraction over patience = 2 steps is
    # 1.0 > 0.9, so steps 3 and 4 sample G = 8; then 4 again, and after two more stalled steps
    # (5, 6) it is raised again for step 7.
    expected = [4, 4, 8, 8, 4, 4, 8]
    rows = flat_run(tiny_model_dir, tmp_path / "unbroken", "trainer.steps=7")
    assert [row["sampler/group_size"] for row in rows] == expected
    samples = read_metrics(tmp_path / "unbroken", SAMPLES_FILE)
    assert [len(entry["completions"]) for entry in samples] == expected  # really sampled
    # Stopped after step 3 (inside the raised phase), then resumed: the same sizes at the same steps.
    flat_run(tiny_model_dir, tmp_path / "resumed", "trainer.steps=3")
    resumed = flat_run(tiny_model_dir, tmp_path / "resumed", "trainer.steps=7", "trainer.resume=true")
    assert [row["sampler/group_size"] for row in resumed] == expected
