"""One GRPO step of grpo-cli against one of TRL's GRPOTrainer, side by side, on the same local
model, prompts and settings; and our sampler against transformers' generate.

    pip install -e '.[bench]'          # TRL >= 1.16
    python scripts/bench_step.py                       # both sizes, float32, 8 timed steps each
    python scripts/bench_step.py --bf16                # bfloat16 mixed precision on both sides
    python scripts/bench_step.py --phases              # our step phase by phase, against its floor
    python scripts/bench_step.py --profile --size tiny # torch.profiler's table of one of our steps
    python scripts/bench_step.py --device cuda         # on a GPU: 0.5B and 1.5B shapes, bf16, our step alone

Settings (issue 9): 8 prompts x G = 8, 64 new tokens with min_new_tokens = 64 (every completion
the same length), beta = 0.04 (a reference pass), num_iterations = 1, one optimizer step per
generation batch, float32, CPU, temperature 1, lr 1e-5, max_grad_norm 1. TRL: loss_type grpo
(= our sequence_mean), use_bias_correction_kl=False (TRL's default multiplies the KL by the
ratio; the paper does not), scale_rewards=group. Both sides train a full fine-tune with a
frozen reference copy.

Each side runs in its own process (so each has its own peak RSS), both alive at once; after a
warm-up step each, the parent has them take turns: ours, TRL, ours, TRL, ... Reported: the
median seconds per step, the ratio ours / TRL, generation tokens per second (completion tokens
over the seconds spent generating) and the peak RSS of each process. Then the sampler alone:
`sampler=fast` against `sampler=hf` (model.generate) on the same batch.

The models are built here, nothing is downloaded (cached in $GRPO_CLI_CACHE/bench-*):
`tiny` (Qwen2, hidden 256, 4 layers) and `small` (hidden 512, 8 layers), with a byte-level BPE
of about 300 tokens trained on the prompts, randomly initialised.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
BENCH_SIZES = {  # name -> Qwen2 shape
    "tiny": dict(
        hidden_size=256, intermediate_size=576, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
    "small": dict(
        hidden_size=512, intermediate_size=1152, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
    ),
    # --device cuda: the decoder shapes of Qwen2.5-0.5B and -1.5B, randomly initialised, saved in
    # bfloat16. The vocabulary is the bench tokenizer's (277, not 151,936), so the head is small.
    "0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    "1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
    ),
}
GPU_SIZES = ("0.5b", "1.5b")
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bfloat16, by device name
PROMPTS, GROUP, NEW_TOKENS, BETA, LR = 8, 8, 64, 0.04, 1e-5
BUILD_VERSION = 1


def bench_model(size: str) -> Path:
    """The folder of a bench model (built on first use)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_cli.data.tasks import addition_rows
    from grpo_cli.models.sources import cache_root
    from grpo_cli.models.tiny import train_tokenizer

    folder = cache_root() / f"bench-{size}-v{BUILD_VERSION}"
    if (folder / "config.json").is_file():
        return folder
    rows = addition_rows()
    tokenizer = train_tokenizer([row["prompt"] + " " + row["answer"] for row in rows], vocab_size=300)
    tokenizer.model_max_length = 512
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **BENCH_SIZES[size],
    )
    model = Qwen2ForCausalLM(config)
    if size in GPU_SIZES:
        model = model.to(torch.bfloat16)
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process built it first: keep theirs
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise
    return folder


def prompt_rows() -> list[dict[str, str]]:
    from grpo_cli.data.tasks import addition_rows

    return addition_rows()[: PROMPTS * 4]


def exact_answer(completions: list[str], answers: list[str]) -> list[float]:
    """The same cheap reward on both sides: 1 when the completion starts with the answer."""
    return [float(text.strip().startswith(str(answer))) for text, answer in zip(completions, answers)]


def peak_rss_bytes() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))


# ---------------------------------------------------------------------------- our side


