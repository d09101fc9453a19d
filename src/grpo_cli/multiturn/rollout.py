"""The multi-turn rollout: G conversations per prompt, each turn sampled by the run's own sampler
for the conversations still going, tools run and environments stepped in between, and one
Rollout of them all for the reward stage and the update.

Each turn, the active conversations' ids so far (prompt + every segment, as drawn) are one
PromptBatch of one completion each, so any sampler (fast, hf, vllm) serves it; a conversation
ends when its turn calls no tool (or, with an environment, when the environment says done), at
rollout.max_turns, or at rollout.max_total_tokens. sampler=fast continues each conversation from
the keys and values of its last turn (prefilling only the turn's last token and the reply), vLLM
from its prefix cache; sampler=hf prefills each turn's context again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_cli.config import ConfigError
from grpo_cli.multiturn.conversation import Conversation
from grpo_cli.multiturn.environments import (
    Environment,
    EnvironmentStep,
    environment_factory,
    environment_step,
    reset_messages,
)
from grpo_cli.multiturn.tools import Tool, build_tools, parse_tool_calls, run_tool_call
from grpo_cli.records import PromptBatch, Rollout
from grpo_cli.sampling.rollouts import rollout_from


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int  # assistant turns a conversation may take
    max_total_tokens: int  # its tokens after the prompt, the policy's and the others'
    tool_timeout_s: float | None  # a tool call running longer is stopped (an error the model reads)
    max_tool_chars: int  # a tool's result is cut to this many characters


class MultiTurnSampler:
    """The Sampler of a run with rollout.tools or rollout.environment: `inner` (the run's fast,
    hf or vllm sampler) draws each turn; the conversations make the Rollout."""

    def __init__(self, inner: Any, rollout_cfg: Any, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "rollout.tools / rollout.environment: multi-turn rollouts need a chat template, and this "
                "model's tokenizer has none. Use an instruct model (e.g. model=smollm2-135m-instruct) or "
                "rollout=single_turn."
            )
        for key in ("max_turns", "max_total_tokens"):  # a conversation holds at least one sampled token
            if int(rollout_cfg[key]) < 1:
                raise ConfigError(f"rollout.{key}={rollout_cfg[key]}: give a whole number of at least 1.")
        self.inner, self.tokenizer = inner, tokenizer
        self.tools = build_tools(rollout_cfg.tools)
        self.make_environment = environment_factory(rollout_cfg.environment) if rollout_cfg.environment else None
        self.limits = TurnLimits(
            max_turns=int(rollout_cfg.max_turns),
            max_total_tokens=int(rollout_cfg.max_total_tokens),
            tool_timeout_s=float(rollout_cfg.tool_timeout_s) or None,
            max_tool_chars=int(rollout_cfg.max_tool_chars),
        )

    def openings(self, batch: PromptBatch, copies: int) -> tuple[list[list[dict[str, Any]]], list[Environment] | None]:
        """Each prompt's first messages `copies` times side by side, and a fresh environment for
        each conversation (reset on its dataset row: the columns, the prompt's text as `prompt`)."""
        if batch.messages is None:
            raise ConfigError("multi-turn rollouts need chat prompts: set data.use_chat_template=auto or true.")
        if self.make_environment is None:
            return [list(batch.messages[b]) for b in range(batch.size) for _ in range(copies)], None
        environments, opening = [], []
        for b in range(batch.size):
            row = {key: values[b] for key, values in batch.columns.items()}
            row["prompt"] = batch.messages[b][-1]["content"]
            for _ in range(copies):
                environment = self.make_environment()
                environments.append(environment)
                opening.append(reset_messages(environment, row))
        return opening, environments

    def conversations(
        self, policy: Any, batch: PromptBatch, copies: int, greedy: bool
    ) -> tuple[list[Conversation], bool]:
        """The batch's conversations played out, and whether the sampler kept its log-probs."""
        opening, environments = self.openings(batch, copies)
        kept_log_probs = []

        def sample_turn(turn_batch: PromptBatch) -> Rollout:
            if not greedy:
                drawn = self.inner.sample(policy, turn_batch, group_size=1)
                kept_log_probs.append(drawn.sampler_log_probs is not None)
                return drawn
            # The eval's greedy turns: the inner sampler gives text, which is re-encoded (the eval
            # trains on nothing, so the ids need not be the drawn ones).
            texts = self.inner.greedy(policy, turn_batch)
            ids = [
                self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id] for text in texts
            ]
            filled = padded(ids, self.tokenizer.eos_token_id, left=False)
            return rollout_from(turn_batch, 1, filled, self.tokenizer, 1.0)

        # sampler=fast keeps each turn's keys and values for the next (vLLM has its prefix cache)
        keeping = getattr(self.inner, "keeping_turns", contextlib.nullcontext)
        with keeping():
            played = run_conversations(sample_turn, self.tokenizer, opening, self.tools, self.limits, environments)
        return played, bool(kept_log_probs) and all(kept_log_probs)

    def sample(self, policy: Any, batch: PromptBatch, group_size: int | None = None) -> Rollout:
        group = group_size or self.inner.cfg.group_size
        conversations, keeps_log_probs = self.conversations(policy, batch, group, greedy=False)
        return conversations_rollout(
            conversations,
            self.tokenizer,
            batch.texts,
            batch.columns,
            group,
            self.inner.cfg.temperature,
            keeps_log_probs,
        )

    def greedy(self, policy: Any, batch: PromptBatch) -> list[str]:
        return [final_answer(c) for c in self.greedy_conversations(policy, batch)]

    def greedy_conversations(self, policy: Any, batch: PromptBatch) -> list[Conversation]:
        """The eval's conversations: one a prompt, each turn greedy."""
        return self.conversations(policy, batch, 1, greedy=True)[0]

    def close(self) -> None:
        self.inner.close()


