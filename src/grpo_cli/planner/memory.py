"""The memory planner: the peak memory of one training process on its device, from the config
and the model's config.json alone, before anything is loaded.

    peak   = held + the largest phase
    held   = policy weights + LoRA adapter + gradients + optimizer states + reference model
             + reward model                      (allocated for the whole step)
    phases = sampling | reference pass | update | eval | reward scoring   (one after the other)

Gradients belong to the update: update.py frees them (zero_grad) right after the optimizer
step, so they are gone while the next step samples. The phases follow pipeline.py's order
(sample -> reward -> reference log-probs -> update), so only the largest adds to the peak.
The byte counts are in memory_formulas.py; `cheapest_fixes` re-plans the config with one change
at a time; `format_plan` prints the table. docs/MEMORY.md explains every row.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf

from grpo_cli.algorithm.update import shared_prompt_pass_group
from grpo_cli.config import EVAL_BATCH, ArchitectureConfig, beta_schedule, boosted_group_size, is_multi_turn
from grpo_cli.launch import launched_world_size
from grpo_cli.models.cpu_gemm import ONEDNN_MIN_WEIGHTS
from grpo_cli.planner.architecture import (
    Architecture,
    Weight,
    architecture_from_block,
    architecture_from_hf,
    architecture_of,
    local_config,
    lora_targets,
    lora_weights,
    model_weights,
    parameter_count,
)
from grpo_cli.planner.formulas import (
    DTYPE_BYTES,
    Amount,
    forward_bytes,
    kv_bytes_per_token,
    optimizer_bytes,
    reference_amount,
    sampling_amounts,
    update_amounts,
    weight_bytes,
)
from grpo_cli.sampling.packed import PACK_MIN_WEIGHTS

__all__ = [
    "architecture_of",
    "plan_memory",
    "cheapest_fixes",
    "format_plan",
    "format_fixes",
    "MemoryPlan",
    "PlanRow",
    "Fix",
    "GB",
    "DEFAULT_PROMPT_TOKENS",
]

GB = 1e9  # the table's unit, as memory/rss_gb in metrics.jsonl
DEFAULT_PROMPT_TOKENS = 256  # a GSM8K question in a chat template is 100-250 tokens
HELD = "held"  # the phase of rows allocated for the whole step
REWARD_MODEL_TARGET = "grpo_cli.rewards.reward_model"


@dataclass(frozen=True)
class PlanRow:
    name: str
    bytes: int
    note: str  # how it was computed
    phase: str = HELD  # HELD, or the transient phase it belongs to
    on_device: bool = True  # False: on another device (a reference on the CPU), not in the peak


@dataclass
class MemoryPlan:
    rows: list[PlanRow]
    arch: Architecture
    device: str  # cuda | cpu
    prompt_tokens: int
    assumptions: list[str] = field(default_factory=list)

    @property
    def held_bytes(self) -> int:
        return sum(row.bytes for row in self.rows if row.phase == HELD and row.on_device)

    @property
    def phase_bytes(self) -> dict[str, int]:
        """Each phase's total on this device, in the order the step runs them."""
        totals: dict[str, int] = {}
        for row in self.rows:
            if row.phase != HELD and row.on_device:
                totals[row.phase] = totals.get(row.phase, 0) + row.bytes
        return totals

    @property
    def peak_phase(self) -> str:
        return max(self.phase_bytes.items(), key=lambda item: item[1], default=("none", 0))[0]

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + self.phase_bytes.get(self.peak_phase, 0)

    def bytes_of(self, name: str) -> int:
        """The bytes of the row called `name` (0 when the plan has none)."""
        return sum(row.bytes for row in self.rows if row.name == name)


@dataclass(frozen=True)
class StepShape:
    """The numbers of one step that every row is computed from."""

    device: str  # cuda | cpu
    dtype: str  # the weights' dtype name
    size: int  # bytes per weight
    quantization: str  # none | 8bit | 4bit
    upcast: bool  # a quantized float16 policy runs its activations in float32 (peft's cast)
    act: int  # bytes per activation
    prompt_tokens: int
    new_tokens: int
    group: int  # the largest group size of the run (adaptive raises it)
    completions: int  # per step
    micro: int  # completions per forward/backward
    uses_kl: bool


