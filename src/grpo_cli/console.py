"""What a person watching the run sees: the live status panel and the sample tables.

On a terminal the run shows a progress bar (with ETA) above a panel of the last step's numbers
and any warning from `health.py`; `status_lines(row)` decides what the panel says, so the same
lines serve the panel and the plain log. When stdout is not a terminal (CI, `> file`), RunLogger
prints plain lines instead and these renderables are not used.
"""

from __future__ import annotations

from typing import Any, Optional

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

PLAIN_NUMBERS = {  # the short plain log line: metric -> label
    "reward/mean": "reward",
    "kl": "kl",
    "advantage/zero_std_fraction": "zero-std",
    "completion/length_mean": "len",
    "sampler/logprob_mismatch": "mismatch",  # sampler=vllm: the engine's log-probs against the trainer's
    "time/step": "s/step",
}
COMPLETION_WIDTH = 80  # characters of a completion shown in a sample table


def number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0%}"


def plain_line(row: dict[str, Any]) -> str:
    """`step 40  reward 0.75  kl 0.012 ...` for logs that are not a terminal."""
    numbers = "  ".join(f"{label} {number(row[key])}" for key, label in PLAIN_NUMBERS.items() if key in row)
    extra = f"  eval {row['eval/accuracy']:.3f}" if "eval/accuracy" in row else ""
    return f"step {row['step']}  {numbers}{extra}"


def status_lines(row: dict[str, Any], last_eval: Optional[dict[str, Any]] = None) -> list[tuple[str, str]]:
    """(label, value) pairs describing one step's metrics row, for the live panel."""
    get = row.get
    per_function = [
        f"{key[len('reward/') : -len('/mean')]} {number(value, 3)}"
        for key, value in row.items()
        if key.startswith("reward/") and key.endswith("/mean") and key != "reward/mean"
    ]
    reward = f"{number(get('reward/mean'), 3)} ± {number(get('reward/std'), 3)}"
    lines = [("reward", reward + (f"   ({', '.join(per_function)})" if per_function else ""))]
    lines.append(("KL / beta", f"{number(get('kl'))} / {number(get('beta'))}"))
    lines.append(
        (
            "clip fraction",
            f"{percent(get('clip/fraction'))} (high {percent(get('clip/high_fraction'))}, "
            f"low {percent(get('clip/low_fraction'))})",
        )
    )
    lines.append(("entropy", number(get("entropy"))))
    lines.append(("zero-std groups", percent(get("advantage/zero_std_fraction"))))
    lines.append(
        (
            "completion length",
            f"mean {number(get('completion/length_mean'), 3)}, max "
            f"{number(get('completion/length_max'))}, truncated "
            f"{percent(get('completion/truncated_fraction'))}",
        )
    )
    lines.append(
        (
            "step time",
            f"{number(get('time/step'), 3)} s = sample {number(get('time/sample'), 3)} + "
            f"reward {number(get('time/reward'), 3)} + update {number(get('time/update'), 3)}",
        )
    )
    lines.append(("tokens / s", number(get("tokens_per_second"), 4)))
    if "sampler/logprob_mismatch" in row:
        lines.append(
            (
                "sampler mismatch",
                f"mean {number(get('sampler/logprob_mismatch'))}, max {number(get('sampler/logprob_mismatch_max'))} "
                f"(|log p| sampler vs trainer; capped {percent(get('rollout_correction/capped_fraction'))})",
            )
        )
    if "sampler/group_size" in row:
        lines.append(("group size", str(get("sampler/group_size"))))
    if last_eval is not None:
        lines.append(("eval accuracy", f"{number(last_eval.get('eval/accuracy'), 3)} (step {last_eval['step']})"))
    return lines


def status_panel(
    progress: RenderableType, row: Optional[dict[str, Any]], last_eval: Optional[dict[str, Any]], warnings: list[str]
) -> RenderableType:
    """The live display: progress bar, the last step's numbers, the warnings now present."""
    parts: list[RenderableType] = [progress]
    if row is not None:
        table = Table(show_header=False, box=None, padding=(0, 2), title=f"step {row['step']}", title_justify="left")
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for label, value in status_lines(row, last_eval):
            table.add_row(label, value)
        parts.append(table)
    parts += [Text(f"warning: {warning}", style="bold yellow") for warning in warnings]
    return Group(*parts)


