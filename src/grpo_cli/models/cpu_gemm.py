"""The CPU's fastest float32 GEMM for the update's linear layers: oneDNN's, on CPUs other than
Intel's.

torch multiplies a float32 `nn.Linear` on the CPU by MKL's GEMM. On an AMD EPYC MKL's kernel for
the linear layer's product (inputs @ weight^T) is far from the best the CPU does: measured on a
2-core EPYC with avx512 (docs/BENCHMARKS.md), [3600, 576] x [576, 1536] ran at 136-157 GFLOP/s
through torch's linear and 174-219 through oneDNN, the library torch itself calls for bfloat16
products and torch.compile's CPU weight freezing calls for float32 ones. On an Intel Xeon MKL is
Intel's own; oneDNN there is not measured yet, so Intel keeps torch's GEMM. Small weights
(under ONEDNN_MIN_WEIGHTS elements) keep it too: oneDNN's per-call cost outweighs its kernel.

`OneDnnLinears(model)` is a `with` block within which the model's float32 `nn.Linear` layers on
the CPU multiply through oneDNN (forward) and through oneDNN and torch's GEMM (backward: the
inputs' gradient by oneDNN, the weight's by torch's, the faster of each pair measured), with the
same products to float32 rounding (tests/test_cpu_gemm.py). Under torch.autocast the layers run
their own forward (autocast's bfloat16 product is oneDNN's already). Pure torch.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def intel_cpu() -> bool:
    """Whether /proc/cpuinfo names an Intel CPU (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in cpuinfo)
    except OSError:
        return False


def onednn_gemm_available() -> bool:
    """Whether this torch has oneDNN's linear ops (on weights as they are, or laid out ahead)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


@functools.cache
def onednn_bfloat16_available() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU: it needs avx512bw, avx512vl and avx512dq
    or avx_ne_convert, which an AVX2-only CPU (an AMD EPYC without AVX-512) lacks; there it
    refuses to lay out a bfloat16 weight."""
    return onednn_gemm_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# The smallest weight whose products oneDNN takes. Its call costs ~20 us more than torch's
# (a primitive found by shape): measured on the EPYC, a [256, 128] weight ran 2.1x slower
# through it at 16 rows and 0.9-1.0x at 256-1024, SmolLM2's [192, 576] 0.8-0.9x from 256 rows
# and its [1536, 576] 0.7-0.8x at every row count. The tiny default's weights (at most
# 300 x 128) stay below it: with them through oneDNN its step took 1.2x longer and its resident
# memory grew 0.50 -> 0.57 GB over 1000 steps (a primitive per row count met), flat without.
ONEDNN_MIN_WEIGHTS = 1 << 16


def onednn_enabled() -> bool:
    """Whether oneDNN's GEMM may be used: yes unless GRPO_CLI_ONEDNN_GEMM=0 (the way back to
    torch's GEMM everywhere, for comparing or for a CPU where it is not measured to pay)."""
    return os.environ.get("GRPO_CLI_ONEDNN_GEMM", "1") != "0"


def onednn_takes(weight: torch.Tensor) -> bool:
    """Whether this weight is large enough for oneDNN's GEMM to pay (ONEDNN_MIN_WEIGHTS)."""
    return weight.numel() >= ONEDNN_MIN_WEIGHTS


def onednn_pays() -> bool:
    """Whether float32 products on this CPU go through oneDNN (see the module docstring)."""
    return onednn_enabled() and onednn_gemm_available() and not intel_cpu()


def onednn_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """inputs [..., in] @ weight[out, in]^T + bias [out] by oneDNN, without autograd; `weight`
    may be a transposed view or laid out by torch.ops.mkldnn._reorder_linear_weight."""
    return torch.ops.mkldnn._linear_pointwise(inputs, weight, bias, "none", [], "")


def linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.linear, through oneDNN where it pays for these tensors: float32 on a
    CPU where onednn_pays, outside autocast, a weight oneDNN takes. Differentiable either way."""
    if (
        inputs.dtype == weight.dtype == torch.float32
        and onednn_takes(weight)
        and inputs.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
        and onednn_pays()
    ):
        return _OneDnnLinear.apply(inputs, weight, bias)
    return torch.nn.functional.linear(inputs, weight, bias)


class _OneDnnLinear(torch.autograd.Function):
    """y = x W^T + b with x [..., in], W [out, in]. Backward: dx = dy W (oneDNN, W^T viewed as
    the [in, out] weight), dW = dy^T x and db = sum dy over rows (torch's GEMM: measured faster
    than oneDNN's for this product on the EPYC)."""

    @staticmethod
    def forward(ctx, inputs, weight, bias):
        ctx.save_for_backward(inputs, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        inputs, weight = ctx.saved_tensors
        need_inputs, need_weight, need_bias = ctx.needs_input_grad
        rows = grad.reshape(-1, grad.shape[-1])  # [M, out]
        grad_inputs = onednn_linear(grad, weight.t()) if need_inputs else None
        grad_weight = rows.t().mm(inputs.reshape(-1, inputs.shape[-1])) if need_weight else None
        grad_bias = rows.sum(dim=0) if ctx.has_bias and need_bias else None
        return grad_inputs, grad_weight, grad_bias


class OneDnnLinears:
    """A reusable `with` block within which the float32 `nn.Linear` layers on the CPU of every
    model given (None skipped), of weights oneDNN takes, call `linear` with their current weights: oneDNN where it pays,
    their own product elsewhere and under autocast. Nothing is swapped where oneDNN does not
    pay, and a module whose forward is already replaced on the instance (hooks) is left alone.
    Hold it over the forward and the backward both: a checkpointed layer replays its forward
    in the backward, and should multiply as it did."""

    def __init__(self, *models: torch.nn.Module | None):
        self.modules = {}  # by id: a module reached twice is swapped once
        if not onednn_pays():
            return
        for model in models:
            for module in () if model is None else cpu_float32_linears(model):
                if onednn_takes(module.weight):
                    self.modules[id(module)] = module

    def __enter__(self):
        for module in self.modules.values():
            module.forward = functools.partial(_module_linear, module)
        return self

    def __exit__(self, *exc):
        for module in self.modules.values():
            del module.forward


def cpu_float32_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's plain `nn.Linear` layers with float32 weights on the CPU whose forward is the
    class's (one replaced on the instance, by hooks or another swap, is left out)."""
    return [
        module
        for module in model.modules()
        if type(module) is torch.nn.Linear
        and "forward" not in vars(module)
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    ]


def _module_linear(module: torch.nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    return linear(inputs, module.weight, module.bias)
