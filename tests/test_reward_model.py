"""The reward-model reward: a tiny 2-layer Qwen2 sequence classifier built here from a config,
with the tiny policy's local tokenizer, saved and loaded through the real from_pretrained path."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch

from grpo_cli.config import ConfigError
from grpo_cli.rewards.reward_model import reward_model
from helpers import act_as_an_avx512_bf16_cpu

# The module itself (`grpo_cli.rewards.reward_model` may be the function once rewards/__init__
# exports it): its cache is what the load-once test looks at.
rm_module = importlib.import_module("grpo_cli.rewards.reward_model")

PROMPTS = ["What is 2 + 3?"] * 3 + ["What is 40 + 2?"] * 3
# Different lengths on purpose: a batch pads all but the longest.
COMPLETIONS = [" 5", " 6", " the answer is 5", " 42", " 12345678", ""]


def _tiny_classifier(tokenizer, num_labels: int):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # random init gives scores ~0.1 apart; spread them so closeness means something
        model.score.weight.mul_(10.0)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def classifier(tokenizer):
    """The in-memory twin of the saved reward model: scores computed by hand come from it."""
    return _tiny_classifier(tokenizer, num_labels=1)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tokenizer, classifier) -> str:
    folder = tmp_path_factory.mktemp("reward-model")
    classifier.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _by_hand(classifier, tokenizer, text: str) -> float:
    """score.weight . (final hidden state at the last token), the text alone, no padding."""
    input_ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        hidden = classifier.model(input_ids=input_ids).last_hidden_state[0, -1]  # [hidden]
        return float(classifier.score.weight[0] @ hidden)


def test_scores_a_batch_as_the_head_at_the_last_token(rm_dir, classifier, tokenizer):
    scores = reward_model(PROMPTS, COMPLETIONS, path=rm_dir, batch_size=4)

    assert len(scores) == len(COMPLETIONS)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores)
    # The tiny tokenizer has no chat template: the text is prompt + completion.
    expected = [_by_hand(classifier, tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert len({round(s, 4) for s in scores}) == len(scores)  # different completions, different scores


@pytest.fixture(scope="module")
def padding_variants(tmp_path_factory, tokenizer, classifier, rm_dir) -> dict[str, str]:
    """Folders where padding mistakes would show:
    - gpt2: absolute position embeddings, so left padding would shift every position;
    - pad-id-mismatch: config.pad_token_id is not the tokenizer's pad, so the head would be read
      at a padding token unless the padding is written with the config's id."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(0)
    gpt2 = GPT2ForSequenceClassification(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
    )
    mismatch = _tiny_classifier(tokenizer, num_labels=1)
    mismatch.config.pad_token_id = len(tokenizer) - 1  # a real token id, never produced by these texts
    folders = {"qwen2": rm_dir}
    for name, model in {"gpt2": gpt2, "pad-id-mismatch": mismatch}.items():
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[name] = str(folder)
    return folders


@pytest.mark.parametrize("variant", ["qwen2", "gpt2", "pad-id-mismatch"])
def test_batching_and_padding_do_not_change_scores(padding_variants, variant):
    path = padding_variants[variant]
    one_by_one = [reward_model([p], [c], path=path, batch_size=1)[0] for p, c in zip(PROMPTS, COMPLETIONS)]
    for batch_size in (2, 4, 8):
        batched = reward_model(PROMPTS, COMPLETIONS, path=path, batch_size=batch_size)
        assert batched == pytest.approx(one_by_one, abs=1e-4)
    # Deterministic: the same call twice gives the same numbers.
    assert reward_model(PROMPTS, COMPLETIONS, path=path) == reward_model(PROMPTS, COMPLETIONS, path=path)


def test_truncation_keeps_the_end(rm_dir, classifier, tokenizer):
    # Digits are one token each, so " 12345" ends in the same 4 tokens "2345" after any prompt:
    # truncated from the left to 4 tokens, both texts are the same 4 tokens.
    long_prompts = ["What is 2 + 3?", "Add 9 and 8, then 7:"]
    scores = reward_model(long_prompts, [" 12345"] * 2, path=rm_dir, max_length=4)
    kept = tokenizer.decode(tokenizer(long_prompts[0] + " 12345")["input_ids"][-4:])
    assert kept == "2345"
    assert scores == pytest.approx([_by_hand(classifier, tokenizer, kept)] * 2, abs=1e-4)
    untruncated = reward_model(long_prompts, [" 12345"] * 2, path=rm_dir)
    assert untruncated[0] != pytest.approx(untruncated[1], abs=1e-4)


def test_chat_template_formats_user_and_assistant_turns(tmp_path, rm_dir, classifier, tokenizer):
    from transformers import AutoTokenizer

    chat_tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    chat_tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    classifier.save_pretrained(tmp_path)
    chat_tokenizer.save_pretrained(tmp_path)

    scores = reward_model(PROMPTS[:2], COMPLETIONS[:2], path=str(tmp_path))
    # The template renders "[user]<prompt>[assistant]<completion>"; the plain model reads that text as is.
    rendered = reward_model([f"[user]{p}[assistant]" for p in PROMPTS[:2]], COMPLETIONS[:2], path=rm_dir)
    assert scores == pytest.approx(rendered, abs=1e-4)
    assert scores != pytest.approx(reward_model(PROMPTS[:2], COMPLETIONS[:2], path=rm_dir), abs=1e-4)