def plan_memory(
    cfg: Any, prompt_tokens: Optional[int] = None, device: Optional[str] = None, arch: Optional[Architecture] = None
) -> MemoryPlan:
    """The memory plan of the composed config `cfg`, for one process.

    prompt_tokens: the padded prompt length, unknown before tokenizing (default
    DEFAULT_PROMPT_TOKENS, capped by the model's context). device: cuda | cpu (default:
    trainer.device, where auto = cuda when torch sees one). arch: the model's shape (default:
    architecture_of(cfg.model)).
    """
    arch = arch or architecture_of(cfg.model)
    shape, assumptions = _step_shape(cfg, arch, device or _device_kind(cfg.trainer.device), prompt_tokens)
    rows, trained, adapted, reference_here = _held_rows(cfg, arch, shape)
    engine = str(cfg.sampler.backend).lower() == "vllm"
    if engine:  # its weights and KV cache are held for the run; a decode works in its cache
        rows += _vllm_rows(cfg, arch, shape, assumptions)
    else:
        rows += _sampling_rows(
            cfg, arch, shape, trained if cfg.model.lora.enabled else (), "sampling", shape.completions
        )
    for entry in cfg.reward.functions:  # held weights, and a phase after sampling
        rows += _reward_model_rows(entry, shape.device, shape.prompt_tokens + shape.new_tokens)
    rows += _update_rows(cfg, arch, shape, trained, adapted, reference_here)
    if _has_eval(cfg.data) and not engine:  # greedy, EVAL_BATCH prompts per generate (pass@k: no more than a step)
        prompts = min(cfg.data.eval_size, EVAL_BATCH)
        rows += _sampling_rows(cfg, arch, shape, trained if cfg.model.lora.enabled else (), "eval", prompts)
    return MemoryPlan(rows, arch, shape.device, shape.prompt_tokens, assumptions)


def _step_shape(cfg: Any, arch: Architecture, device: str, prompt_tokens: Optional[int]) -> tuple[StepShape, list[str]]:
    """The step's numbers, and the assumptions the plan rests on."""
    model, sampler = cfg.model, cfg.sampler
    dtype = _dtype_name(model.dtype, device)
    quantization = str(model.quantization).lower()
    # models.load_models: under float16 a quantized policy goes through peft's float32 cast, which
    # carries into the residual stream; in bfloat16 or float32 nothing is cast.
    upcast = quantization != "none" and dtype == "float16"
    assumptions = [f"shape from {arch.source}", f"{dtype} on {device}, one process"]
    new = sampler.max_new_tokens
    if is_multi_turn(cfg.get("rollout")):
        # A conversation's tail after the prompt (every turn, tool and environment message) is
        # what the update trains on and the last turn's context holds: up to max_total_tokens.
        new = max(new, int(cfg.rollout.max_total_tokens))
        assumptions.append(f"multi-turn: each conversation after its prompt at rollout.max_total_tokens={new}")
    if prompt_tokens is None:
        prompt_tokens = DEFAULT_PROMPT_TOKENS
        if arch.context_length:
            prompt_tokens = max(1, min(prompt_tokens, arch.context_length - new))
        assumptions.append(
            f"prompts padded to {prompt_tokens} tokens: a guess, the length is known only after tokenizing"
        )
    group = boosted_group_size(sampler) if sampler.adaptive.enabled else sampler.group_size
    completions = cfg.data.prompts_per_step * group
    shape = StepShape(
        device=device,
        dtype=dtype,
        size=DTYPE_BYTES[dtype],
        quantization=quantization,
        upcast=upcast,
        act=4 if upcast else DTYPE_BYTES[dtype],
        prompt_tokens=prompt_tokens,
        new_tokens=new,
        group=group,
        completions=completions,
        micro=_planned_micro(cfg.trainer, prompt_tokens, new, group, completions),
        uses_kl=beta_schedule(cfg.trainer.beta).peak > 0,
    )
    return shape, assumptions


