"""The memory plan at the start of a run (memory_check.py): `trainer.plan=true` prints it and
stops without a model on the machine; a run over its budget stops before loading any weight,
with the table and the ranked fixes; `trainer.plan_force=true` goes on."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_cli import pipeline
from grpo_cli.config import ConfigError
from grpo_cli.data.prompts import PromptSource, train_and_eval_rows
from grpo_cli.models.loading import local_tokenizer_and_context
from grpo_cli.planner.architecture import architecture_from_block, architecture_of
from grpo_cli.planner.check import PLAN_FILE, check_memory, memory_budget, plan_for
from helpers import config, grpo_train, input_error, load_script


class LoadedWeights(Exception):
    """Raised by a stand-in for load_models: the run got past the memory check."""


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise LoadedWeights

    monkeypatch.setattr(pipeline, "load_models", refuse)


def rewarded_config(tiny_model_dir, *overrides):
    cfg = config(tiny_model_dir, *overrides)
    cfg.reward.functions = [{"_target_": "grpo_cli.rewards.exact_match", "weight": 1.0}]
    return cfg


@pytest.mark.slow
def test_plan_only_prints_the_7b_table_and_exits_0_on_a_machine_without_the_model(tmp_path):
    # Qwen2.5-7B is not on this machine: its preset's architecture block is counted.
    result = grpo_train(
        "conf=math_7b", "trainer.plan=true", "trainer.device=cuda", "trainer.memory_budget_gb=16", cwd=tmp_path
    )
    out = result.stdout
    assert "policy weights        15.23  7,615,616,512 params x 2 B (bfloat16)" in out
    assert "shape from model.architecture of Qwen/Qwen2.5-7B-Instruct" in out
    assert "budget 16.00 GB: does not fit" in out and "4-bit base (QLoRA)" in out
    assert not list(tmp_path.rglob("*.safetensors")) and not list(tmp_path.rglob("metrics.jsonl"))


def test_a_run_over_budget_stops_before_loading_with_the_table_and_the_fixes(tmp_path, tiny_model_dir, no_loading):
    cfg = rewarded_config(tiny_model_dir, f"trainer.output_dir={tmp_path}", "trainer.memory_budget_gb=0.001")
    with pytest.raises(ConfigError) as stopped:
        pipeline.run(cfg)  # load_models raises LoadedWeights if it is reached
    message = str(stopped.value)
    assert "more than the 0.00 GB budget (trainer.memory_budget_gb=0.001)" in message
    assert "1. " in message and "trainer.plan_force=true" in message
    table = (tmp_path / PLAN_FILE).read_text()
    assert "policy weights" in table and "does not fit" in table


def test_plan_force_trains_anyway(tmp_path, tiny_model_dir, no_loading):
    cfg = rewarded_config(
        tiny_model_dir, f"trainer.output_dir={tmp_path}", "trainer.memory_budget_gb=0.001", "trainer.plan_force=true"
    )
    with pytest.raises(LoadedWeights):
        pipeline.run(cfg)


def test_over_budget_exits_2_through_the_cli(tmp_path):
    message = input_error("grpo-train", "trainer.memory_budget_gb=0.001", "trainer.steps=1", cwd=tmp_path)
    assert "the run stopped before loading any weight" in message and "gradient checkpointing" in message
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_the_budget_is_the_setting_else_this_machines_memory(monkeypatch, tiny_model_dir):
    import psutil

    trainer = config(tiny_model_dir).trainer
    available = psutil.virtual_memory().available
    budget = memory_budget(trainer, torch.device("cpu"))
    assert budget.source == "available RAM" and abs(budget.bytes - available) < 0.1 * available
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two torchrun processes share the RAM
    assert abs(memory_budget(trainer, torch.device("cpu")).bytes - available / 2) < 0.1 * available
    if not torch.cuda.is_available():
        assert memory_budget(trainer, torch.device("cuda")) is None
    trainer.memory_budget_gb = 24
    assert memory_budget(trainer, torch.device("cpu")).bytes == 24_000_000_000


def test_prompts_are_planned_at_their_real_length_when_the_tokenizer_is_here(tiny_model_dir):
    cfg = config(tiny_model_dir)
    rows = train_and_eval_rows(cfg.data)[0]
    plan = plan_for(cfg, torch.device("cpu"), rows)
    # The widest batch PromptSource can make: every row in one batch, padded to the longest.
    source = PromptSource(cfg.data, local_tokenizer_and_context(cfg.model)[0], rows)
    assert plan.prompt_tokens == source.make_batch(rows).input_ids.shape[1]
    assert not any("a guess" in text for text in plan.assumptions)


def test_a_model_the_planner_cannot_count_trains_without_a_plan(tmp_path, tiny_model_dir, capsys):
    folder = tmp_path / "gpt2-like"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 100})
    )
    cfg = config(tiny_model_dir, f"model.name_or_path={folder}")
    with pytest.raises(ConfigError, match="counts Qwen2/Llama-style decoders only"):
        architecture_of(cfg.model)
    check_memory(cfg, torch.device("cpu"), [], tmp_path)  # says so and returns: the run goes on
    assert "Memory plan: not made" in capsys.readouterr().out


def test_an_architecture_block_needs_a_known_model_type():
    shape = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "tie_word_embeddings": True,
        "head_dim": None,
    }
    with pytest.raises(ConfigError, match="model.architecture.model_type='gpt-9' .org/model. is not a model type"):
        architecture_from_block({"model_type": "gpt-9", **shape}, "org/model")
    with pytest.raises(ConfigError, match="model_type not set"):
        architecture_from_block({"model_type": "???", **shape}, "org/model")
    qwen2, llama = (architecture_from_block({"model_type": kind, **shape}, "org/model") for kind in ("qwen2", "llama"))
    assert qwen2.qkv_bias and not llama.qkv_bias  # transformers' defaults of each type


def test_the_gpu_memory_bench_builds_a_preset_shaped_model_the_plan_counts_exactly(tmp_path, tiny_model_dir):
    # scripts/bench_memory.py runs on a GPU only when a session has one: its model builder and
    # its CPU path are checked here, so the GPU run does not fail on a rotted script.
    from omegaconf import OmegaConf

    from grpo_cli.models.loading import load_models
    from grpo_cli.planner.architecture import model_weights, parameter_count

    bench = load_script("bench_memory")
    block = OmegaConf.create(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 300,
            "tie_word_embeddings": False,
            "head_dim": None,
        }
    )
    folder = bench.build_random_model(block, tmp_path / "llama-shaped", torch.float32, "cpu")
    model = load_models(config(tiny_model_dir, f"model.name_or_path={folder}").model, 0.0, torch.device("cpu")).policy
    planned = parameter_count(
        model_weights(architecture_of(config(tiny_model_dir, f"model.name_or_path={folder}").model))
    )
    assert planned == sum(p.numel() for p in model.parameters())
    rows = bench.run_case("tiny", "cpu", 1, tmp_path)
    assert [(case, phase) for case, phase, _, _ in rows] == [("tiny", "sampling"), ("tiny", "update")]
    assert all(planned_gb > 0 and measured is None for _, _, planned_gb, measured in rows)
