"""One multi-turn conversation as the tokens it is trained on: tokens in, tokens out.

A conversation starts from its prompt's ids. Each assistant turn appends the ids the sampler
drew, exactly as drawn (never re-tokenized: the trained tokens are the sampled ones, the bug
verl #3720 and TRL #5224 report); each tool or environment message appends the tokens the chat
template puts between the turns, found by rendering the longer conversation and keeping what
follows the text so far. A template that rewrites an earlier turn when a later one comes (one
that drops old reasoning, say) cannot extend a conversation this way: TemplateMismatch says so.

`round_trip_problem` is the check of all of it: the conversation's messages rendered through the
template, against the ids to be trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.multiturn.tools import build_tools


class TemplateMismatch(ValueError):
    """The template's rendering of a longer conversation does not start with the shorter one's."""


# What the model is told about the tools where its chat template has no `tools` of its own
# (SmolLM2's, for one): the Hermes format of multiturn/tools.py, in a system message.
TOOLS_SYSTEM_PROMPT = (
    "You can call tools. Their signatures, as JSON, one per line:\n<tools>\n{tools}\n</tools>\n"
    "To call one, write a JSON object with its name and arguments between tool_call tags, for example\n"
    '<tool_call>\n{{"name": "{example}", "arguments": {{...}}}}\n</tool_call>\n'
    "and wait for its result. When you have what you need, give your answer without a tool call."
)


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools=` list itself (it names `tools`)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def with_tools(messages: list[dict[str, Any]], schemas: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """The prompt's messages, told about the tools where the template cannot be (TOOLS_SYSTEM_PROMPT,
    joined to the system message or as a first one). Unchanged without tools or where
    `template_takes_tools` (render() passes them as `tools=` then)."""
    if not schemas or template_takes_tools(tokenizer):
        return list(messages)
    described = TOOLS_SYSTEM_PROMPT.format(
        tools="\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas),
        example=schemas[0]["function"]["name"],
    )
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def tools_prompt_tokens(tool_entries: Any, tokenizer: Any) -> int:
    """How many tokens the tools' description adds to a prompt (rollout.tools; the memory plan's
    prompt length): a one-line chat rendered with and without it."""
    schemas = [tool.schema for tool in build_tools(tool_entries)]
    chat = [{"role": "user", "content": "Hi."}]
    bare = render(tokenizer, chat, [], generation_prompt=True)
    told = render(tokenizer, with_tools(chat, schemas, tokenizer), schemas, generation_prompt=True)
    return max(
        0, len(tokenizer.encode(told, add_special_tokens=False)) - len(tokenizer.encode(bare, add_special_tokens=False))
    )


def render(
    tokenizer: Any, messages: list[dict[str, Any]], schemas: list[dict[str, Any]], generation_prompt: bool
) -> str:
    """The chat template's text of `messages` (with `tools=` where the template takes them)."""
    extra = {"tools": schemas} if schemas and template_takes_tools(tokenizer) else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)