def run_conversations(
    sample_turn: Callable[[PromptBatch], Rollout],
    tokenizer: Any,
    opening: Sequence[list[dict[str, Any]]],  # [N] each conversation's first messages
    tools: Sequence[Tool],
    limits: TurnLimits,
    environments: Sequence[Environment] | None = None,  # [N] one per conversation, already reset
) -> list[Conversation]:
    """Every conversation played to its end. `sample_turn(batch)` draws one completion for each
    of `batch`'s prompts (a sampler's sample with group_size=1)."""
    schemas = [tool.schema for tool in tools]
    conversations = [Conversation.start(tokenizer, list(messages), schemas) for messages in opening]
    end_of_turn = tokenizer.eos_token_id
    while active := [index for index, c in enumerate(conversations) if not c.done]:
        drawn = sample_turn(context_batch([conversations[index] for index in active], tokenizer))
        for row, index in enumerate(active):
            conversation = conversations[index]
            length = int(drawn.completion_mask[row].sum())
            room = limits.max_total_tokens - conversation.completion_length
            ids = drawn.completion_ids[row, : min(length, room)].tolist()
            log_probs = None if drawn.sampler_log_probs is None else drawn.sampler_log_probs[row, : len(ids)].tolist()
            text = conversation.add_sampled(tokenizer, ids, log_probs, end_of_turn)
            if not ids or ids[-1] != end_of_turn:  # cut by max_new_tokens or the total budget
                conversation.done = conversation.truncated = True
                continue
            environment = environments[index] if environments else None
            if conversation.turns >= limits.max_turns:  # no turn follows: its tool calls are not run
                if environment is not None:  # but the environment judges the episode's last move
                    judge(conversation, environment)
                conversation.done = True
                continue
            before = conversation.mark()
            respond(conversation, text, tokenizer, tools, limits, environment)
            if not conversation.done and conversation.completion_length >= limits.max_total_tokens:
                # no room for a turn of the policy's after the reply: the conversation ends at its
                # last turn, as every conversation does, without the reply's tokens (never trained on)
                conversation.rewind(before)
                conversation.done = conversation.truncated = True
    return conversations


