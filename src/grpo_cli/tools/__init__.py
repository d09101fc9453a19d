"""The commands around training: grpo-report (run and sweep reports, plots), grpo-export (a
checkpoint as a plain model folder) and grpo-filter (keep the prompts that teach)."""
