"""The TRL side of the side-by-side benchmark: a `trl.GRPOTrainer` (TRL 1.16) set up like for like
with grpo_cli's trainer, a per-step wall-clock timer, and TRL's loss and gradient on given tensors.

    from trl_baseline import make_trl_trainer, time_trl_steps, trl_loss_and_grad_norm

Importable on purpose (no hydra, no argparse): the benchmark driver and tests/test_trl_parity.py
load it by path. What "like for like" means, setting by setting (grpo_cli's key in brackets):

- one generation batch of prompts_per_step x group_size completions per optimizer step
  [data.prompts_per_step x sampler.group_size], trained on once [trainer.num_iterations=1]:
  steps_per_generation = gradient_accumulation_steps, so TRL generates exactly when an optimizer
  step starts and skips its extra "old policy" forward (old_per_token_logps stays None);
- float32 weights on the CPU [model.dtype=float32, trainer.device=cpu]; with bf16, TRL's own
  mixed precision (bf16=True: autocast over the float32 weights) [model.autocast=bfloat16];
- no gradient checkpointing [model.gradient_checkpointing=false] (TRL's default is on);
- sampling: temperature as given, top_p=1, top_k=0 (off), no min_p, no repetition penalty
  [sampler.*], and every completion max_new_tokens long (min_new_tokens = max_new_tokens, merged
  into TRL's GenerationConfig by generation_kwargs), so both sides generate and train on the
  same number of tokens whatever the model says (forced_length=False: both stop at EOS);
- log-probs of softmax(logits / temperature) on both sides (TRL's fused LM head divides by the
  same temperature); the reference is a second frozen copy of the model [full fine-tune, beta>0];
- loss: TRL's "grpo" = [trainer.loss_aggregation=sequence_mean], "dapo" = [token_mean],
  "dr_grpo" = [constant] (TRL divides by max_completion_length = max_new_tokens, grpo_cli by the
  completion width, also max_new_tokens); k3 KL without TRL's default importance weighting
  (use_bias_correction_kl=False = [trainer.kl_importance_correction=false]); clip 0.2 both ways;
- advantages: group mean / sample std + 1e-4 [trainer.advantage=grpo, std_eps=1e-4];
- optimizer: torch.optim.AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), constant learning
  rate, no warmup, global-norm clipping [optimizer.*] (TRL's defaults are the fused AdamW and a
  linear decay);
- no dropout, no reporting to external services, no checkpoints, no evaluation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

LOSS_TYPES = {"sequence_mean": "grpo", "token_mean": "dapo", "constant": "dr_grpo"}  # grpo_cli -> TRL

RewardFn = Callable[..., list[float]]  # TRL's signature: (prompts, completions, **kwargs) -> scores


def checkpointing_field() -> str:
    """GRPOConfig's name for gradient checkpointing (TrainingArguments renamed it in transformers 5.2x)."""
    fields = GRPOConfig.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def make_trl_trainer(
    model_dir: str,
    prompts: list[str] | list[list[dict[str, str]]],
    reward_fn: RewardFn,
    *,
    group_size: int = 8,
    prompts_per_step: int = 8,
    max_new_tokens: int = 64,
    forced_length: bool = True,
    beta: float = 0.04,
    loss_type: str = "grpo",
    temperature: float = 1.0,
    learning_rate: float = 1e-5,
    max_grad_norm: float = 1.0,
    bf16: bool = False,
    seed: int = 0,
    output_dir: str,
    max_steps: int = 1,
    micro_batch_size: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> GRPOTrainer:
    """A TRL GRPOTrainer configured like grpo_cli's trainer (see the module docstring).

    `prompts`: at least `prompts_per_step` of them, plain text (no chat template) or
    conversations ([{"role": "user", "content": ...}], through the tokenizer's chat template).
    `forced_length`: every completion max_new_tokens long (min_new_tokens); False: up to EOS.
    `micro_batch_size`: completions per forward/backward (grpo_cli's trainer.micro_batch_size);
    0 = the whole generation batch at once. Either way there is one optimizer step per
    generation batch. `config_overrides`: GRPOConfig fields set over the ones above (an
    objective's: loss_type's own, importance_sampling_level, delta, entropy_coef, ...).
    """
    batch = prompts_per_step * group_size
    micro = micro_batch_size or batch
    if batch % micro != 0:
        raise ValueError(f"micro_batch_size={micro_batch_size} must divide {batch} completions per step")
    if len(prompts) < prompts_per_step:
        # TRL's RepeatSampler drops an incomplete batch of prompts: fewer would never train.
        raise ValueError(f"need at least prompts_per_step={prompts_per_step} prompts, got {len(prompts)}")
    accumulation = batch // micro
    fields = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=bf16,
        fp16=False,
        # TRL loads the model itself from the folder: float32 weights; bf16=True adds autocast over
        # them, as grpo_cli's model.autocast=bfloat16 does.
        model_init_kwargs={"dtype": "float32"},
        # TRL's default is True; grpo_cli's is off. Under the name this transformers defines (5.24:
        # activation_checkpointing, where the old name warns; 5.19: gradient_checkpointing).
        **{checkpointing_field(): False},
        disable_dropout=True,
        # One optimizer step per generation batch: the batch is split into `accumulation`
        # micro-batches and generated once (steps_per_generation = gradient_accumulation_steps,
        # which also makes TRL skip the old-policy forward pass).
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=group_size,
        num_iterations=1,
        max_completion_length=max_new_tokens,
        # Merged with dict.update into the GenerationConfig TRL builds (max_new_tokens, do_sample,
        # temperature, top_p, top_k, min_p, ...): EOS is suppressed until max_new_tokens
        # (forced_length; else every completion stops at its EOS).
        generation_kwargs={"min_new_tokens": max_new_tokens} if forced_length else {},
        temperature=temperature,
        top_p=1.0,
        top_k=0,  # 0 = top-k off in TRL (None would leave the model's generation default)
        min_p=None,
        repetition_penalty=1.0,
        beta=beta,
        use_bias_correction_kl=False,  # TRL's default multiplies the KL by the ratio; grpo_cli's does not
        epsilon=0.2,
        epsilon_high=0.2,
        scale_rewards="group",
        loss_type=loss_type,
        mask_truncated_completions=False,
        learning_rate=learning_rate,
        max_grad_norm=max_grad_norm,
        optim="adamw_torch",  # torch.optim.AdamW, as grpo_cli (TRL's default is the fused variant)
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_steps=max_steps,
        seed=seed,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,  # logs after each step, outside the timed bracket (see StepTimer)
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        pad_to_multiple_of=None,
    )
    args = GRPOConfig(**{**fields, **(config_overrides or {})})
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    dataset = Dataset.from_list([{"prompt": text} for text in prompts])
    return GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward_fn,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )


