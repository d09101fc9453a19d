"""Every byte count of the memory planner, in one place. memory.py adds them up into a plan.

Parameter memory (weights, adapter, gradients, optimizer states) is exact: it is what
transformers 5, peft 0.21, bitsandbytes 0.50 and torch 2.13 allocate, checked tensor by tensor
in tests/test_memory.py. Activation memory is a model of what the forward keeps for the backward
(counted with saved-tensor hooks, per tensor, for sdpa attention) plus the largest temporaries,
checked against the measured peak of the heap; docs/MEMORY.md derives each term.
Shapes: h hidden, i MLP width, nh heads, nkv key/value heads, d head width, V vocabulary,
N sequences, L = prompt + new tokens, T new tokens; `act` = bytes of the activations' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from grpo_cli.algorithm.losses import LOGIT_CHUNK_ELEMENTS
from grpo_cli.planner.architecture import Architecture, Linear, Weight, parameter_count

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bitsandbytes 4-bit nf4 with double quantization (models._quantization_config): two 4-bit codes
# per byte, one uint8 absmax per block of 64 elements, itself quantized with a float32 absmax per
# block of 256; and per weight the float32 nf4 code (16), nested code (256) and offset (1).
NF4_BLOCK, NESTED_BLOCK, NF4_FIXED_BYTES = 64, 256, (16 + 256 + 1) * 4
# bitsandbytes AdamW8bit: uint8 states with a float32 absmax per block of 256 elements, and two
# 256-entry float32 maps shared by all tensors; tensors under 4096 elements get float32 states.
ADAM8_BLOCK, ADAM8_MIN_SIZE, ADAM8_MAPS_BYTES = 256, 4096, 2 * 256 * 4
ADAM8_NAMES = ("AdamW8bit", "Adam8bit", "PagedAdamW8bit", "PagedAdam8bit")
LOGIT_BLOCK_BYTES = 4 * LOGIT_CHUNK_ELEMENTS  # one float32 block of losses.py's chunked log-softmax


class Amount(NamedTuple):
    bytes: int
    note: str  # how it was computed


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def nf4_bytes(numel: int) -> int:
    blocks = ceil_div(numel, NF4_BLOCK)
    return ceil_div(numel, 2) + blocks + 4 * ceil_div(blocks, NESTED_BLOCK) + NF4_FIXED_BYTES


def int8_bytes(weight: Weight) -> int:
    """LLM.int8: one int8 per element and a float32 scale per output row (SCB)."""
    return weight.numel + 4 * weight.rows


def weight_bytes(weights: Sequence[Weight], dtype_bytes: int, quantization: str, upcast: bool) -> int:
    """Quantization replaces the decoder linears' weights; the rest (embeddings, lm_head, norms,
    biases) keeps `dtype_bytes`, or float32 with `upcast`: a float16 quantized policy goes
    through peft's prepare_model_for_kbit_training, which casts every float16 parameter left to
    float32 (models.load_models)."""
    rest_bytes = 4 if upcast and quantization != "none" else dtype_bytes
    total = 0
    for weight in weights:
        if weight.quantizable and quantization == "4bit":
            total += nf4_bytes(weight.numel) * weight.copies
        elif weight.quantizable and quantization == "8bit":
            total += int8_bytes(weight) * weight.copies
        else:
            total += weight.numel * rest_bytes * weight.copies
    return total


def optimizer_bytes(target: str, weights: Sequence[Weight], dtype_bytes: int) -> Amount:
    """The optimizer's state after its first step (states are created then)."""
    if target.rsplit(".", 1)[-1] in ADAM8_NAMES:
        large = [w for w in weights if w.numel >= ADAM8_MIN_SIZE]
        small = [w for w in weights if w.numel < ADAM8_MIN_SIZE]
        total = sum((2 * w.numel + 2 * 4 * ceil_div(w.numel, ADAM8_BLOCK)) * w.copies for w in large)
        total += 2 * 4 * parameter_count(small) + (ADAM8_MAPS_BYTES if large else 0)
        return Amount(
            total,
            f"2 x 1 B + 2 x 4 B per {ADAM8_BLOCK} for {sum(w.copies for w in large)} tensors; "
            f"2 x 4 B for {sum(w.copies for w in small)} under {ADAM8_MIN_SIZE} elements",
        )
    # torch Adam/AdamW: exp_avg and exp_avg_sq shaped like the parameter, a float32 step per tensor
    note = f"2 states x {dtype_bytes} B per param + 4 B step per tensor"
    if "adam" not in target.lower():
        note += f" (counted as AdamW: {target} is not known here)"
    return Amount(2 * parameter_count(weights) * dtype_bytes + 4 * sum(w.copies for w in weights), note)


