"""The memory planner against the measured peak of real GRPO steps, on randomly initialised
models of a preset's shape (nothing is downloaded).

    python scripts/bench_memory.py --device cuda                       # 0.5B full and 7B LoRA, bf16
    python scripts/bench_memory.py --device cpu --case tiny --steps 1  # the smoke test CI runs

Each case builds a model folder from the preset's `model.architecture` block (random weights,
the tiny model's byte-level tokenizer), composes the run preset with GSM8K prompts, and runs
`--steps` steps through the trainer's own stages: `load_models`, `HFSampler.sample`,
`update_policy`. On CUDA it resets the peak before each phase of the last step and reads
`torch.cuda.max_memory_allocated`: sampling against the plan's held + sampling, and the update
(reference pass included) against held + the larger of the two. The last step is the one to
compare: the optimizer states exist only after the first. On the CPU it runs the same path and
prints the plan (a smoke test; tests/test_memory.py measures the CPU against the RSS).
Prints a Markdown table for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grpo_cli.algorithm.advantages import group_advantages
from grpo_cli.algorithm.optim import make_optimizer, make_scheduler
from grpo_cli.algorithm.update import update_policy
from grpo_cli.cli import config_dir
from grpo_cli.config import beta_schedule
from grpo_cli.data.prompts import PromptSource, train_and_eval_rows
from grpo_cli.models.loading import load_models, trainable_parameters
from grpo_cli.models.sources import resolve_model
from grpo_cli.planner.architecture import architecture_from_block
from grpo_cli.planner.check import plan_for
from grpo_cli.planner.memory import GB
from grpo_cli.sampling import make_sampler

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
MATH_PROMPTS = [f"data.path={GSM8K}", "data.prompt_field=question", "data.answer_field=answer", "data.eval_path=null"]
# name -> the run's overrides (a conf preset and its changes)
CASES = {
    "0.5b-full": ["conf=math_0.5b", "model.dtype=bfloat16", *MATH_PROMPTS],
    "7b-lora": ["conf=math_7b", *MATH_PROMPTS],
    "7b-qlora": ["conf=math_7b", "model.quantization=4bit", *MATH_PROMPTS],
    "tiny": [
        "data.prompts_per_step=4",
        "sampler.group_size=4",
        "sampler.max_new_tokens=16",
        "trainer.micro_batch_size=8",
    ],  # the embedded default's addition prompts
}


def compose_case(overrides: list[str], folder: Path, device: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                *overrides,
                f"model.name_or_path={folder}",
                f"trainer.device={device}",
                "sampler.min_new_tokens=${sampler.max_new_tokens}",  # every completion full length: the plan's case
            ],
        )
    OmegaConf.resolve(cfg)
    return cfg


def build_random_model(block, folder: Path, dtype: torch.dtype, device: str) -> Path:
    """A model folder of the block's shape with random weights and the tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tiny = Path(resolve_model("builtin:tiny-addition"))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    values = {k: v for k, v in OmegaConf.to_container(block).items() if v is not None}
    config = AutoConfig.for_model(
        values.pop("model_type"),
        **values,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    return folder


def run_case(name: str, device: str, steps: int, work: Path) -> list[tuple[str, str, float, float | None]]:
    """(case, phase, planned GB, measured GB or None) of the last step."""
    if name == "tiny":
        folder = Path(resolve_model("builtin:tiny-addition"))
    else:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            preset = compose(config_name="config", overrides=CASES[name][:1])
        architecture_from_block(preset.model.architecture, preset.model.name_or_path)  # a readable error first
        folder = build_random_model(preset.model.architecture, work / name, torch.bfloat16, device)
    cfg = compose_case(CASES[name], folder, device)
    rows = train_and_eval_rows(cfg.data)[0][: 4 * cfg.data.prompts_per_step]
    plan = plan_for(cfg, torch.device(device), rows)
    betas = beta_schedule(cfg.trainer.beta)
    models = load_models(cfg.model, betas.peak, torch.device(device))
    prompts = PromptSource(cfg.data, models.tokenizer, rows)
    sampler = make_sampler(cfg.sampler, models.tokenizer)
    optimizer = make_optimizer(cfg.optimizer, trainable_parameters(models.policy))
    scheduler = make_scheduler(cfg.optimizer, optimizer, steps)
    measured: dict[str, float] = {}
    for step in range(steps):
        batch = prompts.next_batch()
        with peak_memory(device, measured, "sampling"):
            rollout = sampler.sample(models.policy, batch)
        rewards = torch.rand(batch.size, rollout.group_size)  # the update's cost does not depend on them
        advantages = group_advantages(rewards, std_eps=1e-4, std_threshold=1e-4)
        with peak_memory(device, measured, "update"):
            update_policy(
                models,
                rollout,
                advantages,
                optimizer,
                scheduler,
                cfg.trainer,
                cfg.optimizer.max_grad_norm,
                betas.at(step),
            )
    phases = plan.phase_bytes
    update_phase = max(phases.get("update", 0), phases.get("reference pass", 0))
    print(f"{name}: prompts padded to {plan.prompt_tokens} tokens, peak phase {plan.peak_phase}", file=sys.stderr)
    return [
        (name, "sampling", (plan.held_bytes + phases["sampling"]) / GB, measured.get("sampling")),
        (name, "update", (plan.held_bytes + update_phase) / GB, measured.get("update")),
    ]


class peak_memory:
    """On CUDA: the peak allocated bytes of the block, in GB, into `into[phase]`."""

    def __init__(self, device: str, into: dict[str, float], phase: str):
        self.cuda, self.into, self.phase = device.startswith("cuda"), into, phase

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.into[self.phase] = torch.cuda.max_memory_allocated() / GB


def main() -> None:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--case",
        action="append",
        choices=sorted(CASES),
        help="repeatable; default: 0.5b-full, 7b-lora and 7b-qlora on CUDA, tiny on the CPU",
    )
    parser.add_argument("--steps", type=int, default=2, help="steps per case; the last one is measured")
    args = parser.parse_args()
    cases = args.case or (["0.5b-full", "7b-lora", "7b-qlora"] if args.device.startswith("cuda") else ["tiny"])
    print("| case | phase | planned GB | measured GB (max_memory_allocated) | planned / measured |")
    print("|---|---|---|---|---|")
    work = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    try:
        for name in cases:
            for case, phase, planned, measured in run_case(name, args.device, args.steps, work):
                ratio = f"{planned / measured:.2f}" if measured else "-"
                shown = f"{measured:.2f}" if measured is not None else "- (CPU)"
                print(f"| {case} | {phase} | {planned:.2f} | {shown} | {ratio} |", flush=True)
            shutil.rmtree(work / name, ignore_errors=True)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