def _planned_micro(trainer: Any, prompt_tokens: int, new_tokens: int, group: int, completions: int) -> int:
    """Completions in the largest micro-batch: trainer.micro_batch_size, or what
    trainer.micro_batch_tokens lets in when every completion runs to max_new_tokens
    (update.token_budget_rows: whole groups with one prompt pass each while one fits, else single
    rows), or the whole step.

    Example: budget 4096, prompts of 128, 256 new tokens, G = 8, 32 completions: a group costs
    128 + 8 x 256 = 2176 tokens, one fits: 8 completions.
    """
    if trainer.micro_batch_size > 0 or trainer.micro_batch_tokens <= 0:
        return trainer.micro_batch_size or completions
    budget = trainer.micro_batch_tokens
    groups = budget // (prompt_tokens + group * new_tokens) if trainer.share_prompt_pass else 0
    rows = groups * group if groups else budget // (prompt_tokens + new_tokens)
    return max(1, min(rows, completions))


def _held_rows(cfg: Any, arch: Architecture, shape: StepShape):
    """What the whole step holds: the policy's weights, a LoRA adapter, the optimizer states and
    a full fine-tune's reference. Also returns the trained weights, the LoRA-adapted linears,
    and whether the reference is on this device."""
    model = cfg.model
    weights = model_weights(arch)
    base = weight_bytes(weights, shape.size, shape.quantization, shape.upcast)
    rows = [PlanRow("policy weights", base, _weights_note(weights, shape.dtype, shape.quantization, shape.upcast))]
    trained, trained_size, adapted = weights, shape.size, ()
    if model.lora.enabled:  # peft keeps the adapter in float32 whatever the base (autocast_adapter_dtype)
        trained, trained_size = lora_weights(arch, model.lora.r, model.lora.target_modules), 4
        adapted = lora_targets(arch, model.lora.target_modules)
        count = parameter_count(trained)
        note = f"{count:,} params = r {model.lora.r} x (in + out) of {len(adapted)} linears x {arch.num_layers} layers, x 4 B"
        rows.append(PlanRow("LoRA adapter", 4 * count, note))
    states = optimizer_bytes(str(cfg.optimizer._target_), trained, trained_size)
    rows.append(PlanRow("optimizer states", states.bytes, f"{cfg.optimizer._target_}: {states.note}"))
    reference_here = True  # with LoRA the reference is the base model, adapter off
    if shape.uses_kl and not model.lora.enabled:
        where = str(model.reference_device).lower()
        reference_here = where == "same" or _device_kind(where) == shape.device
        note = "a frozen copy of the policy weights, on " + ("the policy's device" if where == "same" else where)
        rows.append(PlanRow("reference model", base, note, on_device=reference_here))
    return rows, trained, adapted, reference_here


def _sampling_rows(
    cfg: Any, arch: Architecture, shape: StepShape, adapter: Sequence[Weight], phase: str, sequences: int
) -> list[PlanRow]:
    """A decode of `sequences` rows (the step's sampling, or the eval's greedy batch): its KV
    cache, its work, and the copies of the weights sampler=fast decodes with: laid out for the
    CPU's GEMM in float32, or in bfloat16 under autocast."""
    keeps_turns = is_multi_turn(cfg.get("rollout")) and str(cfg.sampler.backend).lower() == "fast"
    # KeptTurns.after_prefixes aligns each row's kept prefix and its new tokens apart, so a later
    # turn's cache is wider than its longest row by up to a turn's new tokens: about max_new_tokens.
    holes = cfg.sampler.max_new_tokens if keeps_turns else 0
    amounts = sampling_amounts(arch, shape.act, sequences, shape.prompt_tokens, shape.new_tokens + holes)
    rows = [_row(f"{phase} {what}", amount, phase) for what, amount in zip(("KV cache", "work"), amounts)]
    if keeps_turns:
        # FastSampler.keeping_turns: the last turn's keys and values, beside the next turn's cache
        kept = amounts[0]._replace(note=f"the last turn's KV kept for the next: {amounts[0].note}")
        rows.append(_row(f"{phase} kept turns", kept, phase))
    packed = packed_linear_weights(cfg, arch, shape.device, shape.dtype, adapter)
    if packed:
        rows.append(_row(f"{phase} packed weights", packed, phase))
    copies = bfloat16_linear_weights(cfg, arch, shape.device, shape.dtype, adapter)
    if copies:
        rows.append(_row(f"{phase} bfloat16 weights", copies, phase))
    return rows


