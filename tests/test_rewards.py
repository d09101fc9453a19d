"""Stage 3, rewards: the built-in answer checkers and the scorer that calls user functions safely.

Expected values are worked out by hand in the comments; nothing here downloads anything.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hydra.utils import get_method
from omegaconf import OmegaConf

from grpo_cli.config import ConfigError
from grpo_cli.records import Rewards
from grpo_cli.rewards import exact_match, math_accuracy
from grpo_cli.rewards.api import RewardError, RewardScorer, build_reward_functions, call_reward
from grpo_cli.rewards.math import extract_final_answer, reference_value
from shared_data import shared_file

# The helper reward functions below are named by `_target_` as "<this module>.<function>": pytest
# puts the tests folder on sys.path and registers this module under `__name__`, so hydra's
# get_method imports them like a user's own reward module.


def target(fn) -> str:
    return f"{__name__}.{fn.__name__}"


def score(fn, completions, answers):
    return fn([""] * len(completions), completions, answers)


# ---------------------------------------------------------------- helper reward functions

SEEN_COLUMNS: list[set[str]] = []


def always_raises(prompts, completions, **columns):
    raise RuntimeError("boom")


def wrong_length(prompts, completions, **columns):
    return [1.0]  # one value, whatever the number of completions


def returns_nan(prompts, completions, **columns):
    values = [1.0] * len(completions)
    values[1] = math.nan
    return values


def returns_inf(prompts, completions, **columns):
    return [math.inf] * len(completions)


def returns_bools(prompts, completions, **columns):
    return [True] * len(completions)


def returns_numpy_scalars(prompts, completions, **columns):
    return list(np.ones(len(completions), dtype=np.float32))


def none_for_odd(prompts, completions, **columns):
    # Items 0 and 2 get 1.0, items 1 and 3 get "no opinion".
    return [None if index % 2 else 1.0 for index in range(len(completions))]


def scaled_length(prompts, completions, factor=1.0, offset=0.0):
    return [factor * len(completion) + offset for completion in completions]


def answer_only(prompts, completions, answer):
    # No **kwargs: passing it any other column would raise TypeError.
    return [float(str(a) in c) for c, a in zip(completions, answer)]


def records_columns(prompts, completions, **columns):
    SEEN_COLUMNS.append(set(columns))
    return [0.0] * len(completions)


def constant(prompts, completions, value=1.0, **columns):
    return [value] * len(completions)


# ---------------------------------------------------------------- exact_match


def test_exact_match_ignores_surrounding_space_case_and_final_period():
    completions = [" 7", "7", "7.", "  Seven. ", "7\n", "The answer is 7"]
    answers = ["7", " 7 ", "7", "seven", "7", "7"]
    # Only the last one differs after strip / lower / rstrip(".") / collapsing spaces.
    assert score(exact_match, completions, answers) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_exact_match_wrong_answers_score_zero():
    assert score(exact_match, ["8", "17", "", "77"], ["7", "7", "7", "7"]) == [0.0, 0.0, 0.0, 0.0]


def test_exact_match_compares_inner_whitespace_collapsed():
    assert score(exact_match, ["New   York"], ["new york"]) == [1.0]


def test_exact_match_accepts_non_string_answers():
    assert score(exact_match, ["7", "8"], [7, 7]) == [1.0, 0.0]


# ---------------------------------------------------------------- reference_value


def test_reference_value_takes_the_gsm8k_tail_or_the_bare_value():
    assert reference_value("Step one.\nStep <<2*3=6>>6.\n#### 72") == "72"
    assert reference_value("a #### b #### 9 ") == "9"  # the last ####
    assert reference_value(" 7 ") == "7"
    assert reference_value(42) == "42"


# ---------------------------------------------------------------- extract_final_answer


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Some work.\n#### 42", "42"),
        ("#### 72\nThat is all.", "72"),  # only the line after ####
        (r"So \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),  # nested braces kept whole
        (r"First \boxed{3}, no wait \boxed{4}", "4"),  # the last box
        ("The answer is 1,234.", "1,234."),
        ("so the final answer is 5", "5"),
        ("Answer: $18", "$18"),
        ("She has 3 apples and 5 pears, 12 fruits", "12"),  # last number
        ("There is no number here", None),
        ("", None),
        ("####", None),
        (r"\boxed{3", "3"),  # unclosed box: falls back to the last number
    ],
)
def test_extract_final_answer(completion, expected):
    assert extract_final_answer(completion) == expected


# ---------------------------------------------------------------- math_accuracy


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("6 * 7 = 42\n#### 42", "42"),
        (r"The result is \boxed{\frac{1}{2}}", "0.5"),  # math-verify: 1/2 == 0.5
        (r"The result is \boxed{0.5}", r"\frac{1}{2}"),
        ("The answer is 1,234.", "1234"),  # thousands separator and period ignored
        ("Answer: $18", "18"),  # dollar sign ignored
        ("Answer: 18 dollars", "18"),  # a unit word ignored
        ("First 3, then 4, so 12", "12"),  # last-number fallback
        ("The answer is 3/4", "0.75"),
        ("#### -5", "-5"),
        ("The answer is 42", 42),  # a non-string answer
    ],
)
def test_math_accuracy_right_answers_score_one(completion, answer):
    assert score(math_accuracy, [completion], [answer]) == [1.0]


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("#### 41", "42"),
        (r"\boxed{\frac{1}{3}}", "0.5"),
        ("The answer is 1,235.", "1234"),
        ("The answer is 12, not 5", "5"),  # phrase wins over the last number: "12, not 5" is not 5
        ("First 12, then 3", "12"),  # last number is 3
        ("no number at all", "3"),
        ("", "3"),
    ],
)
def test_math_accuracy_wrong_or_missing_answers_score_zero(completion, answer):
    assert score(math_accuracy, [completion], [answer]) == [0.0]


def test_math_accuracy_with_a_whole_gsm8k_solution_as_the_answer():
    with shared_file("gsm8k/train.jsonl", "GSM8K's train split").open(encoding="utf-8") as handle:
        row = json.loads(handle.readline())
    solution = row["answer"]
    gold = solution.rsplit("####", 1)[1].strip()  # by hand: the text after the last ####
    assert gold and gold == reference_value(solution)
    wrong = str(int(gold.replace(",", "")) + 1)
    completions = [
        f"Let me think step by step. The total is {gold}.",
        f"Working it out...\n#### {gold}",
        f"The answer is {wrong}.",
    ]
    assert score(math_accuracy, completions, [solution] * 3) == [1.0, 1.0, 0.0]


GARBAGE = [
    "",
    " ",
    "\n\n",
    "####",
    "#### ",
    r"\boxed{}",
    r"\boxed{",
    r"\boxed{\frac{1}{0}}",
    "}}}{{{",
    "$$$",
    "$",
    "The answer is",
    "Answer:",
    "Answer: ((((",
    "The answer is $",
    "1/0",
    "-",
    ",,,",
    "nan",
    "inf",
    "1e999",
    "9" * 400,
    "\x00\xff\u2603",
    r"\frac{",
    r"\sqrt{-}",
]


@pytest.mark.parametrize("completion", GARBAGE)
def test_garbage_never_raises_and_scores_zero(completion):
    assert score(math_accuracy, [completion], ["5"]) == [0.0]
    assert score(exact_match, [completion], ["5"]) == [0.0]
    extract_final_answer(completion)  # must not raise


def test_garbage_answers_do_not_raise():
    assert score(math_accuracy, ["5", "5", "5"], ["", "####", r"\boxed{"]) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- building reward functions


def test_helper_targets_are_importable_by_hydra():
    assert get_method(target(always_raises)) is always_raises


def test_build_reward_functions_names_weights_and_columns():
    functions = build_reward_functions(
        [
            {"_target_": "grpo_cli.rewards.exact_match", "weight": 1.0},
            {"_target_": target(answer_only), "weight": 0.25, "name": "contains"},
            {"_target_": target(scaled_length)},  # weight defaults to 1.0
        ]
    )
    assert [f.name for f in functions] == ["exact_match", "contains", "scaled_length"]
    assert [f.weight for f in functions] == [1.0, 0.25, 1.0]
    assert [f.accepts_any_column for f in functions] == [True, False, False]
    assert "answer" in functions[1].column_names


def test_build_reward_functions_accepts_omegaconf_entries():
    entries = OmegaConf.create([{"_target_": "grpo_cli.rewards.exact_match", "weight": 2}])
    (function,) = build_reward_functions(entries)
    assert function.name == "exact_match" and function.weight == 2.0


def test_same_name_twice_gets_distinct_names():
    functions = build_reward_functions(
        [{"_target_": "grpo_cli.rewards.exact_match"}, {"_target_": "grpo_cli.rewards.exact_match"}]
    )
    names = [f.name for f in functions]
    assert len(set(names)) == 2 and names[0] == "exact_match"


def test_renamed_duplicate_never_collides_with_an_explicit_name():
    functions = build_reward_functions(
        [
            {"_target_": "grpo_cli.rewards.exact_match"},
            {"_target_": "grpo_cli.rewards.math_accuracy", "name": "exact_match_2"},
            {"_target_": "grpo_cli.rewards.exact_match"},  # renamed to exact_match_2 too
        ]
    )
    names = [f.name for f in functions]
    assert len(set(names)) == 3


@pytest.mark.parametrize("index", [0, 1])
def test_unimportable_target_raises_config_error_naming_the_entry(index):
    entries = [{"_target_": "grpo_cli.rewards.exact_match"}] * index + [
        {"_target_": "no_such_module_for_grpo_tests.reward", "weight": 1.0}
    ]
    with pytest.raises(ConfigError) as info:
        build_reward_functions(entries)
    message = str(info.value)
    assert f"reward.functions[{index}]" in message
    assert "no_such_module_for_grpo_tests.reward" in message


def test_missing_function_in_existing_module_raises_config_error():
    with pytest.raises(ConfigError, match=r"reward\.functions\[0\]"):
        build_reward_functions([{"_target_": "grpo_cli.rewards.no_such_function"}])


# ---------------------------------------------------------------- call_reward


def _single(fn, **arguments):
    (function,) = build_reward_functions([{"_target_": target(fn), **arguments}])
    return function


def test_call_reward_success_gives_floats_and_no_error():
    function = _single(scaled_length, factor=2)
    values, failures, error = call_reward(function, ["p", "p"], ["ab", "abcd"], {"answer": ["1", "2"]})
    assert error is None and failures == 0
    assert values == [4.0, 8.0] and all(isinstance(v, float) for v in values)


@pytest.mark.parametrize(
    "fn, why, values",
    [
        (always_raises, "raised RuntimeError: boom", [None, None, None]),
        (wrong_length, "returned 1 values for 3 completions", [None, None, None]),
        (returns_nan, "nan", [1.0, None, 1.0]),  # only the NaN value is lost
        (returns_inf, "inf", [None, None, None]),
        (returns_bools, "True", [None, None, None]),
    ],
)
def test_call_reward_failures_give_none_and_a_reason(fn, why, values):
    result = call_reward(_single(fn), ["p"] * 3, ["a", "b", "c"], {"answer": ["1"] * 3})
    assert result.values == values and result.failures == values.count(None)
    assert result.error is not None and why in result.error


def raises_on_marked(prompts, completions, answer, **_):
    if any("!" in text for text in completions):
        raise ValueError(f"cannot parse {completions}")
    return [float(len(text)) for text in completions]


def test_a_function_that_raises_on_one_completion_loses_only_that_score():
    # The batch call raises because of "b!"; called one by one, only "b!" fails.
    result = call_reward(_single(raises_on_marked), ["p"] * 3, ["a", "b!", "ccc"], {"answer": ["1"] * 3})
    assert result.values == [1.0, None, 3.0] and result.failures == 1
    assert "ValueError" in result.error and "b!" in result.error


def test_call_reward_accepts_numpy_scalars():
    values, failures, error = call_reward(_single(returns_numpy_scalars), ["p"], ["a"], {"answer": ["1"]})
    assert error is None and failures == 0 and values == [1.0]


# ---------------------------------------------------------------- RewardScorer

PROMPTS = ["q1", "q1", "q2", "q2"]  # B=2 prompts, G=2 completions each, row-major
SHAPE = (2, 2)


def test_score_texts_single_function_shape_and_values():
    scorer = RewardScorer([{"_target_": "grpo_cli.rewards.exact_match", "weight": 1.0}])
    rewards = scorer.score_texts(PROMPTS, [" 7", "8", "3.", "three"], {"answer": ["7", "7", "3", "3"]}, SHAPE)
    assert isinstance(rewards, Rewards)
    assert scorer.names == ["exact_match"]
    assert rewards.total.shape == SHAPE
    assert torch.equal(rewards.total, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    assert set(rewards.per_function) == {"exact_match"}
    assert torch.equal(rewards.per_function["exact_match"], torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    assert rewards.errors == {}


def test_score_texts_combines_weights():
    scorer = RewardScorer(
        [
            {"_target_": "grpo_cli.rewards.exact_match", "weight": 1.0},
            {"_target_": "grpo_cli.rewards.math_accuracy", "weight": 0.5},
        ]
    )
    completions = ["7", "The answer is 7.", "8", "seven"]
    # exact_match:   1, 0, 0, 0   (only the bare "7" matches)
    # math_accuracy: 1, 1, 0, 0   ("seven" has no number)
    # total = 1*em + 0.5*ma = 1.5, 0.5, 0, 0
    rewards = scorer.score_texts(PROMPTS, completions, {"answer": ["7"] * 4}, SHAPE)
    assert torch.allclose(rewards.total, torch.tensor([[1.5, 0.5], [0.0, 0.0]]))
    assert torch.equal(rewards.per_function["exact_match"], torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(rewards.per_function["math_accuracy"], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_negative_weights_subtract():
    scorer = RewardScorer(
        [
            {"_target_": target(constant), "value": 2.0, "weight": 1.0, "name": "plus"},
            {"_target_": target(constant), "value": 0.5, "weight": -3.0, "name": "minus"},
        ]
    )
    rewards = scorer.score_texts(PROMPTS, ["a"] * 4, {"answer": ["x"] * 4}, SHAPE)
    assert torch.allclose(rewards.total, torch.full(SHAPE, 2.0 - 1.5))  # 2*1 + 0.5*(-3)


def test_failing_functions_never_stop_the_run():
    scorer = RewardScorer(
        [
            {"_target_": "grpo_cli.rewards.exact_match", "weight": 1.0},
            {"_target_": target(always_raises), "weight": 1.0},
            {"_target_": target(wrong_length), "weight": 1.0},
            {"_target_": target(returns_nan), "weight": 1.0},
        ]
    )
    rewards = scorer.score_texts(PROMPTS, ["7", "8", "7", "7"], {"answer": ["7"] * 4}, SHAPE)
    # exact_match: 1, 0, 1, 1; returns_nan: 1, lost, 1, 1; the other two lose everything (0).
    assert torch.equal(rewards.total, torch.tensor([[2.0, 0.0], [2.0, 2.0]]))
    assert set(rewards.errors) == {"always_raises", "wrong_length", "returns_nan"}
    assert "RuntimeError" in rewards.errors["always_raises"] and "boom" in rewards.errors["always_raises"]
    assert "1 values for 4 completions" in rewards.errors["wrong_length"]
    assert "nan" in rewards.errors["returns_nan"]
    assert rewards.error_counts == {"exact_match": 0, "always_raises": 4, "wrong_length": 4, "returns_nan": 1}
    for name in ("always_raises", "wrong_length"):
        values = rewards.per_function[name]
        assert values.shape == SHAPE and torch.isnan(values).all()  # nothing could be scored
    assert torch.isnan(rewards.per_function["returns_nan"]).sum() == 1
    assert not torch.isnan(rewards.total).any()


def test_a_function_failing_on_more_than_max_error_fraction_stops_the_run_naming_it():
    # returns_nan loses 1 of 4 scores (0.25): allowed at 0.5; always_raises loses 4 of 4: stops.
    lenient = RewardScorer([{"_target_": target(returns_nan)}], max_error_fraction=0.5)
    assert lenient.score_texts(PROMPTS, ["a"] * 4, {"answer": ["x"] * 4}, SHAPE).error_counts == {"returns_nan": 1}
    strict = RewardScorer([{"_target_": target(returns_nan)}], max_error_fraction=0.2)
    with pytest.raises(RewardError, match=r"returns_nan failed on 1 of 4 completions.*max_error_fraction=0.2"):
        strict.score_texts(PROMPTS, ["a"] * 4, {"answer": ["x"] * 4}, SHAPE)
    scorer = RewardScorer(
        [{"_target_": "grpo_cli.rewards.exact_match"}, {"_target_": target(always_raises)}], max_error_fraction=0.5
    )
    with pytest.raises(RewardError) as caught:
        scorer.score_texts(PROMPTS, ["a"] * 4, {"answer": ["x"] * 4}, SHAPE)
    message = str(caught.value)
    assert "always_raises failed on 4 of 4" in message and "RuntimeError: boom" in message
    assert isinstance(caught.value, ConfigError)  # the CLI prints it and exits 2, no traceback


def test_none_items_are_nan_per_function_and_add_nothing():
    scorer = RewardScorer(
        [
            {"_target_": target(none_for_odd), "weight": 2.0},
            {"_target_": target(constant), "value": 0.25, "weight": 1.0},
        ]
    )
    rewards = scorer.score_texts(PROMPTS, ["a", "b", "c", "d"], {"answer": ["x"] * 4}, SHAPE)
    per = rewards.per_function["none_for_odd"]
    assert per[0, 0] == 1.0 and per[1, 0] == 1.0
    assert torch.isnan(per[0, 1]) and torch.isnan(per[1, 1])
    # items 0, 2: 2*1 + 0.25 = 2.25; items 1, 3: 0 + 0.25
    assert torch.allclose(rewards.total, torch.tensor([[2.25, 0.25], [2.25, 0.25]]))
    assert rewards.errors == {}


def test_extra_keyword_arguments_reach_the_function():
    scorer = RewardScorer([{"_target_": target(scaled_length), "weight": 1.0, "factor": 0.5, "offset": -1}])
    rewards = scorer.score_texts(PROMPTS, ["", "ab", "abcd", "abcdef"], {"answer": ["x"] * 4}, SHAPE)
    # 0.5 * len - 1 for lengths 0, 2, 4, 6
    assert torch.allclose(rewards.total, torch.tensor([[-1.0, 0.0], [1.0, 2.0]]))
    assert rewards.errors == {}


def test_function_gets_only_the_columns_it_declares():
    columns = {"answer": ["7", "7", "3", "3"], "difficulty": [1, 1, 2, 2], "source": ["a"] * 4}
    scorer = RewardScorer(
        [
            {"_target_": target(answer_only), "weight": 1.0},  # would raise on `difficulty=`
            {"_target_": target(scaled_length), "weight": 0.0},  # declares no column at all
        ]
    )
    rewards = scorer.score_texts(PROMPTS, ["7", "x", "3", "13"], columns, SHAPE)
    assert rewards.errors == {}
    assert torch.equal(rewards.per_function["answer_only"], torch.tensor([[1.0, 0.0], [1.0, 1.0]]))


def test_function_with_var_keywords_gets_every_column():
    SEEN_COLUMNS.clear()
    columns = {"answer": ["7"] * 4, "difficulty": [1] * 4, "source": ["a"] * 4}
    scorer = RewardScorer([{"_target_": target(records_columns), "weight": 1.0}])
    rewards = scorer.score_texts(PROMPTS, ["a"] * 4, columns, SHAPE)
    assert rewards.errors == {}
    assert SEEN_COLUMNS == [{"answer", "difficulty", "source"}]


def test_duplicate_functions_are_scored_separately():
    scorer = RewardScorer(
        [
            {"_target_": target(constant), "value": 1.0, "weight": 1.0},
            {"_target_": target(constant), "value": 3.0, "weight": 1.0},
        ]
    )
    rewards = scorer.score_texts(PROMPTS, ["a"] * 4, {"answer": ["x"] * 4}, SHAPE)
    assert len(rewards.per_function) == 2 and len(set(scorer.names)) == 2
    assert sorted(float(v[0, 0]) for v in rewards.per_function.values()) == [1.0, 3.0]
    assert torch.allclose(rewards.total, torch.full(SHAPE, 4.0))


def reports_workers(prompts, completions, workers=1, **_):
    return [float(workers)] * len(completions)


def test_reward_workers_reach_functions_that_take_them_unless_the_entry_sets_its_own():
    shared = {"workers": 6}
    (given,) = build_reward_functions([{"_target_": target(reports_workers)}], shared=shared)
    (own,) = build_reward_functions([{"_target_": target(reports_workers), "workers": 2}], shared=shared)
    (plain,) = build_reward_functions([{"_target_": "grpo_cli.rewards.exact_match"}], shared=shared)
    assert given.fn([""], ["a"]) == [6.0] and own.fn([""], ["a"]) == [2.0]
    assert plain.fn([""], ["7"], answer=["7"]) == [1.0]  # exact_match takes no `workers`: not passed
