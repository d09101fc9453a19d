"""The update stage on the tiny model, in process: mu passes over one generation batch, the
truncated-completion mask, and every KL estimator."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.algorithm.log_probs import completion_log_probs
from grpo_cli.models import cpu_gemm
from grpo_cli.models.loading import load_models
from grpo_cli.models.transformers_api import CACHE
from grpo_cli.sampling.rollouts import completion_mask
from helpers import config, one_step


def test_single_pass_is_on_policy_and_never_clips(tiny_model_dir):
    # mu = 1: the old policy is the current one, rho = exp(logp - logp.detach()) = 1 exactly.
    stats = one_step(config(tiny_model_dir, "trainer.num_iterations=1")).stats
    assert stats.ratio_deviation_by_pass == [0.0] and stats.clip_fraction_by_pass == [0.0]


def test_gradients_are_freed_after_the_optimizer_step(tiny_model_dir):
    # Kept until the next update, a full fine-tune's gradients (one more copy of the weights)
    # would sit through the next step's sampling; memory.py plans them in the update phase.
    step = one_step(config(tiny_model_dir, "trainer.num_iterations=2"))
    assert step.changed > 0 and all(parameter.grad is None for parameter in step.models.policy.parameters())


def test_bfloat16_autocast_trains_float32_weights_with_bfloat16_forwards(tiny_model_dir):
    # model.autocast=bfloat16: the forward passes run in bfloat16 (logits come out bfloat16),
    # the weights and their AdamW update stay float32, and the step's numbers stay close to a
    # float32 step on the same completions (bfloat16 has 8 significant bits: ~1e-2 relative).
    cfg = config(tiny_model_dir, "model.autocast=bfloat16", "trainer.beta=0.04")
    models, rollout, stats, changed, total = one_step(cfg)
    assert models.autocast_dtype == torch.bfloat16 and changed == total
    assert all(parameter.dtype == torch.float32 for parameter in models.policy.parameters())
    args = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    with torch.no_grad(), models.autocast():
        mixed = completion_log_probs(models.policy, *args)[0]
        logits = models.policy(input_ids=rollout.completion_ids).logits
    full = completion_log_probs(models.policy, *args)[0]
    assert logits.dtype == torch.bfloat16 and mixed.dtype == torch.float32
    assert torch.allclose(mixed, full, atol=0.1) and not torch.equal(mixed, full)


def test_second_pass_sees_real_ratios_and_the_clip_bites(tiny_model_dir):
    # Old log-probs are computed once before pass 1, so pass 1 has rho = 1 (up to float noise);
    # a large step (lr 5e-2) then moves the policy, and with clip_eps 0.05 pass 2 must clip.
    cfg = config(
        tiny_model_dir,
        "trainer.num_iterations=2",
        "trainer.clip_eps=0.05",
        "trainer.beta=0",
        "optimizer.lr=5e-2",
        "sampler.max_new_tokens=8",
    )
    step = one_step(cfg)
    stats = step.stats
    first, second = stats.ratio_deviation_by_pass
    assert first < 1e-4 and stats.clip_fraction_by_pass[0] == 0.0
    assert second > 0.05 and stats.clip_fraction_by_pass[1] > 0.0
    assert stats.clip_fraction > 0 and step.changed > 0


@pytest.mark.parametrize("disable_dropout", [True, False])
def test_with_dropout_disabled_two_training_forwards_agree(tiny_model_dir, disable_dropout):
    # LoRA with dropout 0.5 and a non-zero adapter: if dropout stayed on, the old log-probs and
    # pass 1's would come from different random sub-networks and rho != 1 before any update.
    cfg = config(
        tiny_model_dir, "model.lora.enabled=true", "model.lora.dropout=0.5", f"model.disable_dropout={disable_dropout}"
    )
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    with torch.no_grad():
        for name, parameter in models.policy.named_parameters():
            if "lora_B" in name:  # a fresh adapter's B is 0, which would hide the dropout
                parameter.normal_(std=0.5)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    ones = torch.ones_like(ids)
    models.policy.train()
    with torch.no_grad():
        first, _ = completion_log_probs(models.policy, ids, ones, ids, ones)
        second, _ = completion_log_probs(models.policy, ids, ones, ids, ones)
    assert torch.equal(first, second) == disable_dropout


def end_completions_after(tiny_model_dir, before_eos: list[int]):
    """An edit_rollout for one_step that sets the completions by hand, whatever was sampled:
    row i is before_eos[i] random tokens then EOS (then EOS as padding, as the samplers pad), or
    random tokens only, truncated, where before_eos[i] >= max_new_tokens. The mask and truncated
    flags follow from the EOS as the samplers' do; the decoded texts stay the sampled ones
    (one_step rewards by position)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def edit(rollout):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(5, len(tokenizer), rollout.completion_ids.shape, generator=generator)  # never EOS (0)
        ids[torch.arange(ids.shape[1]) >= torch.tensor(before_eos).unsqueeze(1)] = tokenizer.eos_token_id
        rollout.completion_ids = ids
        rollout.completion_mask, rollout.truncated = completion_mask(ids, tokenizer.eos_token_id)

    return edit