def respond(
    conversation: Conversation,
    text: str,
    tokenizer: Any,
    tools: Sequence[Tool],
    limits: TurnLimits,
    environment: Environment | None,
) -> None:
    """After the policy's turn `text`: its tool calls' results as tool messages, else the
    environment's step, else the end of the conversation."""
    calls = parse_tool_calls(text, tokenizer) if tools else []
    if calls:
        replies = []
        for call in calls:
            result = run_tool_call(call, tools, limits.tool_timeout_s, limits.max_tool_chars)
            conversation.tool_calls += 1
            if result.error_kind is not None:
                conversation.count_error(result.error_kind)
            replies.append({"role": "tool", "name": call.name or "unknown", "content": result.content})
        conversation.add_messages(tokenizer, replies)
        return
    if environment is None:
        conversation.done = True
        return
    step = judge(conversation, environment)
    conversation.done = step.done
    if not step.done:
        conversation.add_messages(tokenizer, step.messages)


def judge(conversation: Conversation, environment: Environment) -> EnvironmentStep:
    """The environment's step on the policy's last turn; its reward and any error recorded."""
    step = environment_step(environment, conversation.messages)
    if step.error is not None:
        conversation.count_error("environment")
    if step.reward is not None:
        conversation.environment_reward = step.reward
    return step


def context_batch(conversations: Sequence[Conversation], tokenizer: Any) -> PromptBatch:
    """The conversations' ids so far as one left-padded PromptBatch: the next turn's prompts."""
    rows = [c.prompt_ids + c.completion_ids for c in conversations]
    return PromptBatch(
        texts=[c.text for c in conversations],
        input_ids=padded(rows, pad_id(tokenizer), left=True),
        attention_mask=padded([[1] * len(ids) for ids in rows], 0, left=True),
        columns={},
    )


def pad_id(tokenizer: Any) -> int:
    """The id padding takes (never attended): the pad token, or the end token where there is none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def padded(rows: Sequence[list[int] | list[float]], value: float, left: bool, dtype=torch.long) -> torch.Tensor:
    width = max((len(row) for row in rows), default=0)
    filled = [
        ([value] * (width - len(row)) + list(row)) if left else (list(row) + [value] * (width - len(row)))
        for row in rows
    ]
    return torch.tensor(filled, dtype=dtype).reshape(len(rows), width)


def conversations_rollout(
    conversations: Sequence[Conversation],
    tokenizer: Any,
    prompts: Sequence[str],  # [B] the prompts' texts
    columns: dict[str, list[Any]],  # each [B]: the dataset's fields
    group_size: int,
    temperature: float,
    sampler_keeps_log_probs: bool,
) -> Rollout:
    """One Rollout of B*G finished conversations (conversation b * G + i: prompt b's i-th). The
    completion is everything after the prompt, attended to its end; policy_mask marks the
    policy's own tokens; the final assistant message is the completion's text; every row's
    messages and environment reward go to the rewards as the columns `messages` and
    `environment_reward`."""
    pad = pad_id(tokenizer)
    log_probs = None
    if sampler_keeps_log_probs:
        log_probs = padded([c.sampler_log_probs for c in conversations], 0.0, left=False, dtype=torch.float32)
    rows = [c.prompt_ids for c in conversations]
    repeated = {key: [value for value in values for _ in range(group_size)] for key, values in columns.items()}
    repeated["messages"] = [c.messages for c in conversations]
    repeated["environment_reward"] = [c.environment_reward for c in conversations]
    repeated["turns"] = [c.turns for c in conversations]
    repeated["tool_calls"] = [c.tool_calls for c in conversations]
    repeated["tool_errors"] = [dict(c.tool_errors) for c in conversations]
    return Rollout(
        prompt_ids=padded(rows, pad, left=True),  # [B*G, P]
        prompt_mask=padded([[1] * len(ids) for ids in rows], 0, left=True),
        completion_ids=padded([c.completion_ids for c in conversations], pad, left=False),  # [B*G, T] the longest tail
        completion_mask=padded([[1] * c.completion_length for c in conversations], 0, left=False),
        truncated=torch.tensor([c.truncated for c in conversations], dtype=torch.bool),
        prompts=[text for text in prompts for _ in range(group_size)],
        completions=[final_answer(c) for c in conversations],
        columns=repeated,
        group_size=group_size,
        temperature=temperature,
        sampler_log_probs=log_probs,
        policy_mask=padded([c.policy_mask for c in conversations], 0, left=False),
    )


def final_answer(conversation: Conversation) -> str:
    """The text the reward functions score: the policy's last turn."""
    said = [m["content"] for m in conversation.messages if m.get("role") == "assistant"]
    return str(said[-1]) if said else ""
