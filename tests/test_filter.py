"""`grpo-filter`: prompts whose sampled rewards differ are kept, all-equal ones counted as too easy
or too hard, and bad input ends in one message (exit 2).

The data mixes prompts tagged easy (every completion scores 1), hard (every completion scores 0)
and mixed (a score drawn from the completion's text, so any two different completions score
differently). With G = 8 completions of 4 tokens at temperature 1 from the tiny model, a mixed
group whose eight completions are all the same text does not happen (the model's draws are
varied: about as likely as eight equal 4-token strings); so exactly the mixed prompts are kept.
"""

from __future__ import annotations

import csv
import json
import os
import zlib
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grpo_cli.cli import config_dir
from grpo_cli.config import ConfigError
from grpo_cli.tools.prompt_filter import KEPT, TOO_EASY, TOO_HARD, classify, filter_file, output_paths, write_atomically
from helpers import ALTERNATING_REWARD, TESTS_DIR, config, input_error, run_script

ROWS = [  # interleaved, with fields the filter must copy as they are (nested, non-ASCII, numbers)
    {"prompt": "Question: what is 1 + 2? Answer:", "answer": "3", "difficulty": "easy", "id": 1},
    {"prompt": "Question: what is 4 + 4? Answer:", "answer": "8", "difficulty": "hard", "id": 2},
    {
        "prompt": "Question: what is 2 + 5? Answer:",
        "answer": "7",
        "difficulty": "mixed",
        "id": 3,
        "meta": {"source": "hand-written", "tags": ["a", "b"]},
    },
    {"prompt": "Question: what is 9 + 0? Answer:", "answer": "9", "difficulty": "easy", "id": 4},
    {
        "prompt": "Question: what is 3 + 3? Answer:",
        "answer": "6",
        "difficulty": "mixed",
        "id": 5,
        "note": "prix 3 € — ok",
    },
    {"prompt": "Question: what is 7 + 1? Answer:", "answer": "8", "difficulty": "hard", "id": 6},
]
# Records 1..6 in input order; easy and hard groups are all-equal, mixed ones differ.
VERDICTS = [TOO_EASY, TOO_HARD, KEPT, TOO_EASY, KEPT, TOO_HARD]
# 6 prompts, 4 per batch: a full batch and a short last one.
SMALL = ["data.prompts_per_step=4", "sampler.group_size=8", "sampler.max_new_tokens=4", "sampler.temperature=1.0"]


