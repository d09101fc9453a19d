"""The optimizer (any torch-style class named by `optimizer._target_`) and its LR schedule."""

from __future__ import annotations

import torch
from hydra.utils import get_class
from omegaconf import OmegaConf
from transformers import get_scheduler

from grpo_cli.config import ConfigError, OptimizerConfig

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def make_optimizer(cfg: OptimizerConfig, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    try:
        optimizer_class = get_class(cfg._target_)
    except Exception as error:
        raise ConfigError(
            f"optimizer._target_={cfg._target_}: cannot import it ({error}). Name an optimizer "
            "class such as torch.optim.AdamW or bitsandbytes.optim.AdamW8bit."
        ) from None
    extra = OmegaConf.to_container(cfg.kwargs) if OmegaConf.is_config(cfg.kwargs) else dict(cfg.kwargs)
    return optimizer_class(
        parameters, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), **extra
    )


def make_scheduler(cfg: OptimizerConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """Linear warmup over `warmup_steps`, then constant, linear decay to 0 or cosine decay to 0."""
    return get_scheduler(
        SCHEDULES[cfg.scheduler.lower()],
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=total_steps,
    )
