"""Every preset composes and validates; validate() rejects bad configs with one clear message."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from grpo_cli.cli import config_dir
from grpo_cli.config import BetaSchedule, ConfigError, beta_schedule
from grpo_cli.validation import validate

CONF = Path(config_dir())
GROUPS = ["model", "data", "sampler", "reward", "optimizer", "trainer", "algorithm", "logger"]


def make(overrides: list[str] = ()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("name", presets("conf"))
def test_every_run_preset_composes_and_validates(name):
    cfg = make([f"conf={name}"])
    validate(cfg, check_files=False)
    assert OmegaConf.to_container(cfg, resolve=True)  # everything resolves


@pytest.mark.parametrize("group,name", [(g, n) for g in GROUPS for n in presets(g)])
def test_every_group_preset_composes_and_validates(group, name):
    validate(make([f"{group}={name}"]), check_files=False)


def test_default_is_the_tiny_preset_and_validates_with_files():
    cfg = make()
    assert cfg.model.name_or_path == "builtin:tiny-addition"
    assert cfg.data.path == "synthetic:addition"
    validate(cfg)


def test_math_7b_preset_has_the_practitioner_numbers():
    cfg = make(["conf=math_7b"])
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-7B-Instruct"
    assert cfg.model.dtype == "bfloat16" and cfg.model.lora.enabled and cfg.model.lora.r == 16
    assert list(cfg.model.lora.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (cfg.sampler.group_size, cfg.sampler.temperature) == (8, 0.8)
    assert (cfg.optimizer.lr, cfg.trainer.beta, cfg.trainer.clip_eps) == (2e-6, 0.02, 0.2)
    assert (cfg.data.prompts_per_step, cfg.trainer.checkpoint_every) == (16, 50)
    assert cfg.data.prompt_field == "question"


def test_code_7b_preset_trains_the_coder_model_with_the_sandboxed_code_reward():
    cfg = make(["conf=code_7b"])
    validate(cfg, check_files=False)
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-Coder-7B-Instruct" and cfg.model.lora.enabled
    targets = [entry["_target_"] for entry in cfg.reward.functions]
    assert targets == ["grpo_cli.rewards.code_execution", "grpo_cli.rewards.format_reward"]
    assert cfg.reward.workers == 4 and cfg.data.answer_field == "tests"


def test_math_reward_preset_is_accuracy_then_format():
    targets = [entry["_target_"] for entry in make(["conf=math_7b"]).reward.functions]
    assert targets == ["grpo_cli.rewards.math_accuracy", "grpo_cli.rewards.format_reward"]


def test_math_half_b_preset_is_a_full_fine_tune():
    cfg = make(["conf=math_0.5b"])
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and not cfg.model.lora.enabled


def test_command_line_overrides_reach_the_config():
    cfg = make(["conf=math_7b", "trainer.beta=0.05", "sampler.group_size=16", "data.path=my.jsonl"])
    assert (cfg.trainer.beta, cfg.sampler.group_size, cfg.data.path) == (0.05, 16, "my.jsonl")


def test_a_typo_in_a_key_is_rejected_by_the_schema():
    with pytest.raises(ConfigCompositionException, match="bta"):
        make(["trainer.bta=0.1"])


def test_a_wrong_type_is_rejected_by_the_schema():
    with pytest.raises(ConfigCompositionException, match="group_size"):
        make(["sampler.group_size=many"])


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["sampler.group_size=1"], "sampler.group_size=1"),
        (["trainer.micro_batch_size=5"], "trainer.micro_batch_size=5"),
        (["data.path=/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl does not exist"),
        (["model.quantization=4bit"], "model.lora.enabled=true"),
        (["model.dtype=fp8"], "model.dtype='fp8'"),
        (["trainer.device=tpu"], "trainer.device='tpu'"),
        (["optimizer.scheduler=step"], "optimizer.scheduler='step'"),
        (["data.path=synthetic:multiplication"], "synthetic:multiplication"),
        (["sampler.min_new_tokens=20", "sampler.max_new_tokens=8"], "sampler.min_new_tokens=20"),
        (["trainer.resume=/no/such/checkpoint"], "no such checkpoint folder"),
        (["reward.functions=[]"], "reward.functions is empty"),
        (["sampler.top_p=0"], "sampler.top_p=0"),
        (["trainer.advantage=ppo"], "trainer.advantage='ppo'"),
        (["trainer.loss_aggregation=sum"], "trainer.loss_aggregation='sum'"),
        (["trainer.kl_estimator=k4"], "trainer.kl_estimator='k4'"),
        (["trainer.beta=-0.1"], "trainer.beta=-0.1"),
        (["trainer.beta=lots"], "trainer.beta='lots'"),
        (["trainer.beta={start: 0.05, stop: 0.02}"], "unknown keys ['stop']"),
        (["trainer.beta={end: 0.02}"], "needs `start`"),
        (["trainer.beta={start: 0.05, shape: exp}"], "trainer.beta.shape='exp'"),
        (["trainer.beta={start: 0.05, warmup_steps: -3}"], "must be finite numbers >= 0"),
        (["trainer.beta={start: 0.05, warmup_steps: 0.5}"], "trainer.beta.warmup_steps=0.5"),
        (["trainer.beta=nan"], "trainer.beta=nan"),
        (["trainer.beta=inf"], "trainer.beta=inf"),
        (["trainer.kl_estimator=K3"], "trainer.kl_estimator='K3'"),
        (["trainer.advantage=RLOO"], "trainer.advantage='RLOO'"),
        (["trainer.std_threshold=-1"], "trainer.std_threshold=-1"),
        (["trainer.clip_eps_high=nan"], "trainer.clip_eps_high=nan"),
        (["reward.clip=[nan,1]"], "reward.clip="),
        (["trainer.clip_eps=1.5"], "trainer.clip_eps=1.5"),
        (["trainer.clip_eps_high=-0.1"], "trainer.clip_eps_high=-0.1"),
        (["trainer.max_resample_rounds=-1"], "trainer.max_resample_rounds=-1"),
        (["reward.clip=[5,-5]"], "reward.clip="),
        (["reward.clip=[1]"], "reward.clip="),
        (["reward.max_error_fraction=1.5"], "reward.max_error_fraction=1.5"),
        (["reward.workers=0"], "reward.workers=0"),
        (["trainer.rollout_correction=tis"], "trainer.rollout_correction='tis'"),
        (["trainer.rollout_correction_cap=0"], "trainer.rollout_correction_cap=0"),
        (["trainer.loss=ppo"], "trainer.loss='ppo'"),
        (["trainer.loss=CISPO"], "trainer.loss='CISPO'"),
        (["trainer.importance_sampling_level=group"], "trainer.importance_sampling_level='group'"),
        (["trainer.delta=1.1"], "trainer.delta=1.1 must exceed 1 + clip_eps_high = 1.2"),
        (["trainer.clip_eps_high=0.28", "trainer.delta=1.25"], "1 + clip_eps_high = 1.28"),
        (["trainer.dual_clip=0.5"], "trainer.dual_clip=0.5 must exceed 1"),
        (["trainer.loss=cispo", "trainer.delta=4"], "trainer.loss=cispo has no such clip"),
        (["trainer.loss=sapo", "trainer.dual_clip=3"], "Set trainer.dual_clip=null"),
        (["trainer.cispo_ratio_max=1"], "trainer.cispo_ratio_max=1.0 must exceed 1"),
        (["trainer.cispo_ratio_min=1.2"], "trainer.cispo_ratio_min=1.2 must be in [0, 1)"),
        (["trainer.sapo_temperature_neg=0"], "trainer.sapo_temperature_neg=0.0 must be positive"),
        (["trainer.sapo_temperature_pos=inf"], "trainer.sapo_temperature_pos=inf"),
        (["trainer.entropy_coef=nan"], "trainer.entropy_coef=nan must be a finite number"),
        (["trainer.top_entropy_quantile=1.5"], "trainer.top_entropy_quantile=1.5 must be in [0, 1]"),
        (["trainer.top_entropy_quantile=-0.1"], "trainer.top_entropy_quantile=-0.1 must be in [0, 1]"),
        (["reward.multi_objective_aggregation=gdpo"], "reward.multi_objective_aggregation='gdpo'"),
        (
            ["reward.multi_objective_aggregation=normalize_then_sum", "trainer.advantage=rloo"],
            "trainer.advantage=rloo contradicts",
        ),
        (
            ["reward.multi_objective_aggregation=sum_then_normalize", "reward.normalize_each=true"],
            "reward.normalize_each=true contradicts",
        ),
        (["sampler=vllm", "sampler.vllm.dtype=fp8"], "sampler.vllm.dtype='fp8'"),
        (["sampler=vllm", "sampler.vllm.kv_cache_gb=-1"], "sampler.vllm.kv_cache_gb=-1"),
        (["sampler=vllm", "sampler.vllm.gpu_memory_utilization=1.5"], "sampler.vllm.gpu_memory_utilization=1.5"),
        (["sampler=vllm", "sampler.vllm.gpu_memory_utilization=0.4", "sampler.vllm.kv_cache_gb=2"], "both size"),
        (["sampler=vllm", "sampler.vllm.tensor_parallel_size=0"], "sampler.vllm.tensor_parallel_size=0"),
    ],
)
def test_validate_names_the_bad_key(overrides, expected):
    with pytest.raises(ConfigError, match="nothing was loaded") as caught:
        validate(make(overrides))
    assert expected in str(caught.value)


def test_algorithm_presets_set_the_variant_keys_and_win_over_the_run_preset():
    dapo = make(["conf=math_7b", "algorithm=dapo"]).trainer
    assert (dapo.loss_aggregation, dapo.clip_eps_high, dapo.filter_zero_std, dapo.mask_truncated) == (
        "token_mean",
        0.28,
        True,
        True,
    )
    assert dapo.beta == 0.0  # DAPO drops the KL term, over math_7b's 0.02
    dr_grpo = make(["algorithm=dr_grpo"]).trainer
    assert (dr_grpo.advantage, dr_grpo.loss_aggregation) == ("dr_grpo", "constant")
    assert make(["algorithm=rloo"]).trainer.advantage == "rloo"
    paper = make([]).trainer
    assert (paper.advantage, paper.loss_aggregation, paper.kl_estimator, paper.clip_eps_high) == (
        "grpo",
        "sequence_mean",
        "k3",
        None,
    )
    gspo = make(["algorithm=gspo"]).trainer
    assert (gspo.loss, gspo.importance_sampling_level, gspo.clip_eps, gspo.clip_eps_high) == (
        "clip",
        "sequence",
        3e-4,
        4e-4,
    )
    cispo = make(["algorithm=cispo"]).trainer
    assert (cispo.loss, cispo.loss_aggregation, cispo.cispo_ratio_max) == ("cispo", "token_mean", 5.0)
    sapo = make(["algorithm=sapo"]).trainer
    assert (sapo.loss, sapo.sapo_temperature_pos, sapo.sapo_temperature_neg) == ("sapo", 1.0, 1.05)
    for name in ("gspo", "cispo", "sapo"):
        validate(make([f"algorithm={name}"]), check_files=False)
    # The command line still wins over the algorithm preset.
    assert make(["algorithm=dapo", "trainer.clip_eps_high=0.3"]).trainer.clip_eps_high == 0.3


def test_a_run_preset_keeps_its_own_algorithm_keys_under_the_default_algorithm(tmp_path):
    # algorithm=grpo (the default) sets nothing, so a preset choosing rloo and k2 keeps them.
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "conf" / "mine.yaml").write_text(
        "# @package _global_\ntrainer:\n  advantage: rloo\n  kl_estimator: k2\n  mask_truncated: true\n"
    )
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        trainer = compose(config_name="config", overrides=["conf=mine"]).trainer
    assert (trainer.advantage, trainer.kl_estimator, trainer.mask_truncated) == ("rloo", "k2", True)


def test_a_beta_schedule_composes_from_the_command_line():
    cfg = make(["trainer.beta={start: 0.05, end: 0.02, warmup_steps: 100, shape: cosine}"])
    validate(cfg)
    assert beta_schedule(cfg.trainer.beta) == BetaSchedule(0.05, 0.02, 100, "cosine")
    assert beta_schedule(make(["trainer.beta=0.02"]).trainer.beta) == BetaSchedule(0.02, 0.02, 0, "linear")


def test_validate_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as caught:
        validate(make(["sampler.group_size=1", "trainer.steps=0"]))
    assert "sampler.group_size=1" in str(caught.value) and "trainer.steps=0" in str(caught.value)


def test_unknown_data_field_is_named_with_the_fields_that_exist(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    with pytest.raises(ConfigError) as caught:
        validate(make([f"data.path={data}", "data.prompt_field=prompt"]))
    assert "data.prompt_field='prompt'" in str(caught.value) and "'question'" in str(caught.value)
