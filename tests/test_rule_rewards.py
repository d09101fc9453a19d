"""The built-in rule rewards: math_accuracy on all of GSM8K's test solutions, and the layout,
length and repetition rewards by hand."""

from __future__ import annotations

import json
import re

import pytest

from grpo_cli.config import ConfigError
from grpo_cli.rewards import format_reward, length_penalty, math_accuracy, overlong_penalty, repetition_penalty
from grpo_cli.rewards.api import RewardScorer
from shared_data import shared_file


def gsm8k_test_rows() -> list[dict]:
    test_split = shared_file("gsm8k/test.jsonl", "GSM8K's test split")
    return [json.loads(line) for line in test_split.read_text().splitlines() if line.strip()]


def test_every_gsm8k_reference_solution_scores_1_against_its_own_answer():
    rows = gsm8k_test_rows()
    solutions = [row["answer"] for row in rows]
    scores = math_accuracy([row["question"] for row in rows], solutions, answer=solutions)
    assert len(rows) == 1319
    failed = [row["answer"][-80:] for row, score in zip(rows, scores) if score != 1.0]
    assert not failed, f"{len(failed)} solutions not recognized, e.g. {failed[:3]}"


def test_changing_the_final_number_of_each_gsm8k_solution_scores_0():
    rows = gsm8k_test_rows()
    solutions = [row["answer"] for row in rows]
    # "#### 18" -> "#### 19": the completion's final answer is now wrong.
    changed = [
        re.sub(r"####\s*(-?[\d,]*\d)\s*$", lambda m: f"#### {int(m.group(1).replace(',', '')) + 1}", text)
        for text in solutions
    ]
    assert all(new != old for new, old in zip(changed, solutions))
    scores = math_accuracy([row["question"] for row in rows], changed, answer=solutions)
    assert scores == [0.0] * len(rows)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>2 + 2 is 4</think><answer>4</answer>", 0.5),
        ("  <think>\nline one\nline two\n</think>\n\n<answer> 4 </answer>\n", 0.5),
        ("<answer>4</answer>", 0.0),  # no think block
        ("<answer>4</answer><think>x</think>", 0.0),  # wrong order
        ("<think>x</think><answer>4</answer> and more", 0.0),  # text after the layout
        ("4", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward_default_layout(completion, expected):
    assert format_reward([""], [completion]) == [expected]


def test_format_reward_custom_tags_bonus_and_pattern():
    assert format_reward(
        ["", ""],
        ["<reasoning>a</reasoning><final>b</final>", "<final>b</final>"],
        tags=["reasoning", "final"],
        bonus=1.0,
    ) == [1.0, 0.0]
    assert format_reward(["", ""], ["Answer: 42", "answer 42"], pattern=r"Answer: \d+") == [0.5, 0.0]


def test_length_penalty_counts_tokens_beyond_the_target_and_is_never_positive():
    # target 4, coef 0.1: lengths 2, 4, 6, 14 -> 0, 0, -0.2, -1.0
    scores = length_penalty([""] * 4, ["a"] * 4, completion_length=[2, 4, 6, 14], target=4, coef=0.1)
    assert scores == pytest.approx([0.0, 0.0, -0.2, -1.0])
    # Without token counts, whitespace words: "a b c d e f" is 6 words -> -0.2
    assert length_penalty([""], ["a b c d e f"], target=4, coef=0.1) == pytest.approx([-0.2])
    assert length_penalty([""], ["word " * 1000]) == pytest.approx([-0.001 * (1000 - 256)])


def dapo_overlong(length: int, max_length: int, cache: int) -> float:
    """DAPO eq. 13, transcribed: 0 | ((L_max - L_cache) - |y|) / L_cache | -1."""
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return ((max_length - cache) - length) / cache
    return -1.0


def test_overlong_penalty_is_dapos_soft_punishment_by_hand_and_at_every_length():
    # L = 100, C = 20: 80 tokens -> 0, 81 -> -0.05, 90 -> -0.5, 100 (truncated) -> -1
    scores = overlong_penalty(
        [""] * 5, ["a"] * 5, completion_length=[10, 80, 81, 90, 100], max_new_tokens=100, buffer=20
    )
    assert scores == pytest.approx([0.0, 0.0, -0.05, -0.5, -1.0])
    lengths = list(range(1, 131))
    for buffer in (1, 7, 20, 100):
        ours = overlong_penalty([""] * 130, ["a"] * 130, completion_length=lengths, max_new_tokens=100, buffer=buffer)
        assert ours == pytest.approx([dapo_overlong(n, 100, buffer) for n in lengths])
    # the default buffer is a fifth of max_new_tokens; coef scales it
    assert overlong_penalty([""], ["a"], completion_length=[90], max_new_tokens=100, coef=0.5) == pytest.approx([-0.25])


def test_overlong_penalty_equals_trls_soft_overlong_punishment():
    rewards = pytest.importorskip("trl.rewards")
    theirs = rewards.get_soft_overlong_punishment(max_completion_len=64, soft_punish_cache=16)
    lengths = list(range(1, 80))
    expected = theirs(completion_ids=[[1] * n for n in lengths])
    ours = overlong_penalty(
        [""] * len(lengths), ["a"] * len(lengths), completion_length=lengths, max_new_tokens=64, buffer=16
    )
    assert ours == pytest.approx(expected)


def test_the_trainer_gives_overlong_penalty_max_new_tokens_and_refuses_a_bad_buffer():
    entries = [{"_target_": "grpo_cli.rewards.overlong_penalty", "buffer": 4}]
    scorer = RewardScorer(entries, max_new_tokens=16)
    rewards = scorer.score_texts([""] * 2, ["a", "b"], {"completion_length": [12, 16]}, (1, 2))
    assert rewards.total.flatten().tolist() == pytest.approx([0.0, -1.0])
    with pytest.raises(
        ConfigError,
        match=r"reward.functions\[0\] \(overlong_penalty\): .*buffer=40 must be between 1 and max_new_tokens=16",
    ):
        RewardScorer([{"_target_": "grpo_cli.rewards.overlong_penalty", "buffer": 40}], max_new_tokens=16)


def test_repetition_penalty_by_hand():
    # ngram 2: "a b a b a b" -> ab ba ab ba ab: 5 n-grams, 2 distinct, 3 repeats -> -0.6
    # "the cat sat on the mat" -> 5 distinct bigrams -> 0; "hi" is shorter than 2 words -> 0
    scores = repetition_penalty([""] * 3, ["a b a b a b", "the cat sat on the mat", "hi"], ngram=2)
    assert scores == pytest.approx([-0.6, 0.0, 0.0])
    # default trigrams, coef 2: "x y z x y z" -> xyz yzx zxy xyz: 4, 3 distinct -> -2 * 0.25
    assert repetition_penalty([""], ["x y z x y z"], coef=2.0) == pytest.approx([-0.5])


def test_rule_rewards_never_raise_on_odd_completions():
    odd = ["", " ", "\x00", "<think>" * 1000, "🙂" * 50]
    for reward in (format_reward, length_penalty, repetition_penalty, math_accuracy):
        scores = reward([""] * len(odd), odd, answer=["1"] * len(odd))
        assert len(scores) == len(odd)
