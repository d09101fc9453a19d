"""Loading the policy, the reference and the tokenizer: dtype, device, LoRA, quantization.

The reference model is what the KL term compares against:
- beta = 0: none at all (no memory, no forward pass);
- LoRA: the policy's own base weights with the adapter switched off (no second copy);
- full fine-tune: a second, frozen `from_pretrained` of the base model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grpo_cli.config import ConfigError, ModelConfig
from grpo_cli.models.sources import resolve_model


@dataclass
class Models:
    policy: torch.nn.Module
    reference: Optional[torch.nn.Module]  # frozen copy (full fine-tune); None with LoRA or beta = 0
    tokenizer: object
    device: torch.device
    base_path: str  # the resolved folder or hub id of the base model
    uses_kl: bool  # beta > 0
    ddp: Optional[torch.nn.Module] = None  # the policy's DDP wrapper under torchrun (distributed.py)
    autocast_dtype: Optional[torch.dtype] = None  # model.autocast: forward passes in this dtype
    precision: str = ""  # one line for the run's first lines: the weights' dtype, the autocast, and why

    def autocast(self):
        """The context for a forward pass: torch.autocast under model.autocast, else nothing."""
        return autocast_to(self.autocast_dtype, self.device)


def autocast_to(dtype: Optional[torch.dtype], device: torch.device):
    """torch.autocast(device, dtype) for forward passes only (not the backward), or a no-op."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def resolve_device(setting: str) -> torch.device:
    setting = setting.lower()
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.device={setting}, but torch sees no CUDA device (torch {torch.__version__}). "
            "Use trainer.device=cpu or auto, or install a CUDA build of torch."
        )
    device = torch.device(setting)
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"trainer.device={setting}, but torch sees {torch.cuda.device_count()} CUDA device(s), "
            f"numbered from 0. Use trainer.device=cuda:0 (or check CUDA_VISIBLE_DEVICES)."
        )
    return device


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
    source = _local_folder(cfg)
    if source is not None:
        return source
    source = cfg.name_or_path
    attempts = [True] if os.environ.get("HF_HUB_OFFLINE") == "1" else [True, False]
    error: Exception | None = None
    for local_only in attempts:
        try:
            AutoConfig.from_pretrained(source, local_files_only=local_only, trust_remote_code=cfg.trust_remote_code)
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


def _local_folder(cfg: ModelConfig) -> Optional[str]:
    """The model's folder when it is one (built-in models are built now), after checking that its
    config.json is there and parses; None for a name that can only be a hub id."""
    source = resolve_model(cfg.name_or_path)
    folder = Path(source).expanduser()
    if not folder.is_dir():
        if folder.exists() or source.startswith(("/", "./", "../", "~")) or source.count("/") > 1:
            what = "is a file, not a model folder" if folder.exists() else "does not exist"
            # name the expanded or resolved path only where it differs from what the user wrote
            path = "that path" if str(folder) == cfg.name_or_path else str(folder)
            raise ConfigError(
                f"model.name_or_path={cfg.name_or_path}: {path} {what}. Give a Hugging Face model "
                "folder (it holds config.json and the weights) or a hub id such as Qwen/Qwen2.5-0.5B-Instruct."
            )
        return None
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: the folder has no config.json, so it is "
            "not a Hugging Face model folder (save one with model.save_pretrained(folder))."
        )
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 checks configs with it

    try:
        AutoConfig.from_pretrained(str(folder), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, StrictDataclassError) as error:
        # one line: a StrictDataclassError says its cause on the lines after the first
        reason = " ".join(str(error).split()) if isinstance(error, StrictDataclassError) else _first_line(error)
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: {config_file} cannot be read "
            f"({reason}). Restore it from the model's source (or save the model again "
            "with save_pretrained)."
        ) from None
    return str(folder)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(error).__name__


def local_tokenizer_and_context(cfg: ModelConfig) -> Optional[tuple[Any, Optional[int]]]:
    """The tokenizer and context length (positions) of a model already on this machine, for
    `validate`: no weights are loaded and nothing is downloaded. None for a hub id that is not in
    the local cache (load_models fetches it, or says why not). ConfigError for a broken folder.
    """
    source = _local_folder(cfg) or cfg.name_or_path
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(
            source, local_files_only=True, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError):  # not in the cache: load_models reports it with the hub's answer
        return None
    return tokenizer, context_length(config)


