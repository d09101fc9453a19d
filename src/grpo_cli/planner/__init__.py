"""The memory planner: the model's shape, the byte formulas of each phase of a step, the plan and
its table, and the check at the start of a run (trainer.plan=true prints it alone)."""
