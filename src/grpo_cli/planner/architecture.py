"""A decoder's shape and the parameter tensors it is made of, for the memory planner.

Read from the model folder's config.json (no weights), or from the model preset's
`model.architecture` block when the model is not on this machine. The layout is the one of
Qwen2 and Llama (and Mistral) decoders in transformers:

    embed_tokens [V, h]
    per layer:  q_proj [nh*d, h], k_proj [nkv*d, h], v_proj [nkv*d, h], o_proj [h, nh*d]
                gate_proj [i, h], up_proj [i, h], down_proj [h, i]
                input_layernorm [h], post_attention_layernorm [h]      (RMSNorm weights)
    norm [h]
    lm_head [V, h]   (absent when tied: it is embed_tokens)

Biases: Qwen2 has them on q/k/v (not o); Llama-style configs say `attention_bias` (q/k/v/o)
and `mlp_bias` (gate/up/down), both off in the released Llama and Mistral models. A preset's
block names its model_type, so both sources go through transformers' config of that type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

from grpo_cli.config import ConfigError
from grpo_cli.models.sources import resolve_model

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Architecture:
    hidden_size: int  # h
    intermediate_size: int  # i, the MLP width
    num_layers: int
    num_heads: int  # nh, query heads
    num_kv_heads: int  # nkv, key/value heads (GQA: fewer than nh)
    vocab_size: int  # V
    tied_embeddings: bool  # lm_head is embed_tokens
    head_dim: int  # d
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    context_length: Optional[int] = None  # max_position_embeddings, when known
    source: str = ""  # where the numbers come from, for the plan's notes


class Linear(NamedTuple):
    name: str
    inputs: int
    outputs: int
    bias: bool


class Weight(NamedTuple):
    """One parameter tensor of shape [rows, cols] ([rows] for cols = 1), `copies` times over
    (num_layers for the per-layer ones)."""

    name: str
    rows: int
    cols: int
    copies: int
    quantizable: bool  # a decoder layer's linear weight: what bitsandbytes quantizes

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def layer_linears(arch: Architecture) -> tuple[Linear, ...]:
    """The seven linear layers of one decoder layer, in forward order."""
    h, i = arch.hidden_size, arch.intermediate_size
    q_width, kv_width = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return (
        Linear("q_proj", h, q_width, arch.qkv_bias),
        Linear("k_proj", h, kv_width, arch.qkv_bias),
        Linear("v_proj", h, kv_width, arch.qkv_bias),
        Linear("o_proj", q_width, h, arch.o_bias),
        Linear("gate_proj", h, i, arch.mlp_bias),
        Linear("up_proj", h, i, arch.mlp_bias),
        Linear("down_proj", i, h, arch.mlp_bias),
    )


def model_weights(arch: Architecture) -> list[Weight]:
    """Every parameter tensor of the model (a tied lm_head is embed_tokens: counted once)."""
    h, layers = arch.hidden_size, arch.num_layers
    weights = [Weight("embed_tokens.weight", arch.vocab_size, h, 1, False)]
    for linear in layer_linears(arch):
        weights.append(Weight(f"{linear.name}.weight", linear.outputs, linear.inputs, layers, True))
        if linear.bias:
            weights.append(Weight(f"{linear.name}.bias", linear.outputs, 1, layers, False))
    weights += [
        Weight("input_layernorm.weight", h, 1, layers, False),
        Weight("post_attention_layernorm.weight", h, 1, layers, False),
        Weight("norm.weight", h, 1, 1, False),
    ]
    if not arch.tied_embeddings:
        weights.append(Weight("lm_head.weight", arch.vocab_size, h, 1, False))
    return weights


def lora_targets(arch: Architecture, target_modules: Sequence[str]) -> tuple[Linear, ...]:
    """The linears of one layer that get an adapter. `all-linear` is peft's: every linear of the
    decoder layers, not the output layer (lm_head)."""
    linears = layer_linears(arch)
    names = [str(name) for name in target_modules]
    if names == [ALL_LINEAR]:
        return linears
    unknown = sorted(set(names) - {linear.name for linear in linears})
    if unknown:
        raise ConfigError(
            f"model.lora.target_modules={names}: {', '.join(unknown)} not in this model; its linear "
            f"layers are named {', '.join(linear.name for linear in linears)} (or use [all-linear])."
        )
    return tuple(linear for linear in linears if linear.name in names)


def lora_weights(arch: Architecture, rank: int, target_modules: Sequence[str]) -> list[Weight]:
    """The adapter's tensors: per targeted linear and layer, A [r, in] and B [out, r], so
    r * (in + out) parameters."""
    weights = []
    for linear in lora_targets(arch, target_modules):
        weights.append(Weight(f"{linear.name}.lora_A.weight", rank, linear.inputs, arch.num_layers, False))
        weights.append(Weight(f"{linear.name}.lora_B.weight", linear.outputs, rank, arch.num_layers, False))
    return weights


def parameter_count(weights: Sequence[Weight]) -> int:
    return sum(weight.numel * weight.copies for weight in weights)


def architecture_of(model_cfg: Any) -> Architecture:
    """The shape of `model_cfg.name_or_path`: its config.json when the model is on this machine
    (a folder, `builtin:...`, or a hub id in the local Hugging Face cache; nothing is
    downloaded), else the `model.architecture` block. ConfigError if neither is there."""
    name = str(model_cfg.name_or_path)
    config = local_config(name, bool(getattr(model_cfg, "trust_remote_code", False)))
    if config is not None:
        return architecture_from_hf(config, source=f"config.json of {name}")
    block = getattr(model_cfg, "architecture", None)
    if block is not None:
        return architecture_from_block(block, name)
    raise ConfigError(
        f"model.name_or_path={name}: its config.json is not on this machine, so the memory planner "
        "does not know the model's shape. Give a local model folder (model.name_or_path=DIR), or "
        "the numbers of its config.json under model.architecture (model_type, hidden_size, "
        "intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size, "
        "tie_word_embeddings), as the presets in conf/model/ do."
    )


def local_config(name_or_path: str, trust_remote_code: bool = False) -> Optional[Any]:
    """transformers' config of a model on this machine (its config.json only), else None."""
    from transformers import AutoConfig

    source = resolve_model(name_or_path)
    folder = Path(source).expanduser()
    is_folder = (folder / "config.json").is_file()
    if not is_folder and (folder.exists() or source.count("/") != 1):
        return None  # a path without config.json, or not the `owner/name` of a hub id
    try:
        return AutoConfig.from_pretrained(
            str(folder) if is_folder else source, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as error:
        if is_folder:
            raise ConfigError(
                f"model.name_or_path={name_or_path}: {folder / 'config.json'} cannot be "
                f"read ({str(error).strip().splitlines()[0]})."
            ) from None
        return None  # not in the local Hugging Face cache


def architecture_from_hf(config: Any, source: str = "") -> Architecture:
    """From a transformers config (a Qwen2/Llama-style decoder)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ConfigError(
            f"{source}: a mixture-of-experts model; the memory planner counts dense Qwen2/Llama-style decoders only."
        )
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    lacking = [key for key in needed if getattr(text, key, None) is None]
    if lacking:
        raise ConfigError(
            f"{source}: no {', '.join(lacking)}; the memory planner counts Qwen2/Llama-style decoders only."
        )
    heads = int(text.num_attention_heads)
    model_type = str(getattr(text, "model_type", "") or "")
    qwen2 = model_type == "qwen2"
    attention_bias = bool(getattr(text, "attention_bias", False))
    return Architecture(
        hidden_size=int(text.hidden_size),
        intermediate_size=int(text.intermediate_size),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        vocab_size=int(text.vocab_size),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        qkv_bias=qwen2 or attention_bias,
        o_bias=attention_bias and not qwen2,
        mlp_bias=bool(getattr(text, "mlp_bias", False)),
        context_length=getattr(text, "max_position_embeddings", None),
        source=source or model_type,
    )


def architecture_from_block(block: Any, name_or_path: str, key: str = "model.architecture") -> Architecture:
    """From a preset's `model.architecture` (config.py ArchitectureConfig; `key` names the block
    in messages): transformers builds the config of its model_type from the numbers given, so
    the block means what the same keys in a config.json mean (biases included)."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    values = OmegaConf.to_container(block) if OmegaConf.is_config(block) else dict(block)
    missing = [name for name, value in values.items() if value == "???"]
    if missing:
        raise ConfigError(
            f"{key} of {name_or_path}: {', '.join(missing)} not set. Copy them from the model's config.json."
        )
    model_type = values.pop("model_type")
    try:
        config = AutoConfig.for_model(
            str(model_type), **{name: value for name, value in values.items() if value is not None}
        )
    except ValueError:
        raise ConfigError(
            f"{key}.model_type={model_type!r} ({name_or_path}) is not a model type transformers "
            "knows; copy it from the model's config.json (qwen2, llama, mistral, ...)."
        ) from None
    return architecture_from_hf(config, source=f"{key} of {name_or_path}")
