"""The one `validate(cfg)` that runs before anything is loaded: the rules that span several
fields (group size >= 2, batch divisibility, files that must exist, a resume that matches its
checkpoint), each problem naming its keys, all raised together as one `ConfigError`.

The schemas themselves (one dataclass per group, what Hydra checks) are in config.py.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from grpo_cli.config import (
    ADVANTAGE_MODES,
    AGGREGATIONS,
    BETA_SHAPES,
    DISTRIBUTED_MODES,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    OBJECTIVES,
    ROLLOUT_CORRECTIONS,
    ConfigError,
    boosted_group_size,
    resume_mode,
)
from grpo_cli.launch import launched_world_size

CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.quantization": ("none", "8bit", "4bit"),
    "sampler.backend": ("hf", "fast", "vllm"),
    "model.autocast": ("none", "bfloat16", "auto"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2"),
    "data.use_chat_template": ("auto", "true", "false"),
    "optimizer.scheduler": ("constant", "linear", "cosine"),
}
NULLABLE_CHOICES = ("reward.multi_objective_aggregation",)  # null: the key is not set
EXACT_CHOICES = {  # read as written by the loss code, so compared case-sensitively
    "trainer.distributed": DISTRIBUTED_MODES,
    "trainer.advantage": ADVANTAGE_MODES,
    "trainer.loss_aggregation": AGGREGATIONS,
    "trainer.kl_estimator": KL_ESTIMATORS,
    "trainer.rollout_correction": ROLLOUT_CORRECTIONS,
    "trainer.loss": OBJECTIVES,
    "trainer.importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
    "reward.multi_objective_aggregation": MULTI_OBJECTIVE_AGGREGATIONS,
}


def validate(cfg: Any, check_files: bool = True) -> None:
    """Reject configs that would fail later, before any model is loaded.

    Collects every problem and raises one ConfigError listing them all, each naming its key.
    The rules between fields come first and import nothing heavy; once they hold, the checks
    that read the disk (model folder and tokenizer, data files, output folder, resume
    checkpoint) and the installed packages follow. `check_files=False` skips those (used when
    composing presets whose data, models and loggers live on other machines, and by `grpo-train`
    before it imports torch and transformers).
    """
    ranks = launched_world_size()  # torchrun's WORLD_SIZE: each rank trains on its share of the step
    problems = (
        _choice_problems(cfg)
        + _batch_problems(cfg, ranks)
        + _number_problems(cfg)
        + _model_problems(cfg, check_files)
        + _device_problems(cfg)
        + _run_problems(cfg, ranks)
        + _vllm_problems(cfg.sampler, ranks)
    )
    if check_files and not problems:  # the rules first: they need no tokenizer, so they are said in a second
        problems += _machine_problems(cfg)
    if problems:
        raise ConfigError(
            "The config has problems, nothing was loaded:\n  - "
            + "\n  - ".join(problems)
            + "\nFix these keys on the command line (key=value) or in your preset."
        )


def _lower(value: Any) -> str:
    return str(value).lower()


def _choice_problems(cfg: Any) -> list[str]:
    """Keys with a fixed set of values (CHOICES case-insensitively, EXACT_CHOICES as written)."""
    problems = []
    for choices, normalize in ((CHOICES, _lower), (EXACT_CHOICES, str)):
        for key, allowed in choices.items():
            group, name = key.split(".")
            if key in NULLABLE_CHOICES and cfg[group][name] is None:
                continue
            if normalize(cfg[group][name]) not in allowed:
                also = " (or null)" if key in NULLABLE_CHOICES else ""
                problems.append(f"{key}={cfg[group][name]!r} is not one of {', '.join(allowed)}{also}.")
    return problems


def _batch_problems(cfg: Any, ranks: int) -> list[str]:
    """The step's shape: groups, prompts per step, micro-batches, and how torchrun ranks share them."""
    sampler, trainer, data = cfg.sampler, cfg.trainer, cfg.data
    problems = []
    if sampler.group_size < 2:
        problems.append(
            f"sampler.group_size={sampler.group_size}: GRPO normalizes rewards within a group, "
            "which needs at least 2 completions per prompt (4 to 16 is usual)."
        )
    if data.prompts_per_step < 1:
        problems.append(f"data.prompts_per_step={data.prompts_per_step} must be at least 1.")
    # Sharded ranks gather weights together, so they must run the same forward passes.
    if trainer.distributed == "fsdp" and trainer.filter_zero_std:
        problems.append(
            "trainer.filter_zero_std=true with trainer.distributed=fsdp: ranks would take "
            "different numbers of sampling rounds. Use trainer.distributed=ddp for dynamic sampling."
        )
    if ranks > 1 and data.prompts_per_step % ranks:
        problems.append(
            f"data.prompts_per_step={data.prompts_per_step} must be a multiple of the {ranks} torchrun "
            f"processes: it is the global batch, and each process takes an equal share of whole groups."
        )
    completions = data.prompts_per_step * sampler.group_size // ranks
    per_rank = f" on each of the {ranks} processes" if ranks > 1 else ""
    if trainer.micro_batch_size < 0 or (trainer.micro_batch_size > 0 and completions % trainer.micro_batch_size != 0):
        problems.append(
            f"trainer.micro_batch_size={trainer.micro_batch_size} must divide the completions per "
            f"step{per_rank}, data.prompts_per_step x sampler.group_size{' / processes' if ranks > 1 else ''} "
            f"= {completions} (or be 0 for all at once)."
        )
    if trainer.micro_batch_tokens < 0:
        problems.append(
            f"trainer.micro_batch_tokens={trainer.micro_batch_tokens} must be 0 (off) or a token budget per "
            "forward/backward pass, such as 8192."
        )
    if trainer.micro_batch_tokens > 0 and trainer.micro_batch_size > 0:
        problems.append(
            f"trainer.micro_batch_tokens={trainer.micro_batch_tokens} with trainer.micro_batch_size="
            f"{trainer.micro_batch_size}: micro-batches are sized by tokens or by completions, not both. "
            "Set one of them to 0."
        )
    if trainer.micro_batch_tokens > 0 and trainer.distributed == "fsdp":
        problems.append(
            "trainer.micro_batch_tokens with trainer.distributed=fsdp: ranks would run different numbers "
            "of forward passes, and sharded ranks gather weights together. Use trainer.micro_batch_size, "
            "or trainer.distributed=ddp."
        )
    return problems