def layer_saved_bytes(
    arch: Architecture, act: int, sequence: int, full: bool, adapted: Sequence[Linear], rank: int
) -> int:
    """Bytes one decoder layer keeps for its backward, per token. Counted tensor by tensor with
    saved-tensor hooks (transformers 5 sdpa attention, torch 2.13)."""
    h, i, heads = arch.hidden_size, arch.intermediate_size, arch.num_heads
    width = heads * arch.head_dim
    norms = 2 * (4 * h + 4)  # each RMSNorm: its input upcast to float32, and 1/rms
    # q, k, v (with a padding mask sdpa gets k and v repeated to all heads), the output, the
    # float32 logsumexp, and the layer's float copy of the [N, 1, L, L] mask: L values per token.
    attention = 4 * act * width + 4 * heads + act * sequence
    mlp = 3 * act * i  # gate, silu(gate), up
    total = norms + attention + mlp
    if full:  # trained weights keep their inputs: per norm x/rms and its output; down's input
        total += 2 * 2 * act * h + act * i
    # LoRA keeps each adapter's input in float32 and its r-wide projection. Float32 activations
    # are shared by the adapters that read them (o_proj reads the attention output, kept above);
    # otherwise every adapter keeps its own float32 copy.
    if act == 4:
        reads = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp", "up_proj": "mlp"}
        inputs = {reads.get(linear.name, linear.name): linear.inputs for linear in adapted if linear.name != "o_proj"}
    else:
        inputs = {linear.name: linear.inputs for linear in adapted}
    return total + 4 * sum(inputs.values()) + 4 * rank * len(adapted)


def update_amounts(
    arch: Architecture,
    act: int,
    count: int,
    prompt: int,
    new: int,
    full: bool,
    adapted: Sequence[Linear],
    rank: int,
    checkpointing: bool,
    prompt_pass_group: int = 1,
    through_head: bool = True,
) -> tuple[Amount, Amount]:
    """One micro-batch of `count` completions: what its forward keeps for the backward, and the
    backward's peak on top of that. The backward starts at the log-probs' logits with their
    gradient and two float32 blocks: one chunk of them (head_logit_elements) where the head runs
    by chunks on the hidden states (log_probs.py; its forward keeps the N x T scored hidden
    rows), else the model's [N, T+1, V] logits (FSDP). Each layer's backward then adds two
    [N*L, i] gradients (float32-sized: measured), and with gradient checkpointing that layer's
    recomputed activations.

    prompt_pass_group = G > 1: one prompt pass per group (update.completion_log_probs): the layers
    keep N/G x P prompt tokens and N x T completion tokens, and each completion's attention keeps
    the prompt's keys and values repeated to all heads (N x P positions). With long prompts this
    is half of the unshared count or less (SmolLM2, P = 109, T = 64, G = 8: 2.0 GB, not 4.0)."""
    sequence = prompt + new
    tokens = count * sequence
    per_layer = layer_saved_bytes(arch, act, sequence, full, adapted, rank) * tokens
    if prompt_pass_group > 1:
        prompt_rows, width = count // prompt_pass_group, arch.num_heads * arch.head_dim
        tokens = prompt_rows * prompt + count * new
        per_layer = (
            layer_saved_bytes(arch, act, prompt, full, adapted, rank) * prompt_rows * prompt
            + layer_saved_bytes(arch, act, sequence, full, adapted, rank) * count * new
            + 2 * act * width * count * prompt
        )
    final, logits = head_amounts(arch, act, count, tokens, new, full, through_head)
    layer_backward = 2 * 4 * arch.intermediate_size * tokens
    if checkpointing:
        kept = Amount(
            arch.num_layers * act * arch.hidden_size * tokens + final,
            f"{arch.num_layers} layer inputs x {count} x {sequence} tokens (checkpointing)",
        )
        layer_backward += per_layer
    else:
        shape = (
            f"{count // prompt_pass_group} x {prompt} prompt + {count} x {new} completion tokens (prompt pass "
            "shared by each group)"
            if prompt_pass_group > 1
            else f"{count} x {sequence} tokens"
        )
        kept = Amount(
            arch.num_layers * per_layer + final, f"{arch.num_layers} layers x {per_layer // tokens:,} B x {shape}"
        )
    if logits.bytes >= layer_backward:
        return kept, logits
    recomputed = "recomputed activations + " if checkpointing else ""
    return kept, Amount(layer_backward, f"one layer's {recomputed}backward temporaries")


