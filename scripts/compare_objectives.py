"""Train the tiny default once per command line and seed, two runs at a time, and print the
greedy-eval table of docs/ALGORITHM.md ("Measured: the objectives and controls").

    python scripts/compare_objectives.py --out /tmp/objectives                      # the doc's runs
    python scripts/compare_objectives.py --out /tmp/o --seeds 0 --run "algorithm=gspo trainer.num_iterations=2"

Each run is `grpo-train <overrides> trainer.seed=S hydra.run.dir=OUT/<n>` with one math thread
(a step of the tiny model is interpreter overhead more than arithmetic, so two runs on two
cores take about the time of one). "After" is the mean of the greedy evals at steps 500, 600
and 700, the bar of tests/test_learning.py (one eval swings by up to 0.3 on this task).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from grpo_cli.logs import read_metrics  # noqa: E402

MU2 = "trainer.num_iterations=2"
# (label, overrides, seeds): the objectives three seeds each, the controls one.
RUNS = [
    ("clip (the paper), mu = 2", f"algorithm=grpo {MU2}", (0,)),
    ("GSPO, mu = 2", f"algorithm=gspo {MU2}", (0, 1, 2)),
    ("CISPO, mu = 2", f"algorithm=cispo {MU2}", (0, 1, 2)),
    ("SAPO, mu = 2", f"algorithm=sapo {MU2}", (0, 1, 2)),
    ("clip + dual_clip 3, mu = 2", f"trainer.dual_clip=3 {MU2}", (0,)),
    ("REINFORCE++-baseline advantages", "trainer.advantage=reinforce_baseline", (0,)),
    ("entropy bonus 0.001", "trainer.entropy_coef=0.001", (0,)),
    ("top 20% tokens by entropy", "trainer.top_entropy_quantile=0.2", (0,)),
    ("reference refresh every 100 steps", "trainer.ref_sync_steps=100", (0,)),
]


def summary(folder: Path) -> dict[str, float]:
    rows = read_metrics(folder)
    evals = {row["step"]: row["eval/accuracy"] for row in rows if "eval/accuracy" in row}
    return {
        "before": evals[0],
        "after": statistics.mean(evals[step] for step in (500, 600, 700)),
        "at_700": evals[700],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a folder for the runs (replaced)")
    parser.add_argument("--run", action="append", help="overrides of one run (repeatable); default: the doc's list")
    parser.add_argument("--seeds", type=int, nargs="+", help="with --run: the seeds (default 0 1 2)")
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args()
    runs = [(overrides, overrides, tuple(args.seeds or (0, 1, 2))) for overrides in args.run] if args.run else RUNS
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    jobs = [(label, overrides, seed) for label, overrides, seeds in runs for seed in seeds]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    grpo_train = str(Path(sys.executable).parent / "grpo-train")
    results: dict[int, tuple[float, dict[str, float] | str]] = {}
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    pending = list(enumerate(jobs))
    while pending or running:
        while pending and len(running) < args.parallel:
            index, (_, overrides, seed) = pending.pop(0)
            folder = args.out / str(index)
            log = (args.out / f"{index}.log").open("w")
            command = [grpo_train, *overrides.split(), f"trainer.seed={seed}", f"hydra.run.dir={folder}"]
            running[index] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), time.time())
        time.sleep(2)
        for index, (process, started) in list(running.items()):
            if process.poll() is None:
                continue
            del running[index]
            minutes = (time.time() - started) / 60
            folder = args.out / str(index)
            results[index] = (minutes, summary(folder) if process.returncode == 0 else f"exit {process.returncode}")
            print(f"done {jobs[index]}: {results[index]}", flush=True)
    print("\n| run | seed | greedy eval before | after (steps 500-700) | at step 700 | minutes |")
    print("|---|---|---|---|---|---|")
    for index, (label, overrides, seed) in enumerate(jobs):
        minutes, result = results[index]
        if isinstance(result, str):
            print(f"| {label} (`{overrides}`) | {seed} | {result} | | | {minutes:.1f} |")
            continue
        print(
            f"| {label} (`{overrides}`) | {seed} | {result['before']:.3f} | {result['after']:.3f} | "
            f"{result['at_700']:.3f} | {minutes:.1f} |"
        )


if __name__ == "__main__":
    main()
