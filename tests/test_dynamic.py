"""Dynamic sampling (trainer.filter_zero_std): every step trains on prompts_per_step groups whose
rewards differ, drawing more prompts when needed; by hand on fake rollouts, then a real run."""

from __future__ import annotations

import json
import zlib

import torch

from grpo_cli.logs import read_metrics
from grpo_cli.pipeline import run
from grpo_cli.records import Rewards, Rollout
from grpo_cli.safety.dynamic import fill_informative_groups
from helpers import config

GROUP = 2


def fake_round(tag: str, group_rewards: list[list[float]], prompt_length: int) -> tuple[Rollout, Rewards]:
    """B groups of G = 2 with the given rewards; prompt ids all `prompt_length` long."""
    groups = len(group_rewards)
    rows = groups * GROUP
    rollout = Rollout(
        prompt_ids=torch.full((rows, prompt_length), 7),
        prompt_mask=torch.ones(rows, prompt_length, dtype=torch.long),
        completion_ids=torch.full((rows, 3), 5),
        completion_mask=torch.ones(rows, 3, dtype=torch.long),
        truncated=torch.zeros(rows, dtype=torch.bool),
        prompts=[f"{tag}{row // GROUP}" for row in range(rows)],
        completions=[f"{tag}{row // GROUP}-{row % GROUP}" for row in range(rows)],
        columns={"answer": [f"{tag}{row // GROUP}" for row in range(rows)]},
        group_size=GROUP,
    )
    total = torch.tensor(group_rewards, dtype=torch.float32)
    return rollout, Rewards(total=total, per_function={"f": total.clone()})


def test_uninformative_groups_are_replaced_by_groups_from_more_rounds():
    # Round 0: groups a0 (1, 1) and a2 (0, 0) are all-equal, a1 (1, 0) is informative.
    # Round 1: b0 (0, 1) informative, b1 (1, 1) not. Round 2: c0 and c1 informative, only c0
    # is needed. Target 3: a1, b0, c0 after 2 extra rounds; 3 + 2 + 2 = 7 groups sampled.
    first = fake_round("a", [[1, 1], [1, 0], [0, 0]], prompt_length=4)
    more = iter(
        [fake_round("b", [[0, 1], [1, 1]], prompt_length=6), fake_round("c", [[0, 2], [3, 1]], prompt_length=2)]
    )
    filled = fill_informative_groups(
        *first, sample_round=lambda: next(more), target=3, max_rounds=5, std_threshold=1e-4
    )
    assert filled.extra_rounds == 2 and filled.informative_groups == 3 and filled.sampled_groups == 7
    assert filled.rollout.prompts == ["a1", "a1", "b0", "b0", "c0", "c0"]
    assert filled.rollout.columns["answer"] == ["a1", "a1", "b0", "b0", "c0", "c0"]
    assert filled.rewards.total.tolist() == [[1, 0], [0, 1], [0, 2]]
    assert filled.rewards.per_function["f"].tolist() == [[1, 0], [0, 1], [0, 2]]
    # Prompts of 4, 6 and 2 tokens are left-padded to 6 with mask 0.
    assert filled.rollout.prompt_ids.shape == (6, 6)
    assert filled.rollout.prompt_mask.sum(dim=1).tolist() == [4, 4, 6, 6, 2, 2]
    assert filled.rollout.prompt_mask[0].tolist() == [0, 0, 1, 1, 1, 1]


def test_no_extra_round_when_the_first_draw_is_informative_enough():
    first = fake_round("a", [[1, 0], [0, 1]], prompt_length=3)
    filled = fill_informative_groups(*first, sample_round=lambda: 1 / 0, target=2, max_rounds=3, std_threshold=1e-4)
    assert filled.extra_rounds == 0 and filled.rollout.prompt_ids.shape == (4, 3)


def test_after_the_round_cap_the_step_is_topped_up_with_uninformative_groups():
    # Every round has 1 informative group of 2; with 1 extra round allowed only 2 of 3 are found,
    # and the step is topped up with the first all-equal group (A = 0) to keep 3 groups.
    rounds = iter([fake_round("b", [[5, 5], [0, 1]], prompt_length=2)])
    first = fake_round("a", [[1, 1], [1, 0]], prompt_length=2)
    filled = fill_informative_groups(
        *first, sample_round=lambda: next(rounds), target=3, max_rounds=1, std_threshold=1e-4
    )
    assert filled.extra_rounds == 1 and filled.informative_groups == 2
    assert filled.rollout.prompts[::GROUP] == ["a1", "b1", "a0"]
    assert filled.rewards.total.tolist() == [[1, 0], [0, 1], [1, 1]]


def easy_or_coin(prompts, completions, easy, **_):
    """1 for every completion of an easy prompt (a group with no signal), else a coin flip
    decided by the completion's text, so hard prompts' groups usually differ."""
    return [1.0 if is_easy else float(zlib.crc32(text.encode()) % 2) for text, is_easy in zip(completions, easy)]


def test_every_step_trains_on_the_configured_number_of_informative_groups(tmp_path, tiny_model_dir):
    # Half of the prompts are all-correct whatever the model says; the step must still see
    # prompts_per_step = 4 informative groups every time.
    data = tmp_path / "half_easy.jsonl"
    with data.open("w") as out:
        for index in range(32):
            a, b = index % 10, (index * 7) % 10
            out.write(
                json.dumps(
                    {"prompt": f"Question: what is {a} + {b}? Answer:", "answer": str(a + b), "easy": index % 2 == 0}
                )
                + "\n"
            )
    cfg = config(
        tiny_model_dir,
        f"data.path={data}",
        "data.prompts_per_step=4",
        "trainer.steps=4",
        "trainer.filter_zero_std=true",
        "trainer.max_resample_rounds=8",
        "trainer.checkpoint_every=0",
        "trainer.log_every=1",
        f"trainer.output_dir={tmp_path / 'run'}",
        "optimizer.lr=1e-4",
    )
    cfg.reward.functions = [{"_target_": f"{__name__}.easy_or_coin", "weight": 1.0}]
    run(cfg)
    rows = [row for row in read_metrics(tmp_path / "run") if row["step"] > 0]
    assert len(rows) == 4
    for row in rows:
        assert row["sampling/informative_groups"] == 4
        assert row["advantage/zero_std_fraction"] == 0.0
        assert row["sampling/sampled_groups"] >= 8  # half the prompts are easy: more rounds were needed
    assert any(row["sampling/extra_rounds"] > 0 for row in rows)