def _vllm_rows(cfg: Any, arch: Architecture, shape: StepShape, assumptions: list[str]) -> list[PlanRow]:
    """sampler=vllm (sampling/vllm.py): the engine's copy of the weights (a LoRA adapter merged,
    quantized weights dequantized) and its KV cache, held for the run, and a decode's work."""
    from grpo_cli.models.loading import resolve_autocast
    from grpo_cli.sampling.vllm import kv_cache_bytes, sampling_sequences

    settings = cfg.sampler.vllm
    dtype = str(settings.dtype).lower()
    if dtype == "auto":  # what the trainer's forward passes run in (sampling.vllm.engine_dtype)
        autocast = resolve_autocast(cfg.model.autocast, shape.device, parameter_count(model_weights(arch)))
        dtype = "bfloat16" if autocast == "bfloat16" else shape.dtype
    size, count = DTYPE_BYTES[dtype], parameter_count(model_weights(arch))
    note = f"{count:,} params x {size} B ({dtype}): the engine's own copy, unquantized, any adapter merged"
    rows = [PlanRow("vLLM weights", count * size, note)]
    length = shape.prompt_tokens + shape.new_tokens
    cache = kv_cache_bytes(cfg, arch, length, size)
    if cache is None:
        assumptions.append(
            f"vLLM's KV cache not counted: it fills sampler.vllm.gpu_memory_utilization="
            f"{settings.gpu_memory_utilization} of the GPU, whatever else is there"
        )
    else:
        note = (
            f"sampler.vllm.kv_cache_gb={settings.kv_cache_gb:g}"
            if settings.kv_cache_gb
            else f"{sampling_sequences(cfg)} seqs x {length} positions in whole blocks x {kv_bytes_per_token(arch, size):,} B"
        )
        rows.append(PlanRow("vLLM KV cache", cache, note))
    work = sampling_amounts(arch, size, shape.completions, shape.prompt_tokens, shape.new_tokens)[1]
    return rows + [_row("sampling work", work, "sampling")]


def _update_rows(
    cfg: Any,
    arch: Architecture,
    shape: StepShape,
    trained: Sequence[Weight],
    adapted: Sequence[str],
    reference_here: bool,
) -> list[PlanRow]:
    """The frozen passes (reference, old policy) and the update: gradients, activations, backward."""
    model, trainer = cfg.model, cfg.trainer
    rows = []
    distributed = launched_world_size() > 1
    # log_probs.output_head: FSDP asks the model for its logits; elsewhere the head runs by chunks
    through_head = not (distributed and trainer.distributed == "fsdp")
    if shape.uses_kl or trainer.num_iterations > 1:  # reference log-probs where the reference is; old ones here
        reference = reference_amount(arch, shape.act, shape.micro, shape.prompt_tokens, shape.new_tokens, through_head)
        here = reference_here or trainer.num_iterations > 1
        rows.append(PlanRow("reference pass", reference.bytes, reference.note, "reference pass", on_device=here))
    # update.update_policy's rule, and a model that keeps its cache in a forward with gradients
    # (gradient checkpointing drops it: log_probs.keeps_cache)
    prompt_pass_group = (
        1
        if model.gradient_checkpointing
        else shared_prompt_pass_group(trainer.share_prompt_pass, shape.micro, shape.group, distributed)
    )
    kept, backward = update_amounts(
        arch,
        shape.act,
        shape.micro,
        shape.prompt_tokens,
        shape.new_tokens,
        not model.lora.enabled,
        adapted,
        model.lora.r,
        bool(model.gradient_checkpointing),
        prompt_pass_group,
        through_head,
    )
    count = parameter_count(trained)
    trained_size = 4 if model.lora.enabled else shape.size
    gradients = PlanRow("gradients", count * trained_size, f"{count:,} trainable params x {trained_size} B", "update")
    return rows + [gradients, _row("update activations", kept, "update"), _row("update backward", backward, "update")]


