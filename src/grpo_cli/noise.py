"""Lines that libraries print and we know to be noise, kept out of the user's console.

A user should see no warning we know to mean nothing for their run: they learn to skip warnings,
and then miss the one that matters. Each entry says why it is noise; anything not listed here
reaches the console as the library wrote it. tests/test_cpu_paths.py provokes each for real.
"""

from __future__ import annotations

import logging
import re
import warnings

# (logger name, how the message starts): lines of the `logging` module.
LOGGED_NOISE = (
    # On a CPU with AVX512-BF16, bitsandbytes 0.50 tries at import to fetch a faster kernel for its
    # packed 4-bit inference layout from the Hugging Face hub (the `kernels` package), once per
    # process (every torchrun rank). No model of ours takes that layout
    # (models.keep_4bit_weights_in_training_layout), and the hub is not reached offline.
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
)

# (category, how the message starts): lines of the `warnings` module.
WARNED_NOISE = (
    # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` on every LoRA model;
    # the property still answers, and nothing of ours reads it.
    (FutureWarning, "`is_gradient_checkpointing` is deprecated"),
)


class _DropKnownNoise(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def silence_known_noise() -> None:
    """Filter the lines above out; idempotent. A logger is one object per name, so its filter holds
    whether the library made the logger before or after this call."""
    for name in {logger for logger, _ in LOGGED_NOISE}:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropKnownNoise) for existing in logger.filters):
            logger.addFilter(_DropKnownNoise(tuple(start for n, start in LOGGED_NOISE if n == name)))
    for category, start in WARNED_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(start), category=category)
