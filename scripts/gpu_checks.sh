#!/usr/bin/env bash
# The GPU checks of issues 8 and 9 in one prepared run, for a session lent a GPU machine (the
# `device` tool; docs/BENCHMARKS.md says what each fills in). Two steps:
#
#   bash scripts/gpu_checks.sh fetch   # here: the wheels the device image lacks, into .whl/ (git-ignored, ~55 MB)
#   bash scripts/gpu_checks.sh run     # there: device run with carry [".whl"], timeout_s 600
#
# The device image has Python 3.12 with torch 2.11, transformers 5.17 (which grpo-cli runs on
# since issue 21: models/transformers_api.py), peft, tokenizers, safetensors, rich and psutil,
# but no Hydra, OmegaConf, math-verify or bitsandbytes, and no vLLM (its CUDA wheel wants torch
# 2.14 and is larger than what a device run can carry): those four travel as wheels and are
# installed with --no-deps into /tmp/site; sampler=vllm is not measured there. Our package runs from
# src/ (PYTHONPATH), its models are built under /tmp (nothing is downloaded). Results land in
# $OUT: bench_step_cuda.json and .log (sampling tok/s, update MFU, peak memory on the 0.5B and
# 1.5B shapes), bench_memory.log (the planner against torch.cuda.max_memory_allocated).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(hydra-core==1.3.8 omegaconf==2.3.0 math-verify==0.9.0
        latex2sympy2_extended==1.11.0 bitsandbytes==0.50.0)

case "${1:-}" in
  fetch)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
    # OmegaConf's parser runtime is published as a source archive only: build its (pure Python) wheel here.
    python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
    du -sh .whl
    ;;
  run)
    : "${OUT:?run this on the device machine, where OUT is set}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD/src:$PWD/scripts" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 GRPO_CLI_CACHE=/tmp/grpo-cli
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
      | tee -a "$OUT/gpu.txt"
    timeout 330 python3 scripts/bench_step.py --device cuda --steps 5 --json "$OUT/bench_step_cuda.json" 2>&1 \
      | tee "$OUT/bench_step.log" || echo "bench_step ended with $?" | tee -a "$OUT/bench_step.log"
    timeout 200 python3 scripts/bench_memory.py --device cuda 2>&1 | tee "$OUT/bench_memory.log" \
      || echo "bench_memory ended with $?" | tee -a "$OUT/bench_memory.log"
    ;;
  *)
    echo "usage: bash scripts/gpu_checks.sh fetch|run" >&2
    exit 2
    ;;
esac
