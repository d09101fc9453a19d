"""The update's float32 linears through oneDNN (models/cpu_gemm.py): the same products and
gradients as torch's own, and the layers' own forward wherever oneDNN is not the path."""

import pytest
import torch

import grpo_cli.models.cpu_gemm as cpu_gemm
import grpo_cli.sampling.packed as packed
from grpo_cli.models.cpu_gemm import OneDnnLinears

ONEDNN_MIN_WEIGHTS = cpu_gemm.ONEDNN_MIN_WEIGHTS  # the real threshold, before conftest's fixture lowers it

needs_onednn = pytest.mark.skipif(not cpu_gemm.onednn_gemm_available(), reason="this torch has no oneDNN linear ops")


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8, bias=False))


def loss_and_gradients(model, inputs):
    inputs = inputs.clone().requires_grad_(True)
    loss = model(inputs).square().sum()
    loss.backward()
    gradients = [parameter.grad.clone() for parameter in model.parameters()] + [inputs.grad]
    model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


@needs_onednn
def test_onednn_linears_give_torchs_loss_and_gradients_and_step_aside_after(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "intel_cpu", lambda: False)  # oneDNN's CPU, forced
    model, inputs = small_model(), torch.randn(3, 5, 16)
    expected_loss, expected = loss_and_gradients(model, inputs)
    products = []
    onednn_linear = cpu_gemm.onednn_linear
    monkeypatch.setattr(cpu_gemm, "onednn_linear", lambda *args: products.append(1) or onednn_linear(*args))
    with OneDnnLinears(model, None, model):  # a model given twice is swapped once; None is skipped
        assert "forward" in vars(model[0]) and "forward" in vars(model[2])
        loss, gradients = loss_and_gradients(model, inputs)
    # two forwards and two inputs' gradients by oneDNN (the weights' gradients by torch's GEMM)
    assert len(products) == 4
    # float32 sums of 16-24 products: rounding stays near 1e-6 of these magnitudes
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(gradients, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not any("forward" in vars(module) for module in model.modules())
    # a wrong product is far outside that bound: the gradient of the first weight without its bias
    assert not torch.allclose(gradients[0], torch.zeros_like(gradients[0]), atol=1e-3)


@needs_onednn
def test_under_autocast_the_layers_run_autocasts_product(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "intel_cpu", lambda: False)
    model, inputs = small_model(), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(inputs)
        with OneDnnLinears(model):
            got = model(inputs)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


@pytest.mark.parametrize("intel, onednn", [(True, True), (False, False)])
def test_nothing_is_swapped_on_intel_or_without_onednn(intel, onednn, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "intel_cpu", lambda: intel)
    monkeypatch.setattr(cpu_gemm, "onednn_gemm_available", lambda: onednn)
    model = small_model()
    assert not OneDnnLinears(model).modules
    assert not cpu_gemm.onednn_pays()


@needs_onednn
def test_a_bfloat16_or_hooked_layer_keeps_its_own_forward(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "intel_cpu", lambda: False)
    model = small_model()
    model[2].to(torch.bfloat16)
    model[0].forward = lambda inputs: inputs  # replaced by someone else
    assert not OneDnnLinears(model).modules


def test_onednn_is_on_by_default_and_off_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "intel_cpu", lambda: False)
    monkeypatch.setattr(cpu_gemm, "onednn_gemm_available", lambda: True)
    monkeypatch.setattr(packed, "intel_cpu", lambda: False)
    monkeypatch.setattr(packed, "onednn_gemm_available", lambda: True)
    monkeypatch.delenv("GRPO_CLI_ONEDNN_GEMM", raising=False)
    assert cpu_gemm.onednn_pays() and packed.decode_gemm(None) == "onednn"
    monkeypatch.setenv("GRPO_CLI_ONEDNN_GEMM", "0")
    assert not cpu_gemm.onednn_pays()
    assert packed.decode_gemm(None) != "onednn" and packed.decode_gemm(torch.bfloat16) != "onednn"


@needs_onednn
def test_weights_under_the_threshold_keep_torchs_gemm(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "intel_cpu", lambda: False)
    monkeypatch.setattr(cpu_gemm, "ONEDNN_MIN_WEIGHTS", ONEDNN_MIN_WEIGHTS)
    small = torch.nn.Linear(128, 300)  # the tiny default's largest weight: 38,400 elements
    large = torch.nn.Linear(576, 192)  # SmolLM2's smallest: 110,592
    assert [module is large for module in OneDnnLinears(small, large).modules.values()] == [True]
    products = []
    onednn_linear = cpu_gemm.onednn_linear
    monkeypatch.setattr(cpu_gemm, "onednn_linear", lambda *args: products.append(1) or onednn_linear(*args))
    cpu_gemm.linear(torch.randn(4, 128), small.weight)
    assert not products
    cpu_gemm.linear(torch.randn(4, 576), large.weight)
    assert products == [1]


@needs_onednn
def test_decode_lays_out_large_weights_only(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "ONEDNN_MIN_WEIGHTS", ONEDNN_MIN_WEIGHTS)
    model = torch.nn.Sequential(torch.nn.Linear(128, 300), torch.nn.Linear(300, 576))  # 38,400 and 172,800
    assert [module for module, _ in packed.ReorderedLinears(model, rows=4).forwards] == [model[1]]
    inputs = torch.randn(4, 128)
    expected = model(inputs)
    with packed.ReorderedLinears(model, rows=4):
        torch.testing.assert_close(model(inputs), expected, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.skipif(not cpu_gemm.onednn_bfloat16_available(), reason="this CPU's oneDNN has no bfloat16 kernels")
def test_decode_lays_out_large_weights_and_copies_small_ones_under_autocast(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "ONEDNN_MIN_WEIGHTS", ONEDNN_MIN_WEIGHTS)
    model = torch.nn.Sequential(torch.nn.Linear(128, 300), torch.nn.Linear(300, 576))
    inputs = torch.randn(4, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(inputs)
        laid_out = packed.ReorderedLinears(model, rows=4, dtype=torch.bfloat16)
        assert len(laid_out.forwards) == 2  # the small one by a bfloat16 copy
        with laid_out:
            got = model(inputs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