def by_difficulty(prompts, completions, difficulty, **columns):
    """easy -> 1, hard -> 0, mixed -> a number in [0, 1) from the completion's text (crc32: the
    same in every process, unlike hash())."""
    scores = {
        "easy": lambda text: 1.0,
        "hard": lambda text: 0.0,
        "mixed": lambda text: zlib.crc32(text.encode("utf-8")) / 2**32,
    }
    return [scores[tag](text) for tag, text in zip(difficulty, completions)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------- the whole command


def test_keeps_exactly_the_prompts_whose_rewards_differ(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "mixed.jsonl", ROWS)
    out = tmp_path / "filtered" / "kept.jsonl"  # the folder does not exist yet
    result = run_script(
        "grpo-filter",
        f"model.name_or_path={tiny_model_dir}",
        f"data.path={data}",
        f"+out={out}",
        *SMALL,
        "reward.functions=[{_target_: test_filter.by_difficulty, weight: 1.0}]",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env={"PYTHONPATH": TESTS_DIR},
    )

    assert read_jsonl(out) == [ROWS[2], ROWS[4]]  # every field as written, input order
    assert sorted(path.name for path in out.parent.iterdir()) == ["kept.jsonl", "kept.summary.json"]  # no temp files
    summary = json.loads((out.parent / "kept.summary.json").read_text())
    assert summary["counts"] == {"kept": 2, "too_easy": 2, "too_hard": 2, "total": 6}
    assert [prompt["verdict"] for prompt in summary["prompts"]] == VERDICTS
    assert [prompt["record"] for prompt in summary["prompts"]] == [1, 2, 3, 4, 5, 6]
    for prompt, row in zip(summary["prompts"], ROWS):
        assert len(prompt["rewards"]) == 8
        if row["difficulty"] == "mixed":
            assert prompt["reward_std"] >= 1e-4 and 0 <= prompt["reward_mean"] < 1
        else:
            expected = 1.0 if row["difficulty"] == "easy" else 0.0
            assert prompt["rewards"] == [expected] * 8
            assert (prompt["reward_mean"], prompt["reward_std"]) == (expected, 0.0)
    assert (summary["group_size"], summary["std_threshold"], summary["seed"]) == (8, 1e-4, 0)

    # stdout is a pipe here: plain lines. Hand-derived: 2 of 6 = 33.3% each; too easy groups
    # average 1, too hard ones 0.
    printed = result.stdout
    assert "filter: 4/6 prompts" in printed and "filter: 6/6 prompts" in printed  # two batches
    assert "kept: 2 prompts (33.3%)" in printed
    assert "too easy: 2 prompts (33.3%), mean reward 1.000" in printed
    assert "too hard: 2 prompts (33.3%), mean reward 0.000" in printed
    assert "total: 6 prompts (100.0%)" in printed
    assert f"kept prompts: {out} (2 records)" in printed


@pytest.mark.slow  # the real model (fetched once per checkout)
def test_the_real_model_preset_keeps_exactly_the_prompts_whose_rewards_differ(tmp_path, smollm2_dir):
    # conf=smollm2_arithmetic: SmolLM2-135M-Instruct, its chat template and system prompt, G = 8
    # completions of up to 20 tokens at temperature 1. Eight equal replies to a mixed prompt
    # would drop it; the model's replies at this temperature vary (seeded: the same every run).
    data = write_jsonl(tmp_path / "mixed.jsonl", ROWS)
    out = tmp_path / "kept.jsonl"
    result = run_script(
        "grpo-filter",
        "conf=smollm2_arithmetic",
        f"model.name_or_path={smollm2_dir}",
        f"data.path={data}",
        f"+out={out}",
        "reward.functions=[{_target_: test_filter.by_difficulty, weight: 1.0}]",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env={"PYTHONPATH": TESTS_DIR},
    )
    assert read_jsonl(out) == [ROWS[2], ROWS[4]]
    summary = json.loads((tmp_path / "kept.summary.json").read_text())
    assert [prompt["verdict"] for prompt in summary["prompts"]] == VERDICTS
    assert all(len(prompt["rewards"]) == 8 for prompt in summary["prompts"])
    assert "filter: 4/6 prompts" in result.stdout and "kept: 2 prompts (33.3%)" in result.stdout


def filter_in_process(tmp_path: Path, tiny_model_dir: Path, data: Path, out: Path, *overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                f"model.name_or_path={tiny_model_dir}",
                f"data.path={data}",
                f"+out={out}",
                *SMALL,
                f"reward.functions=[{{_target_: {__name__}.by_difficulty, weight: 1.0}}]",
                *overrides,
            ],
        )
    return filter_file(cfg)


def test_same_seed_same_result_and_csv_input(tmp_path, tiny_model_dir):
    data = tmp_path / "mixed.csv"
    fields = ["prompt", "answer", "difficulty", "id"]
    with data.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows({key: row[key] for key in fields} for row in ROWS)

    def mixed_rewards(out: Path) -> list[list[float]]:
        prompts = json.loads(out.with_name(out.stem + ".summary.json").read_text())["prompts"]
        return [prompt["rewards"] for prompt in prompts if prompt["verdict"] == KEPT]

    first = filter_in_process(tmp_path, tiny_model_dir, data, tmp_path / "a.jsonl")
    again = filter_in_process(tmp_path, tiny_model_dir, data, tmp_path / "b.jsonl")
    other_seed = filter_in_process(tmp_path, tiny_model_dir, data, tmp_path / "c.jsonl", "trainer.seed=1")

    assert first.verdicts == again.verdicts == other_seed.verdicts == VERDICTS
    assert mixed_rewards(tmp_path / "a.jsonl") == mixed_rewards(tmp_path / "b.jsonl")
    assert mixed_rewards(tmp_path / "a.jsonl") != mixed_rewards(tmp_path / "c.jsonl")
    # CSV fields are text: the output holds them as read.
    assert read_jsonl(tmp_path / "a.jsonl") == [{key: str(ROWS[i][key]) for key in fields} for i in (2, 4)]