def _number_problems(cfg: Any) -> list[str]:
    """Numbers out of their range: positive, non-negative, finite, below 1, probabilities."""
    sampler, trainer, data = cfg.sampler, cfg.trainer, cfg.data
    positive = {
        "trainer.steps": trainer.steps,
        "trainer.num_iterations": trainer.num_iterations,
        "sampler.max_new_tokens": sampler.max_new_tokens,
        "optimizer.lr": cfg.optimizer.lr,
        "trainer.rollout_correction_cap": trainer.rollout_correction_cap,
    }
    problems = [f"{key}={value} must be positive." for key, value in positive.items() if value <= 0]
    if not sampler.temperature > 0:
        problems.append(
            f"sampler.temperature={sampler.temperature} must be positive: GRPO needs sampled groups "
            "whose completions differ (greedy decoding gives G copies of one answer). Use 0.6 to 1.0."
        )
    non_negative = {
        "trainer.clip_eps": trainer.clip_eps,
        "trainer.max_resample_rounds": trainer.max_resample_rounds,
        "trainer.keep_best": trainer.keep_best,
        "trainer.std_threshold": trainer.std_threshold,
        "trainer.checkpoint_every": trainer.checkpoint_every,
        "trainer.eval_every": trainer.eval_every,
        "trainer.std_eps": trainer.std_eps,
        "data.eval_size": data.eval_size,
        "sampler.min_new_tokens": sampler.min_new_tokens,
        "sampler.top_k": sampler.top_k,
        "optimizer.warmup_steps": cfg.optimizer.warmup_steps,
        "optimizer.max_grad_norm": cfg.optimizer.max_grad_norm,
    }
    problems += [f"{key}={value} must be >= 0." for key, value in non_negative.items() if not value >= 0]
    problems += _non_finite_problems(cfg) + _range_problems(cfg)
    if trainer.clip_eps >= 1:
        problems.append(f"trainer.clip_eps={trainer.clip_eps} must be below 1 (the ratio is clipped at 1 - clip_eps).")
    if trainer.clip_eps_high is not None and not 0 <= trainer.clip_eps_high < math.inf:
        problems.append(f"trainer.clip_eps_high={trainer.clip_eps_high} must be >= 0 (or null for clip_eps).")
    problems += _objective_problems(trainer)
    problems += _beta_problems(trainer.beta)
    problems += _clip_problems(cfg.reward.clip)
    problems += _aggregation_problems(cfg.reward, trainer)
    problems += _best_metric_problems(trainer)
    problems += _ref_sync_problems(cfg)
    if not 0 <= cfg.reward.max_error_fraction <= 1:
        problems.append(f"reward.max_error_fraction={cfg.reward.max_error_fraction} must be in [0, 1].")
    if cfg.reward.workers < 1:
        problems.append(f"reward.workers={cfg.reward.workers} must be at least 1.")
    if trainer.keep_last < 1:
        problems.append(f"trainer.keep_last={trainer.keep_last} must be at least 1.")
    if not 0 < sampler.top_p <= 1:
        problems.append(f"sampler.top_p={sampler.top_p} must be in (0, 1].")
    if sampler.min_new_tokens > sampler.max_new_tokens:
        problems.append(
            f"sampler.min_new_tokens={sampler.min_new_tokens} exceeds sampler.max_new_tokens={sampler.max_new_tokens}."
        )
    return problems


