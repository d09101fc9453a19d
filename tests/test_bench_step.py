"""scripts/bench_step.py, the benchmark against TRL (docs/BENCHMARKS.md), still runs: one
alternating step per side on the tiny bench model, each side in its own process."""

from __future__ import annotations

import pytest

from helpers import load_script


@pytest.mark.slow  # about 40 s: two processes start, load their trainers and take a step each
def test_one_step_per_side_runs_and_is_timed(tmp_path):
    bench = load_script("bench_step")
    summary = bench.compare_steps("tiny", steps=1, warmup=0, sampler="fast", bf16=False, work=tmp_path)
    for side in ("ours", "trl"):
        numbers = summary[side]
        assert numbers["median_seconds"] > numbers["median_generate_seconds"] > 0
        assert numbers["generate_tokens_per_second"] > 0 and numbers["peak_rss_gb"] > 0.1
    assert summary["ratio"] > 0


@pytest.mark.slow  # about 15 s: the tiny bench model, one warm-up step and one timed step
def test_the_phase_by_phase_timing_covers_the_step_and_has_floors():
    bench = load_script("bench_step")
    phases = dict((name, (seconds, floor)) for name, seconds, floor in bench.phase_times("tiny", repeats=1))
    assert list(phases) == ["sampling", "reference pass", "policy forward", "backward", "optimizer step"]
    assert all(seconds > 0 for seconds, _ in phases.values())
    # The backward does twice the forward's matmul work; sampling, the reference pass and the
    # policy forward each run every token once.
    assert phases["backward"][1] == pytest.approx(2 * phases["policy forward"][1])
    assert phases["sampling"][1] == phases["reference pass"][1] > 0
    # --one-pass-per-completion: each prompt G times through the update passes, so their floors
    # rise above the sampler's, which still encodes each prompt once (one call, one measured rate).
    unshared = dict((name, (seconds, floor)) for name, seconds, floor in bench.phase_times("tiny", 1, shared=False))
    assert unshared["reference pass"][1] > 1.1 * unshared["sampling"][1]


@pytest.mark.slow  # about 15 s
def test_the_device_figures_run_on_the_cpu_and_the_mfu_is_below_the_measured_matmul_rate():
    # --device cuda's code path, on the CPU in float32: with this machine's own large-matmul
    # rate as the peak, the update's utilisation must come out between 0 and 1 (a FLOP count
    # several times too high would push it above).
    bench = load_script("bench_step")
    peak = bench.matmul_rate(4096, 256, 576) / 1e3  # TFLOP/s, the tiny model's MLP shape
    figures = bench.device_figures("tiny", "cpu", steps=1, peak_tflops=peak, dtype="float32")
    assert figures["sampling_tokens_per_second"] > 0 and figures["peak_memory_gb"] > 0.1
    assert 0.05 < figures["update_mfu"] < 1.0
    assert figures["step_seconds"] > figures["update_seconds"] > 0
