"""The objectives TRL 1.16 also implements equal its `_compute_loss` on the same tensors: the
same log-probs (one leaf tensor both sides differentiate), old and reference log-probs,
advantages and mask (the random step of test_objective.py, where the policy has moved from
pi_old, so the clips and gates are reached). TRL's model forward is replaced by that leaf, so
what is compared is the loss formula and its gradient, nothing of the model.

Like for like (our keys -> TRL's GRPOConfig, beside scripts/trl_baseline.py's settings: k3 KL
with beta 0.04, use_bias_correction_kl=False):
- importance_sampling_level=sequence, loss=clip, sequence_mean -> importance_sampling_level=
  "sequence", loss_type="grpo" (GSPO as its docs set it up)
- loss=cispo, cispo_ratio_max=X, cispo_ratio_min=null, token_mean -> loss_type="cispo",
  epsilon_high=X (TRL's CISPO has no lower bound and always divides by the step's tokens)
- loss=sapo, sapo_temperature_pos/neg, sequence_mean -> loss_type="sapo", the same temperatures
- delta=X -> delta=X, loss_type="grpo"
- entropy_coef=c, token_mean -> entropy_coef=c, loss_type="bnpo" (TRL averages the bonus over
  the tokens it acts on; with top_entropy_quantile too, TRL's bonus divides by the kept tokens,
  ours by all loss tokens, as the loss: not compared)
- top_entropy_quantile=q -> top_entropy_quantile=q (TRL takes the quantile per _compute_loss
  call, ours per micro-batch: the same here, one call)
trainer.dual_clip has no TRL counterpart (verl's clip_ratio_c): its formula test is in
test_objectives.py only.
"""

from __future__ import annotations

import pytest
import torch

from helpers import load_script
from test_objective import BETA, F64, MAX_NEW_TOKENS
from test_objectives import ours_on_the_random_step

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

# ours (test_objectives.ours_settings' keys), our aggregation, TRL's GRPOConfig fields
CASES = {
    "clip (the harness itself)": (dict(eps_low=0.2, eps_high=0.2), "sequence_mean", dict(loss_type="grpo")),
    "gspo": (
        dict(level="sequence", eps_low=0.02, eps_high=0.03),
        "sequence_mean",
        dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.02, epsilon_high=0.03),
    ),
    "cispo": (
        dict(loss="cispo", ratio_min=None, ratio_max=1.3),
        "token_mean",
        dict(loss_type="cispo", epsilon_high=1.3),
    ),
    "sapo": (
        dict(loss="sapo", tau_pos=1.0, tau_neg=1.05),
        "sequence_mean",
        dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
    ),
    "sapo, steep and at the sequence level": (
        dict(loss="sapo", level="sequence", tau_pos=3.0, tau_neg=8.0),
        "sequence_mean",
        dict(
            loss_type="sapo", importance_sampling_level="sequence", sapo_temperature_pos=3.0, sapo_temperature_neg=8.0
        ),
    ),
    "entropy bonus": (
        dict(eps_low=0.2, eps_high=0.2, entropy_coef=0.01),
        "token_mean",
        dict(loss_type="bnpo", entropy_coef=0.01),
    ),
    "top 20% by entropy": (
        dict(eps_low=0.2, eps_high=0.2, top_q=0.2),
        "sequence_mean",
        dict(loss_type="grpo", top_entropy_quantile=0.2),
    ),
    "delta (INTELLECT-2)": (
        dict(eps_low=0.2, eps_high=0.2, delta=1.5),
        "sequence_mean",
        dict(loss_type="grpo", delta=1.5),
    ),
}


@pytest.fixture(scope="module")
def baseline():
    pytest.importorskip("trl")
    return load_script("trl_baseline")


def trl_loss_and_gradient(trainer, log_probs, old, ref, advantages, mask, entropy):
    """TRL's _compute_loss on these tensors, its forward replaced by `log_probs` and `entropy`:
    (loss, d loss / d log_probs, d loss / d entropy)."""
    leaf, entropy_leaf = log_probs.clone().requires_grad_(), entropy.clone().requires_grad_()
    count, length = mask.shape

    def given_log_probs(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **kwargs):
        return leaf, entropy_leaf, None

    trainer._get_per_token_logps_and_entropies = given_log_probs
    trainer.current_gradient_accumulation_steps = 1  # set by transformers' loop for each optimizer step
    trainer.model.train()  # "train": TRL divides by the accumulation steps (1)
    inputs = {
        "prompt_ids": torch.zeros(count, 1, dtype=torch.long),
        "prompt_mask": torch.ones(count, 1, dtype=torch.long),
        "completion_ids": torch.zeros(count, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),  # the generation batch's loss tokens (one process)
    }
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    entropy_grad = entropy_leaf.grad if entropy_leaf.grad is not None else torch.zeros_like(entropy)
    return loss.detach(), leaf.grad, entropy_grad


@pytest.mark.parametrize("case", list(CASES))
def test_objective_equals_trls_compute_loss_on_the_same_tensors(baseline, tiny_model_dir, tmp_path, case):
    ours_keys, aggregation, trl_fields = CASES[case]
    step, ours, _, ours_input = ours_on_the_random_step(ours_keys, aggregation)

    trainer = baseline.make_trl_trainer(
        str(tiny_model_dir),
        ["1+1=", "2+2="],
        lambda prompts, completions, **kwargs: [0.0] * len(prompts),
        group_size=2,
        prompts_per_step=2,
        max_new_tokens=MAX_NEW_TOKENS,
        beta=BETA,
        output_dir=str(tmp_path),
        config_overrides=trl_fields,
    )
    theirs, their_grad, their_entropy_grad = trl_loss_and_gradient(
        trainer, step.log_probs, step.old, step.ref, step.advantages, step.mask, step.entropy
    )
    print(f"{case}: loss ours {ours.item():.12g} TRL {theirs.item():.12g}")
    # float64 on both sides; TRL builds SAPO's temperatures as float32 tensors (torch.where of two
    # Python floats), which rounds 1.05 by 5e-8: 1e-9 would fail on that alone, a formula
    # difference moves the loss by 1e-3 or more (test_objectives.py: every case differs).
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-7, rel=1e-6)
    assert torch.allclose(ours_input.grad, their_grad.to(F64), atol=1e-7, rtol=1e-6)
    assert their_grad.abs().sum() > 0
    assert torch.allclose(step.entropy_grad, their_entropy_grad.to(F64), atol=1e-9)