def test_two_labels_score_the_log_odds_of_label_1(tmp_path, rm_dir, classifier, tokenizer):
    # Head rows (-w, +w), w the one-label head: logit[1] - logit[0] = 2 * (w . h), twice the
    # one-label score; logit[1] alone would give 1x, a softmax probability something in (0, 1).
    two_labels = _tiny_classifier(tokenizer, num_labels=2)
    two_labels.model.load_state_dict(classifier.model.state_dict())
    with torch.no_grad():
        weight = classifier.score.weight[0]
        two_labels.score.weight.copy_(torch.stack([-weight, weight]))
    two_labels.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    one_label_scores = reward_model(PROMPTS, COMPLETIONS, path=rm_dir)
    scores = reward_model(PROMPTS, COMPLETIONS, path=str(tmp_path))
    assert scores == pytest.approx([2 * s for s in one_label_scores], abs=1e-4)


def test_model_is_loaded_once(monkeypatch, rm_dir):
    from transformers import AutoModelForSequenceClassification

    monkeypatch.setattr(rm_module, "_LOADED", {})
    loads = []
    original = AutoModelForSequenceClassification.from_pretrained

    def counting(*args, **kwargs):
        loads.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", counting)
    first = reward_model(PROMPTS, COMPLETIONS, path=rm_dir)
    cached = next(iter(rm_module._LOADED.values())).model
    # On this CPU machine "auto" resolves to cpu and float32: the same cache entry.
    second = reward_model(PROMPTS, COMPLETIONS, path=rm_dir, device="cpu", dtype="float32")
    assert loads == [rm_dir]
    assert len(rm_module._LOADED) == 1 and next(iter(rm_module._LOADED.values())).model is cached
    assert first == second
    assert not any(p.requires_grad for p in cached.parameters()) and not cached.training


def test_works_as_a_configured_reward_function(rm_dir):
    import grpo_cli.rewards as rewards
    from grpo_cli.rewards.api import build_reward_functions

    # `grpo_cli.rewards.reward_model` is the function once rewards/__init__.py exports it.
    exported = callable(getattr(rewards, "reward_model", None))
    target = "grpo_cli.rewards.reward_model" + ("" if exported else ".reward_model")
    [function] = build_reward_functions([{"_target_": target, "weight": 1.0, "path": rm_dir, "batch_size": 4}])
    assert function.name == "reward_model" and function.accepts_any_column  # takes every column
    values = function.fn(PROMPTS, COMPLETIONS, answer=["5"] * len(PROMPTS))
    assert values == pytest.approx(reward_model(PROMPTS, COMPLETIONS, path=rm_dir), abs=1e-6)


@pytest.mark.parametrize("quantization", ["8bit", "4bit"])
def test_quantized_scores_are_close_to_full_precision(rm_dir, quantization):
    # bitsandbytes (a dependency) runs 8bit and 4bit on every x86 CPU: a failure here is a failure.
    scores = reward_model(PROMPTS, COMPLETIONS, path=rm_dir, device="cpu", quantization=quantization)
    full = reward_model(PROMPTS, COMPLETIONS, path=rm_dir, device="cpu")
    assert all(math.isfinite(s) for s in scores)
    # A 64-wide 2-layer model: int8 / nf4 rounding moves each score a little, not the ranking.
    # Measured here (bitsandbytes 0.50, CPU): scores spread ~5.7; the largest change is ~0.016
    # with 8bit (0.3% of the spread) and ~0.17 with 4bit nf4 (3%); correlation > 0.999 for both.
    # The bounds leave ~3x (8bit) and ~2x (4bit) room for other CPUs' kernels.
    spread = max(full) - min(full)
    tolerance = {"8bit": 0.01, "4bit": 0.06}[quantization] * spread
    assert scores == pytest.approx(full, abs=tolerance)
    correlation = torch.corrcoef(torch.tensor([scores, full]))[0, 1]
    assert correlation > 0.99
    model = rm_module.load_reward_model(rm_dir, "cpu", quantization).model
    assert type(model.model.layers[0].mlp.down_proj).__module__.startswith("bitsandbytes")


def test_4bit_scores_are_the_same_whatever_bitsandbytes_detects(rm_dir, monkeypatch):
    # On an AVX512-BF16 CPU bitsandbytes would repack the layers for its bfloat16 kernel at the
    # first scoring pass (tests/test_cpu_paths.py): the scores would depend on the CPU.
    from bitsandbytes.nn import Linear4bit

    monkeypatch.setattr(rm_module, "_LOADED", {})  # bitsandbytes decides when the layers are made
    plain = reward_model(PROMPTS, COMPLETIONS, path=rm_dir, device="cpu", quantization="4bit")
    monkeypatch.setattr(rm_module, "_LOADED", {})
    act_as_an_avx512_bf16_cpu(monkeypatch)
    assert reward_model(PROMPTS, COMPLETIONS, path=rm_dir, device="cpu", quantization="4bit") == plain
    model = rm_module.load_reward_model(rm_dir, "cpu", "4bit").model
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert layers and not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)


def test_missing_folder_names_the_path(tmp_path):
    missing = tmp_path / "no-such-reward-model"
    with pytest.raises(ConfigError, match=f"path={missing}.*no such local folder"):
        reward_model(["q"], ["a"], path=str(missing))


def test_folder_without_config_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match=f"path={tmp_path}: the folder has no config.json"):
        reward_model(["q"], ["a"], path=str(tmp_path))


def test_causal_lm_folder_is_refused(tiny_model_dir):
    # Loading it would give Qwen2ForSequenceClassification a randomly initialized score head.
    with pytest.raises(ConfigError, match="Qwen2ForCausalLM, not a \\*ForSequenceClassification"):
        reward_model(["q"], ["a"], path=str(tiny_model_dir))


def test_unknown_quantization_is_refused(rm_dir):
    with pytest.raises(ConfigError, match="quantization=3bit"):
        reward_model(["q"], ["a"], path=rm_dir, quantization="3bit")
