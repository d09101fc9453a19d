"""Typed config schemas, one dataclass per group, and the one `validate(cfg)` that runs before
anything is loaded.

The dataclasses are the schema: Hydra's ConfigStore holds them as `base_config` (the whole tree)
and `base_<group>` (each group), and every YAML file under `conf/` only sets values. A typo in an
override (`trainer.bta=0.1`) is rejected by Hydra itself, naming the key. Rules that span several
fields (group size >= 2, batch divisibility, files that must exist) live in `validate`, which
raises one `ConfigError` naming every key involved.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from grpo_cli.advantages import ADVANTAGE_MODES
from grpo_cli.distributed import DISTRIBUTED_MODES, launched_world_size
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
class ArchitectureConfig:
    """A model's shape, as its config.json states it: what the memory planner counts with when
    the model is not on this machine (each model preset records its numbers)."""

    model_type: str = MISSING
    """config.json's model_type (qwen2, llama, mistral, ...): transformers' defaults for that type
    fill in the rest, e.g. Qwen2's biases on q/k/v."""
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    vocab_size: int = MISSING
    tie_word_embeddings: bool = False
    head_dim: Optional[int] = None
    """Per-head width; null = hidden_size / num_attention_heads."""


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
    reference_device: str = "same"
    """Where a full fine-tune's frozen reference lives: same (the policy's device) | cpu | cuda |
    cuda:N. It only runs forward, so it can sit on the CPU (slower) to free device memory."""
    attn_implementation: str = "sdpa"
    """sdpa | eager | flash_attention_2 (needs the flash-attn package and a CUDA GPU). Passed to
    from_pretrained; the memory planner counts sdpa's activations."""
    architecture: Optional[ArchitectureConfig] = None
    """The model's shape for the memory planner when its config.json is not on this machine."""


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
    eval_holdout: int = 0
    """With no eval_path: hold this many rows of data.path out of training (a fixed draw, by
    `seed`) and evaluate on them. 0 = none (built-in tasks have their own eval draw)."""


@dataclass
class AdaptiveGroupConfig:
    enabled: bool = False
    """Raise the group size for a while when training stalls (more samples per prompt make a
    group with differing rewards, and so a gradient, more likely)."""
    patience: int = 20
    """Stalled: reward/mean has not beaten its best by `min_improvement` for this many steps..."""
    min_improvement: float = 0.01
    """Reward units a step must beat the best mean reward by to count as an improvement."""
    zero_std_fraction: float = 0.9
    """... or the mean zero-std group fraction over the last `patience` steps is above this."""
    factor: int = 2
    """The raised group size is group_size x factor, capped at max_group_size."""
    max_group_size: int = 16
    duration: int = 10
    """Steps at the raised group size before it returns to sampler.group_size."""


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
    adaptive: AdaptiveGroupConfig = field(default_factory=AdaptiveGroupConfig)
    """Adaptive group size for stalled training (off by default)."""


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
class GuardConfig:
    enabled: bool = False
    """Watch for collapse and roll back to the last good checkpoint instead of training on."""
    window: int = 20
    """Steps in the moving mean of reward/mean that the drop is measured on."""
    reward_drop: float = 0.3
    """Trigger when the windowed mean reward falls this far (reward units) below its best."""
    max_kl: float = 1.0
    """Trigger when the step's mean per-token KL to the reference exceeds this."""
    beta_factor: float = 2.0
    """Multiply beta by this at each rollback (a too-small KL coefficient is the usual cause)."""
    lr_factor: float = 1.0
    """Multiply the learning rate by this at each rollback (1: unchanged)."""
    max_rollbacks: int = 3
    """After this many rollbacks the next trigger stops the run, with a report."""


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
    """The newest checkpoints kept on disk; older ones are deleted (except the best, below)."""
    keep_best: int = 1
    """Also keep this many checkpoints with the highest mean reward (0: only the newest)."""
    resume: Any = False
    """false | true (newest checkpoint in output_dir) | a checkpoint folder."""
    seed: int = 0
    """Seeds model init of tiny models, sampling and everything else random."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N. Under torchrun, auto and cuda mean each rank's own GPU."""
    distributed: str = "ddp"
    """Under torchrun: ddp (DistributedDataParallel: every rank holds the model, gradients are
    averaged) | fsdp (FSDP2 fully_shard: weights, gradients and optimizer state sharded)."""
    log_every: int = 10
    """Print a log line every N steps (metrics.jsonl gets every step)."""
    eval_every: int = 0
    """Run the greedy eval every N steps; 0 = only before the first and after the last step."""
    eval_pass_at_k: bool = False
    """Also sample group_size completions per eval prompt and log eval/pass_at_k: the fraction of
    prompts where the best of them scores the first reward function's best (pass@G for 0/1 rewards)."""
    sample_every: int = 50
    """Every N steps, show a few prompts with their G completions, rewards and advantages and append
    them to samples.jsonl (and TensorBoard); 0 = never."""
    sample_prompts: int = 2
    """Prompts shown (and saved) each time."""
    output_dir: Optional[str] = None
    """Where the run writes. Unset: Hydra's run directory (outputs/DATE/TIME, or the multirun job dir)."""
    plan: bool = False
    """Print the memory plan (estimated peak per device) and exit without loading anything."""
    plan_force: bool = False
    """Train even when the memory plan says the run will not fit."""
    memory_budget_gb: Optional[float] = None
    """The memory the plan must fit in; null = the device's free memory (CUDA) or available RAM."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The collapse guard: NaN/inf loss or gradients, a reward drop, or KL above a bound roll the
    run back to the last good checkpoint with beta raised (docs/ALGORITHM.md, README)."""


