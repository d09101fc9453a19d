"""The update's log-probs through the LM head by chunks (algorithm/log_probs.py) give the numbers
of the model's own logits, never hold a [N, T, V] tensor, and fall back where they must."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_cli.algorithm import log_probs as log_probs_module
from grpo_cli.algorithm.log_probs import completion_log_probs, output_head

VOCAB, HIDDEN = 1000, 64


def small_model(tied: bool = True, dtype: torch.dtype = torch.float64, **config) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    shape = dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, tie_word_embeddings=tied, **shape, **config)
    )
    return model.to(dtype).train()


def rows(prompts: int = 2, group_size: int = 4, prompt_length: int = 7, length: int = 9):
    """Grouped prompts (the first group left-padded) and completions, two ending early."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (prompts, prompt_length), generator=generator).repeat_interleave(group_size, 0)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[:group_size, :2] = 0
    completion = torch.randint(0, VOCAB, (prompts * group_size, length), generator=generator)
    completion_mask = torch.ones_like(completion)
    completion_mask[1, 5:] = 0
    completion_mask[-2, 2:] = 0
    return prompt, prompt_mask, completion, completion_mask


def log_probs_and_grads(model, batch, group_size, through_head, temperature=0.7):
    """(log-probs, entropies, parameter gradients) of a random weighting of the log-probs and
    the entropies (the entropy bonus's gradient), positions past each completion's end zeroed
    (the head path leaves them 0)."""
    model.zero_grad(set_to_none=True)
    log_probs, entropy = completion_log_probs(model, *batch, temperature, True, group_size, through_head)
    mask = batch[3].to(log_probs.dtype)
    generator = torch.Generator().manual_seed(2)
    weights = torch.randn(log_probs.shape, generator=generator, dtype=log_probs.dtype)
    entropy_weights = torch.randn(log_probs.shape, generator=generator, dtype=log_probs.dtype)
    ((log_probs * weights + entropy * entropy_weights) * mask).sum().backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    return (log_probs * mask).detach(), (entropy * mask).detach(), grads


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("group_size", [1, 4])
def test_the_head_by_chunks_equals_the_models_own_logits(tied, group_size, monkeypatch):
    # float64, so the two paths agree to rounding; 50 rows of logits per chunk: 72 scored
    # positions span two chunks, one of them partial.
    monkeypatch.setattr(log_probs_module, "LOGIT_CHUNK_ELEMENTS", 50 * VOCAB)
    model, batch = small_model(tied), rows()
    head = log_probs_and_grads(model, batch, group_size, through_head=True)
    full = log_probs_and_grads(model, batch, group_size, through_head=False)
    assert torch.allclose(head[0], full[0], atol=1e-12) and torch.allclose(head[1], full[1], atol=1e-12)
    assert (head[0][batch[3] == 0] == 0).all()  # past the end: 0, never read
    for head_grad, full_grad in zip(head[2], full[2]):
        assert torch.allclose(head_grad, full_grad, atol=1e-12)


def test_a_lora_on_the_head_takes_the_checkpointed_chunks():
    # peft wraps lm_head in a LoRA layer (not an nn.Linear): the chunks call the module under
    # torch.utils.checkpoint; the adapter's gradients equal those of the model's own logits.
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(small_model(tied=False), LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    assert type(output_head(model)) is not torch.nn.Linear
    for parameter in model.parameters():  # lora_B starts at 0: move it so the adapter matters
        if parameter.requires_grad:
            parameter.data.normal_(0, 0.05)
    batch = rows()
    head = log_probs_and_grads(model, batch, 4, through_head=True)
    full = log_probs_and_grads(model, batch, 4, through_head=False)
    assert torch.allclose(head[0], full[0], atol=1e-12) and torch.allclose(head[1], full[1], atol=1e-12)
    trained = [(h, f) for h, f in zip(head[2], full[2]) if f is not None]
    assert len(trained) == 6  # A and B of lm_head and of the two layers' q_proj
    assert all(torch.allclose(h, f, atol=1e-12) for h, f in trained)


def test_under_bfloat16_autocast_the_two_paths_agree_to_its_rounding():
    # The head's matmuls run in bfloat16 as autocast runs the model's own; forced on any CPU.
    model, batch = small_model(dtype=torch.float32), rows()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head = log_probs_and_grads(model, batch, 4, through_head=True)
        full = log_probs_and_grads(model, batch, 4, through_head=False)
    assert head[0].dtype == torch.float32
    assert (head[0] - full[0]).abs().max() < 2e-2  # both from bf16 logits
    norm = torch.stack([(h - f).norm() / f.norm() for h, f in zip(head[2], full[2])])
    assert norm.max() < 2e-2


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op produced while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_neither_the_forward_nor_the_backward_holds_the_whole_logits(monkeypatch):
    # 8 completions x 20 tokens x V 1000 = 160,000 logits; the weight is 64,000 elements. With
    # chunks of 10 rows (10,000 logits), no tensor of the head path's forward and backward
    # reaches half the logits; the model's own logits path does.
    monkeypatch.setattr(log_probs_module, "LOGIT_CHUNK_ELEMENTS", 10 * VOCAB)
    model, batch = small_model(dtype=torch.float32), rows(length=20)
    sizes = {}
    for through_head in (True, False):
        with LargestTensor() as mode:
            log_probs, _ = completion_log_probs(model, *batch, 1.0, True, 4, through_head)
            log_probs.sum().backward()
        sizes[through_head] = mode.largest
    logits = 8 * 20 * VOCAB
    assert sizes[True] < logits // 2 <= sizes[False]


def test_models_whose_logits_are_more_than_the_head_read_their_own():
    assert output_head(small_model()) is not None
    assert output_head(small_model(final_logit_softcapping=30.0)) is None  # Gemma 2's soft-cap
    assert output_head(torch.nn.Linear(4, 4)) is None  # no decoder to hook


def test_a_batch_without_a_scored_token_gives_zeros():
    model, (prompt, prompt_mask, completion, completion_mask) = small_model(), rows()
    with torch.no_grad():
        log_probs, entropy = completion_log_probs(
            model, prompt, prompt_mask, completion, 0 * completion_mask, 1.0, True
        )
    assert log_probs.shape == entropy.shape == completion.shape and not log_probs.any() and not entropy.any()