def our_config(model_dir: Path, sampler: str, bf16: bool = False, device: str = "cpu", dtype: str = "float32"):
    from omegaconf import OmegaConf

    from grpo_cli.config import Config

    cfg = OmegaConf.structured(Config)
    cfg.merge_with_dotlist(
        [
            f"model.name_or_path={model_dir}",
            f"model.dtype={dtype}",
            "data.path=synthetic:addition",
            f"data.prompts_per_step={PROMPTS}",
            f"sampler.group_size={GROUP}",
            f"sampler.max_new_tokens={NEW_TOKENS}",
            f"sampler.min_new_tokens={NEW_TOKENS}",
            f"sampler.backend={sampler}",
            "sampler.temperature=1.0",
            f"trainer.beta={BETA}",
            "trainer.num_iterations=1",
            "trainer.micro_batch_size=0",
            f"trainer.device={device}",
            "trainer.loss_aggregation=sequence_mean",
            f"optimizer.lr={LR}",
            "optimizer.max_grad_norm=1.0",
            "optimizer.weight_decay=0.0",
            "optimizer.warmup_steps=0",
            "trainer.steps=1000",
        ]
    )
    cfg.reward.functions = [{"_target_": "bench_step.our_reward", "weight": 1.0}]
    cfg.model.autocast = "bfloat16" if bf16 else "none"
    return cfg


def our_reward(prompts, completions, answer, **_):
    return exact_answer(completions, answer)


class OurSide:
    def __init__(self, model_dir: Path, sampler: str, bf16: bool = False, device: str = "cpu", dtype: str = "float32"):
        import torch

        from grpo_cli.distributed import ONE_PROCESS
        from grpo_cli.pipeline import load_parts
        from grpo_cli.rewards.api import RewardScorer

        torch.manual_seed(0)
        cfg = our_config(model_dir, sampler, bf16, device, dtype)
        rows = prompt_rows()
        self.parts = load_parts(
            cfg, RewardScorer.from_config(cfg.reward, cfg.trainer.std_eps), rows, torch.device(device), ONE_PROCESS
        )
        self.step_number = 0

    def step(self) -> dict[str, float]:
        from grpo_cli.pipeline import train_step

        self.step_number += 1
        started = time.perf_counter()
        result = train_step(self.parts, self.step_number, GROUP, 1.0)
        seconds = time.perf_counter() - started
        metrics = result.metrics
        return {
            "seconds": seconds,
            "generate_seconds": metrics["time/sample"],
            "update_seconds": metrics["time/update"],
            "tokens": float(result.rollout.completion_mask.sum()),
            "loss": metrics["loss"],
            "prompt_length": result.rollout.prompt_ids.shape[1],
        }


# ---------------------------------------------------------------------------- TRL's side