def test_trainer_resume_filters_with_a_training_runs_policy(tmp_path, tiny_model_dir):
    from grpo_cli.pipeline import run

    # The alternating reward gives every group an advantage, so the step moves the model whatever
    # was sampled (with exact_match every completion can be wrong: beta 0, an unchanged model).
    trained = run(
        config(
            tiny_model_dir,
            ALTERNATING_REWARD,
            "trainer.steps=1",
            "data.eval_size=0",
            "trainer.beta=0",
            f"trainer.output_dir={tmp_path / 'run'}",
        )
    )
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["advantage/zero_std_fraction"] == 0.0
    data = write_jsonl(tmp_path / "mixed.jsonl", ROWS)
    base = filter_in_process(tmp_path, tiny_model_dir, data, tmp_path / "base.jsonl")
    latest = filter_in_process(
        tmp_path,
        tiny_model_dir,
        data,
        tmp_path / "latest.jsonl",
        "trainer.resume=true",
        f"trainer.output_dir={tmp_path / 'run'}",
    )

    def summary(result) -> dict:
        return json.loads(result.summary_path.read_text())

    assert summary(base)["checkpoint"] is None
    assert summary(latest)["checkpoint"] == str(trained.last_checkpoint)
    # One step at lr 1e-2 moves the tiny model: the same seed draws other completions, which the
    # mixed prompts' rewards (a hash of each completion's text) show.
    assert any(summary(base)["prompts"][i]["rewards"] != summary(latest)["prompts"][i]["rewards"] for i in (2, 4))


# ---------------------------------------------------------------- bad input, through the CLI


@pytest.mark.parametrize(
    "case,expected",
    [
        ("no out", "out is not set: add +out=OUT.jsonl"),
        # each a grpo-filter process: two of the four in `make test` only
        pytest.param("out is the input", "is the input file data.path=", marks=pytest.mark.slow),
        pytest.param("no data file", "does not exist. Check data.path", marks=pytest.mark.slow),
        ("unknown key", "trainer.bta is not a config key. Did you mean trainer.beta? `grpo-filter --help`"),
    ],
)
def test_bad_input_exits_2_with_one_message(tmp_path, case, expected):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    overrides = {
        "no out": [f"data.path={data}"],
        "out is the input": [f"data.path={data}", f"+out={data}"],
        "no data file": [f"data.path={tmp_path / 'missing.jsonl'}", f"+out={tmp_path / 'out.jsonl'}"],
        "unknown key": [f"data.path={data}", f"+out={tmp_path / 'out.jsonl'}", "trainer.bta=1"],
    }[case]
    assert expected in input_error("grpo-filter", *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------- the parts, in process


def test_classify_splits_all_equal_groups_by_the_best_reward_in_the_file():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    informative = torch.tensor([False, False, True, False])
    # best reward 1: [1, 1] is at the best -> too easy; [0, 0] and [0.5, 0.5] below -> too hard.
    assert classify(rewards, informative, 1e-4) == [TOO_EASY, TOO_HARD, KEPT, TOO_HARD]


@pytest.mark.parametrize("value,expected", [(0.0, TOO_HARD), (-1.0, TOO_HARD), (0.3, TOO_EASY)])
def test_classify_when_every_completion_scored_the_same(value, expected):
    # No "best" to compare with: above 0 counts as too easy, 0 or below as too hard.
    rewards = torch.full((2, 4), value)
    assert classify(rewards, torch.tensor([False, False]), 1e-4) == [expected, expected]


def paths_cfg(data: str, out):
    return OmegaConf.create({"data": {"path": data}, "out": out})


def test_output_paths_names_the_summary_beside_out(tmp_path):
    out, summary = output_paths(paths_cfg("synthetic:addition", str(tmp_path / "kept.jsonl")))
    assert (out, summary) == (tmp_path / "kept.jsonl", tmp_path / "kept.summary.json")


@pytest.mark.parametrize(
    "out,expected",
    [
        ("kept.json", "the name must end in .jsonl (e.g. +out=kept.jsonl)"),
        (".", "is a folder"),
        (["a", "b"], "give one file path"),
        ("kept.jsonl", "out's summary file"),  # its summary, kept.summary.json, is the input
    ],
)
def test_output_paths_rejects_unusable_outs(tmp_path, monkeypatch, out, expected):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="out") as caught:
        output_paths(paths_cfg("kept.summary.json", out))
    assert expected in str(caught.value)


def test_write_atomically_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "out.jsonl"
    write_atomically(target, "old\n")
    write_atomically(target, "new\n")
    assert target.read_text() == "new\n"

    def no_rename(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, "half")
    assert target.read_text() == "new\n"
    assert [path.name for path in tmp_path.iterdir()] == ["out.jsonl"]  # the temp file is gone