def _objective_problems(trainer: Any) -> list[str]:
    """The bounds of each objective's own keys, and the keys that belong to another objective."""
    problems = []
    upper = 1 + (trainer.clip_eps if trainer.clip_eps_high is None else trainer.clip_eps_high)
    if trainer.delta is not None and not upper < trainer.delta < math.inf:
        problems.append(
            f"trainer.delta={trainer.delta} must exceed 1 + clip_eps_high = {upper:g} (it caps the ratio "
            "above the clip range; INTELLECT-2 used 4), or be null."
        )
    if trainer.dual_clip is not None and not 1 < trainer.dual_clip < math.inf:
        problems.append(f"trainer.dual_clip={trainer.dual_clip} must exceed 1 (verl's default is 3), or be null.")
    for key in ("delta", "dual_clip"):
        if getattr(trainer, key) is not None and trainer.loss != "clip":
            problems.append(
                f"trainer.{key}={getattr(trainer, key)} shapes the clip of trainer.loss=clip; "
                f"trainer.loss={trainer.loss} has no such clip. Set trainer.{key}=null."
            )
    if not 1 < trainer.cispo_ratio_max < math.inf:
        problems.append(f"trainer.cispo_ratio_max={trainer.cispo_ratio_max} must exceed 1 (ScaleRL used 5).")
    if trainer.cispo_ratio_min is not None and not 0 <= trainer.cispo_ratio_min < 1:
        problems.append(f"trainer.cispo_ratio_min={trainer.cispo_ratio_min} must be in [0, 1), or null for none.")
    for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if not 0 < getattr(trainer, key) < math.inf:
            problems.append(f"trainer.{key}={getattr(trainer, key)} must be positive (SAPO used 1.0 and 1.05).")
    if not -math.inf < trainer.entropy_coef < math.inf:
        problems.append(
            f"trainer.entropy_coef={trainer.entropy_coef} must be a finite number (0 = no bonus; 1e-3 is usual)."
        )
    if not 0 <= trainer.top_entropy_quantile <= 1:
        problems.append(
            f"trainer.top_entropy_quantile={trainer.top_entropy_quantile} must be in [0, 1]: the fraction of "
            "tokens, by entropy, the policy term trains on (1 = all; the 80/20 paper used 0.2)."
        )
    return problems


def _ref_sync_problems(cfg: Any) -> list[str]:
    """trainer.ref_sync_steps moves a reference copy: one must exist and be whole on this rank."""
    trainer = cfg.trainer
    if trainer.ref_sync_steps < 0:
        return [f"trainer.ref_sync_steps={trainer.ref_sync_steps} must be >= 0 (0: a frozen reference)."]
    if not 0 < trainer.ref_mixup_alpha <= 1:
        return [f"trainer.ref_mixup_alpha={trainer.ref_mixup_alpha} must be in (0, 1] (TRL's default is 0.6)."]
    if trainer.ref_sync_steps == 0:
        return []
    reason = None
    if cfg.model.lora.enabled:
        reason = (
            "with model.lora.enabled=true the reference is the base model under the adapter, not a "
            "copy that can move (TRL refuses it too). Train a full fine-tune, or set trainer.ref_sync_steps=0"
        )
    elif _is_number(trainer.beta) and trainer.beta == 0:
        reason = "with trainer.beta=0 there is no reference to refresh. Set a beta > 0, or trainer.ref_sync_steps=0"
    elif trainer.distributed == "fsdp":
        reason = (
            "under trainer.distributed=fsdp the policy is sharded and the reference is not. Use ddp, "
            "or trainer.ref_sync_steps=0"
        )
    return [f"trainer.ref_sync_steps={trainer.ref_sync_steps}: {reason}."] if reason else []


