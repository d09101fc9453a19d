"""Bad input: every case in docs/ERRORS.md, each with one clear message naming the key or file.

Through the real `grpo-train` (exit code 2, no traceback) for the cases Hydra finds and a
representative set of the rest; in process (`validate`, the loaders) where the CLI path is the
same one: pipeline.run calls validate first, and any ConfigError from run ends in cli.fail.
"""

from __future__ import annotations

import ctypes
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grpo_cli.cli import config_dir
from grpo_cli.config import ConfigError
from grpo_cli.validation import validate
from helpers import TESTS_DIR, grpo_train, input_error

SMALL = ["data.prompts_per_step=2", "sampler.group_size=2", "data.eval_size=0", "trainer.steps=1"]


def cli_error(*overrides: str, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """Run grpo-train, expect exit code 2 and no traceback; the message, whitespace joined."""
    return input_error("grpo-train", *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=env)


def make(*overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def validate_error(*overrides: str) -> str:
    with pytest.raises(ConfigError, match="nothing was loaded") as caught:
        validate(make(*overrides))
    return str(caught.value)


def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


GOOD_ROW = '{"prompt": "Question: what is 1 + 2? Answer:", "answer": "3"}\n'

CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2  # linux/capability.h
LINUX_CAPABILITY_VERSION_3 = 0x20080522


class CapabilityHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapabilitySets(ctypes.Structure):  # capabilities 0-31; version 3 takes two, for 0-63
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextmanager
def file_modes_bind_even_root():
    """Within it, this thread cannot read a file its mode forbids, even as root (as CI runs).

    Root reads any file through CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH; they leave the thread's
    effective set, stay permitted, and come back on exit. Not a uid drop to nobody: on our
    machines the interpreter lives under /root (pyenv, mode 700), and nobody could not import the
    modules that validate loads on first use. For any other user the effective set is empty
    already: nothing changes.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    header = CapabilityHeader(LINUX_CAPABILITY_VERSION_3, 0)  # pid 0: the calling thread

    def capset(sets) -> None:
        if libc.capset(ctypes.byref(header), sets) != 0:
            raise OSError(ctypes.get_errno(), "capset")

    held = (CapabilitySets * 2)()
    if libc.capget(ctypes.byref(header), held) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    bound = (CapabilitySets * 2).from_buffer_copy(held)
    bound[0].effective &= ~(1 << CAP_DAC_OVERRIDE | 1 << CAP_DAC_READ_SEARCH)
    capset(bound)
    try:
        yield
    finally:
        capset(held)


# ---------------------------------------------------------------- found by Hydra, through the CLI


@pytest.mark.parametrize(
    "override,expected",
    [
        ("trainer.bta=0.1", "trainer.bta is not a config key. Did you mean trainer.beta?"),
        ("trainers.steps=3", "trainers.steps is not a config key. Did you mean trainer.steps?"),
        (
            "sampler.group_size=many",
            "sampler.group_size: Value 'many' of type 'str' could not be "
            "converted to Integer. sampler.group_size takes a whole number.",
        ),
        ("data.shuffle=maybe", "data.shuffle takes true or false"),
        (
            "conf=nope",
            "conf=nope: there is no preset 'nope' in group 'conf' (no conf/conf/nope.yaml). "
            "The conf presets are: code_7b, math_0.5b, math_7b, smollm2_arithmetic, smollm2_calculator, tiny.",
        ),
        ("model=nope", "model=nope: there is no preset 'nope' in group 'model'"),
        ("trainer.beta=[1", "Cannot parse the override 'trainer.beta=[1'"),
    ],
)
def test_hydra_composition_errors_exit_2_naming_the_key(tmp_path, override, expected):
    assert expected in cli_error(override, tmp_path=tmp_path)


def test_printing_the_config_of_an_unknown_preset_exits_2(tmp_path):
    result = grpo_train("--cfg", "job", "algorithm=ppo", check=False, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "algorithm=ppo: there is no preset 'ppo'" in " ".join(result.stderr.split())


def test_a_run_folder_under_a_file_exits_2_naming_it(tmp_path):
    blocker = write(tmp_path / "a-file", "")
    result = grpo_train(f"hydra.run.dir={blocker / 'run'}", check=False, cwd=tmp_path)
    message = " ".join(result.stderr.split())
    assert result.returncode == 2 and "Traceback" not in message
    assert f"Cannot create the run folder {blocker / 'run'}: Not a directory" in message
    assert "hydra.run.dir" in message


@pytest.mark.parametrize("override", ["conf=nope", "sampler.group_size=1"])
def test_hydra_full_error_shows_the_traceback(tmp_path, override):
    result = grpo_train(
        override, f"hydra.run.dir={tmp_path / 'run'}", check=False, cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"}
    )
    assert result.returncode != 0 and "Traceback" in result.stderr


# ---------------------------------------------------------------- found by us, through the CLI


def test_group_size_one_exits_2_through_the_cli(tmp_path):
    message = cli_error("sampler.group_size=1", tmp_path=tmp_path)
    assert "sampler.group_size=1: GRPO normalizes rewards within a group" in message


def test_a_broken_rule_is_said_before_torch_and_transformers_are_imported(tmp_path):
    # PYTHONPROFILEIMPORTTIME makes Python list each module it imports on stderr ("... | name").
    message = input_error("grpo-train", "sampler.group_size=1", cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert "sampler.group_size=1: GRPO normalizes rewards within a group" in message
    assert "| omegaconf " in message  # the listing is there
    assert "| torch " not in message and "| transformers " not in message


def test_a_broken_interpolation_names_its_key(tmp_path):
    message = cli_error("trainer.seed=${oops}", tmp_path=tmp_path)
    assert "trainer.seed: its interpolation cannot be resolved (Interpolation key 'oops' not found)" in message


def test_a_missing_model_folder_exits_2(tmp_path):
    message = cli_error(f"model.name_or_path={tmp_path / 'no-model'}", *SMALL, tmp_path=tmp_path)
    assert f"model.name_or_path={tmp_path / 'no-model'}: that path does not exist" in message
    # a path written with ~ is named again as the folder it expands to
    message = cli_error("model.name_or_path='~/no-model-here'", *SMALL, tmp_path=tmp_path)
    assert f"model.name_or_path=~/no-model-here: {Path.home() / 'no-model-here'} does not exist" in message


def test_resume_true_without_a_checkpoint_exits_2(tmp_path):
    message = cli_error("trainer.resume=true", *SMALL, tmp_path=tmp_path)
    assert "trainer.resume=true, but" in message and "holds no complete checkpoint" in message


def fake_checkpoint(run: Path, *overrides: str) -> Path:
    """A run folder whose config.yaml was made with `overrides`, holding one (empty) checkpoint:
    enough for the resume checks, which run before anything is loaded."""
    run.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(make(*overrides), run / "config.yaml")
    checkpoint = run / "checkpoints" / "step-000001"
    checkpoint.mkdir(parents=True)
    for name in ("meta.json", "trainer_state.pt"):
        write(checkpoint / name, "{}")
    return checkpoint


def test_resume_with_another_lora_shape_names_the_keys_that_differ(tmp_path):
    fake_checkpoint(tmp_path / "run", "model.lora.enabled=true", "model.lora.r=8")
    message = cli_error(
        "trainer.resume=true",
        "model.lora.enabled=true",
        "model.lora.r=4",
        "model.lora.target_modules=[q_proj]",
        *SMALL,
        tmp_path=tmp_path,
    )
    assert (
        f"checkpoint {tmp_path / 'run' / 'checkpoints' / 'step-000001'} was made with another model set-up" in message
    )
    assert "model.lora.r was 8, now 4" in message
    assert "model.lora.target_modules was ['q_proj', 'k_proj', 'v_proj', 'o_proj'], now ['q_proj']" in message


def test_a_reward_returning_the_wrong_length_stops_the_run(tmp_path, tiny_model_dir):
    message = cli_error(
        *SMALL,
        "sampler.max_new_tokens=4",
        "reward.functions=[{_target_: test_rewards.wrong_length, weight: 1.0}]",
        tmp_path=tmp_path,
        env={"PYTHONPATH": TESTS_DIR},
    )
    assert "Reward function wrong_length failed on 4 of 4 completions" in message
    assert "returned 1 values for 4 completions" in message and "reward.max_error_fraction" in message


# ---------------------------------------------------------------- validate, in process


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["data.prompts_per_step=3", "sampler.group_size=2", "trainer.micro_batch_size=4"],
            "trainer.micro_batch_size=4 must divide the completions per step, "
            "data.prompts_per_step x sampler.group_size = 6",
        ),
        (["trainer.micro_batch_tokens=-1"], "trainer.micro_batch_tokens=-1 must be 0 (off) or a token budget"),
        (
            ["trainer.micro_batch_tokens=512", "trainer.micro_batch_size=4"],
            "micro-batches are sized by tokens or by completions, not both",
        ),
        (
            ["trainer.micro_batch_tokens=512", "trainer.distributed=fsdp"],
            "trainer.micro_batch_tokens with trainer.distributed=fsdp: ranks would run different numbers",
        ),
        (["model.quantization=4bit"], "model.quantization=4bit needs model.lora.enabled=true"),
        (["model.dtype=float16"], "model.dtype=float16 with a full fine-tune (model.lora.enabled=false)"),
        (["model.attn_implementation=flex"], "model.attn_implementation='flex' is not one of sdpa, eager"),
        (
            ["model.attn_implementation=flash_attention_2"],
            "model.attn_implementation=flash_attention_2 needs the flash-attn package",
        ),
        (["sampler.max_new_tokens=0"], "sampler.max_new_tokens=0 must be positive."),
        (["sampler.temperature=0"], "sampler.temperature=0.0 must be positive: GRPO needs sampled groups"),
        (["trainer.beta=-0.1"], "trainer.beta=-0.1: trainer.beta must be a number >= 0"),
        (
            ["sampler.max_new_tokens=128"],
            "sampler.max_new_tokens=128 leaves no room for a prompt in the model's context of 128 positions",
        ),
        (["data.use_chat_template=true"], "data.use_chat_template=true, but the tokenizer has no chat template"),
        (["trainer.resume=/no/such/checkpoint"], "trainer.resume=/no/such/checkpoint: no such checkpoint folder"),
    ],
)
def test_validate_names_the_key(overrides, expected):
    assert expected in validate_error(*overrides)


def test_missing_data_file(tmp_path):
    path = tmp_path / "missing.jsonl"
    assert f"data.path: Data file {path} does not exist" in validate_error(f"data.path={path}")


def test_empty_data_file(tmp_path):
    path = write(tmp_path / "empty.jsonl", "")
    assert f"Data file {path} holds no records" in validate_error(f"data.path={path}")


def test_a_folder_given_as_the_data_file(tmp_path):
    folder = tmp_path / "rows.jsonl"
    folder.mkdir()
    assert f"Data file {folder} is a folder, not a file" in validate_error(f"data.path={folder}")


def test_an_unreadable_data_file(tmp_path):
    path = write(tmp_path / "secret.jsonl", GOOD_ROW)
    path.chmod(0)
    with file_modes_bind_even_root():
        with pytest.raises(PermissionError):  # the set-up holds: the mode now binds this test too
            path.read_text()
        message = validate_error(f"data.path={path}")
    assert f"Data file {path} cannot be read: permission denied" in message


def test_a_data_file_that_is_not_utf8(tmp_path):
    path = write(
        tmp_path / "latin1.jsonl", GOOD_ROW.encode() + '{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1")
    )
    assert f"Data file {path} is not UTF-8 text (line 2: invalid continuation byte)" in validate_error(
        f"data.path={path}"
    )


def test_a_jsonl_line_that_is_not_json_names_the_line(tmp_path):
    path = write(tmp_path / "rows.jsonl", GOOD_ROW + GOOD_ROW + '{"prompt": "oops"\n')
    message = validate_error(f"data.path={path}")
    assert f"Data file {path} could not be read as jsonl: line 3 is not valid JSON" in message


@pytest.mark.parametrize("field", ["prompt", "answer"])
def test_a_field_missing_from_the_first_record(tmp_path, field):
    path = write(tmp_path / "rows.jsonl", '{"question": "1 + 2?", "solution": "3"}\n')
    assert f"data.{field}_field='{field}' is not a field of {path}" in validate_error(f"data.path={path}")


def test_a_field_missing_from_a_later_record(tmp_path):
    path = write(tmp_path / "rows.jsonl", GOOD_ROW + GOOD_ROW + '{"prompt": "2 + 2?"}\n' + GOOD_ROW)
    message = validate_error(f"data.path={path}")
    assert f"data.answer_field='answer': record 3 of {path} has no such field" in message


def test_a_prompt_longer_than_the_models_context(tmp_path):
    long_row = json.dumps({"prompt": "Question: what is " + " + ".join(["1"] * 80) + "?", "answer": "80"})
    path = write(tmp_path / "rows.jsonl", GOOD_ROW + long_row + "\n" + long_row + "\n")
    message = validate_error(f"data.path={path}")
    assert f"data.path={path}: record 2 (and 1 more records) has a prompt of" in message
    assert "with sampler.max_new_tokens=8 that needs" in message
    assert "more than the model's context of 128 (max_position_embeddings)" in message


def tiny_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def test_a_model_folder_with_a_corrupt_config_json(tiny_model_dir, tmp_path):
    folder = tiny_copy(tiny_model_dir, tmp_path)
    write(folder / "config.json", '{"model_type": "qwen2", ')
    message = validate_error(f"model.name_or_path={folder}")
    assert f"model.name_or_path={folder}: {folder / 'config.json'} cannot be read" in message


def test_a_model_folder_without_config_json(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    message = validate_error(f"model.name_or_path={folder}")
    assert f"model.name_or_path={folder}: the folder has no config.json" in message


def test_an_output_dir_under_a_file(tmp_path):
    blocker = write(tmp_path / "a-file", "")
    message = validate_error(f"trainer.output_dir={blocker / 'run'}")
    assert f"trainer.output_dir={blocker / 'run'}: {blocker} is a file, so no folder can be made under it" in message


def test_resume_from_a_folder_that_is_not_a_checkpoint(tmp_path):
    message = validate_error(f"trainer.resume={tmp_path}")
    assert f"trainer.resume={tmp_path}: not a complete checkpoint (no meta.json or trainer_state.pt)" in message


def test_resume_with_another_model_names_it(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    fake_checkpoint(run, "model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct")
    message = validate_error("trainer.resume=true", f"trainer.output_dir={run}")
    assert "model.name_or_path was 'Qwen/Qwen2.5-0.5B-Instruct', now 'builtin:tiny-addition'" in message


def test_resume_of_a_copied_adapter_checkpoint_without_lora(tmp_path):
    checkpoint = fake_checkpoint(tmp_path / "run", "model.lora.enabled=true")
    (tmp_path / "run" / "config.yaml").unlink()  # copied away from its run: judged by its files
    write(checkpoint / "adapter_config.json", "{}")
    message = validate_error(f"trainer.resume={checkpoint}")
    assert "the checkpoint holds a LoRA adapter, but model.lora.enabled=False" in message


def test_resume_with_the_same_set_up_passes(tmp_path):
    fake_checkpoint(tmp_path / "run", "model.lora.enabled=true")
    validate(make("trainer.resume=true", f"trainer.output_dir={tmp_path / 'run'}", "model.lora.enabled=true"))


# ---------------------------------------------------------------- loading, in process


def test_cuda_requested_on_a_machine_without_it(monkeypatch):
    from grpo_cli.models.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.device=cuda, but torch sees no CUDA device"):
        resolve_device("cuda")


def test_a_cuda_index_beyond_the_devices(monkeypatch):
    from grpo_cli.models.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"trainer.device=cuda:3, but torch sees 1 CUDA device\(s\)"):
        resolve_device("cuda:3")


def test_a_reward_target_that_does_not_import():
    from grpo_cli.rewards.api import RewardScorer

    cfg = make("reward.functions=[{_target_: my_rewards.nope, weight: 1.0}]")
    with pytest.raises(ConfigError, match=r"reward.functions\[0\]._target_=my_rewards.nope: cannot import it"):
        RewardScorer.from_config(cfg.reward, cfg.trainer.std_eps)


def test_an_optimizer_target_that_does_not_import():
    from grpo_cli.algorithm.optim import make_optimizer

    cfg = make("optimizer._target_=torch.optim.Adamw")
    with pytest.raises(ConfigError, match="optimizer._target_=torch.optim.Adamw: cannot import it"):
        make_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])


def test_lora_target_modules_the_model_does_not_have(tiny_model_dir):
    from grpo_cli.models.loading import load_models

    cfg = make(f"model.name_or_path={tiny_model_dir}", "model.lora.enabled=true", "model.lora.target_modules=[qkv]")
    with pytest.raises(ConfigError) as caught:
        load_models(cfg.model, 0.0, torch.device("cpu"))
    message = str(caught.value)
    assert "model.lora.target_modules=['qkv']" in message and "q_proj" in message and "all-linear" in message


def test_quantization_without_bitsandbytes(monkeypatch):
    import importlib.util

    from grpo_cli.models.loading import _quantization_config

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    cfg = make("model.quantization=4bit", "model.lora.enabled=true")
    with pytest.raises(ConfigError, match="model.quantization=4bit needs the bitsandbytes package"):
        _quantization_config(cfg.model, torch.float32)


def test_a_tokenizer_without_pad_token_pads_with_eos_and_warns(tiny_model_dir):
    from transformers import AutoTokenizer

    from grpo_cli.models.loading import fix_special_tokens  # load_models calls it on every tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, pad_token=None)  # as Llama's ships
    assert tokenizer.pad_token is None
    with pytest.warns(
        UserWarning,
        match="model.name_or_path=x: the tokenizer has no pad token; padding with the EOS token '<|endoftext|>'",
    ):
        fix_special_tokens(tokenizer, "x")
    assert tokenizer.pad_token == tokenizer.eos_token
    assert tokenizer(["1 + 2", "1"], padding=True)["attention_mask"][1][0] == 0  # padding works


def test_a_tokenizer_without_eos_token(tiny_model_dir):
    from transformers import AutoTokenizer

    from grpo_cli.models.loading import fix_special_tokens

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.eos_token = None
    with pytest.raises(ConfigError, match="model.name_or_path=x: the tokenizer has no EOS token"):
        fix_special_tokens(tokenizer, "x")


@pytest.mark.slow
def test_a_logger_whose_package_is_missing_exits_2_naming_it(tmp_path):
    message = cli_error("logger=wandb", tmp_path=tmp_path)
    assert "logger.wandb=true, but the `wandb` package is not installed" in message


def test_an_eval_holdout_of_every_row(tmp_path):
    data = write(tmp_path / "five.jsonl", GOOD_ROW * 5)
    message = validate_error(f"data.path={data}", "data.eval_holdout=5")
    assert f"data.eval_holdout=5 leaves no training prompt: {data} holds 5 rows" in message
