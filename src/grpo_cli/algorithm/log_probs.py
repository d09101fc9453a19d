"""The update's log-probs: log pi(completion token | prompt, earlier tokens) for the policy, the
old policy and the reference, and the policy's entropy, from one model forward.

Where the model allows it (`output_head`), the vocabulary's logits are never held whole: the
forward asks the model for one logit per row (logits_to_keep=1) and takes the decoder's final
hidden states [N, L, h] from a hook; the LM head then runs on the scored positions only, a
chunk of positions at a time (head_token_log_probs), each chunk's logits recomputed in the
backward (torch.utils.checkpoint) instead of kept. A step's extra memory for the vocabulary is
then one chunk of logits (LOGIT_CHUNK_ELEMENTS), not [N, T, V] logits and their gradient (for
Qwen2.5's V = 151936 those outweigh a small decoder's activations); the price is the head's
forward run twice for the policy (docs/BENCHMARKS.md measures both). This is what Liger's
fused linear losses and Unsloth's chunked GRPO loss do, with the loss left outside the chunks,
so every objective of losses.py keeps its own code. Models whose logits are more than the head
of the hidden states (a logit soft-cap or scale in their config), models without a decoder
lookup, and FSDP (whose root unshards the head only inside its forward) take the full-logits
path, which chunks the log-softmax only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from grpo_cli.algorithm.losses import (
    LOGIT_CHUNK_ELEMENTS,
    compute_dtype,
    entropy_gradient,
    token_entropy,
    token_log_probs,
)
from grpo_cli.models import cpu_gemm
from grpo_cli.models.transformers_api import checkpoints_activations, returned_cache, with_cache

# Config fields of models whose logits are not lm_head(hidden): Gemma 2's soft-cap, Cohere's
# logit_scale, Granite's logits_scaling. Their log-probs come from the model's own logits.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def completion_log_probs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,  # [N, P]
    prompt_mask: torch.Tensor,  # [N, P]
    completion_ids: torch.Tensor,  # [N, T]
    completion_mask: torch.Tensor,  # [N, T]
    temperature: float = 1.0,
    with_entropy: bool = False,
    group_size: int = 1,
    through_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(completion token | prompt, earlier tokens): [N, T], and optionally entropies [N, T].

    pi is the distribution the tokens were sampled from, softmax(logits / temperature), as TRL
    and verl compute it: the ratio and the KL then compare like with like.

    `group_size` > 1: the rows come in groups of that many completions of one prompt (a
    Rollout's layout). Each prompt then runs through the model once, and its keys and values
    serve its whole group (shared_prompt_hidden): the same numbers, with the prompt's share
    of the work divided by G. Rows whose prompts differ, and a model that drops its cache to
    checkpoint gradients, take the plain path.

    `through_head` (the default, where output_head finds the head): the LM head runs on the
    hidden states of the completion tokens only (completion_mask 1), by chunks; positions past
    a completion's end then hold 0 (log-prob and entropy), which nothing reads. False: the
    model's own [N, T + 1, V] logits at every position (the path kept for the models and
    wrappers output_head refuses; tests compare the two).
    """
    head = output_head(model) if through_head else None
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    # Left padding: positions count real tokens only, as `generate` numbered them when sampling.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    rows = (input_ids, attention_mask, position_ids, prompt_ids.shape[1])
    if group_size > 1 and keeps_cache(model) and one_prompt_per_group(prompt_ids, prompt_mask, group_size):
        if head is not None:
            hidden = shared_prompt_hidden(model, *rows, group_size)
            if hidden is not None:
                return head_token_log_probs(head, hidden, completion_ids, completion_mask, temperature, with_entropy)
        else:
            shared = shared_prompt_log_probs(model, *rows, group_size, temperature, with_entropy)
            if shared is not None:
                return shared
    if head is not None:
        hidden = plain_hidden(model, *rows)
        return head_token_log_probs(head, hidden, completion_ids, completion_mask, temperature, with_entropy)
    length = completion_ids.shape[1]
    # [N, T + 1, V]: the last prompt position predicts the first completion token; the final
    # position (after the last token) is ignored by token_log_probs without slicing a copy.
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=length + 1,
        use_cache=False,
    ).logits
    log_probs = token_log_probs(logits, completion_ids, temperature)
    entropy = token_entropy(logits, length, temperature) if with_entropy else None
    return log_probs, entropy


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP's and peft's wrappers (LoRA layers stay in it)."""
    inner = getattr(model, "module", model)  # DDP
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The LM head module where the logits are exactly head(final hidden states), else None
    (the caller then asks the model for its logits). See the module docstring for who is refused."""
    inner = causal_lm(model)
    if not (hasattr(inner, "get_decoder") and hasattr(inner, "get_output_embeddings")):
        return None
    config = getattr(inner, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return None
    with contextlib.suppress(ImportError):
        from torch.distributed.fsdp import FSDPModule

        if isinstance(getattr(model, "module", model), FSDPModule):
            return None
    head = inner.get_output_embeddings()
    return head if isinstance(head, torch.nn.Module) else None


@contextlib.contextmanager
def final_hidden_states(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects, forward by forward, the decoder's output [n, l, h]: the final norm's output, the
    LM head's input. The hook sits on the decoder, so the wrappers (DDP, peft) still run."""
    captured: list[torch.Tensor] = []

    def keep(module, args, output) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = causal_lm(model).get_decoder().register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def plain_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [N, P + T]
    attention_mask: torch.Tensor,  # [N, P + T]
    position_ids: torch.Tensor,  # [N, P + T]
    prompt_length: int,  # P
) -> torch.Tensor:
    """One forward of prompt and completion: the hidden states that predict the completion
    tokens, [N, T, h] (position P - 1 predicts the first). The model's own logits: one row."""
    with final_hidden_states(model) as captured:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=1,
            use_cache=False,
        )
    return captured[0][:, prompt_length - 1 : -1]


