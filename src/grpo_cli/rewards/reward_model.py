"""A learned reward: a sequence-classification model scores prompt + completion.

    reward:
      functions:
        - {_target_: grpo_cli.rewards.reward_model, weight: 1.0, path: /models/rm, batch_size: 16}

The rules, in the order they are applied:
- Text: with a chat template in the reward model's tokenizer, the pair is rendered as
  [user: prompt, assistant: completion] with `apply_chat_template(tokenize=False)` and tokenized
  without extra special tokens (the template has its own); else it is `prompt + completion`,
  tokenized as the tokenizer does by default.
- Truncation keeps the END: sequences longer than `max_length` tokens lose tokens from the left
  (the start of the prompt), because the reward is read at the last token and the completion is
  what is being judged.
- Padding is on the right, so every real token keeps the position it has when scored alone (with
  absolute position embeddings, as in GPT-2, left padding would change the scores). The model
  reads its head at the last token that is not `config.pad_token_id` (Hugging Face's rule for
  `*ForSequenceClassification`, the one reward models are trained with), so the padding is
  written with that id. A tokenizer without a pad token pads with eos, and a model config
  without `pad_token_id` gets the tokenizer's.
- Score: one label -> that logit; two labels -> logit[1] - logit[0], the log-odds of label 1
  (taken as the "good" class); the same number a one-logit head trained with a sigmoid gives, and
  unlike logit[1] alone it does not move when both logits shift together. More labels -> error.

The model is loaded once per (path, device, quantization, dtype) and kept in `_LOADED`, in eval
mode with no gradients (quantized: 8bit LLM.int8 or 4bit nf4, the score head kept unquantized
by transformers), on its own device (`auto`: cuda if available, else cpu), which may differ
from the policy's. A missing or unusable folder raises `ConfigError` naming `path`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from grpo_cli.config import ConfigError, ModelConfig

QUANTIZATIONS = ("none", "8bit", "4bit")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class LoadedRewardModel(NamedTuple):
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device  # where the inputs go


# (path, device, quantization, dtype) -> the loaded model; one load per run, not one per step.
_LOADED: dict[tuple[str, str, str, str], LoadedRewardModel] = {}


def reward_model(
    prompts: list[str],
    completions: list[str],
    path: str,
    batch_size: int = 8,
    device: str = "auto",
    quantization: str = "none",
    max_length: int = 1024,
    dtype: str = "auto",
    **_: Any,
) -> list[float]:
    """One score per completion from the sequence-classification model at `path` (see the module
    docstring for the text, truncation, padding and score rules). Dataset columns are ignored."""
    loaded = load_reward_model(path, device, quantization, dtype)
    texts = reward_texts(loaded.tokenizer, prompts, completions)
    scores: list[float] = []
    for start in range(0, len(texts), batch_size):
        scores.extend(_score_batch(loaded, texts[start : start + batch_size], max_length))
    return scores


def reward_texts(tokenizer: Any, prompts: list[str], completions: list[str]) -> list[str]:
    """The strings the reward model reads: chat-formatted when the tokenizer has a template."""
    if not getattr(tokenizer, "chat_template", None):
        return [prompt + completion for prompt, completion in zip(prompts, completions)]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
            tokenize=False,
        )
        for prompt, completion in zip(prompts, completions)
    ]


@torch.inference_mode()
def _score_batch(loaded: LoadedRewardModel, texts: list[str], max_length: int) -> list[float]:
    tokenizer, model = loaded.tokenizer, loaded.model
    encoded = tokenizer(
        texts,
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=max_length,
        add_special_tokens=not getattr(tokenizer, "chat_template", None),
    ).to(loaded.device)
    input_ids = encoded["input_ids"]  # [N, T], right-padded
    # The head is read at the last token != config.pad_token_id: make the padding exactly that id.
    pad_id = model.config.get_text_config().pad_token_id
    input_ids = input_ids.masked_fill(encoded["attention_mask"] == 0, pad_id)
    logits = model(input_ids=input_ids, attention_mask=encoded["attention_mask"]).logits.float()  # [N, labels]
    values = logits[:, 0] if logits.shape[-1] == 1 else logits[:, 1] - logits[:, 0]  # [N]
    return values.tolist()


def load_reward_model(
    path: str, device: str = "auto", quantization: str = "none", dtype: str = "auto"
) -> LoadedRewardModel:
    """The model and tokenizer at `path`, loaded on first use and cached in `_LOADED`."""
    from grpo_cli.models.loading import resolve_device, resolve_dtype  # here: models imports the rewards package

    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"reward_model quantization={quantization}: use one of {', '.join(QUANTIZATIONS)}.")
    if dtype not in DTYPES:
        raise ConfigError(f"reward_model dtype={dtype}: use one of {', '.join(DTYPES)}.")
    try:
        torch_device = resolve_device(device)
    except ConfigError:
        raise ConfigError(f"reward_model device={device}: torch sees no CUDA device; use device=cpu or auto.") from None
    torch_dtype = resolve_dtype(dtype, torch_device)
    key = (str(path), str(torch_device), quantization, str(torch_dtype))
    if key not in _LOADED:
        _LOADED[key] = _load(str(path), torch_device, quantization, torch_dtype)
    return _LOADED[key]


def _load(path: str, device: torch.device, quantization: str, dtype: torch.dtype) -> LoadedRewardModel:
    _check_source(path)
    options: dict[str, Any] = {"dtype": dtype}
    if quantization != "none":
        from grpo_cli.models.loading import _quantization_config

        options["quantization_config"] = _quantization_config(ModelConfig(quantization=quantization), dtype)
        options["device_map"] = {"": device}
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, **options)
    if quantization == "4bit":
        from grpo_cli.models.loading import keep_4bit_weights_in_training_layout

        # Not for training here: for scores that are the same on every CPU (the packed kernel
        # computes in bfloat16 on bfloat16-rounded scales, on AVX512-BF16 CPUs alone).
        keep_4bit_weights_in_training_layout(model)
    if quantization == "none":
        model = model.to(device)
    model.eval().requires_grad_(False)
    if model.config.num_labels not in (1, 2):
        raise ConfigError(
            f"reward_model path={path}: the model has {model.config.num_labels} labels; a reward "
            "model needs 1 (the score) or 2 (scored as logit[1] - logit[0])."
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.get_text_config().pad_token_id is None:
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"  # real tokens keep the positions they have when scored alone
    tokenizer.truncation_side = "left"  # keep the completion's end, where the score is read
    return LoadedRewardModel(model, tokenizer, device)


def _check_source(path: str) -> None:
    """ConfigError naming `path` unless it holds (or names) a sequence-classification model."""
    folder = Path(path)
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ConfigError(
            f"reward_model path={path}: the folder has no config.json, so it is not a Hugging Face "
            "model folder. Point path at the folder where the reward model was saved with "
            "save_pretrained (its tokenizer beside it)."
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"reward_model path={path}: no such local folder, and it could not be loaded from the "
            f"Hugging Face cache or hub ({first_line}). Download the reward model first (e.g. "
            "`huggingface-cli download NAME --local-dir DIR`) and set path=DIR."
        ) from None
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ConfigError(
            f"reward_model path={path}: the folder holds a {', '.join(architectures)}, not a "
            "*ForSequenceClassification model, so its score head would be random weights. Give "
            "the folder of a trained reward model."
        )
