"""The embedded default visibly learns: `grpo-train` with no arguments, held-out greedy eval.

Sampled reward alone is no proof (a policy can sharpen onto a shortcut such as always giving
the most frequent answer); the bar is the greedy accuracy on the eval draw, before vs after.
"""

from __future__ import annotations

import pytest

from grpo_cli.logs import read_metrics
from helpers import grpo_train


@pytest.mark.slow
def test_default_run_raises_greedy_eval_accuracy(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "default"
    result = grpo_train(f"hydra.run.dir={run_dir}")
    rows = read_metrics(run_dir)
    before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    print(f"greedy eval accuracy: {before:.3f} -> {after:.3f}")
    assert rows[-1]["step"] == 700
    assert after >= 0.45 and after >= before + 0.25, result.stdout[-2000:]
    assert "greedy eval accuracy, before -> after" in result.stdout
