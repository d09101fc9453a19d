"""grpo-cli: fine-tune causal language models with GRPO from the command line."""

__version__ = "0.1.0"
