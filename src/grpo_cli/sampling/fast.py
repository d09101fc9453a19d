"""Group sampling with our own decode loop (`sampler=fast`), drawing from the same distribution
as transformers' `generate` (`sampler=hf`), with less work per token:

- each prompt is encoded once, and its keys and values are copied to its G completions
  (generate encodes every prompt G times);
- the keys and values live in buffers allocated once for the whole completion, written in
  place (generate's dynamic cache concatenates every layer's cache at every token);
- the prompt pass computes logits for its last position only;
- a token is drawn with a few tensor operations: min_new_tokens, temperature, top-k, top-p,
  as generate's processors do them and in their order, without its per-step machinery;
- each token runs through the decoder's layers directly, with the attention mask made once
  (the model's forward rebuilds it at every token), where the model allows it; there the
  linear layers multiply by weights laid out once per decode for the CPU's fastest GEMM
  (packed.decode_gemm: oneDNN's, in bfloat16 under autocast, or MKL's packed one in float32
  on an Intel CPU), not laid out or cast again at every token;
- the loop runs under inference mode (no-grad mode under FSDP) and stops as soon as every
  completion has ended;
- within `keeping_turns` (a multi-turn rollout) each decode keeps its rows' keys and values, and
  the next turn prefills only what follows each conversation's kept prefix (KeptTurns).

The pure core is `next_token_scores` (the distribution) and `draw_tokens` (one token per row).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer

from grpo_cli.config import SamplerConfig
from grpo_cli.models.loading import autocast_to
from grpo_cli.models.transformers_api import returned_cache, with_cache
from grpo_cli.records import PromptBatch, Rollout
from grpo_cli.sampling.packed import LowPrecisionLinears, PackedLinears, ReorderedLinears, decode_gemm
from grpo_cli.sampling.rollouts import rollout_from


def next_token_scores(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Logits [N, V] -> the scores whose softmax is the sampling distribution, as generate's
    TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper make them (in that order):
    removed tokens get -inf. Example: logits [2, 1, 0], top_k 2 -> [2, 1, -inf]."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, -torch.inf)
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        # drop the least likely tokens whose total mass stays within 1 - top_p; keep the best one
        remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
        remove[..., -1] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), -torch.inf)
    return scores


def draw_tokens(scores: torch.Tensor, greedy: bool) -> torch.Tensor:
    """One token id per row of scores [N, V]: the best, or a sample of softmax(scores).

    Sampling inverts the cumulative distribution at one uniform number per row: the first
    token whose cumulative probability exceeds u. That is an exact draw (removed tokens have
    zero-width intervals) and needs N random numbers where torch.multinomial draws N x V
    exponentials, the slowest part of a CPU decode step. Float64 keeps the sum's rounding far
    below the smallest probabilities of a large vocabulary."""
    if greedy:
        return scores.argmax(dim=-1)
    cumulative = scores.softmax(dim=-1).double().cumsum(dim=-1)  # [N, V]
    u = torch.rand(scores.shape[0], 1, dtype=torch.float64, device=scores.device) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, u, right=True).squeeze(1).clamp_(max=scores.shape[1] - 1)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values [N, kv_heads, capacity, head_dim], written in place; attention
    reads the filled part, a view. Made from the keys and values so far [N, kv_heads, L, head_dim]."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        shape = (keys.shape[0], keys.shape[1], capacity, keys.shape[3])
        self.key_buffer = keys.new_empty(shape)
        self.value_buffer = values.new_empty(shape)
        self.length = keys.shape[2]
        self.key_buffer[:, :, : self.length] = keys
        self.value_buffer[:, :, : self.length] = values
        self.device, self.is_initialized = keys.device, True
        self._expose()

    def _expose(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[2]
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values


SINGLE_QUERY_ATTENTION = "grpo_cli_single_query"


def single_query_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of one new token per sequence over its keys and values, as two batched matmuls:
    query [N, H, 1, d], key and value [N, KV, L, d] (KV divides H: grouped-query attention),
    attention_mask [N, 1, 1, L] additive (0 = attend, -inf = padding). Returns ([N, 1, H, d],
    None), the layout transformers' attention functions return. On a CPU decode step this costs
    about a third of sdpa's kernel, which is built for many queries."""
    count, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scaling = dim**-0.5 if scaling is None else scaling
    grouped = query.view(count, kv_heads, heads // kv_heads, dim)  # the query heads that share a key head
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scaling + attention_mask  # [N, KV, H/KV, L]
    attended = torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)  # [N, KV, H/KV, d]
    return attended.view(count, 1, heads, dim), None


AttentionInterface.register(SINGLE_QUERY_ATTENTION, single_query_attention)


