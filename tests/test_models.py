"""Loading modes on the tiny model, in process: full fine-tune, LoRA, gradient checkpointing,
4-bit QLoRA; and one real update step through each."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from grpo_cli.advantages import group_advantages
from grpo_cli.config import Config
from grpo_cli.models import load_models, reference_model, trainable_parameters
from grpo_cli.optim import make_optimizer, make_scheduler
from grpo_cli.prompts import PromptSource
from grpo_cli.sampling import make_sampler
from grpo_cli.update import completion_log_probs, update_policy


def config(tiny_model_dir, *overrides: str):
    cfg = OmegaConf.structured(Config)
    cfg.merge_with_dotlist([
        f"model.name_or_path={tiny_model_dir}", "data.path=synthetic:addition",
        "data.prompts_per_step=2", "sampler.group_size=4", "sampler.max_new_tokens=4",
        "optimizer.lr=1e-2", *overrides,
    ])
    return cfg


def one_step(cfg):
    """Sample, reward by hand (alternating 1/0 so every group has signal), update once."""
    torch.manual_seed(0)
    models = load_models(cfg.model, cfg.trainer.beta, torch.device("cpu"))
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    rollout = make_sampler(cfg.sampler, models.tokenizer).sample(models.policy, batch)
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0]] * batch.size)
    advantages = group_advantages(rewards, std_eps=1e-4, std_threshold=1e-4)
    parameters = trainable_parameters(models.policy)
    before = [p.detach().clone() for p in parameters]
    optimizer = make_optimizer(cfg.optimizer, parameters)
    scheduler = make_scheduler(cfg.optimizer, optimizer, 1)
    stats = update_policy(models, rollout, advantages, optimizer, scheduler, cfg.trainer,
                          cfg.optimizer.max_grad_norm)
    changed = sum(not torch.equal(b, p) for b, p in zip(before, parameters))
    return models, rollout, stats, changed, len(parameters)


def test_full_fine_tune_trains_every_weight_against_a_frozen_copy(tiny_model_dir):
    models, _, stats, changed, total = one_step(config(tiny_model_dir, "trainer.beta=0.04"))
    assert models.reference is not None and not any(p.requires_grad for p in models.reference.parameters())
    assert changed == total and stats.tokens > 0 and stats.grad_norm > 0


def test_beta_zero_loads_no_reference(tiny_model_dir):
    models, _, stats, _, _ = one_step(config(tiny_model_dir, "trainer.beta=0"))
    assert models.reference is None and stats.kl == 0.0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_trains_the_adapter_only_and_its_reference_is_the_base(tiny_model_dir, checkpointing):
    cfg = config(tiny_model_dir, "model.lora.enabled=true", "model.lora.r=4",
                 f"model.gradient_checkpointing={checkpointing}", "trainer.beta=0.04")
    models, rollout, stats, changed, total = one_step(cfg)
    assert models.reference is None  # no second copy of the weights
    names = [n for n, p in models.policy.named_parameters() if p.requires_grad]
    # LoRA's B starts at zero, so A gets no gradient on the first step: only the B half moves.
    assert names and all("lora_" in n for n in names) and changed == total // 2
    # Adapter off == the untouched base model: the reference log-probs are the base model's.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    args = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    with torch.no_grad():
        base_log_probs = completion_log_probs(base, *args)[0]
        with reference_model(models) as reference:
            assert torch.allclose(completion_log_probs(reference, *args)[0], base_log_probs, atol=1e-5)
        # the adapter is back on outside the context: the trained policy differs from the base
        assert not torch.allclose(completion_log_probs(models.policy, *args)[0], base_log_probs, atol=1e-5)


def test_qlora_4bit_loads_and_trains_on_cpu(tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    cfg = config(tiny_model_dir, "model.lora.enabled=true", "model.lora.r=4",
                 "model.quantization=4bit", "model.lora.target_modules=[all-linear]")
    models, _, stats, changed, total = one_step(cfg)
    assert changed == total // 2 and stats.tokens > 0  # the lora_B half, as above
    assert any("4bit" in type(m).__name__ for m in models.policy.modules())
