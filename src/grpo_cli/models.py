"""Loading the policy, the reference and the tokenizer: dtype, device, LoRA, quantization.

The reference model is what the KL term compares against:
- beta = 0: none at all (no memory, no forward pass);
- LoRA: the policy's own base weights with the adapter switched off (no second copy);
- full fine-tune: a second, frozen `from_pretrained` of the base model.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grpo_cli.config import ConfigError, ModelConfig
from grpo_cli.tiny import resolve_builtin


@dataclass
class Models:
    policy: torch.nn.Module
    reference: Optional[torch.nn.Module]  # frozen copy (full fine-tune); None with LoRA or beta = 0
    tokenizer: object
    device: torch.device
    base_path: str  # the resolved folder or hub id of the base model
    uses_kl: bool  # beta > 0


def resolve_device(setting: str) -> torch.device:
    setting = setting.lower()
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.device={setting}, but torch sees no CUDA device (torch {torch.__version__}). "
            "Use trainer.device=cpu or auto, or install a CUDA build of torch."
        )
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    setting = setting.lower()
    if setting == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[setting]


def check_model_source(cfg: ModelConfig) -> str:
    """The model's folder or hub id, after making sure its config can be read; ConfigError if not.

    A local folder is used as is. A hub id is looked up in the local Hugging Face cache first;
    only then (unless HF_HUB_OFFLINE=1) on the hub.
    """
    source = resolve_builtin(cfg.name_or_path)
    if Path(source).is_dir():
        if not (Path(source) / "config.json").is_file():
            raise ConfigError(
                f"model.name_or_path={cfg.name_or_path}: the folder has no config.json, so it is "
                "not a Hugging Face model folder (save one with model.save_pretrained(folder))."
            )
        return source
    attempts = [True] if os.environ.get("HF_HUB_OFFLINE") == "1" else [True, False]
    error: Exception | None = None
    for local_only in attempts:
        try:
            AutoConfig.from_pretrained(
                source, local_files_only=local_only, trust_remote_code=cfg.trust_remote_code
            )
            return source
        except (OSError, ValueError) as caught:
            error = caught
    first_line = str(error).strip().splitlines()[0] if error else ""
    raise ConfigError(
        f"model.name_or_path={cfg.name_or_path}: no such local folder, and it could not be loaded "
        f"from the Hugging Face cache or hub ({first_line}). Download it first (e.g. "
        "`huggingface-cli download NAME --local-dir DIR`) and pass model.name_or_path=DIR, or use "
        "the built-in model (model.name_or_path=builtin:tiny-addition)."
    )


def _quantization_config(cfg: ModelConfig, dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    if cfg.quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def _from_pretrained(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
    options = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.quantization != "none":
        options["quantization_config"] = _quantization_config(cfg, dtype)
        options["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(path, **options)
    return model if cfg.quantization != "none" else model.to(device)


def load_models(cfg: ModelConfig, beta: float, device: torch.device,
                checkpoint: Optional[str] = None) -> Models:
    """Policy (from `checkpoint` when resuming), reference and tokenizer, ready to train."""
    base_path = check_model_source(cfg)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(
        checkpoint or base_path, trust_remote_code=cfg.trust_remote_code
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation appends on the right

    lora = cfg.lora.enabled
    policy = _from_pretrained(checkpoint if checkpoint and not lora else base_path, cfg, dtype, device)
    if cfg.quantization != "none":
        from peft import prepare_model_for_kbit_training

        policy = prepare_model_for_kbit_training(
            policy, use_gradient_checkpointing=cfg.gradient_checkpointing
        )
    elif cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            policy.enable_input_require_grads()
    if lora:
        policy = _attach_adapter(policy, cfg, checkpoint)
    policy.config.use_cache = not cfg.gradient_checkpointing
    if cfg.disable_dropout:
        disable_dropout(policy)

    reference = None
    if beta > 0 and not lora:
        reference = _from_pretrained(base_path, cfg, dtype, device)
        reference.eval().requires_grad_(False)
    return Models(policy, reference, tokenizer, device, base_path, uses_kl=beta > 0)


def _attach_adapter(base, cfg: ModelConfig, checkpoint: Optional[str]):
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    if checkpoint:
        return PeftModel.from_pretrained(base, checkpoint, is_trainable=True)
    targets = list(cfg.lora.target_modules)
    peft_config = PeftLoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, peft_config)


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout layer (LoRA's included) to p = 0.

    With dropout, the log-probs of the ratio pi / pi_old and of the KL would come from different
    random sub-networks in each forward pass: rho != 1 on the first pass, clipping on noise.
    Functional attention dropout reads the config; it is 0 in the models we know, and set to 0
    here where the config has it.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    config = getattr(model, "config", None)
    if config is not None and isinstance(getattr(config, "attention_dropout", None), float):
        config.attention_dropout = 0.0


@contextlib.contextmanager
def reference_model(models: Models) -> Iterator[torch.nn.Module]:
    """The module whose forward pass gives reference log-probs."""
    if models.reference is not None:
        yield models.reference
    else:  # LoRA: the same weights without the adapter
        with models.policy.disable_adapter():
            yield models.policy


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
