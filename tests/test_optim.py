"""The learning-rate schedules (optim.make_scheduler) equal transformers' get_scheduler at every
step, with and without warmup, past the last step too."""

from __future__ import annotations

import pytest
import torch
from transformers import get_scheduler

from grpo_cli.algorithm.optim import make_scheduler
from helpers import config

TRANSFORMERS_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def learning_rates(scheduler, optimizer, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_each_schedule_is_transformers_own(tiny_model_dir, schedule, warmup):
    cfg = config(
        tiny_model_dir, f"optimizer.scheduler={schedule}", f"optimizer.warmup_steps={warmup}", "optimizer.lr=3e-4"
    ).optimizer
    rates = {}
    for side in ("ours", "transformers"):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        scheduler = (
            make_scheduler(cfg, optimizer, 20)
            if side == "ours"
            else get_scheduler(TRANSFORMERS_NAMES[schedule], optimizer, num_warmup_steps=warmup, num_training_steps=20)
        )
        rates[side] = learning_rates(scheduler, optimizer, 25)  # 5 steps past the end
    assert rates["ours"] == pytest.approx(rates["transformers"], rel=1e-12, abs=1e-15)
    assert len(set(rates["ours"])) > (1 if schedule != "constant" or warmup else 0)
    if warmup:
        assert rates["ours"][0] == 0.0 and rates["ours"][warmup] == pytest.approx(3e-4)
