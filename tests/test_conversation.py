"""Tokens in, tokens out (multiturn/conversation.py) on the real model's tokenizer and template
(SmolLM2-135M-Instruct): the trained ids of each assistant turn are the sampled ones, the ids
between turns are the template's, and the finished conversation rendered through the template
is what is trained on; any difference is found."""

import pytest
from transformers import AutoTokenizer

from grpo_cli.multiturn.conversation import Conversation, TemplateMismatch, round_trip_problem, template_takes_tools
from grpo_cli.multiturn.tools import build_tools, parse_tool_calls, run_tool_call

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 + 48"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def character_ids(tokenizer, text: str) -> list[int]:
    """`text` as the model may sample it but the tokenizer never writes it: one token a character."""
    return [tokenizer.convert_tokens_to_ids(char) for token in tokenizer.tokenize(text) for char in token]


def calculator_conversation(tokenizer):
    tools = build_tools([{"_target_": "grpo_cli.multiturn.builtin_tools.calculator"}])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    conversation = Conversation.start(tokenizer, [{"role": "user", "content": "What is 37 + 48?"}], [tools[0].schema])
    first = tokenizer.encode("Let me compute it.\n" + CALL, add_special_tokens=False) + [end]
    text = conversation.add_sampled(tokenizer, first, [-0.5] * len(first), end)
    (result,) = [run_tool_call(call, tools, timeout_s=1, max_chars=100) for call in parse_tool_calls(text)]
    conversation.add_messages(tokenizer, [{"role": "tool", "name": "calculator", "content": result.content}])
    second = character_ids(tokenizer, "The answer is 85.") + [end]
    conversation.add_sampled(tokenizer, second, None, end)
    return conversation, [first, second]


def test_a_tool_conversation_trains_on_the_sampled_ids_and_renders_as_its_template(tokenizer):
    assert not template_takes_tools(tokenizer)  # SmolLM2's: the tools go in a system message
    conversation, sampled = calculator_conversation(tokenizer)
    assert "<tools>" in conversation.messages[0]["content"] and '"calculator"' in conversation.messages[0]["content"]
    assert round_trip_problem(tokenizer, conversation, sampled) is None
    # the policy's ids are the drawn ones, the non-canonical second turn too
    assert (
        conversation.segments[2][0]
        == sampled[1]
        != tokenizer.encode("The answer is 85.<|im_end|>", add_special_tokens=False)
    )
    # between the turns: the template's tokens, the tool's result inside, not the policy's
    between, by_policy = conversation.segments[1]
    assert not by_policy
    assert tokenizer.decode(between) == "\n<|im_start|>tool\n85<|im_end|>\n<|im_start|>assistant\n"
    mask = conversation.policy_mask
    assert len(mask) == conversation.completion_length == len(conversation.sampler_log_probs)
    assert mask == [1] * len(sampled[0]) + [0] * len(between) + [1] * len(sampled[1])
    assert conversation.sampler_log_probs[: len(sampled[0])] == [-0.5] * len(sampled[0])
    assert conversation.turns == 2 and conversation.messages[-1] == {
        "role": "assistant",
        "content": "The answer is 85.",
    }


def test_the_round_trip_fails_on_any_difference(tokenizer):
    conversation, sampled = calculator_conversation(tokenizer)
    # a trainer that re-tokenized the model's text (the canonical ids, not the sampled ones)
    retokenized = tokenizer.encode("The answer is 85.", add_special_tokens=False) + [sampled[1][-1]]
    conversation.segments[2] = (retokenized, True)
    assert "not the sampled ids" in round_trip_problem(tokenizer, conversation, [sampled[0], retokenized[:-1]])
    conversation, sampled = calculator_conversation(tokenizer)
    ids, _ = conversation.segments[1]
    conversation.segments[1] = (ids[:-1], False)  # one template token lost between the turns
    assert "decode to" in round_trip_problem(tokenizer, conversation, sampled)
    conversation, sampled = calculator_conversation(tokenizer)
    conversation.messages[3]["content"] = "86"  # the trained tool result is not the conversation's
    assert "decode to" in round_trip_problem(tokenizer, conversation, sampled)


def test_a_template_that_rewrites_earlier_turns_is_refused_with_what_differs(tokenizer):
    conversation, _ = calculator_conversation(tokenizer)
    conversation.messages[1]["content"] = "(reasoning dropped)"  # as a template that strips old turns renders it
    with pytest.raises(TemplateMismatch, match="rewrites an earlier turn"):
        conversation.add_messages(tokenizer, [{"role": "user", "content": "And 2 + 2?"}])