def decode(tokenizer: Any, ids: list[int]) -> str:
    """The text of `ids`, special tokens and spaces as they are (what the template renders)."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class Conversation:
    """One of a step's B*G conversations, growing turn by turn.

    `segments` after the prompt, in order: (ids, by the policy). The policy's are exactly what
    the sampler drew, its end-of-turn token included; the others are the template's tokens
    between turns with the tool's or environment's message inside."""

    messages: list[dict[str, Any]]  # the chat so far, the prompt's messages first
    schemas: list[dict[str, Any]]  # the tools' JSON schemas the model was told about
    prompt_ids: list[int]
    text: str  # the template's text of everything so far: prompt + segments
    segments: list[tuple[list[int], bool]] = field(default_factory=list)
    sampler_log_probs: list[float] = field(default_factory=list)  # one per completion token; 0 off the policy's
    turns: int = 0  # assistant turns sampled
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)  # kind -> count (multiturn/tools.ERROR_KINDS)
    environment_reward: float | None = None
    done: bool = False
    truncated: bool = False  # ended by a token limit, not by the policy's own answer

    @classmethod
    def start(cls, tokenizer: Any, messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> Conversation:
        """A conversation at its first generation prompt (the tools described, add_special_tokens
        off: the template writes the model's special tokens itself)."""
        messages = with_tools(messages, schemas, tokenizer)
        text = render(tokenizer, messages, schemas, generation_prompt=True)
        return cls(messages, schemas, tokenizer.encode(text, add_special_tokens=False), text)

    @property
    def completion_ids(self) -> list[int]:
        return [token for ids, _ in self.segments for token in ids]

    @property
    def policy_mask(self) -> list[int]:  # 1 on the policy's tokens, 0 on the template's and tools'
        return [int(by_policy) for ids, by_policy in self.segments for _ in ids]

    @property
    def completion_length(self) -> int:
        return sum(len(ids) for ids, _ in self.segments)

    def add_sampled(self, tokenizer: Any, ids: list[int], log_probs: list[float] | None, end_of_turn: int) -> str:
        """Append one assistant turn's sampled ids (through `end_of_turn` where the sampler
        stopped there) and its message; returns the turn's text without the end-of-turn token."""
        self.segments.append((list(ids), True))
        self.sampler_log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.turns += 1
        body = ids[:-1] if ids and ids[-1] == end_of_turn else ids
        content = decode(tokenizer, body)
        self.messages.append({"role": "assistant", "content": content})
        self.text += decode(tokenizer, ids)
        return content

    def add_messages(self, tokenizer: Any, messages: list[dict[str, Any]]) -> None:
        """Append tool or environment messages and the next generation prompt: the template's
        tokens between the last assistant turn and the next one (not trained on)."""
        self.messages += messages
        full = render(tokenizer, self.messages, self.schemas, generation_prompt=True)
        if not full.startswith(self.text):
            raise TemplateMismatch(
                "the chat template renders this conversation differently once a turn is added (it "
                "rewrites an earlier turn), so the sampled tokens cannot be kept as they are. Multi-turn "
                "rollouts need a template whose rendering of a longer chat starts with the shorter "
                f"one's. The text so far ends {self.text[-80:]!r}; the longer one has "
                f"{full[max(0, len(self.text) - 80) : len(self.text)]!r} there."
            )
        between = tokenizer.encode(full[len(self.text) :], add_special_tokens=False)
        self.segments.append((between, False))
        self.sampler_log_probs += [0.0] * len(between)
        self.text = full

    def count_error(self, kind: str) -> None:
        """One more bad tool call of `kind` (multiturn/tools.ERROR_KINDS), or a failed environment step."""
        self.tool_errors[kind] = self.tool_errors.get(kind, 0) + 1

    def mark(self) -> tuple[int, int, int, str]:
        """Where the conversation is now, for rewind."""
        return len(self.messages), len(self.segments), len(self.sampler_log_probs), self.text

    def rewind(self, mark: tuple[int, int, int, str]) -> None:
        """Back to `mark`: the messages and segments added since are dropped."""
        messages, segments, log_probs, self.text = mark
        del self.messages[messages:], self.segments[segments:], self.sampler_log_probs[log_probs:]


def round_trip_problem(tokenizer: Any, conversation: Conversation, sampled_turns: list[list[int]]) -> str | None:
    """None when the ids to be trained on are exactly the conversation: the policy's segments
    are `sampled_turns` (the sampler's ids, in order) id for id, the other segments are the
    template's tokens, and prompt + segments decode to the template's text of the finished
    messages up to the end of the last turn (less its end-of-turn token where a token limit cut it
    off). Else what differs."""
    policy_segments = [ids for ids, by_policy in conversation.segments if by_policy]
    if policy_segments != [list(turn) for turn in sampled_turns]:
        return f"the policy's segments {policy_segments} are not the sampled ids {sampled_turns}"
    trained = decode(tokenizer, conversation.prompt_ids + conversation.completion_ids)
    rendered = render(tokenizer, conversation.messages, conversation.schemas, generation_prompt=False)
    if not rendered.startswith(trained):
        at = next((i for i, (a, b) in enumerate(zip(trained, rendered)) if a != b), min(len(trained), len(rendered)))
        return (
            f"the trained ids decode to {trained[at : at + 60]!r} where the template renders {rendered[at : at + 60]!r}"
        )
    rest = rendered[len(trained) :]
    if conversation.truncated and tokenizer.eos_token and rest.startswith(tokenizer.eos_token):
        rest = rest[len(tokenizer.eos_token) :]  # a turn cut off by a token limit never sampled its end
    if rest.strip():  # after the last turn's end-of-turn token the template may only close the line
        return f"the template renders {rest!r} after the trained ids end"
    for ids, by_policy in conversation.segments:
        if not by_policy and tokenizer.encode(decode(tokenizer, ids), add_special_tokens=False) != ids:
            return f"the template's tokens {ids} are not the tokenization of their text"
    return None