def shared_prompt_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [N, P + T]: prompt then completion, rows grouped by prompt
    attention_mask: torch.Tensor,  # [N, P + T]
    position_ids: torch.Tensor,  # [N, P + T]
    prompt_length: int,  # P
    group_size: int,  # G
) -> torch.Tensor | None:
    """plain_hidden with one prompt pass per group (shared_prompt_pass): [N, T, h], or None for
    a model whose cache cannot be repeated per row."""
    with final_hidden_states(model) as captured:
        if shared_prompt_pass(model, input_ids, attention_mask, position_ids, prompt_length, group_size, 1) is None:
            return None
    first = captured[0][:, -1:].repeat_interleave(group_size, dim=0)  # [N, 1, h] predicts token 0
    return torch.cat([first, *captured[1:]], dim=1)  # [N, T, h]


def head_token_log_probs(
    head: torch.nn.Module,
    hidden: torch.Tensor,  # [N, T, h]: position t predicts tokens[:, t]
    tokens: torch.Tensor,  # [N, T]
    scored: torch.Tensor,  # [N, T] 1 where a log-prob is wanted (completion tokens)
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden) / temperature)[token] at the scored positions, [N, T] (0 at the
    others), and the entropies likewise (differentiable: the entropy bonus), LOGIT_CHUNK_ELEMENTS logits at a time.

    With gradients, nothing of a chunk but its [n, h] hidden rows outlives it: the backward
    recomputes its logits to get the gradient of the hidden states and of the head's weights,
    by _LinearHeadLogProbs for an nn.Linear head, else under torch.utils.checkpoint (which
    replays the forward's autocast; a LoRA on the head).
    Example: V = 151936 -> chunks of 110 positions (about 64 MiB of float32 logits each)."""
    count, length = tokens.shape
    where = scored.reshape(-1).nonzero().squeeze(1)  # [M] flat indices of the scored positions
    rows = hidden.reshape(count * length, -1).index_select(0, where)  # [M, h]
    picked = tokens.reshape(-1).index_select(0, where)  # [M]
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // vocab)
    if type(head) is torch.nn.Linear:  # the usual head: its weight read directly, its gradient summed in place
        device = rows.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
        log_probs, entropy = _LinearHeadLogProbs.apply(
            rows, head.weight, head.bias, picked, temperature, chunk, dtype, with_entropy
        )
        return _scatter(log_probs, where, count, length), _scatter(entropy, where, count, length)
    grads = torch.is_grad_enabled() and rows.requires_grad
    log_probs, entropies = [], []
    for start in range(0, rows.shape[0], chunk):
        block = (head, rows[start : start + chunk], picked[start : start + chunk], temperature, with_entropy)
        if grads:
            chunk_log_probs, chunk_entropy = checkpoint(_chunk_log_probs, *block, use_reentrant=False)
        else:
            chunk_log_probs, chunk_entropy = _chunk_log_probs(*block)
        log_probs.append(chunk_log_probs)
        entropies.append(chunk_entropy)
    if not log_probs:  # no scored position at all
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return _scatter(empty, where, count, length), _scatter(empty, where, count, length) if with_entropy else None
    entropy = torch.cat(entropies) if with_entropy else None
    return _scatter(torch.cat(log_probs), where, count, length), _scatter(entropy, where, count, length)


def _scatter(values: torch.Tensor | None, where: torch.Tensor, count: int, length: int) -> torch.Tensor | None:
    """[M] values at flat positions `where` -> [count, length], 0 elsewhere (None stays None)."""
    if values is None:
        return None
    flat = values.new_zeros(count * length)
    return flat.index_copy(0, where, values).view(count, length)


def _scaled_logits(inputs, weight, bias, compute: torch.dtype, temperature: float) -> torch.Tensor:
    """One chunk's logits / temperature in `compute` (float32): [c, h] -> [c, V]. The forward and
    the backward's recomputation must give the same numbers, so both call this."""
    return cpu_gemm.linear(inputs, weight, bias).to(compute) / temperature  # oneDNN where it pays


class _LinearHeadLogProbs(torch.autograd.Function):
    """log softmax(rows W^T + b) / temperature)[token] and the entropy for an nn.Linear head,
    `chunk` rows at a time, the matmuls in `dtype` (autocast's, else the weight's) and the
    softmax in float32. The backward recomputes each chunk's logits and sums the weight's
    gradient over chunks into one buffer (in place in float32), so no [V, h] temporary per
    chunk and no logits outlive their chunk. With x = logits / temperature and g the incoming
    gradient of a row's log-prob: d/dlogits = g (onehot(token) - softmax(x)) / temperature,
    plus, for the entropy bonus, g_H dH/dx / temperature (losses.entropy_gradient);
    rows' gradient = that @ W, W's = that^T @ rows, b's = its sum over rows."""

    @staticmethod
    def forward(ctx, rows, weight, bias, tokens, temperature, chunk, dtype, with_entropy):  # [M, h], [V, h], [V], [M]
        compute = compute_dtype(dtype)
        weight_in, bias_in = weight.to(dtype), None if bias is None else bias.to(dtype)
        log_probs = rows.new_empty(rows.shape[0], dtype=compute)
        entropy = rows.new_empty(rows.shape[0], dtype=compute) if with_entropy else None
        for start in range(0, rows.shape[0], chunk):
            part = slice(start, start + chunk)
            logits = _scaled_logits(rows[part].to(dtype), weight_in, bias_in, compute, temperature)
            normalizer = torch.logsumexp(logits, dim=-1)
            log_probs[part] = logits.gather(-1, tokens[part].unsqueeze(-1)).squeeze(-1) - normalizer
            if with_entropy:
                entropy[part] = normalizer - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
        ctx.save_for_backward(rows, weight, bias, tokens)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.set_materialize_grads(False)  # an output nothing used gets None, not zeros to multiply
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        rows, weight, bias, tokens = ctx.saved_tensors
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None
        need_rows, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype, compute, temperature = ctx.dtype, compute_dtype(ctx.dtype), ctx.temperature
        weight_in, bias_in = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_rows = torch.empty_like(rows) if need_rows else None
        grad_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=compute, device=weight.device) if need_bias else None
        for start in range(0, rows.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            inputs = rows[part].to(dtype)
            logits = _scaled_logits(inputs, weight_in, bias_in, compute, temperature)
            if grad_log_probs is not None:
                scale = grad_log_probs[part].to(compute).unsqueeze(-1) / temperature  # [c, 1]
                grad_logits = (
                    torch.softmax(logits, dim=-1).mul_(-scale).scatter_add_(-1, tokens[part].unsqueeze(-1), scale)
                )
            else:
                grad_logits = torch.zeros_like(logits)
            if grad_entropy is not None:  # the entropy bonus: logits are already / temperature
                entropy_scale = grad_entropy[part].to(compute).unsqueeze(-1)  # [c, 1]
                grad_logits += entropy_gradient(logits, 1.0).mul_(entropy_scale / temperature)
            if need_bias:
                grad_bias += grad_logits.sum(dim=0)
            grad_logits = grad_logits.to(dtype)
            if need_rows:
                grad_rows[part] = (grad_logits @ weight_in).to(rows.dtype)
            if need_weight and dtype == compute:
                grad_weight.addmm_(grad_logits.T, inputs)
            elif need_weight:  # bfloat16 matmul, summed in float32
                grad_weight += grad_logits.T @ inputs
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_rows, grad_weight, grad_bias, None, None, None, None, None


def _chunk_log_probs(
    head: torch.nn.Module, rows: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[n, h] hidden rows -> ([n] log-probs of `tokens`, [n] entropies or None)."""
    logits = head(rows).unsqueeze(0)  # [1, n, V]
    log_probs = token_log_probs(logits, tokens.unsqueeze(0), temperature)[0]
    entropy = token_entropy(logits, None, temperature)[0] if with_entropy else None
    return log_probs, entropy


def one_prompt_per_group(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int) -> bool:
    """Whether rows [N, P] come in groups of `group_size` equal prompts, N a multiple of it."""
    if prompt_ids.shape[0] % group_size:
        return False
    for rows in (prompt_ids, prompt_mask):
        grouped = rows.view(-1, group_size, rows.shape[1])  # [B, G, P]
        if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
            return False
    return True


def keeps_cache(model: torch.nn.Module) -> bool:
    """False where a forward with gradients drops the KV cache (gradient checkpointing does)."""
    inner = getattr(model, "module", model)  # DDP
    return not (torch.is_grad_enabled() and checkpoints_activations(inner))


def shared_prompt_pass(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [N, P + T]: prompt then completion, rows grouped by prompt
    attention_mask: torch.Tensor,  # [N, P + T]
    position_ids: torch.Tensor,  # [N, P + T]
    prompt_length: int,  # P
    group_size: int,  # G
    logits_to_keep: int = 0,  # the completions' logits: 0 all, 1 the last (their hidden states are read)
) -> list | None:
    """The model's outputs [prompt pass (N / G rows), completion pass (N rows), if T > 1] with
    one prompt pass per group; None for a model whose cache cannot be repeated per row (the
    caller takes the plain path).

    1. Each group's prompt, B = N / G rows, runs once, keeping its keys and values (and its last
       position's logits or hidden state, which predict the first completion token).
    2. The keys and values are repeated G times (autograd sums the G copies' gradients back into
       the one prompt pass), and the completions, less their last token (nothing after it is
       scored), run on top of them.
    Equal to the plain pass up to float rounding (tests/test_update.py); the time it saves grows
    with the prompt's length (docs/BENCHMARKS.md measures it)."""
    completion_ids = input_ids[:, prompt_length:]  # [N, T]
    firsts = slice(0, None, group_size)  # the first row of each group
    prompt = model(
        input_ids=input_ids[firsts, :prompt_length],
        attention_mask=attention_mask[firsts, :prompt_length],
        position_ids=position_ids[firsts, :prompt_length],
        use_cache=True,
        logits_to_keep=1,
    )
    cache = returned_cache(prompt)
    if not hasattr(cache, "batch_repeat_interleave"):  # a model with another kind of state
        return None
    cache.batch_repeat_interleave(group_size)
    if completion_ids.shape[1] == 1:
        return [prompt]
    completions = model(
        input_ids=completion_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, prompt_length:-1],
        use_cache=True,
        logits_to_keep=logits_to_keep,
        **with_cache(cache),
    )
    return [prompt, completions]


def shared_prompt_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [N, P + T]
    attention_mask: torch.Tensor,  # [N, P + T]
    position_ids: torch.Tensor,  # [N, P + T]
    prompt_length: int,  # P
    group_size: int,  # G
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """completion_log_probs from the model's own logits with one prompt pass per group: [N, T]
    log-probs (and entropies), or None (shared_prompt_pass)."""
    outputs = shared_prompt_pass(model, input_ids, attention_mask, position_ids, prompt_length, group_size)
    if outputs is None:
        return None
    completion_ids = input_ids[:, prompt_length:]  # [N, T]
    first_logits = outputs[0].logits.repeat_interleave(group_size, dim=0)  # [N, 1, V]
    log_probs = [token_log_probs(first_logits, completion_ids[:, :1], temperature)]
    entropy = [token_entropy(first_logits, 1, temperature)] if with_entropy else None
    if len(outputs) > 1:
        logits = outputs[1].logits  # [N, T-1, V]
        log_probs.append(token_log_probs(logits, completion_ids[:, 1:], temperature))
        if with_entropy:
            entropy.append(token_entropy(logits, None, temperature))
    return torch.cat(log_probs, dim=1), torch.cat(entropy, dim=1) if with_entropy else None
