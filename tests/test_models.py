"""Loading modes on the tiny model, in process: full fine-tune, LoRA, gradient checkpointing,
4-bit QLoRA; and one real update step through each."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.algorithm.log_probs import completion_log_probs
from grpo_cli.models.loading import reference_model
from helpers import config, one_step


def test_full_fine_tune_trains_every_weight_against_a_frozen_copy(tiny_model_dir):
    models, _, stats, changed, total = one_step(config(tiny_model_dir, "trainer.beta=0.04"))
    assert models.reference is not None and not any(p.requires_grad for p in models.reference.parameters())
    assert changed == total and stats.tokens > 0 and stats.grad_norm > 0


def test_beta_zero_loads_no_reference(tiny_model_dir):
    step = one_step(config(tiny_model_dir, "trainer.beta=0"))
    assert step.models.reference is None and step.stats.kl == 0.0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_trains_the_adapter_only_and_its_reference_is_the_base(tiny_model_dir, checkpointing):
    cfg = config(
        tiny_model_dir,
        "model.lora.enabled=true",
        "model.lora.r=4",
        f"model.gradient_checkpointing={checkpointing}",
        "trainer.beta=0.04",
    )
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
    cfg = config(
        tiny_model_dir,
        "model.lora.enabled=true",
        "model.lora.r=4",
        "model.quantization=4bit",
        "model.lora.target_modules=[all-linear]",
    )
    models, _, stats, changed, total = one_step(cfg)
    assert changed == total // 2 and stats.tokens > 0  # the lora_B half, as above
    assert any("4bit" in type(m).__name__ for m in models.policy.modules())