class TrlSide:
    """TRL's trainer.train() runs in a thread of this process; a callback holds each optimizer
    step at its start until the parent asks for it, and reports its time at its end."""

    def __init__(self, model_dir: Path, bf16: bool, work: Path):
        import queue
        import threading

        import torch
        from transformers import TrainerCallback

        sys.path.insert(0, str(SCRIPTS))
        from trl_baseline import make_trl_trainer

        torch.manual_seed(0)
        rows = prompt_rows()
        answers = {row["prompt"]: row["answer"] for row in rows}

        def reward(prompts, completions, **_):
            return exact_answer(completions, [answers[prompt] for prompt in prompts])

        self.trainer = make_trl_trainer(
            str(model_dir),
            [row["prompt"] for row in rows],
            reward,
            group_size=GROUP,
            prompts_per_step=PROMPTS,
            max_new_tokens=NEW_TOKENS,
            beta=BETA,
            loss_type="grpo",
            learning_rate=LR,
            max_grad_norm=1.0,
            bf16=bf16,
            output_dir=str(work),
        )
        self.trainer.args.max_steps = 1000
        self.trainer.args.logging_steps = 10**6  # TRL prints its metrics at each logging step
        self.go, self.done = queue.Queue(), queue.Queue()
        self.generate_seconds = 0.0
        model = self.trainer.model
        generate = model.generate

        def timed_generate(*args, **kwargs):
            started = time.perf_counter()
            output = generate(*args, **kwargs)
            self.generate_seconds += time.perf_counter() - started
            return output

        model.generate = timed_generate
        side = self

        class Turns(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                side.go.get()  # wait for the parent's turn
                side.started, side.generate_seconds = time.perf_counter(), 0.0

            def on_step_end(self, args, state, control, **kwargs):
                side.done.put(
                    {
                        "seconds": time.perf_counter() - side.started,
                        "generate_seconds": side.generate_seconds,
                        "tokens": float(PROMPTS * GROUP * NEW_TOKENS),
                        "loss": float("nan"),
                    }
                )

        self.trainer.add_callback(Turns())
        self.thread = threading.Thread(target=self.trainer.train, daemon=True)
        self.thread.start()

    def step(self) -> dict[str, float]:
        self.go.put("step")
        return self.done.get()


# ---------------------------------------------------------------------------- workers


def worker(side: str, size: str, sampler: str, bf16: bool, work: str, pipe) -> None:
    """Build one side, then answer the parent: "step" -> that step's numbers, "peak" -> peak RSS."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(SCRIPTS))
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    model_dir = bench_model(size)
    runner = OurSide(model_dir, sampler, bf16) if side == "ours" else TrlSide(model_dir, bf16, Path(work))
    pipe.send("ready")
    while True:
        command = pipe.recv()
        if command == "step":
            pipe.send(runner.step())
        elif command == "peak":
            pipe.send(peak_rss_bytes())
        else:
            return


def answer(side: str, process, pipe, timeout: float = 600.0) -> Any:
    """The worker's next reply; RuntimeError if it died or stays silent (never a hang)."""
    waited = 0.0
    while not pipe.poll(1.0):
        waited += 1.0
        if not process.is_alive() or waited > timeout:
            raise RuntimeError(
                f"the {side} worker {'exited' if not process.is_alive() else 'hangs'} "
                f"(exit code {process.exitcode}); its output above says why"
            )
    return pipe.recv()


def compare_steps(size: str, steps: int, warmup: int, sampler: str, bf16: bool, work: Path) -> dict[str, Any]:
    bench_model(size)  # built here, not by both workers at once
    context = multiprocessing.get_context("spawn")
    # A spawned worker imports this module by name to find `worker`, on a copy of our sys.path.
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    sides = {}
    for side in ("ours", "trl"):
        parent, child = context.Pipe()
        process = context.Process(target=worker, args=(side, size, sampler, bf16, str(work / side), child))
        process.start()
        sides[side] = (process, parent)
    try:
        for side, (process, pipe) in sides.items():
            if answer(side, process, pipe) != "ready":
                raise RuntimeError(f"the {side} worker did not start")
        results: dict[str, list[dict[str, float]]] = {"ours": [], "trl": []}
        for turn in range(warmup + steps):
            for side, (process, pipe) in sides.items():  # ours, then TRL: alternating
                pipe.send("step")
                numbers = answer(side, process, pipe)
                if turn >= warmup:
                    results[side].append(numbers)
        peaks = {}
        for side, (process, pipe) in sides.items():
            pipe.send("peak")
            peaks[side] = answer(side, process, pipe)
    finally:
        for process, pipe in sides.values():
            if process.is_alive():
                pipe.send("exit")
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    summary: dict[str, Any] = {"size": size, "steps": steps}
    for side in sides:
        peak = peaks[side]
        rows = results[side]
        generate = sum(r["generate_seconds"] for r in rows)
        summary[side] = {
            "median_seconds": statistics.median(r["seconds"] for r in rows),
            "median_generate_seconds": statistics.median(r["generate_seconds"] for r in rows),
            "generate_tokens_per_second": sum(r["tokens"] for r in rows) / generate if generate else None,
            "peak_rss_gb": peak / 1e9,
        }
    summary["ratio"] = summary["ours"]["median_seconds"] / summary["trl"]["median_seconds"]
    return summary


def compare_samplers(size: str, repeats: int, bf16: bool) -> dict[str, float]:
    """Median seconds of sampler=fast and sampler=hf (model.generate) on the same batch."""
    import torch

    from grpo_cli.data.prompts import PromptSource
    from grpo_cli.models.loading import load_models
    from grpo_cli.sampling import make_sampler

    medians = {}
    cfg = our_config(bench_model(size), "hf", bf16)
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    batch = PromptSource(cfg.data, models.tokenizer, prompt_rows()).next_batch()
    for backend in ("fast", "hf", "fast", "hf"):  # the first of each is a warm-up
        cfg.sampler.backend = backend
        sampler = make_sampler(cfg.sampler, models.tokenizer, autocast=models.autocast_dtype)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            sampler.sample(models.policy, batch)
            times.append(time.perf_counter() - started)
        medians[backend] = statistics.median(times)
    tokens = PROMPTS * GROUP * NEW_TOKENS
    return {
        "fast_tokens_per_second": tokens / medians["fast"],
        "hf_tokens_per_second": tokens / medians["hf"],
        "speedup": medians["hf"] / medians["fast"],
    }


# --samplers: the real model's case (issue 21): GSM8K questions through SmolLM2's chat template,
# 4 prompts x G=4 x 128 forced tokens.
REAL_PROMPTS, REAL_GROUP, REAL_NEW_TOKENS = 4, 4, 128
SAMPLER_MODELS = ("tiny", "small", "smollm2")


def sampler_bench(size: str, bf16: bool):
    """(config, prompt rows) of the sampler comparison on `size` (a bench model, or smollm2)."""
    if size != "smollm2":
        return our_config(bench_model(size), "fast", bf16), prompt_rows()
    from grpo_cli.data.prompts import read_rows
    from grpo_cli.models.sources import resolve_model

    gsm8k = SCRIPTS.parent.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
    cfg = our_config(Path(resolve_model("builtin:smollm2-135m-instruct")), "fast", bf16)
    cfg.merge_with_dotlist(
        [
            f"data.path={gsm8k}",
            "data.prompt_field=question",
            f"data.prompts_per_step={REAL_PROMPTS}",
            f"sampler.group_size={REAL_GROUP}",
            f"sampler.max_new_tokens={REAL_NEW_TOKENS}",
            f"sampler.min_new_tokens={REAL_NEW_TOKENS}",
        ]
    )
    return cfg, read_rows(str(gsm8k), limit=REAL_PROMPTS * 4)


def sampler_speeds(size: str, bf16: bool, repeats: int) -> dict[str, float]:
    """Completion tokens per second of each sampler backend (fast, hf, and vllm where vLLM is
    installed) on one batch at the forced length, the median of `repeats` calls after a warm-up
    (the engine's build, the first call's kernel set-up, not timed)."""
    import torch

    from grpo_cli.data.prompts import PromptSource
    from grpo_cli.models.loading import load_models
    from grpo_cli.sampling import run_sampler
    from grpo_cli.sampling.vllm import vllm_installed

    cfg, rows = sampler_bench(size, bf16)
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    batch = PromptSource(cfg.data, models.tokenizer, rows).next_batch()
    tokens = batch.size * cfg.sampler.group_size * cfg.sampler.max_new_tokens
    speeds = {}
    for backend in ("fast", "hf", "vllm") if vllm_installed() else ("fast", "hf"):
        cfg.sampler.backend = backend
        sampler = run_sampler(cfg, models, rows)
        try:
            times = []
            for _ in range(repeats + 1):
                started = time.perf_counter()
                rollout = sampler.sample(models.policy, batch)
                times.append(time.perf_counter() - started)
            assert int(rollout.completion_mask.sum()) == tokens  # the forced length, every completion
        finally:
            sampler.close()
        speeds[f"{backend}_tokens_per_second"] = tokens / statistics.median(times[1:])
    return speeds


def matmul_rate(rows: int, inner: int, outer: int, repeats: int = 20, dtype: str = "float32") -> float:
    """Median GFLOP/s of a [rows, inner] x [inner, outer] matmul in `dtype` on this machine."""
    import torch

    left = torch.randn(rows, inner, dtype=getattr(torch, dtype))
    right = torch.randn(inner, outer, dtype=getattr(torch, dtype))
    times = []
    for _ in range(repeats + 3):
        started = time.perf_counter()
        left @ right
        times.append(time.perf_counter() - started)
    return 2 * rows * inner * outer / statistics.median(times[3:]) / 1e9


def step_forward_flops(policy, prompt_length: int, shared: bool = True) -> float:
    """The matmul work of one forward over the bench step: 2 x weights x tokens through the
    decoder layers, and the head on every scored position (attention left out). Tokens: each
    prompt once (sampling and the shared update passes), then every completion token but the
    last; `shared` False: each prompt once per completion, and every completion token."""
    config = policy.config
    decoder = sum(p.numel() for name, p in policy.named_parameters() if ".layers." in name)
    count = PROMPTS * GROUP
    if shared:
        tokens = PROMPTS * prompt_length + count * (NEW_TOKENS - 1)
    else:
        tokens = count * (prompt_length + NEW_TOKENS)
    return 2 * decoder * tokens + 2 * config.hidden_size * config.vocab_size * count * NEW_TOKENS


def device_figures(size: str, device: str, steps: int, peak_tflops: float, dtype: str = "bfloat16") -> dict[str, float]:
    """Our step on `device` (--device cuda): median sampling tokens per second, update MFU
    (the update's matmul work, reference pass + forward + backward = 4 forwards, per second, over
    `peak_tflops`), and peak memory (CUDA: torch.cuda.max_memory_allocated; CPU: peak RSS)."""
    import torch

    side = OurSide(bench_model(size), "fast", device=device, dtype=dtype)
    side.step()  # warm-up
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rows = [side.step() for _ in range(steps)]
    update_seconds = statistics.median(row["update_seconds"] for row in rows)
    update_flops = 4 * step_forward_flops(side.parts.models.policy, rows[-1]["prompt_length"])
    return {
        "step_seconds": statistics.median(row["seconds"] for row in rows),
        "sampling_tokens_per_second": statistics.median(row["tokens"] / row["generate_seconds"] for row in rows),
        "update_seconds": update_seconds,
        "update_tflops": update_flops / update_seconds / 1e12,
        "update_mfu": update_flops / update_seconds / (peak_tflops * 1e12),
        "peak_memory_gb": (torch.cuda.max_memory_allocated(device) if cuda else peak_rss_bytes()) / 1e9,
    }


def bf16_peak_tflops(device: str) -> float | None:
    import torch

    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in name), None)