class StepTimer(TrainerCallback):
    """Wall seconds of each optimizer step, from on_step_begin to on_step_end.

    In transformers' training loop (5.x) on_step_begin fires before the first micro-batch's
    `training_step`, and GRPOTrainer generates inside `training_step` -> `_prepare_inputs` ->
    `_generate_and_score_completions` (sampling, rewards, advantages, the reference forward);
    on_step_end fires after gradient clipping, `optimizer.step()`, the scheduler and zero_grad.
    So the bracket holds the whole GRPO step; only fetching the prompt rows from the dataloader
    (before on_step_begin) and logging (after on_step_end) are outside. `intervals` keeps the
    perf_counter stamps, so a test can check that generation happened inside them.
    """

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self._begin: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._begin is not None:
            self.intervals.append((self._begin, time.perf_counter()))
            self._begin = None

    @property
    def seconds(self) -> list[float]:
        return [end - begin for begin, end in self.intervals]


def time_trl_steps(trainer: GRPOTrainer, steps: int, timer: StepTimer | None = None) -> list[float]:
    """Run `trainer.train()` for `steps` optimizer steps; wall seconds of each (generation included).

    Pass a `timer` to keep its interval stamps; by default a fresh one is used and removed after.
    """
    timer = timer or StepTimer()
    trainer.args.max_steps = steps
    trainer.add_callback(timer)
    try:
        trainer.train()
    finally:
        trainer.remove_callback(timer)
    return timer.seconds


def trl_reference_log_probs(
    trainer: GRPOTrainer, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
) -> torch.Tensor:
    """Reference per-token log-probs [N, logits_to_keep], by TRL's own path: the frozen `ref_model`
    (full fine-tune), or the policy with its adapter off (PEFT), in chunks of the per-device batch
    size, without gradient, as `_generate_and_score_completions` computes them."""
    batch_size = trainer.args.per_device_train_batch_size
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        if trainer.ref_model is not None:
            log_probs, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
            )
        else:
            model = trainer.accelerator.unwrap_model(trainer.model)
            with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                log_probs, _, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
    return log_probs


def trl_loss_and_grad_norm(
    trainer: GRPOTrainer,
    prompt_ids: torch.Tensor,  # [N, P] left-padded
    prompt_mask: torch.Tensor,  # [N, P]
    completion_ids: torch.Tensor,  # [N, T] padded after EOS
    completion_mask: torch.Tensor,  # [N, T] 1 up to and including the first EOS
    advantages: torch.Tensor,  # [N]
) -> tuple[float, float]:
    """TRL's loss and gradient norm for one generation batch of given tensors, without an
    optimizer step: (loss of the step, total L2 norm of the gradient over trainable parameters).

    Builds what `_generate_and_score_completions` hands on (TRL 1.16): prompt/completion ids and
    masks, advantages, `num_items_in_batch` (loss tokens of the whole generation batch, the DAPO
    denominator), `ref_per_token_logps` when beta != 0, and no `old_per_token_logps` (None when
    num_iterations = 1 and generation is aligned with the optimizer step: TRL then uses the
    detached current log-probs). Then it does what `training_step` does for each of the
    gradient_accumulation_steps micro-batches: `compute_loss` (which already divides by the
    accumulation steps, `loss_is_scaled_for_ga`) and backward. The rows are not shuffled (TRL
    shuffles before splitting; the sum over the step does not depend on the order). The
    gradients are cleared afterwards, so the model is unchanged.
    """
    device = trainer.accelerator.device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
    advantages = advantages.to(device=device, dtype=torch.float32)
    model = trainer.model
    model.train()  # compute_loss reads the mode: "train" divides by the accumulation steps

    inputs: dict[str, Any] = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),  # one process: gather is the identity
    }
    if trainer.beta != 0.0:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        inputs["ref_per_token_logps"] = trl_reference_log_probs(
            trainer, input_ids, attention_mask, completion_ids.size(1)
        )

    chunks = trainer.args.steps_per_generation
    size = completion_ids.size(0) // chunks
    # Set by transformers' training loop for each optimizer step; not there before train().
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    model.zero_grad(set_to_none=True)
    total = 0.0
    for index in range(chunks):
        rows = slice(index * size, (index + 1) * size)
        chunk = {key: value if value.ndim == 0 else value[rows] for key, value in inputs.items()}
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, chunk)
        trainer.accelerator.backward(loss)
        total += loss.item()
    parameters = [p for p in model.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(parameters, math.inf))  # inf: measure, never clip
    model.zero_grad(set_to_none=True)
    for values in trainer._metrics.values():  # compute_loss logged kl/entropy/clip metrics: not a step
        values.clear()
    return total, norm
