"""Stages 4 and 5, the arithmetic of GRPO: rewards -> advantages (pure), the clipped objective and
KL (pure), the policy update that applies them, and the optimizer with its schedule."""
