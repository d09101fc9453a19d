"""The update's float32 linears through oneDNN (models/cpu_gemm.py): the same products and
gradients as torch's own, and the layers' own forward wherever oneDNN is not the path."""

import pytest
import torch

import grpo_cli.models.cpu_gemm as cpu_gemm
import grpo_cli.sampling.packed as packed
from grpo_cli.models.cpu_gemm import OneDnnLinears

ONEDNN_ENABLED = cpu_gemm.onednn_enabled  # the real switch, before conftest's fixture replaces it

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


def test_onednn_is_opt_in_by_environment(monkeypatch):
    monkeypatch.delenv("GRPO_CLI_ONEDNN_GEMM", raising=False)
    assert not ONEDNN_ENABLED()
    monkeypatch.setattr(cpu_gemm, "onednn_enabled", ONEDNN_ENABLED)
    assert not cpu_gemm.onednn_pays()
    assert packed.decode_gemm(None) != "onednn" and packed.decode_gemm(torch.bfloat16) != "onednn"
    monkeypatch.setenv("GRPO_CLI_ONEDNN_GEMM", "1")
    assert ONEDNN_ENABLED()