def head_amounts(
    arch: Architecture, act: int, count: int, tokens: int, new: int, full: bool, through_head: bool
) -> tuple[int, Amount]:
    """What the last norm and the LM head add to the update: the bytes the forward keeps (last
    norm, rotary cos and sin, and the head's input) over `tokens` positions, and the backward's
    logits with their gradient and two float32 blocks: one chunk (head_logit_elements) where the
    head runs by chunks on the N x T scored hidden rows (kept), else [N, T+1, V] (FSDP)."""
    final = (4 * arch.hidden_size + 4 + 2 * act * arch.head_dim) * tokens  # last norm; rotary cos, sin
    if through_head:  # the scored hidden rows the chunks recompute from; a trained norm keeps its output
        final += act * arch.hidden_size * (count * new + (tokens if full else 0))
        elements = head_logit_elements(arch, count, new)
        shape = f"{elements // arch.vocab_size}x{arch.vocab_size}"
        what = "one chunk of logits" if elements < count * new * arch.vocab_size else "logits"
    else:
        final += act * arch.hidden_size * (tokens + count * (new + 1)) if full else 0  # its output; lm_head's input
        elements = count * (new + 1) * arch.vocab_size
        shape, what = f"{count}x{new + 1}x{arch.vocab_size}", "logits"
    logits = 2 * act * elements + 2 * min(LOGIT_BLOCK_BYTES, 4 * elements)
    return final, Amount(logits, f"{what} {shape} x {act} B, their grad, 2 blocks")


def forward_bytes(arch: Architecture, act: int, count: int, sequence: int) -> int:
    """The peak of a no-grad forward: the residual stream and the MLP's three [N*L, i]
    temporaries, and the [N, 1, L, L] mask as bool and as a float copy."""
    tokens = count * sequence
    return tokens * act * (2 * arch.hidden_size + 3 * arch.intermediate_size) + tokens * sequence * (1 + act)


def head_logit_elements(arch: Architecture, count: int, new: int) -> int:
    """The logits of one chunk of log_probs.head_token_log_probs: LOGIT_CHUNK_ELEMENTS // V rows
    of V, or all N x T scored rows where they are fewer.
    Example: V = 151936 -> 110 rows, 16.7M elements (64 MiB in float32), whatever N x T."""
    rows = max(1, LOGIT_CHUNK_ELEMENTS // arch.vocab_size)
    return min(rows, count * new) * arch.vocab_size


def reference_amount(
    arch: Architecture, act: int, count: int, prompt: int, new: int, through_head: bool = True
) -> Amount:
    """Reference (and old-policy) log-probs of one micro-batch, without grad: the logits (one
    chunk of them through the head, else [N, T+1, V]), three float32 blocks of the log-softmax,
    and the forward's own peak."""
    logit_elements = head_logit_elements(arch, count, new) if through_head else count * (new + 1) * arch.vocab_size
    total = act * logit_elements + 3 * min(LOGIT_BLOCK_BYTES, 4 * logit_elements)
    return Amount(
        total + forward_bytes(arch, act, count, prompt + new),
        f"no-grad forward of {count} completions: {'a chunk of ' if through_head else ''}logits, 3 blocks, 1 layer",
    )


def kv_bytes_per_token(arch: Architecture, act: int) -> int:
    """The keys and values of one position in every layer, in bytes (`act` a value's size).
    Example: 4 layers x 2 kv heads x 32 wide x 4 B x 2 (k and v) = 2048 B."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * act


def sampling_amounts(arch: Architecture, act: int, count: int, prompt: int, new: int) -> tuple[Amount, Amount]:
    """generate() with a dynamic cache for `count` sequences: keys and values of every layer and
    position; and the larger of the prompt's forward (the cache then holds only the prompt) and,
    at the last token, the old copy of one layer's keys while torch.cat grows them, plus the
    next-token logits [N, V] (the model's, a float32 copy, the processed scores, the probabilities)."""
    sequence = prompt + new
    per_position = kv_bytes_per_token(arch, act)  # k and v, all layers
    cache = Amount(per_position * count * sequence, f"{count} seqs x {sequence} positions x {per_position:,} B")
    # Above the full cache: while the prompt runs the cache lacks the new tokens' positions.
    prompt_forward = forward_bytes(arch, act, count, prompt) - per_position * count * new
    last_token = per_position // (2 * arch.num_layers) * count * sequence + count * arch.vocab_size * (act + 3 * 4)
    if prompt_forward > last_token:
        return cache, Amount(prompt_forward, f"forward of the {count} x {prompt} prompt tokens")
    return cache, Amount(last_token, "one layer's keys copied as the cache grows + next-token logits")
