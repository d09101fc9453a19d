"""sampler=fast draws from the same distribution as sampler=hf (transformers' generate): the
warpers equal transformers' own on random logits, greedy outputs are identical, and first- and
second-token frequencies over thousands of samples pass a two-sample chi-square test (which
does reject a sampler at another temperature)."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from grpo_cli.data.prompts import PromptSource
from grpo_cli.models.cpu_gemm import onednn_bfloat16_available, onednn_gemm_available
from grpo_cli.models.loading import load_models
from grpo_cli.sampling import Sampler, make_sampler
from grpo_cli.sampling.fast import (
    FastSampler,
    draw_tokens,
    next_token_scores,
    runs_layer_by_layer,
    single_query_attention,
)
from grpo_cli.sampling.hf import HFSampler
from grpo_cli.sampling.packed import PackedLinears, decode_gemm, packed_gemm_available
from helpers import config, homogeneity_p_value, multinomial_draw, token_counts


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.5)])
def test_the_scores_are_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(16, 300) * 3
    expected = logits.clone()
    for warper, used in (
        (TemperatureLogitsWarper(temperature), True),
        (TopKLogitsWarper(max(top_k, 1)), top_k > 0),
        (TopPLogitsWarper(top_p), top_p < 1.0),
    ):
        expected = warper(None, expected) if used else expected
    assert torch.equal(next_token_scores(logits, temperature, top_k, top_p), expected)


def test_top_k_and_top_p_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert next_token_scores(logits, 1.0, 2, 1.0).isinf().tolist() == [[False, False, True, True]]
    # softmax: 0.644, 0.237, 0.087, 0.032. top_p 0.85: the two best hold 0.881 >= 0.85, so the
    # 0.087 and 0.032 go (their 0.119 is within 1 - 0.85 = 0.15); top_p 0.9 keeps three.
    assert next_token_scores(logits, 1.0, 0, 0.85).isinf().tolist() == [[False, False, True, True]]
    assert next_token_scores(logits, 1.0, 0, 0.9).isinf().tolist() == [[False, False, False, True]]


def test_draw_follows_the_probabilities_and_never_picks_a_removed_token():
    # probabilities 0.5, 0.3, 0.2 and a removed token; 100,000 draws: each frequency within 5
    # standard errors (sqrt(p (1 - p) / n) <= 0.0016) of its probability.
    torch.manual_seed(0)
    scores = torch.tensor([[0.5, 0.3, 0.2, 1.0]]).log()
    scores[0, 3] = -torch.inf
    counts = torch.bincount(draw_tokens(scores.expand(100_000, 4), greedy=False), minlength=4).double() / 100_000
    assert counts[3] == 0 and torch.allclose(counts[:3], torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.008)
    assert draw_tokens(scores, greedy=True).tolist() == [0]


def setup(tiny_model_dir, backend, *overrides):
    cfg = config(tiny_model_dir, f"sampler.backend={backend}", *overrides)
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    return cfg, models, make_sampler(cfg.sampler, models.tokenizer)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_single_query_attention_equals_sdpa(kv_heads):
    # One query per sequence over 7 cached positions, 4 query heads sharing kv_heads key heads
    # (grouped-query attention), the first two positions of row 1 padding.
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 4, 1, 8), torch.randn(3, kv_heads, 7, 8), torch.randn(3, kv_heads, 7, 8)
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[1, :2] = False
    bias = torch.zeros(3, 7).masked_fill(~keep, -torch.inf)[:, None, None]  # [3, 1, 1, 7]
    out, _ = single_query_attention(None, query, key, value, bias, scaling=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query,
        key.repeat_interleave(4 // kv_heads, dim=1),
        value.repeat_interleave(4 // kv_heads, dim=1),
        attn_mask=keep[:, None, None],
        scale=0.3,
    )  # [3, 4, 1, 8]
    assert out.shape == (3, 1, 4, 8) and torch.allclose(out, expected.transpose(1, 2), atol=1e-6)


needs_mkl = pytest.mark.skipif(not packed_gemm_available(), reason="this torch has no MKL packed GEMM")


@needs_mkl
def test_packed_linears_compute_the_layers_own_products_and_step_aside_after():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8, bias=False), torch.nn.Linear(8, 4))
    hooked = model[2]
    hooked.forward = lambda inputs: torch.zeros(inputs.shape[0], 4)  # a forward replaced by someone else
    packed = PackedLinears(model, rows=5, min_weights=0)
    assert [module for module, _ in packed.forwards] == [model[0], model[1]]
    for rows in (5, 3):  # the packed shape, and another that takes the plain GEMM
        inputs = torch.randn(rows, 16)
        with torch.inference_mode():
            expected = model[1](model[0](inputs))
            with packed:
                assert "forward" in vars(model[0]) and "forward" in vars(model[1])
                got = model[1](model[0](inputs))
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert "forward" not in vars(model[0]) and "forward" not in vars(model[1])  # the class's forward again
    assert "forward" in vars(hooked)
    # The weights packed are those of the block's making; an optimizer step needs a new block.
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ones = torch.ones(5, 16)
    with torch.inference_mode(), PackedLinears(model, rows=5, min_weights=0):
        torch.testing.assert_close(model[0](ones), ones @ model[0].weight.T + model[0].bias)


@needs_mkl
def test_sampling_with_packed_weights_draws_from_the_same_distribution(tiny_model_dir, monkeypatch):
    # The decode steps multiply by packed weights, made once per decode for B*G rows; every
    # step's scores are those of the plain GEMM, and the layers' own forward is back afterwards.
    # The two GEMMs may round differently (by CPU), so the plain run is fed the packed run's
    # tokens: a draw at a CDF boundary could flip, and then the runs would compare other
    # sequences. The scores agree to float32 rounding, not bit for bit.
    import grpo_cli.sampling.fast as fast
    import grpo_cli.sampling.packed as packed

    cfg, models, sampler = setup(
        tiny_model_dir, "fast", "data.prompts_per_step=8", "sampler.max_new_tokens=12", "sampler.min_new_tokens=12"
    )
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    products = Counter()
    # the tiny model's weights are all below the size worth packing: pack them all here
    assert not PackedLinears(models.policy, rows=32).forwards
    monkeypatch.setattr(packed, "PACK_MIN_WEIGHTS", 0)

    packed_forward = packed.packed_forward

    def counted_packed_forward(weight, bias, rows):
        forward = packed_forward(weight, bias, rows)
        return lambda inputs: products.update([tuple(inputs.shape)]) or forward(inputs)

    monkeypatch.setattr(packed, "packed_forward", counted_packed_forward)
    scores, drawn = {True: [], False: []}, []

    def replaying_draw(step_scores, greedy):  # the packed run draws, the plain run takes its tokens
        scores[packing].append(step_scores.clone())
        if packing:
            drawn.append(draw_tokens(step_scores, greedy))
        return drawn[len(scores[packing]) - 1]

    for packing in (True, False):
        # packing is the Intel CPU's path (packing_pays): forced either way, whatever this CPU is
        monkeypatch.setattr(packed, "intel_cpu", lambda packing=packing: packing)
        torch.manual_seed(0)
        with monkeypatch.context() as patch:
            patch.setattr(fast, "draw_tokens", replaying_draw)
            sampler.sample(models.policy, batch)
    layers = models.policy.config.num_hidden_layers
    # 11 decode steps through 7 linear layers per decoder layer and the head, all with 8 x 4 rows
    assert {shape[0] for shape in products} == {32}
    assert sum(products.values()) == 11 * (7 * layers + 1)
    # float32 rounding moves these logits (|x| < 6) by about 3e-6 from float64's: 1e-4 is far above
    # any two GEMMs' rounding, and far below a wrong product's error.
    assert len(scores[True]) == len(scores[False]) == 12
    for step, (packed_scores, plain_scores) in enumerate(zip(scores[True], scores[False])):
        torch.testing.assert_close(
            packed_scores, plain_scores, rtol=1e-4, atol=1e-4, msg=lambda message, step=step: f"step {step}: {message}"
        )
    assert not any("forward" in vars(module) for module in models.policy.modules())
    # Under autocast the layers must cast as autocast does: nothing is packed.
    products.clear()
    monkeypatch.setattr(packed, "intel_cpu", lambda: True)
    make_sampler(cfg.sampler, models.tokenizer, autocast=torch.bfloat16).sample(models.policy, batch)
    assert not products


def test_low_precision_linears_compute_autocasts_own_products_and_step_aside_after():
    from grpo_cli.sampling.packed import LowPrecisionLinears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8, bias=False), torch.nn.Linear(8, 4))
    hooked = model[2]
    hooked.forward = lambda inputs: torch.zeros(inputs.shape[0], 4)  # a forward replaced by someone else
    copies = LowPrecisionLinears(model, torch.bfloat16)
    assert [module for module, _ in copies.forwards] == [model[0], model[1]]
    inputs = torch.randn(5, 16)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model[1](model[0](inputs))  # autocast casts each weight at the call
        with copies:
            got = model[1](model[0](inputs))
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)  # the same kernel on the same values
    assert "forward" not in vars(model[0]) and "forward" not in vars(model[1]) and "forward" in vars(hooked)


def test_under_autocast_the_decode_steps_use_weight_copies_made_once_with_the_same_scores(tiny_model_dir, monkeypatch):
    # Autocast would cast every float32 weight again at every decode step (it keeps no cast in
    # inference mode); the sampler makes the bfloat16 copies once per decode instead. The steps'
    # scores, and so the draws, are those of autocast's own casts, bit for bit.
    import grpo_cli.sampling.fast as fast
    import grpo_cli.sampling.packed as packed
    from grpo_cli.sampling.fast import FastSampler

    cfg, models, _ = setup(tiny_model_dir, "fast", "sampler.max_new_tokens=8", "sampler.min_new_tokens=8")
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    sampler = make_sampler(cfg.sampler, models.tokenizer, autocast=torch.bfloat16)
    copies = Counter()
    cast_forward = packed.cast_forward

    def counted_cast_forward(weight, bias, dtype):
        copies.update([dtype])
        return cast_forward(weight, bias, dtype)

    monkeypatch.setattr(packed, "cast_forward", counted_cast_forward)
    monkeypatch.setattr(packed, "onednn_gemm_available", lambda: False)  # the copies' path, not oneDNN's
    rollouts, scores = [], {True: [], False: []}
    for held in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(
                fast,
                "draw_tokens",
                lambda step, greedy, held=held: scores[held].append(step) or draw_tokens(step, greedy),
            )
            if not held:  # autocast's per-call casts
                patch.setattr(FastSampler, "decode_weights", lambda *args: contextlib.nullcontext())
            torch.manual_seed(0)
            rollouts.append(sampler.sample(models.policy, batch))
    linears = sum(type(module) is torch.nn.Linear for module in models.policy.modules())
    assert copies == Counter({torch.bfloat16: linears})  # once per decode, not per token
    assert len(scores[True]) == 8 and all(map(torch.equal, scores[True], scores[False]))
    assert torch.equal(rollouts[0].completion_ids, rollouts[1].completion_ids)
    assert not any("forward" in vars(module) for module in models.policy.modules())


needs_onednn = pytest.mark.skipif(not onednn_gemm_available(), reason="this torch has no oneDNN linear ops")
# oneDNN's bfloat16 kernels need AVX-512 (or avx_ne_convert): decode_gemm does not take them
# elsewhere (test_without_onednn_bfloat16_kernels_autocast_decodes_by_a_bfloat16_copy).
ONEDNN_BFLOAT16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not onednn_bfloat16_available(), reason="this CPU's oneDNN has no bfloat16 kernels"),
)


@needs_onednn
@pytest.mark.parametrize("dtype", [None, ONEDNN_BFLOAT16])
def test_reordered_linears_compute_the_layers_own_products_and_step_aside_after(dtype):
    from grpo_cli.sampling.packed import ReorderedLinears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8, bias=False), torch.nn.Linear(8, 4))
    hooked = model[2]
    hooked.forward = lambda inputs: torch.zeros(inputs.shape[0], 4)  # a forward replaced by someone else
    reordered = ReorderedLinears(model, rows=5, dtype=dtype)
    assert [module for module, _ in reordered.forwards] == [model[0], model[1]]
    autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    for shape in ((5, 16), (3, 16), (5, 1, 16)):  # the rows laid out for, others, a decode step's [N, 1, h]
        inputs = torch.randn(shape)
        with torch.inference_mode(), autocast:
            expected = model[1](model[0](inputs))
            with reordered:
                got = model[1](model[0](inputs))
        assert got.dtype == expected.dtype == (dtype or torch.float32)
        # bfloat16 keeps 8 bits: 2e-2 is its rounding of these sums; float32 agrees to 1e-6
        tolerance = 2e-2 if dtype else 1e-6
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert "forward" not in vars(model[0]) and "forward" not in vars(model[1]) and "forward" in vars(hooked)


@pytest.mark.parametrize("intel", [False, True])
@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_decode_gemm_takes_onednn_except_for_float32_on_intel_where_mkl_packs(intel, onednn, autocast, monkeypatch):
    import grpo_cli.sampling.packed as packed

    monkeypatch.setattr(packed, "intel_cpu", lambda: intel)  # the CPU, forced either way
    monkeypatch.setattr(packed, "onednn_gemm_available", lambda: onednn)
    monkeypatch.setattr(packed, "onednn_bfloat16_available", lambda: onednn)
    monkeypatch.setattr(packed, "packed_gemm_available", lambda: True)
    expected = {
        (False, True): "onednn",
        (True, True): "onednn" if autocast else "mkl_packed",
        (False, False): "bfloat16_copy" if autocast else "plain",
        (True, False): "bfloat16_copy" if autocast else "mkl_packed",
    }[intel, onednn]
    assert decode_gemm(autocast) == expected


@pytest.mark.parametrize("intel", [False, True])
def test_without_onednn_bfloat16_kernels_autocast_decodes_by_a_bfloat16_copy(intel, monkeypatch):
    # An AVX2-only CPU (an AMD EPYC without AVX-512): oneDNN has float32 kernels, no bfloat16 ones.
    import grpo_cli.sampling.packed as packed

    monkeypatch.setattr(packed, "intel_cpu", lambda: intel)
    monkeypatch.setattr(packed, "onednn_gemm_available", lambda: True)
    monkeypatch.setattr(packed, "onednn_bfloat16_available", lambda: False)
    monkeypatch.setattr(packed, "packed_gemm_available", lambda: True)
    assert decode_gemm(torch.bfloat16) == "bfloat16_copy"
    assert decode_gemm(None) == ("mkl_packed" if intel else "onednn")


@needs_onednn
@pytest.mark.parametrize("autocast", [None, ONEDNN_BFLOAT16])
def test_sampling_with_weights_laid_out_for_onednn_draws_from_the_same_distribution(
    tiny_model_dir, autocast, monkeypatch
):
    # On a CPU other than Intel's the decode steps multiply through oneDNN by weights laid out
    # once per decode (in bfloat16 under autocast). Each step's scores are those of the layers'
    # own products (autocast's per-call casts under autocast) to rounding; the plain run is fed
    # the laid-out run's tokens, so both score the same sequences (as the packed test above).
    import grpo_cli.sampling.fast as fast
    import grpo_cli.sampling.packed as packed
    from grpo_cli.sampling.fast import FastSampler

    monkeypatch.setattr(packed, "intel_cpu", lambda: False)  # oneDNN's CPU, forced
    cfg, models, _ = setup(tiny_model_dir, "fast", "sampler.max_new_tokens=8", "sampler.min_new_tokens=8")
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    sampler = make_sampler(cfg.sampler, models.tokenizer, autocast=autocast)
    laid_out = Counter()
    reordered_forward = packed.reordered_forward

    def counted(weight, bias, rows, dtype):
        laid_out.update([rows])
        return reordered_forward(weight, bias, rows, dtype)

    monkeypatch.setattr(packed, "reordered_forward", counted)
    scores, drawn = {True: [], False: []}, []

    def replaying_draw(step_scores, greedy):
        scores[reordering].append(step_scores.clone())
        if reordering:
            drawn.append(draw_tokens(step_scores, greedy))
        return drawn[len(scores[reordering]) - 1]

    for reordering in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(fast, "draw_tokens", replaying_draw)
            if not reordering:
                patch.setattr(FastSampler, "decode_weights", lambda *args: contextlib.nullcontext())
            torch.manual_seed(0)
            sampler.sample(models.policy, batch)
    linears = sum(type(module) is torch.nn.Linear for module in models.policy.modules())
    assert laid_out == Counter({batch.size * cfg.sampler.group_size: linears})  # once per decode
    # float32: rounding moves these logits (|x| < 6) by about 3e-6; bfloat16's 8 bits by up to 0.1
    tolerance = 0.15 if autocast else 1e-4
    assert len(scores[True]) == len(scores[False]) == 8
    for step, (ours, plain) in enumerate(zip(scores[True], scores[False])):
        torch.testing.assert_close(
            ours, plain, rtol=tolerance, atol=tolerance, msg=lambda m, step=step: f"step {step}: {m}"
        )
    assert not any("forward" in vars(module) for module in models.policy.modules())


def test_make_sampler_picks_the_backend_and_both_are_samplers(tiny_model_dir):
    assert isinstance(setup(tiny_model_dir, "fast")[2], FastSampler)
    assert isinstance(setup(tiny_model_dir, "hf")[2], HFSampler)
    assert all(isinstance(setup(tiny_model_dir, backend)[2], Sampler) for backend in ("fast", "hf"))
    assert not isinstance(object(), Sampler)  # the protocol's methods are checked


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_greedy_completions_are_identical(tiny_model_dir, attention):
    # sdpa: the decoder runs layer by layer; eager: through the model's forward
    outputs = {}
    for backend in ("hf", "fast"):
        cfg, models, sampler = setup(
            tiny_model_dir,
            backend,
            "data.prompts_per_step=16",
            "sampler.max_new_tokens=8",
            f"model.attn_implementation={attention}",
        )
        assert runs_layer_by_layer(models.policy, 64) == (attention == "sdpa")
        outputs[backend] = sampler.greedy(models.policy, PromptSource(cfg.data, models.tokenizer).next_batch())
        assert models.policy.config._attn_implementation == attention  # the decode steps' own attention is undone
    assert outputs["fast"] == outputs["hf"] and len(set(outputs["hf"])) > 3


def test_lora_policies_run_layer_by_layer_with_the_adapter_on(tiny_model_dir):
    # The adapter must act while sampling: a LoRA policy with a non-zero adapter samples
    # differently from its base, and the same as generate does.
    outputs = {}
    for backend in ("hf", "fast"):
        torch.manual_seed(0)  # the same adapter both times (peft draws lora_A at random)
        cfg, models, sampler = setup(
            tiny_model_dir,
            backend,
            "model.lora.enabled=true",
            "model.lora.r=4",
            "data.prompts_per_step=16",
            "sampler.max_new_tokens=8",
        )
        for name, parameter in models.policy.named_parameters():
            if "lora_B" in name:
                parameter.data.normal_(0, 0.5)
        batch = PromptSource(cfg.data, models.tokenizer).next_batch()
        outputs[backend] = sampler.greedy(models.policy, batch)
        with models.policy.disable_adapter():
            outputs[f"{backend} base"] = sampler.greedy(models.policy, batch)
    assert runs_layer_by_layer(models.policy, 64)
    assert outputs["fast"] == outputs["hf"] and outputs["fast base"] == outputs["hf base"]
    assert outputs["fast"] != outputs["fast base"]


def test_a_rollout_has_the_hf_layout(tiny_model_dir):
    # min_new_tokens: no EOS before it; ids are [B*G, T] grouped by prompt; the mask ends at EOS.
    cfg, models, sampler = setup(tiny_model_dir, "fast", "sampler.max_new_tokens=6", "sampler.min_new_tokens=3")
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    torch.manual_seed(0)
    rollout = sampler.sample(models.policy, batch)
    eos = models.tokenizer.eos_token_id
    assert rollout.completion_ids.shape == (batch.size * 4, 6) and rollout.group_size == 4
    assert not (rollout.completion_ids[:, :3] == eos).any()
    assert torch.equal(rollout.prompt_ids, batch.input_ids.repeat_interleave(4, dim=0))
    ended = (rollout.completion_ids == eos).any(dim=1)
    assert torch.equal(rollout.truncated, ~ended)
    assert rollout.prompts[:4] == [batch.texts[0]] * 4


def test_first_and_second_token_frequencies_match_generate(tiny_model_dir):
    samples = 4000
    hf = token_counts(tiny_model_dir, "hf", 1.0, samples, seed=1)
    fast = token_counts(tiny_model_dir, "fast", 1.0, samples, seed=2)  # independent draws
    assert len(hf[0]) > 5 and len(hf[1]) > 5  # a spread-out distribution, so the test has something to test
    for position in (0, 1):
        assert homogeneity_p_value(hf[position], fast[position]) > 1e-3, position
    # The test can fail: the same sampler at temperature 0.7 is told apart.
    colder = token_counts(tiny_model_dir, "fast", 0.7, samples, seed=3)
    assert homogeneity_p_value(hf[1], colder[1]) < 1e-6


def test_with_generates_random_draw_the_fast_sampler_draws_the_very_same_tokens(tiny_model_dir, monkeypatch):
    # Sampling is a distribution (the model's logits, the warpers) and a way to draw from it.
    # Swap our inverse-CDF draw for the one generate uses (torch.multinomial on the softmax) and
    # the two samplers, seeded alike, return the same tokens: the distribution is generate's,
    # exactly, at every position of every completion; only the random stream differs.
    import grpo_cli.sampling.fast as fast

    completions = {}
    for backend in ("hf", "fast"):
        if backend == "fast":
            monkeypatch.setattr(fast, "draw_tokens", multinomial_draw)
        cfg, models, sampler = setup(
            tiny_model_dir,
            backend,
            "data.prompts_per_step=16",
            "sampler.group_size=8",
            "sampler.max_new_tokens=8",
            "sampler.temperature=1.3",
            "sampler.top_k=40",
        )
        torch.manual_seed(0)
        completions[backend] = sampler.sample(models.policy, PromptSource(cfg.data, models.tokenizer).next_batch())
    assert completions["fast"].completions == completions["hf"].completions
    assert torch.equal(completions["fast"].completion_mask, completions["hf"].completion_mask)
    assert len(set(completions["hf"].completions)) > 20  # varied samples, not one repeated answer


def test_a_turn_continues_from_the_kept_keys_and_values_as_a_fresh_prefill_would(tiny_model_dir):
    # keeping_turns: the second decode prefills only what follows each row's kept prefix (the
    # first turn's last token and the "reply"), with identical prompt rows prefilled once, and
    # draws what a decode of the whole context from scratch draws.
    cfg, models, sampler = setup(tiny_model_dir, "fast", "sampler.max_new_tokens=8", "data.prompts_per_step=4")
    policy, eos = models.policy, models.tokenizer.eos_token_id
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    ids, mask = batch.input_ids.repeat_interleave(2, dim=0), batch.attention_mask.repeat_interleave(2, dim=0)
    prefilled = []
    hook = policy.model.embed_tokens.register_forward_hook(lambda module, args, out: prefilled.append(args[0].shape))
    reply = ids[0][mask[0].bool()][-3:].tolist()  # three tokens that stand for a tool's answer
    with sampler.keeping_turns():
        first = sampler.decode(policy, ids, mask, 1, greedy=True)
        assert len(sampler.kept.ids) == batch.size  # the greedy copies drew alike: each kept once
        contexts = []
        for row in range(ids.shape[0]):
            drawn = first[row].tolist()
            drawn = drawn[: drawn.index(eos) + 1] if eos in drawn else drawn
            contexts.append(ids[row][mask[row].bool()].tolist() + drawn + reply)
        width = max(len(row) for row in contexts)
        next_ids = torch.tensor([[eos] * (width - len(row)) + row for row in contexts])
        next_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in contexts])
        before = len(prefilled)
        continued = sampler.decode(policy, next_ids, next_mask, 1, greedy=True)
        second_prefill = prefilled[before]
    hook.remove()
    assert prefilled[0] == (batch.size, ids.shape[1])  # each prompt once, not twice
    # greedy: the copies drew alike, so their contexts are one row again
    assert second_prefill[0] == len({tuple(row) for row in contexts}) and second_prefill[1] <= len(reply) + 1
    assert sampler.kept is None  # dropped at the end of the rollout
    fresh = sampler.decode(policy, next_ids, next_mask, 1, greedy=True)
    assert torch.equal(continued, fresh) and len({tuple(row) for row in fresh.tolist()}) > 1