def sample_entries(step: int, rollout: Any, rewards: Any, advantages: Any, prompts: int) -> list[dict[str, Any]]:
    """The first `prompts` groups of a step as plain JSON: prompt, answer, the G completions with
    their total and per-function rewards, advantages and truncation (one samples.jsonl line each)."""
    group = rollout.group_size
    entries = []
    for index in range(min(prompts, rollout.num_prompts)):
        rows = slice(index * group, (index + 1) * group)
        entries.append(
            {
                "step": step,
                "prompt": rollout.prompts[rows.start],
                "answer": rollout.columns.get("answer", [None] * len(rollout.prompts))[rows.start],
                "completions": rollout.completions[rows],
                "rewards": _floats(rewards.total[index]),
                "per_function": {name: _floats(values[index]) for name, values in rewards.per_function.items()},
                "advantages": _floats(advantages.values[rows]),
                "truncated": [bool(t) for t in rollout.truncated[rows]],
            }
        )
        if "messages" in rollout.columns:  # a multi-turn rollout: the whole conversations
            entries[-1]["conversations"] = rollout.columns["messages"][rows]
            entries[-1]["turns"] = rollout.columns["turns"][rows]
    return entries


def conversation_lines(entry: dict[str, Any], index: int) -> list[str]:
    """Completion `index` of a samples entry as lines: its one completion, or (multi-turn) each
    message after the system prompt as `role: text` (a tool's as `tool NAME: text`), less the
    opening user message that repeats the entry's prompt."""
    if "conversations" not in entry:
        return [entry["completions"][index]]
    lines = []
    for position, message in enumerate(entry["conversations"][index]):
        role = message.get("role", "?")
        if role == "system" or (position <= 1 and role == "user" and message.get("content") == entry["prompt"]):
            continue
        speaker = f"tool {message['name']}" if role == "tool" and message.get("name") else role
        lines.append(f"{speaker}: {message.get('content', '')}")
    return lines


def _floats(values: Any) -> list[Optional[float]]:
    return [None if v != v else round(float(v), 6) for v in values.tolist()]  # NaN (no score) -> null


def samples_table(entry: dict[str, Any]) -> Table:
    """One prompt's group as a table: completion, reward, advantage."""
    title = f"step {entry['step']} · {_shorten(entry['prompt'], COMPLETION_WIDTH)}"
    if entry.get("answer") is not None:
        title += f" · answer {_shorten(str(entry['answer']), 40)}"
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("#", justify="right")
    table.add_column(
        "conversation" if "conversations" in entry else "completion", overflow="fold", max_width=COMPLETION_WIDTH
    )
    table.add_column("reward", justify="right")
    table.add_column("advantage", justify="right")
    for index, (reward, advantage) in enumerate(zip(entry["rewards"], entry["advantages"])):
        cut = " [truncated]" if entry["truncated"][index] else ""
        text = "\n".join(_shorten(line, COMPLETION_WIDTH) for line in conversation_lines(entry, index)) + cut
        table.add_row(str(index), text, number(reward, 3), number(advantage, 3))
    return table


def samples_text(entry: dict[str, Any]) -> str:
    """The same group as plain lines (logs that are not a terminal) and TensorBoard markdown."""
    lines = [f"step {entry['step']} sample: prompt {entry['prompt']!r}, answer {entry.get('answer')!r}"]
    for index, (reward, advantage) in enumerate(zip(entry["rewards"], entry["advantages"])):
        said = conversation_lines(entry, index)
        head = f"    {index}: reward {number(reward, 3)}  advantage {number(advantage, 3)}"
        if "conversations" not in entry:
            lines.append(f"{head}  {said[0]!r}")
        else:  # one line per message
            lines += [head, *(f"        {line!r}" for line in said)]
    return "\n".join(lines)


def _shorten(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
