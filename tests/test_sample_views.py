"""How a step's sampled groups are shown: samples.jsonl entries rendered as the console table,
the plain log lines, wandb's table and grpo-report's Samples section, for single-turn
completions and for multi-turn conversations (every message after the system prompt)."""

from __future__ import annotations

import io
import json

from rich.console import Console

from grpo_cli.console import conversation_lines, samples_table, samples_text
from grpo_cli.tools.report import report
from test_report import quiet, training_rows, write_run

PROMPT = "What is 37 + 48? Use the calculator."


def single_turn_entry(step: int = 2) -> dict:
    return {
        "step": step,
        "prompt": "2 + 3 =",
        "answer": "5",
        "completions": ["5", "six"],
        "rewards": [1.0, 0.0],
        "per_function": {"exact_match": [1.0, 0.0]},
        "advantages": [0.707107, -0.707107],
        "truncated": [False, True],
    }


def multi_turn_entry(step: int = 2) -> dict:
    system = {"role": "system", "content": "You may call these tools: calculator"}
    user = {"role": "user", "content": PROMPT}
    called = [
        system,
        user,
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>',
        },
        {"role": "tool", "name": "calculator", "content": "85"},
        {"role": "assistant", "content": "The answer is 85."},
    ]
    alone = [system, user, {"role": "assistant", "content": "It is 75."}]
    return {
        **single_turn_entry(step),
        "prompt": PROMPT,
        "answer": "85",
        "completions": ["The answer is 85.", "It is 75."],
        "truncated": [False, False],
        "conversations": [called, alone],
        "turns": [2, 1],
    }


def test_a_single_turn_completion_is_one_line():
    assert conversation_lines(single_turn_entry(), 1) == ["six"]
    text = samples_text(single_turn_entry())
    assert "    1: reward 0  advantage -0.707  'six'" in text


def test_a_conversation_shows_every_message_after_the_system_prompt_and_the_prompt():
    lines = conversation_lines(multi_turn_entry(), 0)
    assert lines == [
        'assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>',
        "tool calculator: 85",
        "assistant: The answer is 85.",
    ]
    assert conversation_lines(multi_turn_entry(), 1) == ["assistant: It is 75."]
    text = samples_text(multi_turn_entry()).splitlines()
    assert text[1:5] == [
        "    0: reward 1  advantage 0.707",
        '        \'assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>\'',
        "        'tool calculator: 85'",
        "        'assistant: The answer is 85.'",
    ]


def test_an_environments_own_user_turns_are_shown():
    entry = multi_turn_entry()
    entry["conversations"][1] = [
        {"role": "user", "content": "Guess my number between 1 and 100."},  # the environment's opening, not the prompt
        {"role": "assistant", "content": "50"},
        {"role": "user", "content": "Higher."},
    ]
    assert conversation_lines(entry, 1) == [
        "user: Guess my number between 1 and 100.",
        "assistant: 50",
        "user: Higher.",
    ]


def test_the_console_table_has_a_line_per_message():
    console = Console(file=io.StringIO(), width=120, record=True)
    console.print(samples_table(multi_turn_entry()))
    shown = console.export_text()
    assert "conversation" in shown and "tool calculator: 85" in shown and "assistant: The answer is 85." in shown
    lines = shown.splitlines()
    tool = next(i for i, line in enumerate(lines) if "tool calculator: 85" in line)
    assert "assistant: The answer is 85." in lines[tool + 1]  # the next message on its own line


def test_grpo_report_shows_the_last_steps_conversations(tmp_path):
    run = write_run(tmp_path / "run", training_rows())
    entries = [single_turn_entry(step=10), multi_turn_entry(step=20)]
    (run / "samples.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    report(run, quiet())
    text = (run / "report.md").read_text()
    samples = text[text.index("## Samples") :]
    assert "### Step 20 · answer `85`" in samples and "Step 10" not in samples  # the last step only
    assert "Completion 0 · reward 1.00 · advantage 0.707" in samples
    block = samples[samples.index("Completion 0") :]
    assert (
        "```\nassistant: <tool_call>" in block and "\ntool calculator: 85\nassistant: The answer is 85.\n```" in block
    )


def test_grpo_report_without_samples_or_with_a_cut_line_says_so(tmp_path):
    run = write_run(tmp_path / "run", training_rows())
    report(run, quiet())
    assert "No samples.jsonl groups: the run logged none" in (run / "report.md").read_text()
    (run / "samples.jsonl").write_text(json.dumps(single_turn_entry()) + '\n{"step": 3, "prom')
    report(run, quiet())
    assert "samples.jsonl is unreadable (JSONDecodeError" in (run / "report.md").read_text()