def test_mask_truncated_leaves_truncated_completions_out_of_the_loss(tiny_model_dir):
    # The first group all cut off at the 4 new tokens, and two of the second (rows 4 and 6); rows
    # 5 and 7 end after 1 and 2 tokens: 2 + 3 with their EOS, of 6 x 4 + 2 + 3 = 29 in all.
    edit = end_completions_after(tiny_model_dir, [4, 4, 4, 4, 4, 1, 4, 2])
    kept = one_step(config(tiny_model_dir, "trainer.mask_truncated=false"), edit)
    masked = one_step(config(tiny_model_dir, "trainer.mask_truncated=true"), edit)
    rollout = masked.rollout
    assert rollout.truncated.tolist() == [True] * 5 + [False, True, False]
    assert kept.stats.tokens == int(rollout.completion_mask.sum()) == 29
    assert masked.stats.tokens == int(rollout.completion_mask[~rollout.truncated].sum()) == 5


def test_when_every_completion_is_truncated_and_masked_nothing_is_learned(tiny_model_dir):
    def truncate_all(rollout):
        rollout.truncated[:] = True

    cfg = config(tiny_model_dir, "trainer.mask_truncated=true", "trainer.beta=0")
    step = one_step(cfg, truncate_all)
    stats = step.stats
    # No optimizer step at all (AdamW would still apply weight decay and momentum): skipped.
    assert stats.tokens == 0 and stats.skipped_steps == 1 and step.changed == 0
    assert stats.entropy is None and stats.clip_fraction is None  # nothing measured, not "0"


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_every_kl_estimator_trains_and_reports_kl(tiny_model_dir, estimator):
    # mu = 2 so the second pass is off the reference and the KL estimate is not 0.
    cfg = config(tiny_model_dir, f"trainer.kl_estimator={estimator}", "trainer.beta=0.1", "trainer.num_iterations=2")
    models, _, stats, changed, total = one_step(cfg)
    assert models.uses_kl and changed == total
    assert stats.kl != 0.0 and stats.loss == stats.loss  # not NaN
    if estimator != "k1":  # k2 and k3 are never negative; k1 can be
        assert stats.kl > 0


def test_a_beta_schedule_that_starts_at_zero_still_loads_the_reference(tiny_model_dir):
    cfg = config(tiny_model_dir, "trainer.beta={start: 0.0, end: 0.05, warmup_steps: 10}")
    step = one_step(cfg)
    assert step.models.uses_kl and step.stats.kl == 0.0  # beta 0 at step 0, policy == reference on pass 1


def encoder_batches(model) -> tuple[list[int], object]:
    """Record the batch size of every decoder forward of `model` (returns the list, the hook)."""
    sizes: list[int] = []
    decoder = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    hook = decoder.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    return sizes, hook


