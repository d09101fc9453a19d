"""conf=smollm2_arithmetic: the task's rows and held-out split, the reward as the preset composes
it, model.autocast=auto on either kind of CPU, and (slow) the preset on the real model."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from hydra import compose, initialize_config_dir

from grpo_cli.cli import config_dir
from grpo_cli.data.tasks import SYNTHETIC_TASKS, arithmetic_rows
from grpo_cli.logs import read_metrics
from grpo_cli.models import loading
from grpo_cli.models.loading import load_models, resolve_autocast
from grpo_cli.rewards.api import RewardScorer
from helpers import config, grpo_train

PROBLEM = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


def preset(*overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=["conf=smollm2_arithmetic", *overrides])


@pytest.mark.parametrize(
    "task,problems",
    [
        ("plus-minus-one", 998 + 998),  # N + 1 and N - 1 for N in 2..999
        ("small-mixed", 196 + 105 + 196),  # + and * on every pair of 2..15, - where a >= b (14 * 15 / 2)
    ],
)
def test_a_task_holds_out_45_percent_of_its_problems_and_never_trains_on_them(task, problems):
    train, held_out = arithmetic_rows(task, "train"), arithmetic_rows(task, "eval")
    assert len(train) + len(held_out) == problems and len(held_out) == round(0.45 * problems)
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in held_out}
    assert arithmetic_rows(task, "eval") == held_out  # the same split every time
    for row in train + held_out:
        a, op, b = PROBLEM.fullmatch(row["prompt"]).groups()
        assert row["answer"] == str(eval(f"{a} {op} {b}")) and int(row["answer"]) >= 0


def test_the_builtin_task_trains_on_the_train_split_and_evaluates_on_the_held_out_one():
    rows, eval_rows = SYNTHETIC_TASKS["plus-minus-one"]
    assert rows() == arithmetic_rows("plus-minus-one", "train")
    assert eval_rows(224, seed=5) == arithmetic_rows("plus-minus-one", "eval")[:224] == eval_rows(224, seed=0)
    assert preset().data.path == "synthetic:plus-minus-one" and preset().data.eval_size >= 200


@functools.cache
def presets_scorer() -> RewardScorer:
    cfg = preset()
    return RewardScorer.from_config(cfg.reward, cfg.trainer.std_eps)


@pytest.mark.parametrize(
    "reply,correct,well_formed,answer_anywhere",
    [
        ("78", 1.0, 1.0, 1.0),
        (" 78.", 1.0, 1.0, 1.0),
        ("13 * 6 = 78", 1.0, 1.0, 1.0),  # the sum written out, then the answer
        ("77", 0.0, 1.0, 0.0),  # well-formed and wrong
        ("13 * 6 = 77", 0.0, 1.0, 0.0),
        ("13 * 6", 0.0, 0.0, 0.0),  # echoing the question's numbers earns nothing
        ("13 6", 0.0, 0.0, 0.0),
        ("78 is close to 80", 0.0, 0.0, 0.0),
        ("13 * 6 = 78\n\nYou're right, 13 * 6 is 78", 0.0, 0.0, 1.0),  # right, but rambling: nothing
        ("", 0.0, 0.0, 0.0),
    ],
)
def test_the_presets_reward_pays_for_the_right_number_alone(reply, correct, well_formed, answer_anywhere):
    scorer = presets_scorer()
    scored = scorer.score_texts(["What is 13 * 6?"], [reply], {"answer": ["78"]}, (1,))
    per_function = {name: values.item() for name, values in scored.per_function.items()}
    assert per_function == {"correct": correct, "well_formed": well_formed, "answer_anywhere": answer_anywhere}
    assert scored.total.item() == correct  # the other two are read in the eval, and weigh nothing


@pytest.mark.parametrize("fast_bfloat16", [True, False])
def test_autocast_auto_is_bfloat16_only_on_a_cpu_with_fast_bfloat16_for_a_large_model(
    monkeypatch, tiny_model_dir, fast_bfloat16
):
    # Forced both ways: CI runs on CPUs with and without avx512_bf16, and without it bfloat16 is
    # emulated (50-100x slower matmuls on an AVX2-only EPYC), so auto must not pick it there.
    # Nor below 10M parameters, where it measured slower (docs/BENCHMARKS.md).
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: fast_bfloat16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    smollm2, tiny = 134_515_008, 627_456
    assert resolve_autocast("auto", "cpu", smollm2) == ("bfloat16" if fast_bfloat16 else "none")
    assert resolve_autocast("auto", "cpu", tiny) == "none"
    assert resolve_autocast("auto", "cuda", smollm2) == "none"  # there model.dtype=auto is bfloat16 already
    assert (
        resolve_autocast("bfloat16", "cpu", tiny) == "bfloat16" and resolve_autocast("none", "cpu", smollm2) == "none"
    )
    assert config(tiny_model_dir).model.autocast == "auto" and preset().model.autocast == "auto"  # the default

    # The tiny model is under the threshold: float32, and the run's first lines say why.
    models = load_models(config(tiny_model_dir).model, beta=0.0, device=torch.device("cpu"))
    assert models.autocast_dtype is None
    reason = "no bfloat16 matmul units" if not fast_bfloat16 else "0.6M parameters, under the 10M"
    assert (
        models.precision.startswith("Precision: float32 weights, forward passes in float32")
        and reason in models.precision
    )
    # The threshold lowered to 0 stands for a large model: bfloat16 where the CPU has the units.
    monkeypatch.setattr(loading, "AUTO_BFLOAT16_MIN_PARAMETERS", 0)
    models = load_models(config(tiny_model_dir).model, beta=0.0, device=torch.device("cpu"))
    assert models.autocast_dtype == (torch.bfloat16 if fast_bfloat16 else None)
    picked = "forward passes in bfloat16 autocast" if fast_bfloat16 else "forward passes in float32"
    assert picked in models.precision, models.precision


@pytest.mark.slow
def test_the_preset_trains_the_real_model_and_its_summary_shows_each_functions_eval(smollm2_dir, tmp_path):
    # The preset as a user runs it, cut to 2 steps and 8 eval problems: the builtin model from
    # the cache (smollm2_dir fetched it), the chat template, the three reward functions.
    run = tmp_path / "run"
    result = grpo_train(
        "conf=smollm2_arithmetic",
        f"hydra.run.dir={run}",
        "trainer.steps=2",
        "trainer.eval_every=2",
        "trainer.checkpoint_every=2",
        "data.eval_size=8",
        "sampler.max_new_tokens=12",
    )
    evals = [row for row in read_metrics(run) if "eval/accuracy" in row]
    assert [row["step"] for row in evals] == [0, 2]
    for row in evals:
        assert row["eval/accuracy"] == row["eval/correct"] <= row["eval/well_formed"] <= 1.0
        assert row["eval/correct"] <= row["eval/answer_anywhere"]  # right and well-formed is right
    for name in ("accuracy", "well_formed", "answer_anywhere"):
        assert f"greedy eval {name}, before -> after" in result.stdout
    assert (run / "checkpoints" / "step-000002").is_dir()