class AttentionImplementation:
    """A reusable `with` block within which the policy's attention layers call the attention
    function registered as `name`; the model's own choice is back in force outside it."""

    def __init__(self, policy, name: str):
        self.config = (policy.get_base_model() if hasattr(policy, "get_base_model") else policy).config
        self.name, self.previous = name, self.config._attn_implementation

    def __enter__(self):
        self.config._attn_implementation = self.name

    def __exit__(self, *exc):
        self.config._attn_implementation = self.previous


def runs_layer_by_layer(policy, capacity: int) -> bool:
    """Whether one_token_forward runs `policy` layer by layer: a Qwen2/Llama-style decoder
    (embed_tokens, rotary_emb, layers, norm) with sdpa attention over every position of
    sequences of up to `capacity` tokens (no sliding window within them)."""
    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    decoder, config = getattr(model, "model", None), model.config
    return (
        getattr(config, "_attn_implementation", None) == "sdpa"
        and all(hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm"))
        and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])
        and (getattr(config, "sliding_window", None) or capacity) >= capacity
    )


def one_token_forward(policy, attention: torch.Tensor, cache, layer_by_layer: bool):
    """A function (tokens [N], positions [N, 1], length) -> next-token logits [N, V] that runs one
    token per sequence through the policy, its keys and values going into `cache`; `length` is
    the positions attended so far, this token's included. attention: [N, P + T] (1 = a token).

    A Qwen2/Llama-style decoder with sdpa attention is run layer by layer, with its attention
    mask made once: the model's forward would rebuild the mask, and pass through its output
    wrappers, at every token (`layer_by_layer`, where runs_layer_by_layer allows it); call it
    within AttentionImplementation(policy, SINGLE_QUERY_ATTENTION). Otherwise the model's own
    forward."""
    if not layer_by_layer:

        def forward(tokens: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
            return policy(
                input_ids=tokens[:, None],
                attention_mask=attention[:, :length],
                position_ids=positions,
                use_cache=True,
                **with_cache(cache),
            ).logits[:, -1]

        return forward

    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy  # peft: LoRA stays on
    decoder, config = model.model, model.config
    # [N, 1, 1, P + T]: 0 where a position may be attended, -inf on padding (single_query_attention)
    attention_bias = torch.zeros(attention.shape, device=attention.device)
    attention_bias = attention_bias.masked_fill_(attention == 0, -torch.inf)[:, None, None]
    layers, head = decoder.layers[: config.num_hidden_layers], model.get_output_embeddings()

    def forward(tokens: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        hidden = decoder.embed_tokens(tokens[:, None])  # [N, 1, h]
        rotary = decoder.rotary_emb(hidden, positions)
        for layer in layers:
            hidden = layer(
                hidden,
                attention_mask=attention_bias[..., :length],
                position_embeddings=rotary,
                position_ids=positions,
                use_cache=True,
                **with_cache(cache),
            )
        return head(decoder.norm(hidden[:, -1]))

    return forward


class KeptTurns:
    """The keys and values of a decode's rows (FastSampler.keeping_turns), each row's context and
    the tokens it drew up to its end, for the next turn of the same conversations."""

    def __init__(self):
        self.ids: list[torch.Tensor] = []  # each kept row's tokens [L_j]
        self.keys: list[list[torch.Tensor]] = []  # each kept row's, layer by layer [kv_heads, L_j, head_dim]
        self.values: list[list[torch.Tensor]] = []

    def longest_prefix(self, ids: torch.Tensor) -> tuple[int, int]:
        """The kept row sharing the longest prefix with `ids` [L], and that prefix's length: at
        most L - 1, so that a prefill is left to give the next token's logits (0: none shared)."""
        best, best_length = 0, 0
        for index, kept in enumerate(self.ids):
            width = min(len(kept), len(ids) - 1)
            differ = (kept[:width] != ids[:width]).nonzero()
            length = int(differ[0, 0]) if len(differ) else width
            if length > best_length:
                best, best_length = index, length
        return best, best_length

    def after_prefixes(self, ids: torch.Tensor, mask: torch.Tensor):
        """The prefill of rows ids, mask [U, P] (left-padded) after their kept prefixes:
        (new ids [U, S], context ids [U, C + S], context mask [U, C + S], past cache or None).
        Row u's kept prefix is right-aligned in the first C positions and its new tokens in the
        last S, padding (holes) before each; the past holds the kept keys and values where the
        prefix is. The kept rows are dropped (the decode keeps its own)."""
        rows = [ids[u][mask[u].bool()] for u in range(ids.shape[0])]
        matches = [self.longest_prefix(row) for row in rows]
        kept_width = max((length for _, length in matches), default=0)
        if kept_width == 0:
            self.ids, self.keys, self.values = [], [], []
            return ids, ids, mask, None
        new_width = max(len(row) - length for row, (_, length) in zip(rows, matches))
        width = kept_width + new_width
        context_ids, context_mask = ids.new_zeros(ids.shape[0], width), mask.new_zeros(ids.shape[0], width)
        first = self.keys[0]
        past_keys = [layer.new_zeros(ids.shape[0], layer.shape[0], kept_width, layer.shape[2]) for layer in first]
        past_values = [torch.zeros_like(layer) for layer in past_keys]
        for u, (row, (index, length)) in enumerate(zip(rows, matches)):
            fresh = len(row) - length
            context_ids[u, kept_width - length : kept_width], context_ids[u, width - fresh :] = (
                row[:length],
                row[length:],
            )
            context_mask[u, kept_width - length : kept_width], context_mask[u, width - fresh :] = 1, 1
            for layer in range(len(first)):
                past_keys[layer][u, :, kept_width - length :] = self.keys[index][layer][:, :length]
                past_values[layer][u, :, kept_width - length :] = self.values[index][layer][:, :length]
        self.ids, self.keys, self.values = [], [], []
        past = DynamicCache()
        for layer, (keys, values) in enumerate(zip(past_keys, past_values)):
            past.update(keys, values, layer)
        return context_ids[:, kept_width:], context_ids, context_mask, past

    def keep(
        self,
        context_ids: torch.Tensor,  # [N, W]
        attention: torch.Tensor,  # [N, W + T]: 1 = a token
        layers: list[PreallocatedLayer],
        completions: torch.Tensor,  # [N, T]
        eos: int,
    ) -> None:
        """Each row's context and drawn tokens up to its EOS, as far as their keys and values were
        written (a turn's last token is drawn, never run through the model). Rows alike (greedy
        copies, or samples that drew the same) are kept once."""
        width = context_ids.shape[1]
        written = layers[0].length - width  # completion tokens run through the model
        seen = {tuple(ids.tolist()) for ids in self.ids}
        for row in range(context_ids.shape[0]):
            drawn = completions[row, :written]
            ends = (drawn == eos).nonzero()
            drawn = drawn[: int(ends[0, 0]) + 1] if len(ends) else drawn
            real = attention[row, :width].bool()
            ids = torch.cat([context_ids[row][real], drawn])
            key = tuple(ids.tolist())
            if key in seen:
                continue
            seen.add(key)
            where = torch.cat([real.nonzero()[:, 0], torch.arange(width, width + len(drawn), device=real.device)])
            self.ids.append(ids)
            self.keys.append([layer.key_buffer[row][:, where] for layer in layers])
            self.values.append([layer.value_buffer[row][:, where] for layer in layers])


class FastSampler:
    def __init__(self, cfg: SamplerConfig, tokenizer, synced: bool = False, autocast: torch.dtype | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.autocast = autocast
        # FSDP: every rank runs the same number of forward passes (each gathers weights), so a
        # rank whose completions have all ended keeps stepping until every rank has.
        self.synced = synced
        self.kept: KeptTurns | None = None  # within keeping_turns: the last decode's keys and values

    def sample(self, policy, batch: PromptBatch, group_size: int | None = None) -> Rollout:
        """G completions per prompt; G = sampler.group_size unless given (adaptive group size)."""
        group = group_size or self.cfg.group_size
        completion_ids = self.decode(policy, batch.input_ids, batch.attention_mask, group, greedy=False)
        return rollout_from(batch, group, completion_ids, self.tokenizer, self.cfg.temperature)

    def close(self) -> None:
        """Nothing to free: the sampler holds nothing beyond the policy."""

    def greedy(self, policy, batch: PromptBatch) -> list[str]:
        """One greedy completion per prompt (for eval)."""
        completion_ids = self.decode(policy, batch.input_ids, batch.attention_mask, 1, greedy=True)
        return self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    @contextlib.contextmanager
    def keeping_turns(self):
        """Within it, each decode keeps its rows' keys and values, and the next decode prefills
        only what follows each row's longest kept prefix: the turns of one multi-turn rollout,
        whose conversations grow by the turn drawn and the reply to it. Dropped at the end (the
        next rollout samples from new weights)."""
        self.kept = KeptTurns()
        try:
            yield
        finally:
            self.kept = None

    def decode(
        self, policy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, copies: int, greedy: bool
    ) -> torch.Tensor:
        """Completion ids [B*copies, T] (T = max_new_tokens), rows grouped by prompt; after a
        completion's EOS come pad tokens. prompt_ids, prompt_mask: [B, P], left-padded."""
        cfg, eos, pad = self.cfg, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        device = next(policy.parameters()).device
        kept = self.kept if copies == 1 and not self.synced else None
        was_training = policy.training
        policy.eval()  # no dropout; also lets a checkpointed model use its KV cache
        # FSDP gathers each layer's weights into buffers it writes in place in training too: made
        # under inference mode, they could not be written outside it. No-grad mode there.
        no_grad = torch.no_grad() if self.synced else torch.inference_mode()
        try:
            with no_grad, autocast_to(self.autocast, device):
                prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
                if kept is None:  # each prompt once, its keys and values copied to its completions
                    rows = torch.arange(prompt_ids.shape[0], device=device).repeat_interleave(copies)
                    new_ids, context_ids, context_mask, past = prompt_ids, prompt_ids, prompt_mask, None
                else:  # identical rows once (a rollout's first turn: G copies of each prompt)
                    together = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
                    unique, rows = torch.unique(together, dim=0, return_inverse=True)
                    prompt_width = prompt_ids.shape[1]
                    new_ids, context_ids, context_mask, past = kept.after_prefixes(
                        unique[:, :prompt_width], unique[:, prompt_width:]
                    )
                width = context_mask.shape[1]  # [U, W]: prompt_mask's, or kept prefix and new tokens with holes
                positions = (context_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # [U, W]; holes are padding
                output = policy(
                    input_ids=new_ids,
                    attention_mask=context_mask,
                    position_ids=positions[:, width - new_ids.shape[1] :],
                    use_cache=True,
                    logits_to_keep=1,
                    **with_cache(past),
                )
                # FSDP (synced) gathers the weights in the model's own forward: no layer-by-layer there
                direct = not self.synced and runs_layer_by_layer(policy, width + cfg.max_new_tokens)
                attending = (
                    AttentionImplementation(policy, SINGLE_QUERY_ATTENTION) if direct else contextlib.nullcontext()
                )
                # the context's keys and values: copied once per completion, with room for it
                cache = returned_cache(output)
                cache.layers = [
                    PreallocatedLayer(layer.keys[rows], layer.values[rows], width + cfg.max_new_tokens)
                    for layer in cache.layers
                ]
                logits = output.logits[:, -1][rows]  # [N, V]
                count = logits.shape[0]
                # Every position a completion can reach: its context's padding, then its own tokens.
                attention = torch.cat([context_mask[rows], context_mask.new_ones(count, cfg.max_new_tokens)], dim=1)
                one_token = one_token_forward(policy, attention, cache, direct)
                packed = self.decode_weights(policy, count, direct)
                next_position = positions[:, -1:][rows] + 1  # [N, 1]
                completions = torch.full((count, cfg.max_new_tokens), pad, dtype=torch.long, device=device)
                running = torch.ones(count, dtype=torch.bool, device=device)
                for step in range(cfg.max_new_tokens):
                    if step < cfg.min_new_tokens:  # generate's MinNewTokensLengthLogitsProcessor
                        logits[:, eos] = -torch.inf
                    scores = (
                        logits.float() if greedy else next_token_scores(logits, cfg.temperature, cfg.top_k, cfg.top_p)
                    )
                    tokens = torch.where(running, draw_tokens(scores, greedy), pad)
                    completions[:, step] = tokens
                    running &= tokens != eos
                    if step == cfg.max_new_tokens - 1 or not self._any_running(running):
                        break
                    with attending, packed:  # the decode steps only: the prompt pass above ran sdpa
                        logits = one_token(tokens, next_position, width + step + 1)
                    next_position = next_position + 1
                if kept is not None:
                    kept.keep(context_ids[rows], attention, cache.layers, completions, eos)
        finally:
            policy.train(was_training)
        return completions.cpu().clone()  # a normal tensor: inference-mode ones cannot enter autograd

    def decode_weights(self, policy, rows: int, direct: bool):
        """The decode steps' weights, prepared once for this decode for the GEMM decode_gemm
        picks (under autocast in its dtype: MKL's packed GEMM would run in float32 where autocast
        casts). Only layer by layer (`direct`) on the CPU: under FSDP the forward gathers its
        weights at every call, and a GPU's GEMM needs no layout."""
        gemm = decode_gemm(self.autocast) if direct and next(policy.parameters()).device.type == "cpu" else "plain"
        if gemm == "onednn":
            return ReorderedLinears(policy, rows, self.autocast)
        if gemm == "mkl_packed":
            return PackedLinears(policy, rows)
        if direct and self.autocast is not None:  # "bfloat16_copy" on the CPU, and a GPU's
            return LowPrecisionLinears(policy, self.autocast)
        return contextlib.nullcontext()

    def _any_running(self, running: torch.Tensor) -> bool:
        flag = running.any().float()
        if self.synced:
            import torch.distributed as dist

            flag = flag.cuda() if dist.get_backend() == "nccl" else flag
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
