"""Stage 1, prompts: data files and built-in tasks, through the chat template, in resumable batches."""
