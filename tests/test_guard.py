"""The collapse guard: what triggers it (by hand), and a real run that rolls back, doubles beta,
and stops with a report when the rollbacks are used up; a NaN step never reaches the weights."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.checkpoint import save_checkpoint
from grpo_cli.config import GuardConfig
from grpo_cli.logs import read_metrics
from grpo_cli.pipeline import run
from grpo_cli.safety.guard import GuardState, GuardStop, roll_back, rollback_reason
from helpers import ALTERNATING_REWARD, computed_rows, config

FINE = {"loss": 0.1, "grad_norm": 1.0, "kl": 0.01, "skipped_updates": 0}


def test_non_finite_loss_or_gradient_triggers():
    guard = GuardConfig(enabled=True)
    for bad in ({"loss": math.nan}, {"grad_norm": math.inf}, {"skipped_updates": 1}):
        assert "not finite" in rollback_reason(guard, GuardState(), 7, {**FINE, "reward/mean": 0.5, **bad})


def test_kl_above_the_bound_triggers():
    guard = GuardConfig(enabled=True, max_kl=0.5)
    assert rollback_reason(guard, GuardState(), 3, {**FINE, "kl": 0.4, "reward/mean": 0.5}) is None
    assert "exceeded trainer.guard.max_kl=0.5" in rollback_reason(
        guard, GuardState(), 3, {**FINE, "kl": 0.6, "reward/mean": 0.5}
    )


def test_reward_drop_is_measured_on_the_window_against_its_best():
    # window 3, drop 0.3: rewards 0.6 0.7 0.8 -> best window mean 0.7 (step 3); then 0.5 -> window
    # (0.7, 0.8, 0.5) = 0.667, fine; 0.2 -> (0.8, 0.5, 0.2) = 0.5: 0.2 below, fine; 0.1 ->
    # (0.5, 0.2, 0.1) = 0.267: 0.433 below the best -> trigger at step 6.
    guard, state = GuardConfig(enabled=True, window=3, reward_drop=0.3), GuardState()
    reasons = [
        rollback_reason(guard, state, step, {**FINE, "reward/mean": reward})
        for step, reward in enumerate([0.6, 0.7, 0.8, 0.5, 0.2, 0.1], start=1)
    ]
    assert reasons[:5] == [None] * 5 and "fell to 0.2667 at step 6" in reasons[5]
    assert state.best_reward == pytest.approx(0.7) and state.best_step == 3


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_roll_back_restores_the_checkpoint_weights_and_raises_beta(tmp_path, tiny_model_dir, lora):
    from grpo_cli.algorithm.optim import make_optimizer, make_scheduler
    from grpo_cli.models.loading import load_models, trainable_parameters
    from grpo_cli.safety.adaptive import AdaptiveGroupState
    from grpo_cli.state import TrainState

    cfg = config(tiny_model_dir, f"model.lora.enabled={lora}")
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    parameters = trainable_parameters(models.policy)
    optimizer = make_optimizer(cfg.optimizer, parameters)
    scheduler = make_scheduler(cfg.optimizer, optimizer, 10)
    saved = [p.detach().clone() for p in parameters]
    save_checkpoint(
        tmp_path,
        1,
        models.policy,
        models.tokenizer,
        {"optimizer": optimizer.state_dict()},
        {"reward_mean": 0.5},
        keep_last=2,
    )
    with torch.no_grad():
        for parameter in parameters:
            parameter.add_(1.0)
    guard, state = GuardConfig(enabled=True, beta_factor=2.0, lr_factor=0.5), GuardState()
    train_state = TrainState(models.policy, optimizer, scheduler, prompts=None, adaptive=AdaptiveGroupState(4, 4))
    target = roll_back(guard, state, 5, "KL too high", tmp_path, train_state.restore_weights, optimizer, scheduler)
    assert target.name == "step-000001"
    assert all(torch.equal(p, s) for p, s in zip(parameters, saved))
    assert state.beta_scale == 2.0 and optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 1e-2)
    assert state.rollbacks == [{"step": 5, "reason": "KL too high", "checkpoint": str(target)}]


def test_a_run_rolls_back_doubles_beta_and_stops_with_a_report(tmp_path, tiny_model_dir):
    # max_kl 1e-9: step 1 is on the reference (KL 0), every later step drifts (the alternating
    # reward gives every step a gradient: no step may leave the weights where they were). Step 2
    # rolls back to step 1 (beta 0.04 -> 0.08), step 3 again (-> 0.16), step 4 finds the 2
    # rollbacks used up.
    cfg = config(
        tiny_model_dir,
        ALTERNATING_REWARD,
        "trainer.steps=6",
        "trainer.beta=0.04",
        "trainer.checkpoint_every=1",
        "trainer.guard.enabled=true",
        "trainer.guard.max_kl=1e-9",
        "trainer.guard.max_rollbacks=2",
        "trainer.log_every=1",
        "data.eval_size=0",
        f"trainer.output_dir={tmp_path}",
    )
    with pytest.raises(GuardStop) as caught:
        run(cfg)
    message = str(caught.value)
    assert "Stopped at step 4" in message and "max_rollbacks=2" in message
    assert message.count("rolled back to") == 2 and "step-000001" in message
    rows = [row for row in read_metrics(tmp_path) if row["step"] > 0]
    assert [row["guard/rollbacks"] for row in rows] == [0, 1, 2]
    assert [row["beta"] for row in rows] == pytest.approx([0.04, 0.04, 0.08])


def test_a_nan_step_never_reaches_the_weights(tiny_model_dir, monkeypatch):
    # The loss of every micro-batch is made NaN: the gradient is NaN, update.py sees it before
    # optimizer.step, skips the step and counts it; no weight changes.
    import grpo_cli.algorithm.update as update_module
    from helpers import one_step

    original = update_module.grpo_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        return loss * math.nan, metrics

    monkeypatch.setattr(update_module, "grpo_loss", nan_loss)
    step = one_step(config(tiny_model_dir, "trainer.beta=0"))
    assert step.stats.skipped_steps == 1 and step.changed == 0 and not math.isfinite(step.stats.grad_norm)


def test_resume_restores_the_guard_state_exactly(tmp_path, tiny_model_dir):
    # Every step after the first triggers (max_kl 1e-9: the alternating reward moves the weights
    # at every step) and doubles beta; a run stopped after 3 steps and resumed to 6 must log
    # exactly what an unbroken 6-step run logs.
    def guarded(output_dir, steps, *extra):
        return config(
            tiny_model_dir,
            ALTERNATING_REWARD,
            f"trainer.steps={steps}",
            "trainer.checkpoint_every=1",
            "trainer.guard.enabled=true",
            "trainer.guard.max_kl=1e-9",
            "trainer.guard.max_rollbacks=10",
            "data.eval_size=0",
            f"trainer.output_dir={output_dir}",
            *extra,
        )

    run(guarded(tmp_path / "unbroken", 6))
    run(guarded(tmp_path / "resumed", 3))
    run(guarded(tmp_path / "resumed", 6, "trainer.resume=true"))

    resumed, unbroken = (computed_rows(read_metrics(tmp_path / name)) for name in ("resumed", "unbroken"))
    assert [row["guard/rollbacks"] for row in unbroken] == [0, 1, 2, 3, 4, 5]
    assert resumed == unbroken
