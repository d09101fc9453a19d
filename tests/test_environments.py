"""Environments for multi-turn rollouts (multiturn/environments.py): built from `_target_`,
stepped on the policy's text without ever raising on it, their own bugs named."""

import pytest

from grpo_cli.config import ConfigError
from grpo_cli.multiturn.environments import NumberGuessing, environment_factory, environment_step, reset_messages

GUESSING = {"_target_": "grpo_cli.multiturn.environments.NumberGuessing", "high": 10, "max_guesses": 3}


def said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_the_example_game_hints_rewards_and_ends():
    make = environment_factory(GUESSING)
    game = make()
    opening = reset_messages(game, {"answer": "7", "question": "unused"})
    assert opening[0]["role"] == "user" and "1 to 10" in opening[0]["content"]
    assert environment_step(game, opening + said("5")).messages[0]["content"] == "Higher."
    lower = environment_step(game, opening + said("I think 9"))
    assert (lower.messages[0]["content"], lower.reward, lower.done) == ("Lower.", None, False)
    found = environment_step(game, opening + said("7"))
    assert (found.reward, found.done) == (1.0, True)
    other = make()  # one instance per conversation: a fresh episode's state
    reset_messages(other, {"answer": 2})
    assert other.guesses == 0 and other.secret == 2


def test_guesses_run_out_and_a_turn_without_a_number_ends_the_episode():
    game = NumberGuessing(high=10, max_guesses=2)
    reset_messages(game, {"answer": 3})
    environment_step(game, said("8"))
    out = environment_step(game, said("9"))
    assert (out.reward, out.done) == (0.0, True) and "it was 3" in out.messages[0]["content"]
    reset_messages(game, {"answer": 3})
    assert environment_step(game, said("no idea")).reward == 0.0


class RaisesOnText:
    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    def step(self, messages):
        return int(messages[-1]["content"])  # breaks on anything but a number


class ReturnsTheWrongThing:
    def __init__(self, result=None):
        self.result = result

    def reset(self, row):
        return self.result if self.result is not None else [{"role": "user", "content": row["answer"]}]

    def step(self, messages):
        return self.result


def test_a_step_that_raises_on_the_policys_text_ends_the_episode_without_a_reward():
    out = environment_step(RaisesOnText(), said("not a number"))
    assert out.done and out.reward is None and out.messages == []
    assert out.error.startswith("ValueError")


@pytest.mark.parametrize(
    "result, named",
    [
        ([{"role": "user", "content": "x"}], "must return a tuple"),
        (([{"content": "x"}], None, False), 'a "role" and a "content"'),
        (([{"role": "user", "content": "x"}], float("nan"), True), "finite number or None"),
        (("Higher.", None, False), "list of messages"),
    ],
)
def test_a_step_that_returns_the_wrong_thing_is_the_environments_bug_and_named(result, named):
    with pytest.raises(ConfigError, match="ReturnsTheWrongThing.step") as error:
        environment_step(ReturnsTheWrongThing(result), said("1"))
    assert named in str(error.value)


def test_bad_environment_entries_and_a_reset_that_fails_on_the_data_are_config_errors():
    with pytest.raises(ConfigError, match="has no _target_"):
        environment_factory({"high": 3})
    with pytest.raises(ConfigError, match="cannot import it"):
        environment_factory({"_target_": "no_such_module.Game"})
    with pytest.raises(ConfigError, match="has no reset or step method"):
        environment_factory({"_target_": "builtins.dict"})
    with pytest.raises(ConfigError, match="must be at least 1"):
        environment_factory({**GUESSING, "high": 0})
    with pytest.raises(ConfigError, match="unexpected keyword"):
        environment_factory({**GUESSING, "colour": "red"})
    with pytest.raises(ConfigError, match="NumberGuessing.reset failed on the dataset row"):
        reset_messages(NumberGuessing(), {"question": "no answer column"})
    with pytest.raises(ConfigError, match="ReturnsTheWrongThing.reset"):
        reset_messages(ReturnsTheWrongThing("not messages"), {"answer": "1"})


def test_the_multiturn_pages_examples_run():
    import re
    import sys
    import types
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "MULTITURN.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    assert len(blocks) == 2
    for index, source in enumerate(blocks):
        module = types.ModuleType(f"multiturn_doc_example_{index}")  # `_target_` finds its functions here
        sys.modules[module.__name__] = module
        try:
            exec(compile(source, f"docs/MULTITURN.md block {index}", "exec"), module.__dict__)
        finally:
            del sys.modules[module.__name__]
