"""sampler=fast's decode weights, prepared once per decode instead of at every token: linear
layers multiplied by weights laid out for oneDNN's GEMM (ReorderedLinears: under bfloat16
autocast a bfloat16 copy so laid out, and in float32 on a CPU other than Intel's), by weights
packed for MKL's GEMM (PackedLinears: float32 on an Intel CPU), or, without oneDNN, under
bfloat16 autocast by a bfloat16 copy of their weights (LowPrecisionLinears). Pure torch: the
memory planner reads decode_gemm and PACK_MIN_WEIGHTS without loading a sampler."""

from __future__ import annotations

import torch

from grpo_cli.models import cpu_gemm
from grpo_cli.models.cpu_gemm import (
    cpu_float32_linears,
    intel_cpu,
    onednn_bfloat16_available,
    onednn_gemm_available,
    onednn_linear,
)

# sampler=fast on a CPU packs a float32 linear weight for MKL's GEMM (PackedLinears) when it
# has at least this many elements: smaller products run no faster packed (a [256, 128] weight:
# 39 against 41 us), and the packing's allocations cost more than they save (the tiny default's
# sampling took 3% longer with every weight packed). memory.py counts the same weights.
PACK_MIN_WEIGHTS = 1 << 17


def packed_gemm_available() -> bool:
    """Whether this torch has MKL's packed GEMM ops (x86 builds with MKL)."""
    return torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")


def packing_pays() -> bool:
    """Whether sampler=fast packs its float32 decode weights here: MKL's packed GEMM exists and
    the CPU is Intel's. Measured (docs/BENCHMARKS.md): on a Xeon packing made the small bench
    model's sampling 9-15% faster; on an AMD EPYC it made SmolLM2-135M's 10% slower (MKL's
    packed kernel is not its fastest path there) and the small model's no faster."""
    return packed_gemm_available() and intel_cpu()


def decode_gemm(autocast: torch.dtype | None) -> str:
    """The GEMM sampler=fast's decode steps multiply by on a CPU, once its weights are laid out:
    "onednn" (ReorderedLinears), "mkl_packed" (PackedLinears), "bfloat16_copy"
    (LowPrecisionLinears) or "plain" (the layers' own forward).

    Measured (docs/BENCHMARKS.md): on a 2-core AMD EPYC a [16, 576] x [576, 1536] product ran
    1.9x faster in float32 (1.7x in bfloat16) through oneDNN on a laid-out weight than through
    torch's own GEMM (MKL's in float32, which on that CPU reaches 9 GB/s of weights against
    oneDNN's 16); on an Intel Xeon MKL's packed GEMM made float32 sampling 9-15% faster, and
    oneDNN there is not measured yet, so Intel keeps MKL in float32. Under autocast torch's
    bfloat16 GEMM is oneDNN's already: a laid-out copy only saves its per-call reorder; a CPU
    whose oneDNN has no bfloat16 kernel (no AVX-512) gets the bfloat16 copy."""
    if cpu_gemm.onednn_enabled() and onednn_gemm_available():
        if autocast is None and not intel_cpu():
            return "onednn"
        if autocast is not None and onednn_bfloat16_available():
            return "onednn"
    if autocast is not None:
        return "bfloat16_copy"
    return "mkl_packed" if packing_pays() else "plain"


class _SwappedForwards:
    """A reusable `with` block that gives each module of self.forwards its own forward."""

    forwards: list

    def __enter__(self):
        for module, forward in self.forwards:
            module.forward = forward

    def __exit__(self, *exc):
        for module, _ in self.forwards:
            del module.forward


class PackedLinears(_SwappedForwards):
    """A reusable `with` block within which the policy's float32 `nn.Linear` layers on the CPU,
    of at least `min_weights` weights (default PACK_MIN_WEIGHTS), multiply by weights packed for
    MKL's GEMM, once, for inputs of `rows` rows.

    A decode step multiplies the same [rows, in] x [in, out] shapes at every token; MKL's packed
    GEMM (the one torch.compile's CPU weight freezing uses) skips laying the weight out again at
    each call. The results are the same (tests/test_fast_sampler.py), in less time
    (docs/BENCHMARKS.md measures it). The weights change with every
    optimizer step, so make one per decode; an input of another number of rows takes the plain
    GEMM. It holds a packed copy of those weights (about their size) while it lives. Nothing is
    packed without MKL, and a module whose forward is already replaced on the instance (hooks)
    is left alone."""

    def __init__(self, policy, rows: int, min_weights: int | None = None):
        self.forwards = []
        if not packed_gemm_available():
            return
        min_weights = PACK_MIN_WEIGHTS if min_weights is None else min_weights
        for module in policy.modules():
            weight = getattr(module, "weight", None)
            if (
                type(module) is torch.nn.Linear
                and "forward" not in vars(module)
                and weight.numel() >= min_weights
                and weight.dtype == torch.float32
                and weight.device.type == "cpu"
            ):
                self.forwards.append((module, packed_forward(weight.detach(), module.bias, rows)))