@dataclass
class LoggerConfig:
    tensorboard: bool = True
    """Scalars and sample texts to OUTPUT_DIR/tensorboard (metrics.jsonl is always written)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`; offline with WANDB_MODE=offline)."""
    mlflow: bool = False
    """Also log to MLflow (needs `pip install mlflow`; MLFLOW_TRACKING_URI says where)."""
    project: str = "grpo-cli"
    """The wandb project / MLflow experiment name."""
    run_name: Optional[str] = None
    """The wandb / MLflow run name; unset: the run folder's name."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


GROUP_SCHEMAS = {
    "model": ModelConfig,
    "data": DataConfig,
    "sampler": SamplerConfig,
    "reward": RewardConfig,
    "optimizer": OptimizerConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
}


def register_configs() -> None:
    """Store the schemas so `conf/config.yaml` and each group's YAML can name them."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for group, schema in GROUP_SCHEMAS.items():
        store.store(group=group, name=f"base_{group}", node=schema)


def schema_keys(schema: Optional[type] = None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (`trainer.beta`, `model.lora.r`, ...), for suggestions."""
    keys = []
    for item in fields(schema or Config):
        key = prefix + item.name
        nested = _schema_class(item.type)
        keys += schema_keys(nested, key + ".") if nested else [key]
    return keys


def schema_type(key: str) -> Optional[str]:
    """The type a key is declared with, as written in its dataclass (`int`, `List[str]`), or None."""
    schema: Any = Config
    *groups, name = key.split(".")
    for group in groups:
        found = {item.name: item for item in fields(schema)}.get(group)
        schema = _schema_class(found.type) if found else None
        if schema is None:
            return None
    found = {item.name: item for item in fields(schema)}.get(name)
    if found is None:
        return None
    written = found.type if isinstance(found.type, str) else getattr(found.type, "__name__", str(found.type))
    return {"int": "a whole number", "float": "a number", "bool": "true or false",
            "str": "a string"}.get(written, f"a value of type {written}")


def _schema_class(annotation: Any) -> Optional[type]:
    """The dataclass an annotation names (annotations are strings here), or None for a leaf."""
    found = globals().get(annotation) if isinstance(annotation, str) else annotation
    return found if isinstance(found, type) and is_dataclass(found) else None


CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.quantization": ("none", "8bit", "4bit"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2"),
    "data.use_chat_template": ("auto", "true", "false"),
    "optimizer.scheduler": ("constant", "linear", "cosine"),
}
EXACT_CHOICES = {  # read as written by the loss code, so compared case-sensitively
    "trainer.distributed": DISTRIBUTED_MODES,
    "trainer.advantage": ADVANTAGE_MODES,
    "trainer.loss_aggregation": AGGREGATIONS,
    "trainer.kl_estimator": KL_ESTIMATORS,
}


def validate(cfg: Any, check_files: bool = True) -> None:
    """Reject configs that would fail later, before any model is loaded.

    Collects every problem and raises one ConfigError listing them all, each naming its key.
    `check_files=False` skips the checks that read the disk or the installed packages (used when
    composing presets whose data, models and loggers live on other machines).
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
    ranks = launched_world_size()  # torchrun's WORLD_SIZE: each rank trains on its share of the step
    if trainer.distributed == "fsdp":
        # Sharded ranks gather weights together, so they must run the same forward passes.
        if trainer.filter_zero_std:
            problems.append("trainer.filter_zero_std=true with trainer.distributed=fsdp: ranks would take "
                            "different numbers of sampling rounds. Use trainer.distributed=ddp for dynamic sampling.")
        if trainer.guard.enabled:
            problems.append("trainer.guard.enabled=true with trainer.distributed=fsdp: rolling back sharded "
                            "weights is not supported yet. Use trainer.distributed=ddp, or run without the guard.")
    if ranks > 1 and data.prompts_per_step % ranks:
        problems.append(
            f"data.prompts_per_step={data.prompts_per_step} must be a multiple of the {ranks} torchrun "
            f"processes: it is the global batch, and each process takes an equal share of whole groups."
        )
    completions = data.prompts_per_step * sampler.group_size // ranks
    per_rank = f" on each of the {ranks} processes" if ranks > 1 else ""
    if trainer.micro_batch_size < 0 or (
        trainer.micro_batch_size > 0 and completions % trainer.micro_batch_size != 0
    ):
        problems.append(
            f"trainer.micro_batch_size={trainer.micro_batch_size} must divide the completions per "
            f"step{per_rank}, data.prompts_per_step x sampler.group_size{' / processes' if ranks > 1 else ''} "
            f"= {completions} (or be 0 for all at once)."
        )
    positive = {
        "trainer.steps": trainer.steps,
        "trainer.num_iterations": trainer.num_iterations,
        "sampler.max_new_tokens": sampler.max_new_tokens,
        "optimizer.lr": cfg.optimizer.lr,
    }
    problems += [f"{key}={value} must be positive." for key, value in positive.items() if value <= 0]
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
    if lower(cfg.model.dtype) == "float16" and not cfg.model.lora.enabled:
        problems.append(
            "model.dtype=float16 with a full fine-tune (model.lora.enabled=false): the weights and "
            "AdamW's states would be float16 with no float32 master copy, so updates smaller than "
            "float16's resolution are lost. Use model.dtype=bfloat16 (or float32), or train a LoRA "
            "adapter (model.lora.enabled=true: its weights are float32)."
        )
    if lower(cfg.model.attn_implementation) == "flash_attention_2" and check_files \
            and importlib.util.find_spec("flash_attn") is None:
        problems.append("model.attn_implementation=flash_attention_2 needs the flash-attn package (CUDA "
                        "only), which is not installed: `pip install flash-attn`, or use sdpa.")
    device = lower(trainer.device)
    if not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
        problems.append(f"trainer.device={trainer.device!r} is not one of auto, cpu, cuda, cuda:N.")
    reference_device = lower(cfg.model.reference_device)
    if not (reference_device in ("same", "cpu", "cuda") or reference_device.startswith("cuda:")):
        problems.append(f"model.reference_device={cfg.model.reference_device!r} is not one of same, cpu, cuda, cuda:N.")

    resume = trainer.resume
    if not isinstance(resume, (bool, str)) or resume == "":
        problems.append(f"trainer.resume={resume!r} must be false, true or a checkpoint folder.")
    problems += _reward_problems(cfg.reward.functions)
    problems += _adaptive_problems(sampler, max(data.prompts_per_step // ranks, 1), trainer.micro_batch_size)
    if trainer.sample_prompts < 0 or trainer.sample_every < 0 or data.eval_holdout < 0:
        problems.append("trainer.sample_every, trainer.sample_prompts and data.eval_holdout must be >= 0.")

    if check_files:
        from grpo_cli.models import local_tokenizer_and_context
        from grpo_cli.prompts import data_problems

        try:  # no weights, no download: the tokenizer and config.json of a model on this machine
            model = local_tokenizer_and_context(cfg.model)
        except ConfigError as error:
            problems.append(str(error))
            model = None
        problems += data_problems(data, model, sampler.max_new_tokens)
        problems += output_dir_problems(trainer.output_dir)
        problems += _logger_problems(cfg.logger)  # installed packages: this machine, like the files
        on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if "paged" in str(cfg.optimizer._target_).lower() and not on_cuda:
            problems.append(
                f"optimizer._target_={cfg.optimizer._target_}: paged optimizers keep their states in CUDA "
                "unified memory, and this run is on the CPU. Use optimizer=adamw_8bit (or adamw)."
            )
        if isinstance(resume, bool) or (isinstance(resume, str) and resume):
            problems += resume_problems(cfg)

    if problems:
        raise ConfigError(
            "The config has problems, nothing was loaded:\n  - "
            + "\n  - ".join(problems)
            + "\nFix these keys on the command line (key=value) or in your preset."
        )


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
    return [f"trainer.output_dir={output_dir}: {why}. Point trainer.output_dir (or hydra.run.dir) "
            "at a folder you can write to."]


RESUME_KEYS = ("model.name_or_path", "model.lora.enabled", "model.lora.r",
               "model.lora.target_modules", "model.quantization")
LORA_SHAPE_KEYS = ("model.lora.r", "model.lora.target_modules")  # compared only when both use LoRA


def resume_problems(cfg: Any) -> list[str]:
    """trainer.resume must name a complete checkpoint made with this model set-up.

    The checkpoint `RUN/checkpoints/step-N` was written by the run whose resolved config is
    `RUN/config.yaml`; the keys of RESUME_KEYS decide whether its weights (or adapter) fit the
    model this config loads, so any difference is reported with both values. A checkpoint copied
    away from its run folder is checked by what it holds: an adapter only fits a LoRA config.
    `trainer.resume=true` with no checkpoint yet is left to pipeline, which says where it looked.
    """
    from grpo_cli.checkpoint import META_FILE, STATE_FILE, latest_checkpoint

    mode = resume_mode(cfg.trainer.resume)
    if mode is None:
        return []
    if mode == "latest":
        checkpoint = latest_checkpoint(Path(cfg.trainer.output_dir)) if cfg.trainer.output_dir else None
        if checkpoint is None:
            return []
    else:
        checkpoint = Path(mode)
        if not checkpoint.is_dir():
            return [f"trainer.resume={mode}: no such checkpoint folder. Give a folder such as "
                    "RUN/checkpoints/step-000100, or trainer.resume=true for the newest in the run folder."]
        missing = [name for name in (META_FILE, STATE_FILE) if not (checkpoint / name).is_file()]
        if missing:
            return [f"trainer.resume={mode}: not a complete checkpoint (no {' or '.join(missing)}). "
                    "Give a folder such as RUN/checkpoints/step-000100 (a folder without meta.json "
                    "is a save that was cut off), or trainer.resume=true for the newest complete one."]
    saved = checkpoint.parent.parent / "config.yaml"
    model = cfg.model
    if not saved.is_file():
        has_adapter = (checkpoint / "adapter_config.json").is_file()
        if has_adapter != bool(model.lora.enabled):
            held = "a LoRA adapter" if has_adapter else "full model weights"
            return [f"trainer.resume={checkpoint}: the checkpoint holds {held}, but "
                    f"model.lora.enabled={model.lora.enabled}. Resume with the set-up it was made with."]
        return []
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
    return [f"trainer.resume: checkpoint {checkpoint} was made with another model set-up (its run's "
            f"config: {saved}): {'; '.join(differ)}. Resume with the values it was made with, or "
            "start a fresh run (trainer.resume=false) in another folder."]


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _same_model(old: Any, new: Any) -> bool:
    if old == new:
        return True
    paths = [Path(str(v)).expanduser() for v in (old, new)]
    return all(p.is_dir() for p in paths) and paths[0].resolve() == paths[1].resolve()


def boosted_group_size(sampler: Any) -> int:
    """The group size adaptive sampling raises to: group_size x factor, capped."""
    return min(sampler.group_size * sampler.adaptive.factor, sampler.adaptive.max_group_size)


def _adaptive_problems(sampler: Any, prompts_per_step: int, micro_batch_size: int) -> list[str]:
    adaptive = sampler.adaptive
    if not adaptive.enabled:
        return []
    problems = [f"sampler.adaptive.{key}={getattr(adaptive, key)} must be at least {least}."
                for key, least in (("patience", 1), ("duration", 1), ("factor", 2))
                if getattr(adaptive, key) < least]
    if adaptive.max_group_size <= sampler.group_size:
        problems.append(f"sampler.adaptive.max_group_size={adaptive.max_group_size} must exceed "
                        f"sampler.group_size={sampler.group_size}, or there is nothing to raise it to.")
    if not 0 <= adaptive.zero_std_fraction <= 1:
        problems.append(f"sampler.adaptive.zero_std_fraction={adaptive.zero_std_fraction} must be in [0, 1].")
    boosted = prompts_per_step * boosted_group_size(sampler)
    if not problems and micro_batch_size > 0 and boosted % micro_batch_size:
        problems.append(f"trainer.micro_batch_size={micro_batch_size} must also divide the completions "
                        f"of a raised step, data.prompts_per_step x {boosted_group_size(sampler)} = {boosted}.")
    return problems


OPTIONAL_LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # key -> package


def _logger_problems(logger: Any) -> list[str]:
    return [f"logger.{key}=true, but the `{package}` package is not installed. Install it "
            f"(pip install {package}) or choose another logger (logger=tensorboard or logger=jsonl)."
            for key, package in OPTIONAL_LOGGERS.items()
            if logger[key] and importlib.util.find_spec(package) is None]


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