def packed_linear_weights(
    cfg: Any, arch: Architecture, device: str, dtype: str, adapter: Sequence[Weight]
) -> Optional[Amount]:
    """sampler=fast on a CPU in float32 (no autocast) decodes with a copy of the float32 linear
    weights laid out for the GEMM sampling/packed.decode_gemm picks: those of at least
    ONEDNN_MIN_WEIGHTS elements for oneDNN (ReorderedLinears; CPUs other than Intel's), of at least PACK_MIN_WEIGHTS for
    MKL's packed GEMM (PackedLinears; Intel's): the decoder's unless quantized, the head's, the
    adapter's. None where nothing is laid out."""
    from grpo_cli.models.loading import resolve_autocast
    from grpo_cli.sampling.packed import decode_gemm

    gemm = decode_gemm(None)
    if (
        device != "cpu"
        or gemm not in ("onednn", "mkl_packed")
        or dtype != "float32"
        or str(cfg.sampler.backend).lower() != "fast"
        or resolve_autocast(cfg.model.autocast, device, parameter_count(model_weights(arch))) != "none"
    ):
        return None
    least = ONEDNN_MIN_WEIGHTS if gemm == "onednn" else PACK_MIN_WEIGHTS
    count = parameter_count([weight for weight in _linear_weights(cfg, arch, adapter) if weight.numel >= least])
    if not count:
        return None
    if gemm == "onednn":
        return Amount(
            4 * count,
            f"{count:,} weights of linears of >= {ONEDNN_MIN_WEIGHTS:,} x 4 B, laid out for oneDNN's GEMM while decoding",
        )
    return Amount(
        4 * count,
        f"{count:,} weights of linears of >= {PACK_MIN_WEIGHTS:,} x 4 B, packed for MKL's GEMM while decoding",
    )


def bfloat16_linear_weights(
    cfg: Any, arch: Architecture, device: str, dtype: str, adapter: Sequence[Weight]
) -> Optional[Amount]:
    """sampler=fast under bfloat16 autocast with float32 weights decodes with a bfloat16 copy of
    every float32 linear weight (sampling/packed.py, LowPrecisionLinears): the decoder's unless
    quantized, the head's, the adapter's. None elsewhere."""
    from grpo_cli.models.loading import resolve_autocast

    if (
        dtype != "float32"
        or str(cfg.sampler.backend).lower() != "fast"
        or resolve_autocast(cfg.model.autocast, device, parameter_count(model_weights(arch))) != "bfloat16"
    ):
        return None
    count = parameter_count(_linear_weights(cfg, arch, adapter))
    return Amount(2 * count, f"{count:,} weights of linears x 2 B, a bfloat16 copy made once per decode")


def _linear_weights(cfg: Any, arch: Architecture, adapter: Sequence[Weight]) -> list[Weight]:
    """The weights of the policy's nn.Linear layers: the head, the adapter's, the decoder's
    unless quantized (bitsandbytes layers are not nn.Linear)."""
    linears = [Weight("lm_head.weight", arch.vocab_size, arch.hidden_size, 1, False), *adapter]
    if str(cfg.model.quantization).lower() == "none":
        linears += [weight for weight in model_weights(arch) if weight.quantizable]
    return linears


def _row(name: str, amount: Amount, phase: str = HELD) -> PlanRow:
    return PlanRow(name, amount.bytes, amount.note, phase)


def _reward_model_rows(entry: Any, device: str, sequence: int) -> list[PlanRow]:
    """rewards.reward_model loads its model once and keeps it: its weights are held, its scoring
    is a phase. Counted from its config.json when it is on this machine, else from an
    `architecture` mapping in the entry (the function ignores keys it does not take)."""
    if str(entry.get("_target_", "")) != REWARD_MODEL_TARGET:
        return []
    path = str(entry.get("path", ""))
    config = local_config(path) if path else None
    if config is not None:
        arch, labels = architecture_from_hf(config, f"config.json of {path}"), int(getattr(config, "num_labels", 1))
    elif entry.get("architecture") is not None:
        block = OmegaConf.merge(OmegaConf.structured(ArchitectureConfig), entry["architecture"])  # typed, defaults
        arch, labels = architecture_from_block(block, path, "reward.functions[].architecture"), 1
    else:
        return [
            PlanRow(
                f"reward model {path}",
                0,
                "not counted: no config.json here; give the entry `architecture: {...}` to count it",
            )
        ]
    setting = str(entry.get("device", "auto")).lower()
    where = device if setting == "auto" else _device_kind(setting)
    dtype, quantization = _dtype_name(str(entry.get("dtype", "auto")), where), str(entry.get("quantization", "none"))
    weights = [w for w in model_weights(arch) if w.name != "lm_head.weight"] + [
        Weight("score.weight", labels, arch.hidden_size, 1, False)
    ]  # *ForSequenceClassification head
    batch, length = int(entry.get("batch_size", 8)), min(int(entry.get("max_length", 1024)), sequence)
    return [
        PlanRow(
            f"reward model {path}",
            weight_bytes(weights, DTYPE_BYTES[dtype], quantization, upcast=False),
            _weights_note(weights, dtype, quantization, upcast=False),
            on_device=where == device,
        ),
        PlanRow(
            "reward scoring",
            forward_bytes(arch, DTYPE_BYTES[dtype], batch, length),
            f"no-grad forward of {batch} x {length} tokens",
            "reward scoring",
            where == device,
        ),
    ]


