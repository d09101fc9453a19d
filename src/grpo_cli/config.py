"""Typed config schemas, one dataclass per group, and the one `validate(cfg)` that runs before
anything is loaded.

The dataclasses are the schema: Hydra's ConfigStore holds them as `base_config` (the whole tree)
and `base_<group>` (each group), and every YAML file under `conf/` only sets values. A typo in an
override (`trainer.bta=0.1`) is rejected by Hydra itself, naming the key. Rules that span several
fields (group size >= 2, batch divisibility, files that must exist) live in `validate`, which
raises one `ConfigError` naming every key involved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from grpo_cli.advantages import ADVANTAGE_MODES
from grpo_cli.losses import AGGREGATIONS, BETA_SHAPES, KL_ESTIMATORS, BetaSchedule


class ConfigError(ValueError):
    """A bad config value, data file or model folder. The CLI prints its message and exits 2."""


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train a LoRA adapter (peft) instead of all weights; the reference is then the base model."""
    r: int = 16
    """Rank of the adapter matrices."""
    alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = 0.05
    """Adapter dropout; only in effect with model.disable_dropout=false."""
    target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Module names to adapt, or ["all-linear"]."""


@dataclass
class ModelConfig:
    name_or_path: str = MISSING
    """A Hugging Face model folder or hub id, or `builtin:tiny-addition` (built locally on first use)."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16. auto: bfloat16 on CUDA devices that support it, else float32."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    quantization: str = "none"
    """none | 8bit | 4bit (bitsandbytes). Quantized weights cannot be trained: needs lora.enabled."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    disable_dropout: bool = True
    """Set every dropout layer to p = 0 (as TRL's disable_dropout): with dropout, the ratio
    pi/pi_old and the KL compare two random sub-networks, so rho != 1 even before any update."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model folder to run. Off unless you trust the source."""


@dataclass
class DataConfig:
    path: str = MISSING
    """A JSONL, JSON, Parquet or CSV file, or a built-in task such as `synthetic:addition`."""
    prompt_field: str = "prompt"
    """The column that holds the prompt text."""
    answer_field: str = "answer"
    """The column passed to reward functions as `answer=` (every other column is passed by its name)."""
    system_prompt: Optional[str] = None
    """Prepended as a system message (chat template) or a first paragraph (plain text)."""
    use_chat_template: str = "auto"
    """auto | true | false. auto: on when the tokenizer has a chat template."""
    prompts_per_step: int = 16
    """Prompts sampled per training step (B); the step trains on B x group_size completions."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (with `seed` and the epoch number, so resume is exact)."""
    seed: int = 0
    eval_path: Optional[str] = None
    """Held-out prompts for the greedy eval. Unset: the built-in task's eval draw, or no eval for files."""
    eval_size: int = 200
    """At most this many eval prompts are used."""


@dataclass
class SamplerConfig:
    group_size: int = 8
    """G, completions sampled per prompt. Group statistics need at least 2."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k filtering."""
    max_new_tokens: int = 256
    min_new_tokens: int = 0


@dataclass
class RewardConfig:
    functions: List[Any] = field(
        default_factory=lambda: [{"_target_": "grpo_cli.rewards.exact_match", "weight": 1.0}]
    )
    """Reward functions: each `{_target_: module.function, weight: w, ...its own keyword args}`."""
    clip: Optional[List[float]] = None
    """[low, high]: clamp each function's scores to this range before weighting (null: no clip)."""
    max_error_fraction: float = 0.5
    """Stop the run when one function's scores are lost (it raised, returned a wrong length or a
    non-finite value) for more than this fraction of one call's completions: a bug, not bad luck."""
    workers: int = 4
    """Parallel sandboxed processes for code_execution (passed to rewards that take `workers`)."""
    normalize_each: bool = False
    """Z-score each function's scores within their group before the weighted sum, so a reward on a
    large scale does not drown a small one. The logged reward/mean stays the plain weighted sum."""


@dataclass
class OptimizerConfig:
    _target_: str = "torch.optim.AdamW"
    """Any torch-style optimizer class: called as cls(params, lr=, weight_decay=, betas=, **kwargs)."""
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    kwargs: Any = field(default_factory=dict)
    """Extra keyword arguments for the optimizer class (e.g. {eps: 1e-6})."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before each step; 0 disables clipping."""
    scheduler: str = "constant"
    """constant | linear | cosine; each with `warmup_steps` of linear warmup first."""
    warmup_steps: int = 0


@dataclass
class TrainerConfig:
    steps: int = 100
    """Training steps; each samples prompts_per_step x group_size completions."""
    beta: Any = 0.04
    """KL coefficient against the frozen reference: a number, or a schedule
    {start: 0.05, end: 0.02, warmup_steps: 100, shape: linear|cosine|step}. 0 (start and end)
    skips the reference model entirely."""
    kl_estimator: str = "k3"
    """k3 (the paper's, >= 0) | k2 | k1: the per-token KL estimate added to the loss."""
    advantage: str = "grpo"
    """grpo (group mean/std) | rloo (leave-one-out mean) | dr_grpo (group mean, no std) |
    batch_std (group mean, std of the whole batch)."""
    loss_aggregation: str = "sequence_mean"
    """sequence_mean (the paper: per-sequence mean, then over sequences) | token_mean (DAPO: all
    tokens of the step weigh the same) | constant (Dr. GRPO: token sums / max_new_tokens)."""
    clip_eps: float = 0.2
    """PPO clip range: the ratio pi/pi_old is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: Optional[float] = None
    """Upper clip (DAPO clip-higher, e.g. 0.28); null = clip_eps."""
    num_iterations: int = 1
    """mu: optimizer passes over each generation batch (old log-probs are computed once, before)."""
    micro_batch_size: int = 0
    """Completions per forward/backward pass (gradient accumulation); 0 = the whole step at once."""
    std_eps: float = 1e-4
    """Added to the std before dividing: A = (r - mean) / (std + std_eps)."""
    std_threshold: float = 1e-4
    """Groups whose reward std is below this get A = 0 (no signal) and are counted."""
    filter_zero_std: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts until
    the step has data.prompts_per_step informative groups."""
    max_resample_rounds: int = 4
    """Extra sampling rounds a step may take to fill its informative groups; if still short, the
    step is topped up with uninformative groups (A = 0) and the shortfall is logged."""
    mask_truncated: bool = False
    """Leave completions that hit max_new_tokens without EOS out of the loss (DAPO overlong filter)."""
    checkpoint_every: int = 50
    """Save a checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Checkpoints kept on disk; older ones are deleted."""
    resume: Any = False
    """false | true (newest checkpoint in output_dir) | a checkpoint folder."""
    seed: int = 0
    """Seeds model init of tiny models, sampling and everything else random."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    log_every: int = 10
    """Print a log line every N steps (metrics.jsonl gets every step)."""
    eval_every: int = 0
    """Run the greedy eval every N steps; 0 = only before the first and after the last step."""
    output_dir: Optional[str] = None
    """Where the run writes. Unset: Hydra's run directory (outputs/DATE/TIME, or the multirun job dir)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


GROUP_SCHEMAS = {
    "model": ModelConfig,
    "data": DataConfig,
    "sampler": SamplerConfig,
    "reward": RewardConfig,
    "optimizer": OptimizerConfig,
    "trainer": TrainerConfig,
}


def register_configs() -> None:
    """Store the schemas so `conf/config.yaml` and each group's YAML can name them."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for group, schema in GROUP_SCHEMAS.items():
        store.store(group=group, name=f"base_{group}", node=schema)


CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.quantization": ("none", "8bit", "4bit"),
    "data.use_chat_template": ("auto", "true", "false"),
    "optimizer.scheduler": ("constant", "linear", "cosine"),
}
EXACT_CHOICES = {  # read as written by the loss code, so compared case-sensitively
    "trainer.advantage": ADVANTAGE_MODES,
    "trainer.loss_aggregation": AGGREGATIONS,
    "trainer.kl_estimator": KL_ESTIMATORS,
}


def validate(cfg: Any, check_files: bool = True) -> None:
    """Reject configs that would fail later, before any model is loaded.

    Collects every problem and raises one ConfigError listing them all, each naming its key.
    `check_files=False` skips the checks that read the disk (used when composing presets whose
    data and models live on other machines).
    """
    problems: list[str] = []

    def lower(value: Any) -> str:
        return str(value).lower()

    for choices, normalize in ((CHOICES, lower), (EXACT_CHOICES, str)):
        for key, allowed in choices.items():
            group, name = key.split(".")
            if normalize(cfg[group][name]) not in allowed:
                problems.append(f"{key}={cfg[group][name]!r} is not one of {', '.join(allowed)}.")

    sampler, trainer, data = cfg.sampler, cfg.trainer, cfg.data
    if sampler.group_size < 2:
        problems.append(
            f"sampler.group_size={sampler.group_size}: GRPO normalizes rewards within a group, "
            "which needs at least 2 completions per prompt (4 to 16 is usual)."
        )
    if data.prompts_per_step < 1:
        problems.append(f"data.prompts_per_step={data.prompts_per_step} must be at least 1.")
    completions = data.prompts_per_step * sampler.group_size
    if trainer.micro_batch_size < 0 or (
        trainer.micro_batch_size > 0 and completions % trainer.micro_batch_size != 0
    ):
        problems.append(
            f"trainer.micro_batch_size={trainer.micro_batch_size} must divide the completions per "
            f"step, data.prompts_per_step x sampler.group_size = {completions} (or be 0 for all at once)."
        )
    positive = {
        "trainer.steps": trainer.steps,
        "trainer.num_iterations": trainer.num_iterations,
        "sampler.max_new_tokens": sampler.max_new_tokens,
        "sampler.temperature": sampler.temperature,
        "optimizer.lr": cfg.optimizer.lr,
    }
    problems += [f"{key}={value} must be positive." for key, value in positive.items() if value <= 0]
    non_negative = {
        "trainer.clip_eps": trainer.clip_eps,
        "trainer.max_resample_rounds": trainer.max_resample_rounds,
        "trainer.std_threshold": trainer.std_threshold,
        "trainer.checkpoint_every": trainer.checkpoint_every,
        "trainer.log_every": trainer.log_every,
        "trainer.eval_every": trainer.eval_every,
        "trainer.std_eps": trainer.std_eps,
        "sampler.min_new_tokens": sampler.min_new_tokens,
        "sampler.top_k": sampler.top_k,
        "optimizer.warmup_steps": cfg.optimizer.warmup_steps,
        "optimizer.max_grad_norm": cfg.optimizer.max_grad_norm,
    }
    problems += [f"{key}={value} must be >= 0." for key, value in non_negative.items() if not value >= 0]
    if trainer.clip_eps >= 1:
        problems.append(f"trainer.clip_eps={trainer.clip_eps} must be below 1 (the ratio is clipped at 1 - clip_eps).")
    if trainer.clip_eps_high is not None and not 0 <= trainer.clip_eps_high < math.inf:
        problems.append(f"trainer.clip_eps_high={trainer.clip_eps_high} must be >= 0 (or null for clip_eps).")
    problems += _beta_problems(trainer.beta)
    problems += _clip_problems(cfg.reward.clip)
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
            f"sampler.min_new_tokens={sampler.min_new_tokens} exceeds sampler.max_new_tokens="
            f"{sampler.max_new_tokens}."
        )
    if lower(cfg.model.quantization) != "none" and not cfg.model.lora.enabled:
        problems.append(
            f"model.quantization={cfg.model.quantization} needs model.lora.enabled=true: quantized "
            "weights cannot be trained directly, only a LoRA adapter on top of them (QLoRA)."
        )
    device = lower(trainer.device)
    if not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
        problems.append(f"trainer.device={trainer.device!r} is not one of auto, cpu, cuda, cuda:N.")
    resume = trainer.resume
    if not isinstance(resume, (bool, str)) or resume == "":
        problems.append(f"trainer.resume={resume!r} must be false, true or a checkpoint folder.")
    problems += _reward_problems(cfg.reward.functions)

    if check_files:
        from grpo_cli.prompts import data_problems  # reads only the first record of each file

        problems += data_problems(data)
        if isinstance(resume, str) and resume.lower() not in ("true", "false"):
            if not Path(resume).is_dir():
                problems.append(f"trainer.resume={resume}: no such checkpoint folder.")

    if problems:
        raise ConfigError(
            "The config has problems, nothing was loaded:\n  - "
            + "\n  - ".join(problems)
            + "\nFix these keys on the command line (key=value) or in your preset."
        )


def _reward_problems(functions: Any) -> list[str]:
    problems = []
    if not functions:
        return ["reward.functions is empty: give at least one {_target_: ..., weight: ...}."]
    for index, entry in enumerate(functions):
        key = f"reward.functions[{index}]"
        if not hasattr(entry, "get") or not entry.get("_target_"):
            problems.append(f"{key}={entry!r} needs a _target_ naming a function (module.name).")
            continue
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool):
            problems.append(f"{key}.weight={weight!r} must be a number.")
    return problems


def beta_schedule(beta: Any) -> BetaSchedule:
    """trainer.beta (a number or a {start, end, warmup_steps, shape} mapping) as a BetaSchedule."""
    if OmegaConf.is_config(beta):
        beta = OmegaConf.to_container(beta, resolve=True)
    if isinstance(beta, dict):
        start = float(beta["start"])
        return BetaSchedule(start, float(beta.get("end", start)), int(beta.get("warmup_steps", 0)),
                            str(beta.get("shape", "linear")))
    return BetaSchedule(float(beta), float(beta))


BETA_KEYS = ("start", "end", "warmup_steps", "shape")


def _beta_problems(beta: Any) -> list[str]:
    hint = ("trainer.beta must be a number >= 0 or a schedule such as "
            "trainer.beta='{start: 0.05, end: 0.02, warmup_steps: 100, shape: linear}'")
    if OmegaConf.is_config(beta):
        beta = OmegaConf.to_container(beta, resolve=True)
    if isinstance(beta, dict):
        unknown = sorted(set(beta) - set(BETA_KEYS))
        if unknown or "start" not in beta:
            return [f"trainer.beta={beta}: " + (f"unknown keys {unknown}; " if unknown else "needs `start`; ")
                    + f"the schedule keys are {', '.join(BETA_KEYS)}."]
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
    if (values is None or len(values) != 2 or not all(_is_number(v) and math.isfinite(v) for v in values)
            or values[0] >= values[1]):
        return [f"reward.clip={clip!r} must be [low, high] with low < high, e.g. reward.clip=[-5,5] (or null)."]
    return []


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resume_mode(resume: Any) -> Optional[str]:
    """Normalize trainer.resume: None (start fresh), "latest", or a checkpoint path."""
    if resume is False or str(resume).lower() == "false":
        return None
    if resume is True or str(resume).lower() == "true":
        return "latest"
    return str(resume)
