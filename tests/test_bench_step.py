"""scripts/bench_step.py, the benchmark against TRL (docs/BENCHMARKS.md), still runs: one
alternating step per side on the tiny bench model, each side in its own process."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import load_script


@pytest.mark.slow  # about 40 s: two processes start, load their trainers and take a step each
def test_one_step_per_side_runs_and_is_timed(tmp_path):
    bench = load_script("bench_step")
    summary = bench.compare_steps(bench.make_case("tiny"), steps=1, warmup=0, sampler="fast", bf16=False, work=tmp_path)
    for side in ("ours", "trl"):
        numbers = summary[side]
        assert numbers["median_seconds"] > numbers["median_generate_seconds"] > 0
        assert numbers["generate_tokens_per_second"] > 0 and numbers["peak_rss_gb"] > 0.1
    assert summary["ratio"] > 0


@pytest.mark.slow  # about 15 s: the tiny bench model, one warm-up step and one timed step
def test_the_phase_by_phase_timing_covers_the_step_and_has_floors():
    bench = load_script("bench_step")
    phases = dict(
        (name, (seconds, floor)) for name, seconds, floor in bench.phase_times(bench.make_case("tiny"), repeats=1)
    )
    assert list(phases) == ["sampling", "reference pass", "policy forward", "backward", "optimizer step"]
    assert all(seconds > 0 for seconds, _ in phases.values())
    # The backward does twice the forward's matmul work; sampling, the reference pass and the
    # policy forward each run every token once.
    assert phases["backward"][1] == pytest.approx(2 * phases["policy forward"][1])
    # Sampling runs the same tokens as the reference pass, but its decode steps at a decode's
    # row count, streaming the weights: its floor is its own, counted at that lower rate.
    assert phases["sampling"][1] > 0 and phases["reference pass"][1] > 0


def test_the_floors_count_each_prompt_once_per_group_when_the_pass_is_shared():
    # step_forward_flops on a rollout of 8 prompts x G = 8 (12 prompt tokens, 64 completion
    # tokens; one completion ended 4 tokens early) and a stand-in model: 1,000 decoder weights,
    # a head of hidden 4 x vocabulary 10.
    from types import SimpleNamespace

    bench = load_script("bench_step")
    completion_mask = torch.ones(64, 64)
    completion_mask[5, 60:] = 0  # one completion ended 4 tokens early: 4 positions of padding
    rollout = SimpleNamespace(prompt_mask=torch.ones(64, 12), completion_mask=completion_mask, group_size=8)
    policy = SimpleNamespace(
        config=SimpleNamespace(hidden_size=4, vocab_size=10),
        named_parameters=lambda: [
            ("model.layers.0.mlp.weight", torch.zeros(1000)),
            ("lm_head.weight", torch.zeros(40)),
        ],
    )
    scored = 64 * 64 - 4  # 4092 scored positions, each through the head (2 x 4 x 10 FLOPs)
    # shared: each prompt once (8 x 12), every scored token but each completion's last one
    assert bench.step_forward_flops(policy, rollout) == 2 * 1000 * (8 * 12 + scored - 64) + 80 * scored
    # one pass per completion: each prompt 64 times, every scored token
    assert bench.step_forward_flops(policy, rollout, shared=False) == 2 * 1000 * (64 * 12 + scored) + 80 * scored


@pytest.mark.slow  # about 15 s
def test_the_device_figures_run_on_the_cpu_and_the_mfu_counts_the_update_flops_derived_by_hand():
    # --device cuda's code path, on the CPU in float32: it runs end to end and reports its
    # fields, and the MFU divides the FLOP count derived here by hand. No timed ratio is checked
    # (e.g. the MFU against a separately timed matmul peak): the two are timed at different
    # moments, under whatever else runs, and AVX-512 raises a large matmul's rate more than the
    # small update's, so such a ratio is a benchmark's figure, not a property of the code.
    bench = load_script("bench_step")
    peak_tflops = 1.0  # any peak: the MFU is the update's FLOP/s over it
    figures = bench.device_figures(bench.make_case("tiny"), "cpu", steps=1, peak_tflops=peak_tflops, dtype="float32")
    assert all(math.isfinite(value) and value > 0 for value in figures.values()), figures
    assert figures["peak_memory_gb"] > 0.1  # the CPU's peak RSS, a loaded model and more
    assert figures["step_seconds"] > figures["update_seconds"]  # the update is a part of the step

    # The tiny bench model (bench_step.BENCH_SIZES): Qwen2, h = 256, i = 576, 4 layers, 4 heads of
    # 64, 2 key/value heads (k/v width 128), q/k/v biases, vocabulary 277 (the bench tokenizer),
    # tied embeddings. Per layer: q 256x256 + 256, k and v 256x128 + 128, o 256x256, gate/up/down
    # 3 x 256x576, two norms of 256 = 65,792 + 2 x 32,896 + 65,536 + 442,368 + 512 = 640,000.
    decoder_weights = 4 * 640_000
    # One forward: 8 prompts of 12 tokens once (the shared prompt pass; every addition prompt is
    # 12 bench tokens), then 64 completions x 63 tokens (min_new_tokens = 64: all 64 long; the
    # last token is scored, never fed), 2 x weights per token; the head on the 64 x 64 scored
    # positions, 2 x 256 x 277 per position. Attention's own matmuls are left out.
    forward = 2 * decoder_weights * (8 * 12 + 64 * 63) + 2 * 256 * 277 * 64 * 64  # 21,716,271,104
    # The update: the reference pass, the policy forward and the backward (twice a forward).
    update_flops = 4 * forward
    counted_flops = figures["update_tflops"] * 1e12 * figures["update_seconds"]  # the figures' own count
    assert counted_flops == pytest.approx(update_flops, rel=1e-9)
    assert figures["update_mfu"] == pytest.approx(figures["update_tflops"] / peak_tflops, rel=1e-9)


@pytest.mark.slow  # about 90 s: SmolLM2-135M from its wheel in two processes, one step each
def test_the_real_model_case_gives_both_sides_the_same_chat_prompts_and_times_every_phase(tmp_path):
    # The real-length case at a small size: 2 GSM8K questions x G = 2, at most 8 new tokens,
    # natural length (both sides stop at EOS). Both sides must see the same prompt tokens (the
    # tokenizer's chat template, applied by each trainer) and report each phase of the step.
    bench = load_script("bench_step")
    case = bench.Case("smollm2", prompts_per_step=2, group_size=2, new_tokens=8, forced_length=False)
    summary = bench.compare_steps(case, steps=1, warmup=0, sampler="fast", bf16=False, work=tmp_path)
    ours, trl = summary["ours"], summary["trl"]
    assert ours["prompt_length"] == trl["prompt_length"] > 50  # the template's system prompt + the question
    for side in (ours, trl):
        assert 1 <= side["mean_completion_length"] <= 8
        phases = [side[f"median_{phase}"] for phase in bench.PHASES]
        assert all(seconds > 0 for seconds in phases), side
        assert side["median_seconds"] > sum(phases)  # the rest (rewards, backward, optimizer) is left
    assert summary["rss_ratio"] == pytest.approx(ours["peak_rss_gb"] / trl["peak_rss_gb"])


def test_completion_lengths_count_up_to_and_including_the_first_eos():
    bench = load_script("bench_step")
    eos = 2
    rows = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 9, 2, 9]])
    assert bench.completion_lengths(rows, eos) == [2, 4, 1]