def _weights_note(weights: Sequence[Weight], dtype: str, quantization: str, upcast: bool) -> str:
    count = parameter_count(weights)
    if quantization == "none":
        return f"{count:,} params x {DTYPE_BYTES[dtype]} B ({dtype})"
    layout = "nf4 0.5 B + absmax" if quantization == "4bit" else "int8 1 B + row scales"
    return f"{count:,} params: decoder linears {layout}, the rest {'float32' if upcast else dtype}"


def _device_kind(setting: str) -> str:
    setting = str(setting).lower()
    if setting == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if setting.startswith("cuda") else "cpu"


def _dtype_name(setting: str, device: str) -> str:
    """models.resolve_dtype for a device we may not be on: auto = bfloat16 on CUDA (float32 on a
    GPU without bf16, known only when it is this machine's), float32 on the CPU."""
    setting = str(setting).lower()
    if setting != "auto":
        return setting
    if device != "cuda":
        return "float32"
    import torch

    return "float32" if torch.cuda.is_available() and not torch.cuda.is_bf16_supported() else "bfloat16"


def _has_eval(data: Any) -> bool:
    from grpo_cli.data.prompts import synthetic_task_name

    if data.eval_size <= 0:  # no eval at all, whatever else is set (prompts.train_and_eval_rows)
        return False
    return bool(data.eval_path) or data.eval_holdout > 0 or synthetic_task_name(str(data.path)) is not None


@dataclass(frozen=True)
class Fix:
    change: str  # what to do, in words
    overrides: tuple[str, ...]  # the command-line overrides that do it
    cost: str  # what it costs the run
    saving: int  # bytes off the peak, this change alone
    peak: int  # the peak with this change alone
    cumulative_peak: int  # the peak with this and every fix listed before it


def cheapest_fixes(cfg: Any, plan: MemoryPlan, budget_bytes: Optional[int] = None) -> list[Fix]:
    """The changes that lower the peak, cheapest first (what they cost the run, not what they
    save), each re-planned alone and together with the ones before it. With a budget, the list
    leaves out fixes that save under 5% of the excess and stops at the first fix whose
    cumulative peak fits."""
    fixes, together = [], copy.deepcopy(cfg)
    negligible = 0.05 * (plan.peak_bytes - budget_bytes) if budget_bytes is not None else 0
    for change, overrides, cost in _candidate_fixes(cfg, plan):
        alone = _replan(copy.deepcopy(cfg), overrides, plan)
        if plan.peak_bytes - alone.peak_bytes <= negligible:
            continue
        cumulative = _replan(together, overrides, plan)
        fixes.append(
            Fix(change, overrides, cost, plan.peak_bytes - alone.peak_bytes, alone.peak_bytes, cumulative.peak_bytes)
        )
        if budget_bytes is not None and cumulative.peak_bytes <= budget_bytes:
            break
    return fixes


def _replan(cfg: Any, overrides: Sequence[str], plan: MemoryPlan) -> MemoryPlan:
    cfg.merge_with_dotlist(list(overrides))  # edits `cfg`: `together` accumulates the fixes
    return plan_memory(cfg, plan.prompt_tokens, plan.device, plan.arch)


