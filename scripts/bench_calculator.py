"""The figures of `conf=smollm2_calculator` (docs/MULTITURN.md): SmolLM2-135M-Instruct's greedy
accuracy on held-out two-digit sums without tools, then with the calculator before and after
GRPO for each seed, the share of problems where it calls the tool, and the minutes each run took.

  without tools   the same questions, rollout=single_turn, one step run for its step-0 eval, in
                  two framings: the preset's prompt with its worked example answered without a
                  call (strict: the number alone), and the plain question with the model's own
                  system prompt read leniently (the reply's last number); the higher is the bar's
                  baseline
  no worked call  the calculator offered but data.few_shot=[]: how often the untrained model
                  calls it, greedy (the step-0 eval) and sampled (step 1's 16 conversations)
  with tools      `grpo-train conf=smollm2_calculator trainer.seed=S`, its step-0 and last evals
  trained without tools
                  the same GRPO run (seed, steps, prompts) with rollout=single_turn in each framing
                  above, the higher of the two: what training alone buys without the calculator,
                  since the reward also takes the sum written out ("10 + 17 = 27")

    .venv/bin/python scripts/bench_calculator.py --seeds 0 1 2 --out /tmp/calculator

Each run is a grpo-train child process, one after another (2 cores: two at once only share them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench_step import cpu_line  # scripts/ is on the path of a script run from it

GRPO_TRAIN = str(Path(sys.executable).parent / "grpo-train")
ONE_EVAL = ("trainer.steps=1", "trainer.checkpoint_every=0")
# The first framing is the preset's worked example with the call taken out: the answer given straight away.
NO_TOOLS = {
    "worked example, strict": (
        "data.system_prompt='Reply with the number only.'",
        "data.few_shot=[{role: user, content: 'What is 12 + 34?'}, {role: assistant, content: '46'}]",
    ),
    "plain question, lenient": ("data.system_prompt=null", "data.few_shot=[]"),
}
SCORE = {"worked example, strict": "eval/accuracy", "plain question, lenient": "eval/answer_anywhere"}


def grpo_train(run_dir: Path, *overrides: str, reuse: bool = False) -> tuple[list[dict], float]:
    """One run's metrics.jsonl rows and its minutes (`reuse`: a finished run's, with the minutes
    this script timed when it ran it, kept in bench_minutes.txt beside the metrics)."""
    metrics, timed = run_dir / "metrics.jsonl", run_dir / "bench_minutes.txt"
    if reuse and metrics.exists() and timed.exists():
        return [json.loads(line) for line in metrics.read_text().splitlines()], float(timed.read_text())
    started = time.perf_counter()
    command = [GRPO_TRAIN, "conf=smollm2_calculator", f"hydra.run.dir={run_dir}", *overrides]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    minutes = (time.perf_counter() - started) / 60
    timed.write_text(f"{minutes:.3f}\n")
    return [json.loads(line) for line in metrics.read_text().splitlines()], minutes


def evals(rows: list[dict]) -> list[dict]:
    return [row for row in rows if "eval/accuracy" in row]


def without_tools(run_dir: Path, *overrides: str, reuse: bool) -> list[tuple[str, list[dict], float]]:
    """A rollout=single_turn run in each framing of NO_TOOLS (in run_dir-0, run_dir-1):
    (framing, metrics rows, minutes) each."""
    runs = []
    for index, (framing, framing_overrides) in enumerate(NO_TOOLS.items()):
        path = Path(f"{run_dir}-{index}")
        rows, minutes = grpo_train(path, "rollout=single_turn", *overrides, *framing_overrides, reuse=reuse)
        runs.append((framing, rows, minutes))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-calculator"))
    parser.add_argument("--steps", type=int, default=None, help="trainer.steps (default: the preset's)")
    parser.add_argument("--reuse", action="store_true", help="read the runs already in --out instead of rerunning")
    args = parser.parse_args()
    print(f"CPU: {cpu_line()}", flush=True)
    baselines = []
    for framing, rows, minutes in without_tools(args.out / "without-tools", *ONE_EVAL, reuse=args.reuse):
        baselines.append(evals(rows)[0][SCORE[framing]])
        print(f"without tools ({framing}): greedy accuracy {baselines[-1]:.3f} ({minutes:.1f} min)", flush=True)
    baseline = max(baselines)
    rows, minutes = grpo_train(args.out / "no-worked-call", *ONE_EVAL, "data.few_shot=[]", reuse=args.reuse)
    first_eval, first_step = evals(rows)[0], next(row for row in rows if "rollout/tool_calls" in row)
    print(
        f"tools, no worked call: tool use greedy {first_eval['eval/tool_use']:.3f}, sampled "
        f"{first_step['rollout/tool_calls']:.3f} a conversation ({minutes:.1f} min)",
        flush=True,
    )
    steps = [f"trainer.steps={args.steps}"] if args.steps else []
    print(
        "| seed | accuracy before -> after | tool use before -> after | after - without tools "
        "| trained without tools | after - trained without tools | minutes (tools, both without) |"
    )
    print("|---|---|---|---|---|---|---|")
    gains, gains_over_trained = [], []
    for seed in args.seeds:
        rows, minutes = grpo_train(args.out / f"seed{seed}", f"trainer.seed={seed}", *steps, reuse=args.reuse)
        first, last = evals(rows)[0], evals(rows)[-1]
        untooled = without_tools(
            args.out / f"seed{seed}-without-tools", f"trainer.seed={seed}", *steps, reuse=args.reuse
        )
        trained_without_tools = max(evals(run)[-1][SCORE[framing]] for framing, run, _ in untooled)
        untooled_minutes = sum(taken for _, _, taken in untooled)
        gains.append(last["eval/accuracy"] - baseline)
        gains_over_trained.append(last["eval/accuracy"] - trained_without_tools)
        print(
            f"| {seed} | {first['eval/accuracy']:.3f} -> {last['eval/accuracy']:.3f} (step {last['step']}) "
            f"| {first['eval/tool_use']:.3f} -> {last['eval/tool_use']:.3f} | {gains[-1]:+.3f} "
            f"| {trained_without_tools:.3f} | {gains_over_trained[-1]:+.3f} "
            f"| {minutes:.1f}, {untooled_minutes:.1f} |",
            flush=True,
        )
    print(f"smallest gain over the model without tools: {min(gains):+.3f} (the bar: +0.25)")
    print(f"smallest gain over the same GRPO run without tools: {min(gains_over_trained):+.3f}")


if __name__ == "__main__":
    main()