def phase_times(size: str, repeats: int, shared: bool = True) -> list[tuple[str, float, float]]:
    """Our step phase by phase, on the stages' own functions: [(phase, median seconds, floor
    seconds)]. The floor is the phase's matmul work (2 x weights x tokens through the decoder
    and the head, twice that for the backward; attention left out) at the float32 rate this
    machine reaches on a large matmul of the model's MLP shape."""
    import torch

    from grpo_cli.algorithm.log_probs import completion_log_probs
    from grpo_cli.algorithm.losses import LossDenominators, LossSettings, grpo_loss
    from grpo_cli.models.loading import reference_model

    passes_per_group = GROUP if shared else 1  # completion_log_probs' group_size: 1 = a pass per completion
    side = OurSide(bench_model(size), "fast")
    parts = side.parts
    models, policy = parts.models, parts.models.policy
    side.step()  # warm-up
    times: dict[str, list[float]] = {
        name: [] for name in ("sampling", "reference pass", "policy forward", "backward", "optimizer step")
    }
    for _ in range(repeats):
        marks = [time.perf_counter()]
        rollout = parts.sampler.sample(policy, parts.prompts.next_batch(), GROUP)
        marks.append(time.perf_counter())
        rows = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask, 1.0)
        with torch.no_grad(), reference_model(models) as reference:
            reference_log_probs, _ = completion_log_probs(reference, *rows, False, passes_per_group)
        marks.append(time.perf_counter())
        policy.train()
        log_probs, _ = completion_log_probs(policy, *rows, True, passes_per_group)
        settings = LossSettings(clip_eps=0.2, clip_eps_high=0.2, beta=BETA)
        denominators = LossDenominators(log_probs.shape[0], int(rollout.completion_mask.sum()), NEW_TOKENS)
        loss, _ = grpo_loss(
            log_probs,
            log_probs.detach(),
            reference_log_probs,
            torch.randn(log_probs.shape[0]),
            rollout.completion_mask,
            settings,
            denominators,
        )
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(list(policy.parameters()), 1.0)
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        for name, start, end in zip(times, marks, marks[1:]):
            times[name].append(end - start)

    config = policy.config
    sampling_flops = step_forward_flops(policy, rollout.prompt_ids.shape[1])  # the sampler encodes each prompt once
    forward_flops = step_forward_flops(policy, rollout.prompt_ids.shape[1], shared)
    rate = matmul_rate(4096, config.hidden_size, config.intermediate_size) * 1e9
    floors = {
        "sampling": sampling_flops,
        "reference pass": forward_flops,
        "policy forward": forward_flops,
        "backward": 2 * forward_flops,
        "optimizer step": 0,
    }
    return [(name, statistics.median(values), floors[name] / rate) for name, values in times.items()]


