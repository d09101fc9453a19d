"""The few names of transformers' API that changed between the releases grpo-cli supports.

vLLM 0.32/0.33 take transformers 5.16.1-5.20; our own tests run on 5.24 too. Between those,
two names changed that the decode loop and the shared prompt pass use:
- the KV cache's keyword and the model output's field: `past_key_values` (<= 5.19), then `cache`;
- a model's "recompute activations in the backward" flag: `is_gradient_checkpointing`, then
  `is_activation_checkpointing` (the old name still answers there, with a FutureWarning).
Each is read once, here, from what the installed release defines, not from its version number.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# The keyword a model's forward (and a decoder layer's) takes its KV cache by, and the field of
# its output that holds the cache it filled: one name in every release.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

_CHECKPOINTING = (
    "is_activation_checkpointing"
    if hasattr(PreTrainedModel, "is_activation_checkpointing")
    else "is_gradient_checkpointing"
)


def with_cache(cache: Any) -> dict[str, Any]:
    """The keyword argument that hands `cache` to a forward: `model(..., **with_cache(cache))`."""
    return {CACHE: cache}


def returned_cache(output: Any) -> Any:
    """The KV cache a forward with use_cache=True filled (None if its output carries none)."""
    return getattr(output, CACHE, None)


def checkpoints_activations(model: torch.nn.Module) -> bool:
    """Whether `model` recomputes activations in the backward (gradient checkpointing is on)."""
    return bool(getattr(model, _CHECKPOINTING, False))
