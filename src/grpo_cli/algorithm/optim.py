"""The optimizer (any torch-style class named by `optimizer._target_`) and its LR schedule."""

from __future__ import annotations

import math

import torch
from hydra.utils import get_class
from omegaconf import OmegaConf

from grpo_cli.config import ConfigError, OptimizerConfig


def make_optimizer(cfg: OptimizerConfig, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    try:
        optimizer_class = get_class(cfg._target_)
    except Exception as error:
        raise ConfigError(
            f"optimizer._target_={cfg._target_}: cannot import it ({error}). Name an optimizer "
            "class such as torch.optim.AdamW or bitsandbytes.optim.AdamW8bit."
        ) from None
    extra = OmegaConf.to_container(cfg.kwargs) if OmegaConf.is_config(cfg.kwargs) else dict(cfg.kwargs)
    return optimizer_class(parameters, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), **extra)


def make_scheduler(
    cfg: OptimizerConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 over `warmup_steps`, then constant, linear decay to 0 or cosine decay
    to 0 at `total_steps`: the multipliers of transformers' get_scheduler (constant_with_warmup,
    linear, cosine), equal at every step (tests/test_optim.py). Written out rather than imported
    because transformers.optimization imports its trainer utilities, and with them peft and
    bitsandbytes: 4 of the 12 seconds every `grpo-train` spent importing, for three formulas."""
    schedule, warmup = cfg.scheduler.lower(), cfg.warmup_steps

    def multiplier(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