def profile_step(size: str, rows: int = 15) -> str:
    """torch.profiler's table of one of our steps after a warm-up: the ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    side = OurSide(bench_model(size), "fast")
    side.step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        side.step()
    return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine() -> str:
    import torch
    import transformers
    import trl

    cpuinfo = open("/proc/cpuinfo").read().splitlines() if os.path.exists("/proc/cpuinfo") else []
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), platform.processor()
    )
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), []))
    # The flags that change which kernels run: bf16 matmuls are 1.5x faster than float32 with
    # avx512_bf16 and 3x slower without; bitsandbytes takes another 4-bit path with it.
    named = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)
    return (
        f"{cpu} ({named}), {os.cpu_count()} cores visible, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, trl {trl.__version__}, Python {platform.python_version()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--size",
        action="append",
        choices=sorted({*BENCH_SIZES, "smollm2"}),
        help="repeatable; default tiny and small (--device cuda: 0.5b and 1.5b)",
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sampler", default="fast", choices=("fast", "hf"), help="our sampler backend")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bfloat16 mixed precision on both sides (ours: model.autocast=bfloat16; TRL: bf16=True)",
    )
    parser.add_argument(
        "--one-pass-per-completion",
        action="store_true",
        help="with --phases: the update passes as trainer.share_prompt_pass=false runs them",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="only our step, phase by phase, against each phase's matmul floor (no TRL)",
    )
    parser.add_argument("--profile", action="store_true", help="only torch.profiler's table of one of our steps")
    parser.add_argument(
        "--samplers",
        action="store_true",
        help="only the samplers' tokens/s (fast, hf, vllm where installed) in float32 and bfloat16; "
        "sizes " + ", ".join(SAMPLER_MODELS) + " (default: all)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cuda: our step alone on the 0.5b and 1.5b shapes in bfloat16 (sampling tok/s, "
        "update MFU, peak GPU memory); cpu: the comparison with TRL",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="the device's dense bfloat16 peak for MFU (known: " + ", ".join(BF16_PEAK_TFLOPS) + ")",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(SCRIPTS))
    import tempfile

    print(f"# {' '.join(sys.argv)}\n# {machine()}")
    if args.device != "cpu":
        peak = args.peak_tflops or bf16_peak_tflops(args.device)
        if peak is None:
            parser.error(f"--peak-tflops is needed: the bfloat16 peak of {args.device} is not known here")
        results = []
        for size in args.size or list(GPU_SIZES):
            figures = device_figures(size, args.device, args.steps, peak)
            results.append({"size": size, "device": args.device, "peak_tflops": peak, **figures})
            print(
                f"{size} on {args.device}: {figures['step_seconds']:.3f} s/step, sampling "
                f"{figures['sampling_tokens_per_second']:.0f} tok/s, update {figures['update_seconds']:.3f} s "
                f"({figures['update_tflops']:.1f} TFLOP/s, MFU {figures['update_mfu']:.1%} of {peak:g}), "
                f"peak memory {figures['peak_memory_gb']:.2f} GB",
                flush=True,
            )
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    if args.samplers:
        results = []
        for size in args.size or list(SAMPLER_MODELS):
            for bf16 in (False, True):
                speeds = sampler_speeds(size, bf16, repeats=args.steps)
                results.append({"size": size, "bf16": bf16, **speeds})
                print(
                    f"{size} {'bfloat16' if bf16 else 'float32'}: "
                    + ", ".join(f"{key.split('_')[0]} {value:.0f} tok/s" for key, value in speeds.items()),
                    flush=True,
                )
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    if args.profile:
        for size in args.size or ["tiny", "small"]:
            print(f"{size}:\n{profile_step(size)}", flush=True)
        return
    if args.phases:
        for size in args.size or ["tiny", "small"]:
            config = json.loads((bench_model(size) / "config.json").read_text())
            shape = (4096, config["hidden_size"], config["intermediate_size"])
            print(
                f"{size} matmul {shape[0]}x{shape[1]} @ {shape[1]}x{shape[2]}: "
                f"float32 {matmul_rate(*shape):.0f} GFLOP/s, bfloat16 {matmul_rate(*shape, dtype='bfloat16'):.0f} GFLOP/s"
            )
            phases = phase_times(size, args.steps, shared=not args.one_pass_per_completion)
            total, floor = sum(row[1] for row in phases), sum(row[2] for row in phases)
            for name, seconds, phase_floor in phases + [("step", total, floor)]:
                against = f"{seconds / phase_floor:.2f}x its floor" if phase_floor else "-"
                print(f"{size} {name}: {seconds:.3f} s, floor {phase_floor:.3f} s, {against}", flush=True)
        return
    results = []
    for size in args.size or ["tiny", "small"]:
        bench_model(size)  # built once, before the workers start
        sampler = compare_samplers(size, repeats=5, bf16=args.bf16)  # first: nothing else is running
        with tempfile.TemporaryDirectory() as work:
            steps = compare_steps(size, args.steps, args.warmup, args.sampler, args.bf16, Path(work))
        steps["sampler"] = sampler
        results.append(steps)
        ours, trl = steps["ours"], steps["trl"]
        print(
            f"{size}: ours {ours['median_seconds']:.3f} s/step (generate {ours['median_generate_seconds']:.3f} s, "
            f"{ours['generate_tokens_per_second']:.0f} tok/s, peak RSS {ours['peak_rss_gb']:.2f} GB) | "
            f"TRL {trl['median_seconds']:.3f} s/step (generate {trl['median_generate_seconds']:.3f} s, "
            f"{trl['generate_tokens_per_second']:.0f} tok/s, peak RSS {trl['peak_rss_gb']:.2f} GB) | "
            f"ratio {steps['ratio']:.2f}",
            flush=True,
        )
        print(
            f"{size} sampler: fast {sampler['fast_tokens_per_second']:.0f} tok/s, generate "
            f"{sampler['hf_tokens_per_second']:.0f} tok/s, {sampler['speedup']:.2f}x",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
