"""The multi-turn driver (multiturn/rollout.py) on SmolLM2's real tokenizer and template, with a
scripted policy whose turns are known: tool calls run and answered, environments stepped, only
the conversations still going sampled each turn, every limit applied, and the Rollout's ids the
ones drawn, rendered back through the template without a difference."""

import contextlib

import pytest
import torch
from transformers import AutoTokenizer

from grpo_cli.multiturn.conversation import round_trip_problem
from grpo_cli.multiturn.environments import NumberGuessing, reset_messages
from grpo_cli.multiturn.rollout import TurnLimits, conversations_rollout, run_conversations
from grpo_cli.multiturn.tools import build_tools
from grpo_cli.sampling.rollouts import rollout_from

LIMITS = TurnLimits(max_turns=3, max_total_tokens=400, tool_timeout_s=2.0, max_tool_chars=200)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def call(expression: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


class ScriptedPolicy:
    """Answers each context by the first key of `script` in its last message (the turn to sample,
    ended by <|im_end|> unless the key is in `unended`); records the sizes of the batches given."""

    def __init__(self, tokenizer, script: dict[str, str], unended: tuple[str, ...] = ()):
        self.tokenizer, self.script, self.unended = tokenizer, script, unended
        self.batch_sizes: list[int] = []

    def __call__(self, batch):
        self.batch_sizes.append(batch.size)
        turns = []
        for text in batch.texts:
            last_message = text.rsplit("<|im_start|>", 2)[-2]
            key = next(key for key in self.script if key in last_message)
            ids = self.tokenizer.encode(self.script[key], add_special_tokens=False)
            turns.append(ids if key in self.unended else ids + [self.tokenizer.eos_token_id])
        width = max(len(ids) for ids in turns)
        ids = torch.tensor([t + [self.tokenizer.eos_token_id] * (width - len(t)) for t in turns])
        log_probs = torch.full(ids.shape, -0.25)
        return rollout_from(batch, 1, ids, self.tokenizer, 1.0, sampler_log_probs=log_probs)


def test_tool_conversations_run_to_their_ends_and_train_on_the_drawn_ids(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"  # the end of SmolLM2's turn: the samplers stop there
    tools = build_tools([{"_target_": "grpo_cli.multiturn.builtin_tools.calculator"}])
    script = {
        "What is 37 + 48?": "I will compute it.\n" + call("37 + 48"),
        "85": "The answer is 85.",
        "What is 2 + 2?": "The answer is 4.",  # no tool call: done after one turn
        "Loop forever.": call("1 + 1"),
        "2": call("1 + 1"),  # calls again and again: max_turns ends it
        "Call badly.": '<tool_call>{"name": "calculator", "arguments": </tool_call>',
    }
    script["not valid JSON"] = "Sorry."
    policy = ScriptedPolicy(tokenizer, script)
    questions = ["What is 37 + 48?", "What is 2 + 2?", "Loop forever.", "Call badly."]
    opening = [[{"role": "user", "content": question}] for question in questions]
    conversations = run_conversations(policy, tokenizer, opening, tools, LIMITS)
    assert [c.turns for c in conversations] == [2, 1, 3, 2]
    assert [c.tool_calls for c in conversations] == [1, 0, 2, 1]  # the last turn's call not run
    assert conversations[3].tool_errors == {"malformed": 1}
    assert policy.batch_sizes == [4, 3, 1]  # only the conversations still going are sampled
    assert [c.done for c in conversations] == [True] * 4 and not any(c.truncated for c in conversations)
    for conversation in conversations:
        sampled = [ids for ids, by_policy in conversation.segments if by_policy]
        assert round_trip_problem(tokenizer, conversation, sampled) is None

    rollout = conversations_rollout(conversations, tokenizer, questions, {"answer": [85, 4, 2, 0]}, 1, 1.0, True)
    assert rollout.completions[0] == "The answer is 85." and rollout.columns["answer"] == [85, 4, 2, 0]
    assert rollout.columns["messages"][0][-2] == {"role": "tool", "name": "calculator", "content": "85"}
    for row, conversation in enumerate(conversations):
        length = conversation.completion_length
        assert rollout.completion_ids[row, :length].tolist() == conversation.completion_ids
        assert int(rollout.completion_mask[row].sum()) == length
        assert rollout.policy_mask[row].tolist() == conversation.policy_mask + [0] * (
            rollout.policy_mask.shape[1] - length
        )
        policy_tokens = rollout.policy_mask[row].bool()
        assert torch.all(rollout.sampler_log_probs[row][policy_tokens] == -0.25)
        assert torch.all(rollout.sampler_log_probs[row][~policy_tokens] == 0)
        prompt = rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist()
        assert prompt == conversation.prompt_ids
    assert int(rollout.policy_mask[1].sum()) == int(rollout.completion_mask[1].sum())  # one turn: all the policy's


def test_the_token_budget_and_max_new_tokens_cut_a_conversation_and_mark_it_truncated(tokenizer):
    tools = build_tools([{"_target_": "grpo_cli.multiturn.builtin_tools.calculator"}])
    script = {"Add.": call("1 + 2"), "3": "It is three, " * 30, "Ramble.": "and on " * 20}  # 40 tokens, the widest
    policy = ScriptedPolicy(tokenizer, script, unended=("Ramble.",))
    opening = [[{"role": "user", "content": "Add."}], [{"role": "user", "content": "Ramble."}]]
    limits = TurnLimits(max_turns=5, max_total_tokens=60, tool_timeout_s=2.0, max_tool_chars=200)
    cut, unended = run_conversations(policy, tokenizer, opening, tools, limits)
    assert cut.truncated and cut.completion_length == 60 and cut.turns == 2
    assert unended.truncated and unended.turns == 1  # no <|im_end|>: the sampler's max_new_tokens
    rollout = conversations_rollout([cut, unended], tokenizer, ["Add.", "Ramble."], {}, 1, 1.0, False)
    assert rollout.truncated.tolist() == [True, True] and rollout.sampler_log_probs is None


def test_an_environment_steps_on_each_turn_and_its_reward_reaches_the_rollout(tokenizer):
    games = [NumberGuessing(high=10, max_guesses=3) for _ in range(2)]
    opening = [reset_messages(game, {"answer": answer}) for game, answer in zip(games, (7, 2))]
    question = opening[0][0]["content"]
    script = {question: "5", "Higher.": "7", "Lower.": "6"}
    script[opening[1][0]["content"]] = "5"  # the same opening: the same script
    conversations = run_conversations(ScriptedPolicy(tokenizer, script), tokenizer, opening, [], LIMITS, games)
    found, lost = conversations
    assert (found.turns, found.environment_reward) == (2, 1.0)  # 5 (higher), 7: correct
    assert (lost.turns, lost.environment_reward) == (3, 0.0)  # 5 (lower), 6 (lower), 6: out of guesses
    assert [m["content"] for m in found.messages if m["role"] == "user"][1:] == ["Higher."]
    rollout = conversations_rollout(conversations, tokenizer, [question], {"answer": [7]}, 2, 1.0, True)
    assert rollout.columns["environment_reward"] == [1.0, 0.0] and rollout.num_prompts == 1
    for conversation in conversations:
        sampled = [ids for ids, by_policy in conversation.segments if by_policy]
        assert round_trip_problem(tokenizer, conversation, sampled) is None


class KeepTalking:
    """Asks for another turn until the third, then rewards 1 for any turn of fewer than 200 characters."""

    def __init__(self):
        self.steps = 0

    def reset(self, row):
        return [{"role": "user", "content": f"Tell me about {row['topic']} in one sentence."}]

    def step(self, messages):
        self.steps += 1
        if self.steps == 3:
            return [], float(len(messages[-1]["content"]) < 200), True
        return [{"role": "user", "content": "Go on."}], None, False


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_a_real_sampler_serves_the_turns_and_the_rollout_renders_as_its_template(smollm2_dir, backend):
    from grpo_cli.models.loading import load_models
    from grpo_cli.sampling import make_sampler
    from helpers import config

    cfg = config(smollm2_dir, f"sampler.backend={backend}", "sampler.max_new_tokens=40", "sampler.group_size=1")
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    sampler = make_sampler(cfg.sampler, models.tokenizer)
    tokenizer = models.tokenizer
    games = [KeepTalking() for _ in range(4)]
    opening = [reset_messages(game, {"topic": topic}) for game, topic in zip(games, ["cats", "rain", "tea", "maps"])]
    torch.manual_seed(0)
    sizes = []

    def sample_turn(batch):
        sizes.append(batch.size)
        return sampler.sample(models.policy, batch, group_size=1)

    limits = TurnLimits(max_turns=3, max_total_tokens=200, tool_timeout_s=None, max_tool_chars=200)
    # fast: each turn after the first prefills only what follows the last turn's kept keys and values
    keeping = sampler.keeping_turns() if backend == "fast" else contextlib.nullcontext()
    prefills = []
    embed = models.policy.get_input_embeddings()

    def record_prefill(module, args, output):  # a decode step embeds one token a row
        if args[0].shape[1] > 1:
            prefills.append(args[0].shape)

    hook = embed.register_forward_hook(record_prefill)
    with keeping:
        conversations = run_conversations(sample_turn, tokenizer, opening, [], limits, games)
    hook.remove()
    if backend == "fast":  # the first turn's prefill: the prompts; a later one: the replies
        assert len(prefills) == len(sizes) and all(later[1] < prefills[0][1] // 2 for later in prefills[1:])
    assert sizes[0] == 4 and sizes == sorted(sizes, reverse=True) and len(sizes) <= 3
    assert sum(sizes) == sum(c.turns for c in conversations)
    assert any(c.turns > 1 for c in conversations)  # seed 0 here: [4, 2, 2] (fast), [4, 4, 2] (hf)
    for conversation in conversations:
        sampled = [ids for ids, by_policy in conversation.segments if by_policy]
        assert all(len(ids) <= 40 for ids in sampled)
        assert conversation.truncated or conversation.environment_reward is not None
        assert round_trip_problem(tokenizer, conversation, sampled) is None
    rollout = conversations_rollout(conversations, tokenizer, ["topics"], {}, 4, 1.0, False)
    assert int(rollout.policy_mask.sum()) == sum(len(ids) for c in conversations for ids, own in c.segments if own)