def context_length(config: Any) -> Optional[int]:
    """Positions the model can attend over (prompt + completion), from its config.json."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _quantization_config(cfg: ModelConfig, dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"model.quantization={cfg.quantization} needs the bitsandbytes package, which is not "
            "installed: `pip install bitsandbytes`, or set model.quantization=none."
        )

    if cfg.quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def _from_pretrained(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
    options = {
        "dtype": dtype,
        "trust_remote_code": cfg.trust_remote_code,
        "attn_implementation": cfg.attn_implementation,
    }
    if cfg.quantization != "none":
        options["quantization_config"] = _quantization_config(cfg, dtype)
        options["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(path, **options)
    if cfg.quantization == "4bit":
        keep_4bit_weights_in_training_layout(model)
    return model if cfg.quantization != "none" else model.to(device)


def keep_4bit_weights_in_training_layout(model: torch.nn.Module) -> int:
    """Stop bitsandbytes from repacking the 4-bit weights of `model` for its CPU inference kernel.
    Returns the number of 4-bit layers.

    On a CPU with AVX512-BF16, bitsandbytes (0.50) converts a Linear4bit's weight, in place and
    for good, to a packed layout the first time the layer runs in eval mode on an input that needs
    no gradient: our sampling and greedy eval. Every later forward, training ones included, then
    takes the packed kernel, which has no backward (gradients to the layer's input are dropped)
    and, for a layer with a bias (Qwen2's q/k/v), fails on its in-place bias add. The packing
    also rounds the block scales to bfloat16, so the frozen base would no longer be the one
    loaded, and the sampler would draw from other weights than the update trains. So the policy's
    layers keep the one layout every CPU and every pass share (a 4-bit reward model too, for scores
    that do not depend on the CPU). bitsandbytes decides once per layer,
    in `__init__`, from `has_avx512bf16()`; tests/test_cpu_paths.py forces that detection to True
    on any CPU and checks that no layer is ever packed."""
    from bitsandbytes.nn import Linear4bit

    layers = [module for module in model.modules() if isinstance(module, Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def load_models(cfg: ModelConfig, beta: float, device: torch.device, checkpoint: Optional[str] = None) -> Models:
    """Policy (from `checkpoint` when resuming), reference and tokenizer, ready to train."""
    base_path = check_model_source(cfg)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint or base_path, trust_remote_code=cfg.trust_remote_code)
    fix_special_tokens(tokenizer, cfg.name_or_path)
    tokenizer.padding_side = "left"  # generation appends on the right

    lora = cfg.lora.enabled
    policy = _from_pretrained(checkpoint if checkpoint and not lora else base_path, cfg, dtype, device)
    if cfg.quantization != "none" and dtype == torch.float16:
        from peft import prepare_model_for_kbit_training

        # peft's preparation casts every float16 weight left (embeddings, lm_head, norms) to
        # float32: float16's range is too narrow for them. In bfloat16 that cast would double
        # those weights and make the residual stream float32 (twice the activations and the
        # KV cache), so there we prepare the same way as an unquantized model, below.
        policy = prepare_model_for_kbit_training(
            policy,
            use_gradient_checkpointing=cfg.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},  # as for unquantized models, below
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
        reference_device = device if cfg.reference_device.lower() == "same" else resolve_device(cfg.reference_device)
        reference = _from_pretrained(base_path, cfg, dtype, reference_device)
        reference.eval().requires_grad_(False)
    parameters = sum(parameter.numel() for parameter in policy.parameters())
    autocast = resolve_autocast(cfg.autocast, device.type, parameters)
    return Models(
        policy,
        reference,
        tokenizer,
        device,
        base_path,
        uses_kl=beta > 0,
        autocast_dtype=torch.bfloat16 if autocast == "bfloat16" else None,
        precision=precision_line(cfg.autocast, autocast, dtype, device.type, parameters),
    )


def cpu_has_fast_bfloat16() -> bool:
    """avx512_bf16 or AMX: bfloat16 matmuls 1.5x faster than float32 on such CPUs. Without them
    torch emulates bfloat16, 3x slower on a Xeon with AVX-512 and 50-100x on an AVX2-only EPYC
    (docs/BENCHMARKS.md)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


# model.autocast=auto: bfloat16 autocast pays only where matmuls dominate the step. On the
# tiny default (0.6M parameters) it made steps slower (per-op casts outweigh the smaller
# matmuls) and learned no better; on SmolLM2-135M it makes the step 1.5x faster
# (docs/BENCHMARKS.md, "bf16 by default where it pays").
AUTO_BFLOAT16_MIN_PARAMETERS = 10_000_000


def resolve_autocast(autocast: str, device_type: str, parameters: int) -> str:
    """model.autocast=auto -> bfloat16 on a CPU with fast bfloat16 matmuls for a model of at
    least AUTO_BFLOAT16_MIN_PARAMETERS parameters, else none (on a GPU, model.dtype=auto already
    gives bfloat16 weights). Other values are returned as they are."""
    autocast = str(autocast).lower()
    if autocast != "auto":
        return autocast
    fits = device_type == "cpu" and cpu_has_fast_bfloat16() and parameters >= AUTO_BFLOAT16_MIN_PARAMETERS
    return "bfloat16" if fits else "none"


def precision_line(setting: str, autocast: str, dtype: torch.dtype, device_type: str, parameters: int) -> str:
    """What the run computes in, and why: 'Precision: float32 weights, forward passes in bfloat16
    autocast (model.autocast=auto: a CPU with bfloat16 matmul units, 134.5M parameters)'."""
    weights = str(dtype).removeprefix("torch.")
    forwards = "forward passes in bfloat16 autocast" if autocast == "bfloat16" else f"forward passes in {weights}"
    why = ""
    if str(setting).lower() == "auto":
        if device_type != "cpu":
            why = f"not on {device_type}: model.dtype sets the precision there"
        elif not cpu_has_fast_bfloat16():
            why = "this CPU has no bfloat16 matmul units (avx512_bf16, AMX): bfloat16 would be emulated"
        elif autocast == "bfloat16":
            why = f"this CPU has bfloat16 matmul units; {parameters / 1e6:.1f}M parameters"
        else:
            why = (
                f"{parameters / 1e6:.1f}M parameters, under the {AUTO_BFLOAT16_MIN_PARAMETERS / 1e6:.0f}M "
                "where bfloat16 pays"
            )
        why = f" (model.autocast=auto: {why})"
    return f"Precision: {weights} weights, {forwards}{why}"


def fix_special_tokens(tokenizer, name_or_path: str) -> None:
    """Batches are padded and completions end at EOS: the tokenizer needs both tokens.

    No pad token is common (Llama, Mistral) and harmless here: pad = EOS, with a warning, since
    the attention mask (not the token) is what keeps padding out. No EOS token is an error: the
    sampler could not tell a finished completion from a cut-off one.
    """
    if tokenizer.eos_token is None:
        raise ConfigError(
            f"model.name_or_path={name_or_path}: the tokenizer has no EOS token, so a finished "
            "completion cannot be told from a cut-off one. Set eos_token in the folder's "
            "tokenizer_config.json (or special_tokens_map.json)."
        )
    if tokenizer.pad_token is None:
        warnings.warn(
            f"model.name_or_path={name_or_path}: the tokenizer has no pad token; padding with the "
            f"EOS token {tokenizer.eos_token!r} (the attention mask keeps it out of the model). Set "
            "pad_token in tokenizer_config.json to silence this.",
            UserWarning,
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token


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
    try:
        return get_peft_model(base, peft_config)
    except ValueError as error:  # peft: "Target modules {...} not found in the base model"
        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)}
        )
        raise ConfigError(
            f"model.lora.target_modules={targets}: {_first_line(error)}. This model's linear "
            f"layers are named {', '.join(linear)} (or use model.lora.target_modules=[all-linear])."
        ) from None


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


@torch.no_grad()
def refresh_reference(models: Models, alpha: float) -> None:
    """TR-DPO's soft update of the reference (Gorbatovski et al. 2024, "Learn Your Reference
    Model for Real Good Alignment"; TRL's sync_ref_model): ref <- alpha * policy + (1 - alpha) *
    ref, parameter by parameter, in the reference's dtype and on its device. A full fine-tune's
    own reference copy only (validate refuses LoRA, whose reference is the base model itself).
    Example: alpha 0.6, ref 1.0, policy 2.0 -> 1.6."""
    if models.reference is None:
        raise ValueError("refresh_reference needs the reference copy of a full fine-tune")
    policy = dict(models.policy.named_parameters())
    for name, reference in models.reference.named_parameters():
        reference.mul_(1.0 - alpha).add_(policy[name].detach().to(reference.device, reference.dtype), alpha=alpha)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
