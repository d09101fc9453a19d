"""grpo-cli: fine-tune causal language models with GRPO from the command line."""

import os

from grpo_cli.noise import silence_known_noise

__version__ = "0.1.0"

# oneDNN (torch's bfloat16 products, and float32 ones on CPUs other than Intel's: models/cpu_gemm)
# keeps a compiled primitive per input shape it meets, up to 1024 of them by default, a few MB
# each; the update's row counts vary with the completions' lengths, so a long run filled that
# cache: the tiny default's resident memory grew 0.59 -> 0.71 GB over 1000 steps. 64 holds every
# shape of a few consecutive micro-batches (a forward and backward of one row count meet ~15), so
# the hits that pay stay. oneDNN reads the variable once, at its first primitive, hence here,
# before anything of ours runs torch; a value the user set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")

# Here, so that every entry point and every torchrun rank has it before any library prints.
silence_known_noise()
