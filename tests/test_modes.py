"""Every way of loading and training the policy, two GRPO steps each on the tiny model (CPU):
full fine-tune, LoRA, QLoRA 4-bit, 8-bit + LoRA, 8-bit AdamW, gradient checkpointing; the
trainable parameter count, frozen base weights bit-identical, the trained ones changed. Then
resume from LoRA / QLoRA checkpoints, a reference on the CPU, and grpo-export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli.algorithm.advantages import group_advantages
from grpo_cli.algorithm.optim import make_optimizer, make_scheduler
from grpo_cli.algorithm.update import update_policy
from grpo_cli.config import ConfigError, beta_schedule
from grpo_cli.data.prompts import PromptSource
from grpo_cli.logs import read_metrics
from grpo_cli.models.loading import load_models, trainable_parameters
from grpo_cli.pipeline import run
from grpo_cli.sampling import make_sampler
from grpo_cli.validation import validate
from helpers import ALTERNATING_REWARD, alternating_reward, config

GRPO_EXPORT = str(Path(sys.executable).parent / "grpo-export")

# The tiny model (its config.json): hidden 128, 4 layers, 4 heads of 32, 2 KV heads (k, v: 64
# wide), MLP 256, vocab 277, tied embeddings; Qwen2: q, k, v have biases, o and the MLP none.
#   embeddings 277 x 128                                   =  35,456
#   per layer: q 128x128+128 = 16,512; k, v 128x64+64 = 8,256 each; o 128x128 = 16,384;
#              gate, up, down 128x256 = 32,768 each; 2 norms x 128 = 256    -> 147,968
#   4 layers = 591,872; final norm 128                    -> total 627,456
FULL = 627_456
# LoRA r=4 on q, k, v, o adds r x (in + out) per matrix: q 4x(128+128) = 1,024; k, v
# 4x(128+64) = 768 each; o 1,024 -> 3,584 per layer x 4 layers = 14,336.
LORA_R4 = 14_336
LORA = ["model.lora.enabled=true", "model.lora.r=4"]
MODES = {
    "full": ([], FULL),
    "full+checkpointing": (["model.gradient_checkpointing=true"], FULL),
    "full+adamw_8bit": (["optimizer._target_=bitsandbytes.optim.AdamW8bit"], FULL),
    "lora": (LORA, LORA_R4),
    "lora+checkpointing": ([*LORA, "model.gradient_checkpointing=true"], LORA_R4),
    "lora+adamw_8bit": ([*LORA, "optimizer._target_=bitsandbytes.optim.AdamW8bit"], LORA_R4),
    "qlora_4bit": ([*LORA, "model.quantization=4bit"], LORA_R4),
    "qlora_4bit+checkpointing": ([*LORA, "model.quantization=4bit", "model.gradient_checkpointing=true"], LORA_R4),
    "lora_8bit": ([*LORA, "model.quantization=8bit"], LORA_R4),
}


def two_steps(cfg):
    """Two GRPO steps (sample, reward, advantages, update) -> (models, weights before, after),
    the weights as {name: tensor} over every tensor of the policy's state dict."""
    torch.manual_seed(0)
    betas = beta_schedule(cfg.trainer.beta)
    models = load_models(cfg.model, betas.peak, torch.device("cpu"))
    prompts, sampler = PromptSource(cfg.data, models.tokenizer), make_sampler(cfg.sampler, models.tokenizer)
    optimizer = make_optimizer(cfg.optimizer, trainable_parameters(models.policy))
    scheduler = make_scheduler(cfg.optimizer, optimizer, 2)
    before = {name: tensor.clone() for name, tensor in models.policy.state_dict().items()}
    for step in range(2):
        rollout = sampler.sample(models.policy, prompts.next_batch())
        # Every group holds a 1 and a 0 by construction: both steps have a gradient.
        rewards = torch.tensor(alternating_reward(rollout.prompts, rollout.completions)).view(-1, rollout.group_size)
        advantages = group_advantages(rewards, std_eps=1e-4, std_threshold=1e-4)
        update_policy(models, rollout, advantages, optimizer, scheduler, cfg.trainer, 1.0, betas.at(step))
    return models, before, models.policy.state_dict()


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_trains_what_it_should_and_nothing_else(tiny_model_dir, mode):
    overrides, expected_trainable = MODES[mode]
    cfg = config(tiny_model_dir, *overrides, "data.prompts_per_step=4", "optimizer.lr=1e-2")
    models, before, after = two_steps(cfg)
    trainable = trainable_parameters(models.policy)
    assert sum(p.numel() for p in trainable) == expected_trainable
    # Trained tensors by storage: a tied lm_head is the embedding under a second name.
    trained_storage = {p.data_ptr() for p in trainable}
    trained_names = {name for name, tensor in after.items() if tensor.data_ptr() in trained_storage}
    frozen = [name for name in before if name not in trained_names]
    changed = [name for name in trained_names if not torch.equal(before[name], after[name])]
    for name in frozen:  # base weights (quantized bytes and their scales included) untouched
        assert torch.equal(before[name], after[name]), name
    if expected_trainable == FULL:
        assert not frozen or all(n.endswith(("absmax", "quant_map", "SCB")) for n in frozen)
        assert len(changed) >= 0.9 * len(trained_names)  # AdamW moves every weight with a gradient
    else:
        lora_b = [name for name in trained_names if "lora_B" in name]
        assert lora_b and set(lora_b) <= set(changed)  # B starts at 0: a change means it trained
    if "4bit" in mode or "8bit" in mode and "adamw" not in mode:
        assert any(("4bit" in type(m).__name__ or "8bit" in type(m).__name__) for m in models.policy.modules())