def _candidate_fixes(cfg: Any, plan: MemoryPlan) -> list[tuple[str, tuple[str, ...], str]]:
    """(change, overrides, cost) of every change that applies to `cfg`, cheapest first."""
    model, trainer = cfg.model, cfg.trainer
    candidates = []
    if not str(cfg.optimizer._target_).endswith("8bit"):
        candidates.append(
            (
                "8-bit AdamW states",
                ("optimizer._target_=bitsandbytes.optim.AdamW8bit",),
                "optimizer states rounded to 8 bits",
            )
        )
    completions = cfg.data.prompts_per_step * cfg.sampler.group_size
    micro = trainer.micro_batch_size or completions
    smaller = max((size for size in range(1, micro // 2 + 1) if completions % size == 0), default=None)
    if trainer.micro_batch_tokens > 0:  # halve the budget: micro_batch_size is exclusive with it
        budget = trainer.micro_batch_tokens // 2
        if budget >= cfg.sampler.max_new_tokens:
            candidates.append(
                (
                    f"micro_batch_tokens {trainer.micro_batch_tokens} -> {budget}",
                    (f"trainer.micro_batch_tokens={budget}",),
                    "more forward/backward passes, the same gradient",
                )
            )
    elif smaller and not cfg.sampler.adaptive.enabled:
        candidates.append(
            (
                f"micro_batch_size {micro} -> {smaller}",
                (f"trainer.micro_batch_size={smaller}",),
                "more forward/backward passes, the same gradient",
            )
        )
    if not model.gradient_checkpointing:
        candidates.append(
            (
                "gradient checkpointing",
                ("model.gradient_checkpointing=true",),
                "about a third more compute in the update",
            )
        )
    if any(row.name == "reference model" and row.on_device for row in plan.rows):
        candidates.append(("reference on the CPU", ("model.reference_device=cpu",), "a slower reference pass"))
    if plan.device == "cuda" and _dtype_name(model.dtype, "cuda") == "float32":
        candidates.append(("bfloat16 weights", ("model.dtype=bfloat16",), "bfloat16 precision"))
    if not model.lora.enabled:
        candidates.append(("LoRA", ("model.lora.enabled=true",), "trains an adapter, not every weight"))
    if str(model.quantization) == "none":
        candidates.append(
            (
                "4-bit base (QLoRA)",
                ("model.quantization=4bit", "model.lora.enabled=true"),
                "a quantized base model under the adapter",
            )
        )
    return candidates


def format_plan(plan: MemoryPlan, budget_bytes: Optional[int] = None) -> str:
    """The plan as a plain-text table in GB (1e9 bytes)."""
    lines = [f"Memory plan, one process on {plan.device} (GB = 1e9 bytes)"]
    width = max(len(row.name) for row in plan.rows)

    def line(name: str, count: int, note: str, mark: str = "") -> None:
        lines.append(f"  {name:<{width}} {count / GB:8.2f}  {mark}{note}")

    lines.append("held for the whole step:")
    for row in (row for row in plan.rows if row.phase == HELD):
        line(row.name, row.bytes, row.note, "" if row.on_device else "(not on this device) ")
    line("= held", plan.held_bytes, "")
    lines.append("phases, one at a time (the largest adds to the peak):")
    for phase, total in plan.phase_bytes.items():
        for row in (row for row in plan.rows if row.phase == phase):
            line(row.name, row.bytes, row.note)
        line(f"= {phase}", total, "<- peak" if phase == plan.peak_phase else "")
    lines.append(
        f"peak: held {plan.held_bytes / GB:.2f} + {plan.peak_phase} "
        f"{plan.phase_bytes.get(plan.peak_phase, 0) / GB:.2f} = {plan.peak_bytes / GB:.2f} GB"
    )
    if budget_bytes is not None:
        spare = budget_bytes - plan.peak_bytes
        verdict = f"fits, {spare / GB:.2f} GB to spare" if spare >= 0 else f"does not fit: {-spare / GB:.2f} GB over"
        lines.append(f"budget {budget_bytes / GB:.2f} GB: {verdict}")
    lines += [f"assumes: {text}" for text in plan.assumptions]
    return "\n".join(lines)


def format_fixes(fixes: Sequence[Fix], budget_bytes: Optional[int] = None) -> str:
    """One line per fix: the saving alone, the peak with it and every fix above it."""
    lines = []
    for index, fix in enumerate(fixes, start=1):
        fits = "" if budget_bytes is None else (" fits" if fix.cumulative_peak <= budget_bytes else "")
        lines.append(
            f"{index}. {fix.change} ({' '.join(fix.overrides)}): -{fix.saving / GB:.2f} GB alone, "
            f"peak {fix.cumulative_peak / GB:.2f} GB with 1-{index}{fits}; cost: {fix.cost}"
        )
    return "\n".join(lines)