def packed_forward(weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
    """inputs [..., in] -> inputs @ weight.T + bias, by MKL's GEMM with `weight` packed for `rows` rows."""
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    bias = None if bias is None else bias.detach()

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(inputs, packed, weight, bias, rows)

    return forward


class LowPrecisionLinears(_SwappedForwards):
    """A reusable `with` block, for decode steps under torch.autocast in `dtype`, within which the
    policy's float32 `nn.Linear` layers multiply by a copy of their weights (and biases) in
    `dtype` made once, here.

    Autocast casts a float32 weight at every call: inside inference mode it keeps no cast, so
    each decode step read every float32 weight and wrote its bfloat16 copy again (measured on
    SmolLM2-135M: half the decode's time in those copies), where a held copy is read at half
    the float32 bytes. The products are autocast's own: its inputs in `dtype`, the same kernel
    (tests/test_fast_sampler.py). It holds the copies (2 B a weight for bfloat16) while it
    lives; the weights change with every optimizer step, so make one per decode. A module whose
    forward is already replaced on the instance (hooks) is left alone."""

    def __init__(self, policy, dtype: torch.dtype):
        self.forwards = []
        for module in policy.modules():
            weight = getattr(module, "weight", None)
            if type(module) is torch.nn.Linear and "forward" not in vars(module) and weight.dtype == torch.float32:
                self.forwards.append((module, cast_forward(weight.detach(), module.bias, dtype)))


def cast_forward(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """inputs [..., in] -> inputs @ weight.T + bias in `dtype`, with the weight cast once."""
    weight = weight.to(dtype)
    bias = None if bias is None else bias.detach().to(dtype)

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(inputs.to(dtype), weight, bias)

    return forward


class ReorderedLinears(_SwappedForwards):
    """A reusable `with` block within which the policy's float32 `nn.Linear` layers on the CPU
    (of weights oneDNN takes: cpu_gemm.ONEDNN_MIN_WEIGHTS; under autocast the smaller ones get
    LowPrecisionLinears' copy) multiply, through oneDNN, by their weights laid out once for inputs of `rows` rows: in
    float32, or, for decode steps under torch.autocast in `dtype`, a copy in `dtype` (autocast's
    inputs and output dtype, as LowPrecisionLinears).

    A decode step multiplies the same [rows, in] x [in, out] shapes at every token; a weight laid
    out ahead for oneDNN's kernel (what torch.compile's CPU weight freezing does) is streamed
    from memory at about twice the rate of torch's own GEMM on an AMD EPYC (decode_gemm). The
    products are the same to rounding (tests/test_fast_sampler.py); any number of rows works, the
    layout is tuned for `rows`. It holds the laid-out copies (4 B a weight, or 2 B in bfloat16)
    while it lives; the weights change with every optimizer step, so make one per decode. A
    module whose forward is already replaced on the instance (hooks) is left alone."""

    def __init__(self, policy, rows: int, dtype: torch.dtype | None = None):
        self.forwards = []
        for module in cpu_float32_linears(policy):
            weight = module.weight.detach()
            if cpu_gemm.onednn_takes(weight):
                self.forwards.append((module, reordered_forward(weight, module.bias, rows, dtype)))
            elif dtype is not None:  # too small for oneDNN to pay: a copy in dtype, as LowPrecisionLinears
                self.forwards.append((module, cast_forward(weight, module.bias, dtype)))


def reordered_forward(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, dtype: torch.dtype | None):
    """inputs [..., in] -> inputs @ weight.T + bias by oneDNN, with `weight` (cast to `dtype`
    where given) laid out once for `rows` rows."""
    dtype = weight.dtype if dtype is None else dtype
    laid_out = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), rows)
    bias = None if bias is None else bias.detach().to(dtype)

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        return onednn_linear(inputs.to(dtype), laid_out, bias)

    return forward