def _best_metric_problems(trainer: Any) -> list[str]:
    """An eval metric ranks only checkpoints written at eval steps: checkpoint_every must land on them."""
    if trainer.best_metric_mode not in ("max", "min"):
        return [f"trainer.best_metric_mode={trainer.best_metric_mode!r} must be max or min."]
    if not str(trainer.best_metric).startswith("eval/") or trainer.keep_best == 0:
        return []
    every, eval_every = trainer.checkpoint_every, trainer.eval_every
    if eval_every <= 0 or every <= 0 or every % eval_every:
        return [
            f"trainer.best_metric={trainer.best_metric} is measured by the greedy eval every "
            f"trainer.eval_every={eval_every} steps, but checkpoints are written every "
            f"trainer.checkpoint_every={every}: only checkpoints at eval steps can be ranked. Set "
            "checkpoint_every to a multiple of eval_every (both > 0), e.g. trainer.eval_every=50 "
            "trainer.checkpoint_every=50."
        ]
    return []


def _aggregation_problems(reward: Any, trainer: Any) -> list[str]:
    """reward.multi_objective_aggregation (TRL's name) against the keys it stands for."""
    aggregation = reward.get("multi_objective_aggregation")
    if aggregation == "normalize_then_sum" and trainer.advantage not in ("grpo", "batch_std"):
        return [
            f"reward.multi_objective_aggregation=normalize_then_sum normalizes the summed z-scores by the "
            f"batch's std (trainer.advantage=batch_std), which trainer.advantage={trainer.advantage} "
            "contradicts. Drop one of the two."
        ]
    if aggregation == "sum_then_normalize" and reward.normalize_each:
        return [
            "reward.multi_objective_aggregation=sum_then_normalize sums the raw scores, which "
            "reward.normalize_each=true contradicts. Drop one of the two."
        ]
    return []


def _model_problems(cfg: Any, check_files: bool) -> list[str]:
    """What can be trained how: quantization needs LoRA, float16 needs LoRA, flash-attn installed."""
    model = cfg.model
    problems = []
    if _lower(model.quantization) != "none" and not model.lora.enabled:
        problems.append(
            f"model.quantization={model.quantization} needs model.lora.enabled=true: quantized "
            "weights cannot be trained directly, only a LoRA adapter on top of them (QLoRA)."
        )
    if model.lora.enabled and model.lora.r < 1:
        problems.append(
            f"model.lora.r={model.lora.r} must be at least 1: it is the rank of the "
            "adapter matrices (8 to 64 is usual)."
        )
    if _lower(model.dtype) == "float16" and not model.lora.enabled:
        problems.append(
            "model.dtype=float16 with a full fine-tune (model.lora.enabled=false): the weights and "
            "AdamW's states would be float16 with no float32 master copy, so updates smaller than "
            "float16's resolution are lost. Use model.dtype=bfloat16 (or float32), or train a LoRA "
            "adapter (model.lora.enabled=true: its weights are float32)."
        )
    if (
        _lower(model.attn_implementation) == "flash_attention_2"
        and check_files
        and importlib.util.find_spec("flash_attn") is None
    ):
        problems.append(
            "model.attn_implementation=flash_attention_2 needs the flash-attn package (CUDA "
            "only), which is not installed: `pip install flash-attn`, or use sdpa."
        )
    return problems


def _device_problems(cfg: Any) -> list[str]:
    problems = []
    device = _lower(cfg.trainer.device)
    if not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
        problems.append(f"trainer.device={cfg.trainer.device!r} is not one of auto, cpu, cuda, cuda:N.")
    reference_device = _lower(cfg.model.reference_device)
    if not (reference_device in ("same", "cpu", "cuda") or reference_device.startswith("cuda:")):
        problems.append(f"model.reference_device={cfg.model.reference_device!r} is not one of same, cpu, cuda, cuda:N.")
    return problems