def grouped_rows(tokenizer, group_size: int):
    """Two prompts of different lengths (so one is left-padded), each repeated group_size
    times, with random completions of 5 tokens, the second group's ending early."""
    encoded = tokenizer(["3 + 4 =", "12 + 30 + 7 ="], padding=True, return_tensors="pt")
    prompt_ids = encoded.input_ids.repeat_interleave(group_size, dim=0)
    prompt_mask = encoded.attention_mask.repeat_interleave(group_size, dim=0)
    generator = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(5, len(tokenizer), (prompt_ids.shape[0], 5), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[group_size:, 3:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.parametrize("lora", [False, True])
def test_one_prompt_pass_per_group_gives_the_numbers_of_one_pass_per_completion(tiny_model_dir, lora):
    # trainer.share_prompt_pass: each group's prompt runs once (batch 2, then the 8 completions
    # on its cached keys and values) instead of 8 times; log-probs, entropies and gradients equal
    # the plain pass's up to float rounding.
    models = load_models(config(tiny_model_dir, f"model.lora.enabled={lora}").model, 0.0, torch.device("cpu"))
    policy = models.policy
    policy.train()
    rows = grouped_rows(models.tokenizer, group_size=4)
    results = {}
    for group_size in (1, 4):
        sizes, hook = encoder_batches(policy)
        log_probs, entropy = completion_log_probs(policy, *rows, 0.7, True, group_size)
        hook.remove()
        (log_probs * rows[3]).sum().backward()
        grads = [p.grad.clone() for p in policy.parameters() if p.requires_grad]
        policy.zero_grad(set_to_none=True)
        results[group_size] = (sizes, log_probs.detach(), entropy, grads)
    (plain_sizes, plain, plain_entropy, plain_grads), (shared_sizes, shared, shared_entropy, shared_grads) = (
        results[1],
        results[4],
    )
    assert plain_sizes == [8] and shared_sizes == [2, 8]
    assert torch.allclose(shared, plain, atol=1e-5) and torch.allclose(shared_entropy, plain_entropy, atol=1e-5)
    for shared_grad, plain_grad in zip(shared_grads, plain_grads):  # float32 sums in another order
        assert (shared_grad - plain_grad).norm() <= 1e-5 * plain_grad.norm()


def test_the_prompt_pass_is_not_shared_when_prompts_differ_or_gradients_are_checkpointed(tiny_model_dir):
    models = load_models(config(tiny_model_dir, "model.gradient_checkpointing=true").model, 0.0, torch.device("cpu"))
    policy = models.policy
    policy.train()
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_rows(models.tokenizer, group_size=4)
    sizes, hook = encoder_batches(policy)
    with torch.no_grad():  # no gradients: the cache is kept, the prompt pass shared
        completion_log_probs(policy, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=4)
        # groups of 2 would mix two prompts in the middle group: one pass per completion
        completion_log_probs(
            policy, prompt_ids[2:], prompt_mask[2:], completion_ids[2:], completion_mask[2:], group_size=4
        )
    # gradient checkpointing drops the cache of a forward with gradients: one pass per completion
    completion_log_probs(policy, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=4)
    hook.remove()
    assert sizes == [2, 8, 6, 8]


def test_an_update_with_the_shared_prompt_pass_equals_one_without(tiny_model_dir):
    stats = {}
    for shared in (True, False):
        cfg = config(
            tiny_model_dir, f"trainer.share_prompt_pass={shared}", "trainer.beta=0.04", "trainer.micro_batch_size=4"
        )
        stats[shared] = one_step(cfg).stats
    assert stats[True].loss == pytest.approx(stats[False].loss, rel=1e-4, abs=1e-6)
    assert stats[True].grad_norm == pytest.approx(stats[False].grad_norm, rel=1e-4)
    assert stats[True].kl == pytest.approx(stats[False].kl, rel=1e-3, abs=1e-7)


def test_a_micro_batch_keeps_only_the_columns_its_rows_use():
    # Prompts left-padded to 3 columns, the first used by neither row; completions padded to 3
    # positions, the longest of these rows ending (EOS = 9) at the second.
    from grpo_cli.algorithm.update import micro_batch

    prompt_ids, prompt_mask = (
        torch.tensor([[0, 0, 5], [0, 6, 7], [4, 4, 4]]),
        torch.tensor([[0, 0, 1], [0, 1, 1], [1, 1, 1]]),
    )
    completion_ids, mask = (
        torch.tensor([[9, 0, 0], [3, 9, 0], [3, 3, 3]]),
        torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
    )
    batch = micro_batch(
        slice(0, 2), prompt_ids, prompt_mask, completion_ids, mask, mask * 0, torch.tensor([1.0, -1.0, 0.5])
    )
    assert batch.prompt_ids.tolist() == [[0, 5], [6, 7]] and batch.prompt_mask.tolist() == [[0, 1], [1, 1]]
    assert batch.completion_ids.tolist() == [[9, 0], [3, 9]] and batch.mask.tolist() == [[1, 0], [1, 1]]
    assert batch.loss_mask.tolist() == [[0, 0], [0, 0]] and batch.advantages.tolist() == [1.0, -1.0]
    whole = micro_batch(slice(0, 3), prompt_ids, prompt_mask, completion_ids, mask, mask, torch.zeros(3))
    assert whole.prompt_ids.shape == (3, 3) and whole.completion_ids.shape == (3, 3)  # nothing to cut


def test_micro_batches_of_different_widths_add_up_to_the_whole_step(tiny_model_dir):
    # Each micro-batch is cut to its own longest completion (and its prompts' padding); the loss,
    # KL, entropy and gradient of the step are those of the step in one piece. Completions of
    # 1, 3 | 8, 2 | 5, 4 | 2, 6 tokens (the 8 truncated, the others with their EOS) make
    # micro-batches of 2 rows 3, 8, 5 and 6 positions wide.
    edit = end_completions_after(tiny_model_dir, [0, 2, 8, 1, 4, 3, 1, 5])
    stats = {}
    for micro in (0, 2):
        cfg = config(
            tiny_model_dir,
            f"trainer.micro_batch_size={micro}",
            "trainer.beta=0.04",
            "sampler.max_new_tokens=8",
            "trainer.share_prompt_pass=false",
        )
        step = one_step(cfg, edit)
        rollout, stats[micro] = step.rollout, step.stats
    assert [int(rows.sum(dim=1).max()) for rows in rollout.completion_mask.split(2)] == [3, 8, 5, 6]
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert getattr(stats[2], key) == pytest.approx(getattr(stats[0], key), rel=1e-4, abs=1e-6), key


def test_a_model_without_a_repeatable_cache_takes_one_pass_per_completion(tiny_model_dir):
    # A model whose output carries no cache of keys and values (another kind of state, say)
    # cannot share its prompt pass: the log-probs come from the plain pass instead of failing.
    models = load_models(config(tiny_model_dir).model, 0.0, torch.device("cpu"))

    class NoCache(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            output = self.inner(**kwargs)
            setattr(output, CACHE, None)
            return output

    rows = grouped_rows(models.tokenizer, group_size=4)
    with torch.no_grad():
        plain, _ = completion_log_probs(models.policy, *rows, through_head=False)
        wrapped, _ = completion_log_probs(NoCache(models.policy), *rows, group_size=4)
    assert torch.equal(wrapped, plain)  # a wrapper without get_decoder: the model's own logits


def test_the_prompt_pass_is_shared_by_whole_groups_in_one_process():
    from grpo_cli.algorithm.update import shared_prompt_pass_group

    assert shared_prompt_pass_group(True, 16, 8, False) == 8  # two whole groups per micro-batch
    assert shared_prompt_pass_group(True, 4, 8, False) == 1  # half a group
    assert shared_prompt_pass_group(True, 16, 8, True) == 1  # torchrun: one forward per backward
    assert shared_prompt_pass_group(False, 16, 8, False) == 1  # trainer.share_prompt_pass=false


def test_a_token_budget_packs_whole_groups_and_splits_a_group_over_it():
    from grpo_cli.algorithm.update import token_budget_rows

    def cuts(completions, budget, group_size=2):
        prompts = torch.full((len(completions),), 10)
        rows = token_budget_rows(prompts, torch.tensor(completions), group_size, budget)
        return [(members.tolist(), group) for members, group in rows]

    # group (0, 1) costs 10 + 2 x 50 = 110 tokens, group (2, 3) 10 + 2 x 40 = 90, both 220
    assert cuts([50, 5, 40, 5], 1000) == [([0, 1, 2, 3], 2)]
    assert cuts([50, 5, 40, 5], 130) == [([0, 1], 2), ([2, 3], 2)]
    # group (0, 1) over 100: its rows run apart (2 x (10 + 50) = 120 together), one prompt pass each
    assert cuts([50, 5, 40, 5], 100) == [([2, 3], 2), ([0], 1), ([1], 1)]
    # longest first: the two short groups share a micro-batch (2 x 10 + 4 x 8 = 52 tokens)
    assert cuts([8, 2, 60, 60, 3, 8], 140) == [([2, 3], 2), ([0, 1, 4, 5], 2)]
    assert cuts([200, 5], 100) == [([0], 1), ([1], 1)]  # a completion over the budget runs alone
    # no shared pass, each row its own prompt: rows 0 and 2 take 2 x 10 + 2 x 50 = 120 tokens
    assert cuts([50, 5, 40, 5], 130, group_size=1) == [([0, 2], 1), ([1, 3], 1)]


def test_micro_batches_by_a_token_budget_give_the_whole_steps_gradient(tiny_model_dir, monkeypatch):
    # Completions of 1, 3, 8, 2 | 5, 4, 2, 6 tokens (with EOS; the 8 truncated): a budget of the
    # prompt + 4 x 6 tokens takes the second group whole, with its one prompt pass, and splits the
    # first into its rows. The loss, KL, entropy and gradient are those of the step in one piece.
    import grpo_cli.algorithm.update as update

    passes = []

    def counted(model, prompt_ids, prompt_mask, completion_ids, mask, *rest):
        passes.append((prompt_ids.shape[0], completion_ids.shape[1], rest[-1]))  # rows, width, prompt_pass_group
        return completion_log_probs(model, prompt_ids, prompt_mask, completion_ids, mask, *rest)

    monkeypatch.setattr(update, "completion_log_probs", counted)
    edit = end_completions_after(tiny_model_dir, [0, 2, 8, 1, 4, 3, 1, 5])
    settings = ("trainer.beta=0.04", "sampler.max_new_tokens=8")
    whole = one_step(config(tiny_model_dir, *settings), edit)
    prompt = int(whole.rollout.prompt_mask.sum(dim=1).max())
    passes.clear()
    budget = prompt + 4 * 6
    by_tokens = one_step(config(tiny_model_dir, *settings, f"trainer.micro_batch_tokens={budget}"), edit)
    policy_passes = passes[len(passes) // 2 :]  # the reference's first, then the policy's
    assert policy_passes[0] == (4, 6, 4)  # the second group, one prompt pass
    assert len(policy_passes) > 1 and all(group == 1 for *_, group in policy_passes[1:])
    assert sum(rows for rows, *_ in policy_passes) == 8
    assert all(rows * (prompt + width) <= budget or rows == 1 for rows, width, _ in policy_passes[1:])
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert getattr(by_tokens.stats, key) == pytest.approx(getattr(whole.stats, key), rel=1e-4, abs=1e-6), key


def test_the_entropy_controls_reach_the_update(tiny_model_dir):
    # top_entropy_quantile keeps about that fraction of the loss tokens (logged), entropy_coef
    # moves the gradient; with mu = 2 the entropy is computed in every pass, not only the first.
    settings = ("trainer.num_iterations=2", "trainer.beta=0.04")
    plain = one_step(config(tiny_model_dir, *settings)).stats
    masked = one_step(config(tiny_model_dir, *settings, "trainer.top_entropy_quantile=0.25")).stats
    bonus = one_step(config(tiny_model_dir, *settings, "trainer.entropy_coef=0.5")).stats
    assert plain.entropy_kept_fraction is None
    assert masked.entropy_kept_fraction == pytest.approx(0.25, abs=0.05)
    assert masked.grad_norm != pytest.approx(plain.grad_norm, rel=1e-3)
    assert bonus.grad_norm != pytest.approx(plain.grad_norm, rel=1e-3)
    assert bonus.entropy == pytest.approx(plain.entropy, rel=1e-6)  # the first pass's metric: before any step


@pytest.mark.skipif(not cpu_gemm.onednn_gemm_available(), reason="this torch has no oneDNN linear ops")
def test_an_update_through_onednn_equals_one_through_torchs_gemm(tiny_model_dir, monkeypatch):
    # On a CPU other than Intel's the update's float32 linears (the reference pass, the policy's
    # forward and backward, the head's chunks) multiply through oneDNN; forced either way here,
    # the step's numbers agree to float32 rounding, with mu = 2 so the ratio and clip see it.
    stats, products = {}, []
    onednn_linear = cpu_gemm.onednn_linear
    monkeypatch.setattr(cpu_gemm, "onednn_linear", lambda *args: products.append(1) or onednn_linear(*args))
    for intel in (False, True):
        monkeypatch.setattr(cpu_gemm, "intel_cpu", lambda intel=intel: intel)
        cfg = config(tiny_model_dir, "trainer.beta=0.04", "trainer.num_iterations=2", "sampler.backend=hf")
        stats[intel] = one_step(cfg).stats
        if not intel:
            assert products, "no product went through oneDNN"
            products.clear()
    assert not products  # Intel's CPU: torch's GEMM throughout
    assert stats[False].loss == pytest.approx(stats[True].loss, rel=1e-4, abs=1e-6)
    assert stats[False].grad_norm == pytest.approx(stats[True].grad_norm, rel=1e-4)
    assert stats[False].kl == pytest.approx(stats[True].kl, rel=1e-3, abs=1e-7)
