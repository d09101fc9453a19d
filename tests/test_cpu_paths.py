"""Paths that depend on the CPU, forced so that every machine tests them.

CI runs on whichever CPU it is given: an Intel Xeon without AVX512-BF16 one day, an AMD EPYC with
it the next. bitsandbytes takes another 4-bit path on the second kind (a packed weight layout for
its bfloat16 inference kernel), which once crashed every QLoRA run there while the suite passed on
the first kind. bitsandbytes decides per layer, when the layer is made, from `has_avx512bf16()`;
the fixture below makes that answer True, so these tests take the packed path's decision on any
CPU. The packed kernel itself only runs where the CPU has the instructions: here the point is that
our policy never reaches it, which needs no such CPU.
"""

from __future__ import annotations

import subprocess
import sys

import bitsandbytes
import pytest
import torch
from safetensors.torch import load_file

from grpo_cli.logs import read_metrics
from grpo_cli.pipeline import run
from helpers import ALTERNATING_REWARD, act_as_an_avx512_bf16_cpu, computed_rows, config, one_step

QLORA = [
    "model.lora.enabled=true",
    "model.lora.r=4",
    "model.quantization=4bit",
    "model.lora.target_modules=[all-linear]",
]


def packed_layers(model: torch.nn.Module) -> list[str]:
    """Names of the Linear4bit layers whose weight bitsandbytes has repacked for its CPU kernel."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, bitsandbytes.nn.Linear4bit)
        and getattr(module.weight.quant_state, "packing_format_for_cpu", False)
    ]


def test_the_forced_detection_reaches_bitsandbytes_packing(monkeypatch):
    """The control: a bare Linear4bit, made under the fixture, repacks its weight at its first
    eval-mode forward without grad, as it does on a real AVX512-BF16 CPU. Were this to stop
    (bitsandbytes changed how it decides), the tests below would prove nothing: so it fails."""
    act_as_an_avx512_bf16_cpu(monkeypatch)
    torch.manual_seed(0)
    layer = bitsandbytes.nn.Linear4bit(64, 64, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bitsandbytes.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu").eval()
    with torch.no_grad():
        layer(torch.randn(2, 64))
    assert packed_layers(layer) == [""]


def test_a_qlora_step_takes_the_same_path_whatever_bitsandbytes_detects(tiny_model_dir, monkeypatch):
    """Sampling (eval mode, no grad: where bitsandbytes would repack) then an update, once as this
    CPU runs it and once as an AVX512-BF16 CPU would: the same tokens, loss and adapter, bit for
    bit, and no layer repacked. Before models.keep_4bit_weights_in_training_layout, the forced run
    repacked all 28 layers at the first sampling step: on an AVX512-BF16 CPU the update then
    failed on the in-place bias add of q/k/v, and here the packed bytes were read as plain ones
    (other completions) and the gradient through the base layers was dropped."""
    cfg = config(tiny_model_dir, *QLORA)
    plain_models, plain_rollout, plain_stats, _, _ = one_step(cfg)
    act_as_an_avx512_bf16_cpu(monkeypatch)
    models, rollout, stats, changed, total = one_step(cfg)

    assert packed_layers(models.policy) == []
    assert sum(isinstance(m, bitsandbytes.nn.Linear4bit) for m in models.policy.modules()) == 28  # 7 a layer x 4
    assert torch.equal(rollout.completion_ids, plain_rollout.completion_ids)
    assert (stats.loss, stats.grad_norm) == (plain_stats.loss, plain_stats.grad_norm)
    assert changed == total // 2  # every lora_B moved (lora_A has no gradient while B is 0)
    trained = {n: p for n, p in models.policy.named_parameters() if p.requires_grad}
    for name, parameter in plain_models.policy.named_parameters():
        if parameter.requires_grad:
            assert torch.equal(trained[name], parameter), name


def test_a_qlora_run_with_evals_and_checkpoints_is_the_same_on_an_avx512_bf16_cpu(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The whole loop (greedy evals before and after, sampling, updates, checkpoints), as
    `grpo-train model.lora.enabled=true model.quantization=4bit` runs it, with a reward that gives
    every step a gradient: the forced run's metrics and adapter equal this CPU's exactly."""

    def two_steps(folder):
        run(
            config(
                tiny_model_dir,
                *QLORA,
                ALTERNATING_REWARD,
                "trainer.steps=2",
                "data.eval_size=4",
                "trainer.eval_every=1",
                "trainer.checkpoint_every=1",
                "data.prompts_per_step=4",
                f"trainer.output_dir={folder}",
            )
        )
        return (
            computed_rows(read_metrics(folder)),
            load_file(folder / "checkpoints" / "step-000002" / "adapter_model.safetensors"),
        )

    plain_rows, plain_adapter = two_steps(tmp_path / "plain")
    act_as_an_avx512_bf16_cpu(monkeypatch)
    rows, adapter = two_steps(tmp_path / "avx512_bf16")
    assert any(adapter[key].any() for key in adapter if "lora_B" in key)  # it trained: lora_B starts at 0
    assert rows == plain_rows
    assert adapter.keys() == plain_adapter.keys()
    assert all(torch.equal(adapter[key], plain_adapter[key]) for key in adapter)


# What prints the noise of grpo_cli.noise, for real: bitsandbytes' CPU backend imported again as
# on an AVX512-BF16 CPU, and peft wrapping a model in LoRA.
PRINT_THE_KNOWN_NOISE = """
import importlib, sys
if sys.argv[1] == "with-grpo-cli":
    import grpo_cli
import bitsandbytes.functional
import bitsandbytes.backends.cpu.ops
bitsandbytes.functional.has_avx512bf16 = lambda: True
importlib.reload(bitsandbytes.backends.cpu.ops)
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
shape = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2)
get_peft_model(LlamaForCausalLM(shape), LoraConfig(r=2, target_modules=["q_proj"]))
"""


@pytest.mark.slow  # two child processes that import bitsandbytes, peft and transformers: 35 s
def test_the_warnings_we_know_to_be_noise_stay_out_of_the_console():
    # The control first: without grpo_cli the libraries print them (so the test can fail).
    def stderr_of(mode):
        result = subprocess.run(
            [sys.executable, "-c", PRINT_THE_KNOWN_NOISE, mode], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        return result.stderr

    noise = ("Failed to load CPU gemm_4bit_forward from kernels-community", "`is_gradient_checkpointing` is deprecated")
    alone = stderr_of("alone")
    assert all(line in alone for line in noise), alone
    quiet = stderr_of("with-grpo-cli")
    assert not any(line in quiet for line in noise), quiet