def test_a_full_fine_tunes_reference_can_sit_on_the_cpu(tiny_model_dir):
    cfg = config(tiny_model_dir, "model.reference_device=cpu")
    models = load_models(cfg.model, 0.04, torch.device("cpu"))
    assert next(models.reference.parameters()).device == torch.device("cpu")
    with pytest.raises(ConfigError, match="model.reference_device='gpu' is not one of same, cpu, cuda, cuda:N"):
        validate(config(tiny_model_dir, "model.reference_device=gpu"), check_files=False)


def test_paged_optimizers_are_refused_on_the_cpu(tiny_model_dir):
    with pytest.raises(ConfigError, match="paged optimizers keep their states in CUDA unified memory"):
        validate(config(tiny_model_dir, "optimizer._target_=bitsandbytes.optim.PagedAdamW8bit", "trainer.device=cpu"))


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_model_dir):
    """A LoRA and a QLoRA run of 2 steps each, then resumed to 3, on the alternating reward: every
    step trains (with exact_match every completion can be wrong for three steps: no advantage,
    an adapter still at 0, no KL, nothing trained)."""
    folders = {}
    for name, extra in (("lora", []), ("qlora", ["model.quantization=4bit"])):
        folder = tmp_path_factory.mktemp(name)
        settings = [
            *LORA,
            *extra,
            ALTERNATING_REWARD,
            "optimizer.lr=1e-2",
            "data.prompts_per_step=8",
            "data.eval_size=4",
            "trainer.checkpoint_every=1",
            f"trainer.output_dir={folder}",
        ]
        run(config(tiny_model_dir, *settings, "trainer.steps=2"))
        run(config(tiny_model_dir, *settings, "trainer.steps=3", "trainer.resume=true"))
        folders[name] = folder
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_lora_and_qlora_runs_resume_from_their_adapter_checkpoints(lora_runs, name):
    rows = read_metrics(lora_runs[name])
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    step_2 = load_file(lora_runs[name] / "checkpoints" / "step-000002" / "adapter_model.safetensors")
    step_3 = load_file(lora_runs[name] / "checkpoints" / "step-000003" / "adapter_model.safetensors")
    assert step_2.keys() == step_3.keys() and any(not torch.equal(step_2[k], step_3[k]) for k in step_2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_grpo_export_merges_the_adapter_into_a_model_with_the_same_logits(lora_runs, tiny_model_dir, tmp_path, name):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    result = subprocess.run([GRPO_EXPORT, str(lora_runs[name]), str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "step-000003" in result.stdout  # the run's newest checkpoint
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in key for key in merged.state_dict())
    wrapped = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_runs[name] / "checkpoints" / "step-000003"
    )
    tokens = AutoTokenizer.from_pretrained(out)(["Question: what is 3 + 4? Answer: 7"], return_tensors="pt")
    with torch.no_grad():
        # QLoRA trained against 4-bit weights; the export merges into the full-precision base,
        # the weights those approximated: compared, like the adapter, on that base.
        assert torch.allclose(merged(**tokens).logits, wrapped(**tokens).logits, atol=1e-4)


@pytest.mark.slow
def test_grpo_export_refuses_bad_input(tmp_path, lora_runs):
    for arguments, expected in (
        ([str(tmp_path / "nothing"), str(tmp_path / "out")], "does not exist"),
        ([str(tmp_path), str(tmp_path / "out")], "is neither a checkpoint"),
        ([str(lora_runs["lora"]), str(lora_runs["lora"])], "already exists and is not an empty folder"),
    ):
        result = subprocess.run([GRPO_EXPORT, *arguments], capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "grpo-export: error" in result.stderr and expected in result.stderr
