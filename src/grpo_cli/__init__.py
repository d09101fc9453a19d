"""grpo-cli: fine-tune causal language models with GRPO from the command line."""

from grpo_cli.noise import silence_known_noise

__version__ = "0.1.0"

# Here, so that every entry point and every torchrun rank has it before any library prints.
silence_known_noise()