def _run_problems(cfg: Any, ranks: int) -> list[str]:
    """Resume, reward functions, adaptive group size, samples and holdout."""
    trainer, data = cfg.trainer, cfg.data
    problems = []
    resume = trainer.resume
    if not isinstance(resume, (bool, str)) or resume == "":
        problems.append(f"trainer.resume={resume!r} must be false, true or a checkpoint folder.")
    problems += _reward_problems(cfg.reward.functions)
    problems += _few_shot_problems(data)
    if cfg.get("eval") is not None and cfg.eval.functions is not None:
        problems += _reward_problems(cfg.eval.functions, "eval.functions")
    problems += _adaptive_problems(cfg.sampler, max(data.prompts_per_step // ranks, 1), trainer.micro_batch_size)
    if trainer.sample_prompts < 0 or trainer.sample_every < 0 or data.eval_holdout < 0:
        problems.append("trainer.sample_every, trainer.sample_prompts and data.eval_holdout must be >= 0.")
    return problems


FEW_SHOT_ROLES = ("user", "assistant", "tool")


def _few_shot_problems(data: Any) -> list[str]:
    """data.few_shot: each entry a message of a known role with text content; chat prompts only."""
    if not data.few_shot:
        return []
    problems = []
    if str(data.use_chat_template).lower() == "false":
        problems.append("data.few_shot needs chat prompts: set data.use_chat_template=auto or true, or few_shot=[].")
    for index, message in enumerate(data.few_shot):
        role, content = message.get("role"), message.get("content")
        if role not in FEW_SHOT_ROLES or not isinstance(content, str):
            problems.append(
                f"data.few_shot[{index}]={dict(message)}: give a message {{role: user | assistant | tool, "
                "content: its text}} (a tool message may add name: the tool's)."
            )
    return problems


def _vllm_problems(sampler: Any, ranks: int) -> list[str]:
    """sampler.vllm's settings, read with sampler.backend=vllm only."""
    if _lower(sampler.backend) != "vllm":
        return []
    settings, problems = sampler.vllm, []
    if _lower(settings.dtype) not in ("auto", "float32", "bfloat16", "float16"):
        problems.append(f"sampler.vllm.dtype={settings.dtype!r} is not one of auto, float32, bfloat16, float16.")
    if not settings.kv_cache_gb >= 0:
        problems.append(
            f"sampler.vllm.kv_cache_gb={settings.kv_cache_gb} must be >= 0 (0: sized to one sampling call)."
        )
    utilization = settings.gpu_memory_utilization
    if utilization is not None and not 0 < utilization <= 1:
        problems.append(f"sampler.vllm.gpu_memory_utilization={utilization} must be in (0, 1], or null.")
    if utilization is not None and settings.kv_cache_gb:
        problems.append(
            f"sampler.vllm.gpu_memory_utilization={utilization} and sampler.vllm.kv_cache_gb="
            f"{settings.kv_cache_gb} both size the engine's KV cache: set one (the other null / 0)."
        )
    if settings.tensor_parallel_size < 1:
        problems.append(f"sampler.vllm.tensor_parallel_size={settings.tensor_parallel_size} must be at least 1.")
    if ranks > 1:
        problems.append(
            f"sampler.backend=vllm under torchrun ({ranks} processes): each process would build an engine "
            "of its own beside its share of the model, which grpo-cli does not do yet. Use one process "
            "(sampler.vllm.tensor_parallel_size spreads the engine over GPUs), or sampler=fast under torchrun."
        )
    return problems


def _machine_problems(cfg: Any) -> list[str]:
    """What this machine must hold: the model's tokenizer and config, the data files, a usable
    output folder, the loggers' packages, the CUDA devices named, the resume checkpoint."""
    import torch

    from grpo_cli.data.prompts import data_problems
    from grpo_cli.models.loading import local_tokenizer_and_context

    trainer = cfg.trainer
    problems = []
    try:  # no weights, no download: the tokenizer and config.json of a model on this machine
        model = local_tokenizer_and_context(cfg.model)
    except ConfigError as error:
        problems.append(str(error))
        model = None
    problems += data_problems(cfg.data, model, cfg.sampler.max_new_tokens)
    problems += output_dir_problems(trainer.output_dir)
    problems += _logger_problems(cfg.logger)  # installed packages: this machine, like the files
    device, reference_device = _lower(trainer.device), _lower(cfg.model.reference_device)
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if reference_device.startswith("cuda"):  # else models.resolve_device says it, blaming trainer.device
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = reference_device.partition(":")[2]
        if count == 0 or (index.isdigit() and int(index) >= count):
            seen = (
                f"{count} CUDA device(s), numbered from 0" if count else f"no CUDA device (torch {torch.__version__})"
            )
            problems.append(
                f"model.reference_device={cfg.model.reference_device}, but torch sees {seen}. "
                "Use model.reference_device=same (the policy's device), cpu, or a CUDA "
                "device this machine has."
            )
    if "paged" in str(cfg.optimizer._target_).lower() and not on_cuda:
        problems.append(
            f"optimizer._target_={cfg.optimizer._target_}: paged optimizers keep their states in CUDA "
            "unified memory, and this run is on the CPU. Use optimizer=adamw_8bit (or adamw)."
        )
    if _lower(cfg.sampler.backend) == "vllm":
        problems += _vllm_machine_problems(cfg.sampler.vllm, on_cuda)
    resume = trainer.resume
    if isinstance(resume, bool) or (isinstance(resume, str) and resume):
        problems += resume_problems(cfg)
    return problems


def _vllm_machine_problems(settings: Any, on_cuda: bool) -> list[str]:
    """vLLM installed, and its CUDA-only settings on a CUDA run."""
    from grpo_cli.sampling.vllm import VLLM_MISSING, vllm_installed

    problems = [] if vllm_installed() else [VLLM_MISSING]
    if not on_cuda:
        cuda_only = {
            "sampler.vllm.gpu_memory_utilization": settings.gpu_memory_utilization is not None,
            "sampler.vllm.tensor_parallel_size": settings.tensor_parallel_size > 1,
        }
        problems += [
            f"{key} is for CUDA runs, and this one is on the CPU: on a CPU the engine is one process, "
            "its KV cache sized by sampler.vllm.kv_cache_gb (0: to one sampling call)."
            for key, wrong in cuda_only.items()
            if wrong
        ]
    return problems


def output_dir_problems(output_dir: Optional[str]) -> list[str]:
    """trainer.output_dir must be a folder we can create (or is one) and write to."""
    if not output_dir:
        return []
    existing = Path(output_dir).expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        why = f"{existing} is a file, so no folder can be made under it"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable by this user"
    else:
        return []
    return [
        f"trainer.output_dir={output_dir}: {why}. Point trainer.output_dir (or hydra.run.dir) "
        "at a folder you can write to."
    ]


RESUME_KEYS = (
    "model.name_or_path",
    "model.lora.enabled",
    "model.lora.r",
    "model.lora.target_modules",
    "model.quantization",
)
LORA_SHAPE_KEYS = ("model.lora.r", "model.lora.target_modules")  # compared only when both use LoRA


def _non_finite_problems(cfg: Any) -> list[str]:
    """nan and inf pass the `<=` tests above (nan <= 0 is false) and then turn every weight into
    NaN (optimizer.lr=inf) or a schedule into nothing: every number of these groups must be
    finite. A reward function's own arguments are left to it."""
    problems: list[str] = []

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                if key != "reward" or name != "functions":
                    walk(value, f"{key}.{name}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{key}[{index}]")
        elif isinstance(node, float) and not math.isfinite(node):
            problems.append(f"{key}={node} must be a finite number.")

    for group in ("model", "data", "sampler", "reward", "optimizer", "trainer"):
        walk(OmegaConf.to_container(cfg[group], resolve=True), group)
    return problems


def _range_problems(cfg: Any) -> list[str]:
    """Settings that a run would take without complaint and then train nothing, or crash on."""
    optimizer, trainer = cfg.optimizer, cfg.trainer
    problems = []
    if not optimizer.weight_decay >= 0:
        problems.append(f"optimizer.weight_decay={optimizer.weight_decay} must be >= 0 (0.0 to 0.1 is usual).")
    betas = list(optimizer.betas)
    if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
        problems.append(
            f"optimizer.betas={betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]: Adam's "
            "moving averages of the gradient and its square."
        )
    for key, seed in (("trainer.seed", trainer.seed), ("data.seed", cfg.data.seed)):
        if not 0 <= seed < 2**32:
            problems.append(f"{key}={seed} must be in [0, 2^32): torch, numpy and Python take it as their seed.")
    if trainer.log_every < 1:
        problems.append(
            f"trainer.log_every={trainer.log_every} must be at least 1 (a console line every "
            "that many steps; metrics.jsonl gets every step whatever it is)."
        )
    if trainer.memory_budget_gb is not None and not trainer.memory_budget_gb > 0:
        problems.append(
            f"trainer.memory_budget_gb={trainer.memory_budget_gb} must be positive, or null for what this machine has."
        )
    if not cfg.reward.timeout_s >= 0:
        problems.append(f"reward.timeout_s={cfg.reward.timeout_s} must be >= 0 (0: no limit).")
    return problems


def resume_problems(cfg: Any) -> list[str]:
    """trainer.resume must name a complete checkpoint made with this model set-up.

    The checkpoint `RUN/checkpoints/step-N` was written by the run whose resolved config is
    `RUN/config.yaml`; the keys of RESUME_KEYS decide whether its weights (or adapter) fit the
    model this config loads, so any difference is reported with both values. A checkpoint copied
    away from its run folder is checked by what it holds: an adapter only fits a LoRA config.
    `trainer.resume=true` with no checkpoint yet is left to pipeline, which says where it looked.
    """
    from grpo_cli.checkpoint import META_FILE, STATE_FILE, checkpoint_damage, latest_checkpoint, newest_resumable

    mode = resume_mode(cfg.trainer.resume)
    if mode is None:
        return []
    if mode == "latest":  # the one pipeline will take (it passes over damaged newer ones, saying so)
        run_folder = Path(cfg.trainer.output_dir) if cfg.trainer.output_dir else None
        checkpoint = run_folder and (newest_resumable(run_folder)[0] or latest_checkpoint(run_folder))
        if checkpoint is None:
            return []
    else:
        checkpoint = Path(mode)
        if not checkpoint.is_dir():
            return [
                f"trainer.resume={mode}: no such checkpoint folder. Give a folder such as "
                "RUN/checkpoints/step-000100, or trainer.resume=true for the newest in the run folder."
            ]
        missing = [name for name in (META_FILE, STATE_FILE) if not (checkpoint / name).is_file()]
        if missing:
            return [
                f"trainer.resume={mode}: not a complete checkpoint (no {' or '.join(missing)}). "
                "Give a folder such as RUN/checkpoints/step-000100 (a folder without meta.json "
                "is a save that was cut off), or trainer.resume=true for the newest complete one."
            ]
    problems = _setup_problems(checkpoint, cfg)
    damage = checkpoint_damage(checkpoint) if mode != "latest" and not problems else None
    if damage is not None:
        return [
            f"trainer.resume={mode}: the checkpoint cannot be resumed: {damage}. Give another "
            "checkpoint, or trainer.resume=true for the newest of the run that loads."
        ]
    return problems


def _setup_problems(checkpoint: Path, cfg: Any) -> list[str]:
    """The model set-up of `checkpoint` (its run's config.yaml, else what it holds) against cfg's."""
    saved = checkpoint.parent.parent / "config.yaml"
    model = cfg.model
    if not saved.is_file():
        has_adapter = (checkpoint / "adapter_config.json").is_file()
        if has_adapter != bool(model.lora.enabled):
            held = "a LoRA adapter" if has_adapter else "full model weights"
            return [
                f"trainer.resume={checkpoint}: the checkpoint holds {held}, but "
                f"model.lora.enabled={model.lora.enabled}. Resume with the set-up it was made with."
            ]
        return [] if has_adapter else _other_model_problems(checkpoint, model)
    before = OmegaConf.load(saved)
    both_lora = bool(OmegaConf.select(before, "model.lora.enabled")) and bool(model.lora.enabled)
    differ = []
    for key in RESUME_KEYS:
        if key in LORA_SHAPE_KEYS and not both_lora:
            continue
        old, new = (_plain(OmegaConf.select(c, key)) for c in (before, cfg))
        if key == "model.name_or_path" and _same_model(old, new):
            continue
        if old != new:
            differ.append(f"{key} was {old!r}, now {new!r}")
    if not differ:
        return []
    return [
        f"trainer.resume: checkpoint {checkpoint} was made with another model set-up (its run's "
        f"config: {saved}): {'; '.join(differ)}. Resume with the values it was made with, or "
        "start a fresh run (trainer.resume=false) in another folder."
    ]


# config.json keys that decide the weights' shapes: a checkpoint that differs in one is another model.
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def _other_model_problems(checkpoint: Path, model: Any) -> list[str]:
    """Full weights copied away from their run: their config.json against model.name_or_path's.
    The policy comes from the checkpoint and the reference from model.name_or_path, so another
    model would crash in the embedding, or (with a vocabulary that fits) train against the wrong
    reference. A hub id not on this machine is not compared."""
    import json

    from grpo_cli.models.loading import _local_folder

    try:
        base = _local_folder(model)
        theirs = json.loads((checkpoint / "config.json").read_text())
        ours = json.loads((Path(base) / "config.json").read_text()) if base else None
    except (ConfigError, OSError, ValueError):  # the model's own problems are said elsewhere
        return []
    if ours is None:
        return []
    differ = [
        f"{key} {theirs.get(key)!r} against {ours.get(key)!r}" for key in SHAPE_KEYS if theirs.get(key) != ours.get(key)
    ]
    if not differ:
        return []
    return [
        f"trainer.resume={checkpoint}: the checkpoint is another model than "
        f"model.name_or_path={model.name_or_path} ({', '.join(differ)}); the reference would come from "
        "model.name_or_path. Resume with model.name_or_path set to the model it was trained from."
    ]


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _same_model(old: Any, new: Any) -> bool:
    if old == new:
        return True
    paths = [Path(str(v)).expanduser() for v in (old, new)]
    return all(p.is_dir() for p in paths) and paths[0].resolve() == paths[1].resolve()


def _adaptive_problems(sampler: Any, prompts_per_step: int, micro_batch_size: int) -> list[str]:
    adaptive = sampler.adaptive
    if not adaptive.enabled:
        return []
    problems = [
        f"sampler.adaptive.{key}={getattr(adaptive, key)} must be at least {least}."
        for key, least in (("patience", 1), ("duration", 1), ("factor", 2))
        if getattr(adaptive, key) < least
    ]
    if adaptive.max_group_size <= sampler.group_size:
        problems.append(
            f"sampler.adaptive.max_group_size={adaptive.max_group_size} must exceed "
            f"sampler.group_size={sampler.group_size}, or there is nothing to raise it to."
        )
    if not 0 <= adaptive.zero_std_fraction <= 1:
        problems.append(f"sampler.adaptive.zero_std_fraction={adaptive.zero_std_fraction} must be in [0, 1].")
    boosted = prompts_per_step * boosted_group_size(sampler)
    if not problems and micro_batch_size > 0 and boosted % micro_batch_size:
        problems.append(
            f"trainer.micro_batch_size={micro_batch_size} must also divide the completions "
            f"of a raised step, data.prompts_per_step x {boosted_group_size(sampler)} = {boosted}."
        )
    return problems


OPTIONAL_LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # key -> package


def _logger_problems(logger: Any) -> list[str]:
    return [
        f"logger.{key}=true, but the `{package}` package is not installed. Install it "
        f"(pip install {package}) or choose another logger (logger=tensorboard or logger=jsonl)."
        for key, package in OPTIONAL_LOGGERS.items()
        if logger[key] and importlib.util.find_spec(package) is None
    ]


def _reward_problems(functions: Any, where: str = "reward.functions") -> list[str]:
    problems = []
    if not functions:
        tail = " (or null: the training rewards)" if where != "reward.functions" else ""
        return [f"{where} is empty: give at least one {{_target_: ..., weight: ...}}{tail}."]
    for index, entry in enumerate(functions):
        key = f"{where}[{index}]"
        if not hasattr(entry, "get") or not entry.get("_target_"):
            problems.append(f"{key}={entry!r} needs a _target_ naming a function (module.name).")
            continue
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool):
            problems.append(f"{key}.weight={weight!r} must be a number.")
    return problems


BETA_KEYS = ("start", "end", "warmup_steps", "shape")


def _beta_problems(beta: Any) -> list[str]:
    hint = (
        "trainer.beta must be a number >= 0 or a schedule such as "
        "trainer.beta='{start: 0.05, end: 0.02, warmup_steps: 100, shape: linear}'"
    )
    if OmegaConf.is_config(beta):
        beta = OmegaConf.to_container(beta, resolve=True)
    if isinstance(beta, dict):
        unknown = sorted(set(beta) - set(BETA_KEYS))
        if unknown or "start" not in beta:
            return [
                f"trainer.beta={beta}: "
                + (f"unknown keys {unknown}; " if unknown else "needs `start`; ")
                + f"the schedule keys are {', '.join(BETA_KEYS)}."
            ]
        numbers = {key: beta[key] for key in ("start", "end", "warmup_steps") if key in beta}
        if any(not _is_number(v) or not 0 <= v < math.inf for v in numbers.values()):
            return [f"trainer.beta={beta}: start, end and warmup_steps must be finite numbers >= 0."]
        if not float(beta.get("warmup_steps", 0)).is_integer():
            return [f"trainer.beta.warmup_steps={beta['warmup_steps']} must be a whole number of steps."]
        if str(beta.get("shape", "linear")) not in BETA_SHAPES:
            return [f"trainer.beta.shape={beta.get('shape')!r} is not one of {', '.join(BETA_SHAPES)}."]
        return []
    if not _is_number(beta) or not 0 <= beta < math.inf:
        return [f"trainer.beta={beta!r}: {hint}."]
    return []


def _clip_problems(clip: Any) -> list[str]:
    if clip is None:
        return []
    values = list(clip) if not isinstance(clip, (str, bytes)) and hasattr(clip, "__iter__") else None
    if (
        values is None
        or len(values) != 2
        or not all(_is_number(v) and math.isfinite(v) for v in values)
        or values[0] >= values[1]
    ):
        return [f"reward.clip={clip!r} must be [low, high] with low < high, e.g. reward.clip=[-5,5] (or null)."]
    return []


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
