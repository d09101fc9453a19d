"""Stage 1, prompt loading: rows from a file or a built-in task, formatted, batched, resumable.

Rows come from JSONL, JSON (a list of objects, or {"data": [...]}), Parquet or CSV, or from a
built-in synthetic task (`synthetic:addition`). Each step takes the next `prompts_per_step` rows
of an epoch order that is a fixed function of (data.seed, epoch), so the data position is two
integers and resume continues with exactly the prompts a run without a stop would have seen.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any, Iterable, Optional

from grpo_cli.config import ConfigError, DataConfig
from grpo_cli.distributed import SINGLE, Distributed, local_share
from grpo_cli.records import PromptBatch
from grpo_cli.tasks import SYNTHETIC_TASKS, synthetic_task_name

FILE_FORMATS = (".jsonl", ".json", ".parquet", ".csv")


def read_rows(path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """All rows (or the first `limit`) of a data file as dicts; ConfigError naming the file if unreadable."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in FILE_FORMATS:
        raise ConfigError(
            f"Data file {path}: unknown format '{suffix}'. Use one of {', '.join(FILE_FORMATS)}, or "
            f"a built-in task ({', '.join('synthetic:' + n for n in SYNTHETIC_TASKS)})."
        )
    if file.is_dir():
        raise ConfigError(f"Data file {path} is a folder, not a file. Give the file itself in "
                          "data.path / data.eval_path.")
    if not file.is_file():
        raise ConfigError(f"Data file {path} does not exist. Check data.path / data.eval_path.")
    try:
        rows = list(_iter_rows(file, suffix, limit))
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"Data file {path} is not UTF-8 text (line {_first_non_utf8_line(file)}: {error.reason}). "
            "Save it as UTF-8, or check that the path names the data file and not a binary one."
        ) from error
    except PermissionError as error:
        raise ConfigError(f"Data file {path} cannot be read: permission denied. Make it readable "
                          f"(chmod a+r {path}).") from error
    except (ValueError, OSError) as error:
        raise ConfigError(f"Data file {path} could not be read as {suffix[1:]}: {error}. Fix the file "
                          f"(or convert it to one of {', '.join(FILE_FORMATS)}).") from error
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ConfigError(f"Data file {path}: record {bad + 1} is not an object with named fields.")
    if not rows:
        raise ConfigError(f"Data file {path} holds no records. Give data.path / data.eval_path a "
                          "file with at least one.")
    return rows


def _first_non_utf8_line(file: Path) -> int:
    data = file.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        return data.count(b"\n", 0, error.start) + 1
    return 1


def _iter_rows(file: Path, suffix: str, limit: int | None) -> Iterable[Any]:
    if suffix == ".jsonl":
        with file.open(encoding="utf-8") as handle:
            count = 0
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                if limit is not None and count >= limit:
                    return
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"line {number} is not valid JSON ({error.msg})") from None
                count += 1
    elif suffix == ".json":
        data = json.loads(file.read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError('expected a list of objects, or {"data": [...]}')
        yield from data[:limit]
    elif suffix == ".csv":
        # utf-8-sig: spreadsheet programs often start CSV files with a byte-order mark.
        with file.open(encoding="utf-8-sig", newline="") as handle:
            for index, row in enumerate(csv.DictReader(handle)):
                if limit is not None and index >= limit:
                    return
                yield row
    else:
        import pyarrow.parquet as parquet

        table = parquet.read_table(file)
        yield from (table.slice(0, limit) if limit is not None else table).to_pylist()


def load_rows(path: str) -> list[dict[str, Any]]:
    task = synthetic_task_name(path)
    if task is not None:
        if task not in SYNTHETIC_TASKS:
            raise ConfigError(_unknown_task(path))
        return SYNTHETIC_TASKS[task][0]()
    return read_rows(path)


def train_and_eval_rows(data: DataConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training rows and the held-out eval rows.

    Eval rows come from data.eval_path; else, for a built-in task, from its own eval draw; else,
    with data.eval_holdout = N, from N rows of data.path picked by a fixed draw (`data.seed`)
    and removed from training; else there are none.
    """
    rows = load_rows(data.path)
    if data.eval_path:
        return rows, load_rows(data.eval_path)[: data.eval_size]
    task = synthetic_task_name(data.path)
    if task is not None:
        return rows, SYNTHETIC_TASKS[task][1](data.eval_size, data.seed)
    if data.eval_holdout <= 0:
        return rows, []
    problem = _holdout_problem(data, rows)
    if problem:
        raise ConfigError(problem)
    held = set(random.Random(f"holdout-{data.seed}").sample(range(len(rows)), data.eval_holdout))
    train = [row for index, row in enumerate(rows) if index not in held]
    return train, [rows[index] for index in sorted(held)][: data.eval_size]


def _holdout_problem(data: DataConfig, rows: list[dict[str, Any]]) -> Optional[str]:
    if data.eval_holdout < len(rows) or data.eval_path or synthetic_task_name(data.path) is not None:
        return None
    return (f"data.eval_holdout={data.eval_holdout} leaves no training prompt: {data.path} holds "
            f"{len(rows)} rows. Hold out fewer, or give data.eval_path.")


def _unknown_task(path: str) -> str:
    return (
        f"data.path={path}: no built-in task of that name; the built-in tasks are "
        f"{', '.join('synthetic:' + name for name in SYNTHETIC_TASKS)}."
    )


def data_problems(data: DataConfig, model: Optional[tuple[Any, Optional[int]]] = None,
                  max_new_tokens: int = 0) -> list[str]:
    """The data checks of `validate`: every file exists and parses, every record has the prompt
    and answer fields, and (given `model` = (tokenizer, context length)) every formatted prompt
    plus sampler.max_new_tokens fits the model's context."""
    problems = []
    for key, path in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if not path:
            continue
        task = synthetic_task_name(path)
        try:
            rows = load_rows(path)
        except ConfigError as error:
            problems.append(str(error) if task is not None else f"{key}: {error}")
            continue
        field_problems = _field_problems(data, path, rows)
        problems += field_problems
        if key == "data.path" and _holdout_problem(data, rows):
            problems.append(_holdout_problem(data, rows))
        if model is not None and not field_problems:
            problems += _length_problems(data, key, path, rows, *model, max_new_tokens)
    return problems


def _field_problems(data: DataConfig, path: str, rows: list[dict[str, Any]]) -> list[str]:
    problems = []
    for field_key in ("prompt_field", "answer_field"):
        name = getattr(data, field_key)
        if name not in rows[0]:
            problems.append(
                f"data.{field_key}={name!r} is not a field of {path}; its first record has "
                f"{', '.join(map(repr, rows[0])) or 'no fields'}."
            )
            continue
        lacking = [number for number, row in enumerate(rows, start=1) if name not in row]
        if lacking:
            more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
            problems.append(
                f"data.{field_key}={name!r}: record {lacking[0]}{more} of {path} has no such field. "
                "Every record needs it: fix or drop those records."
            )
    return problems


def _length_problems(data: DataConfig, key: str, path: str, rows: list[dict[str, Any]],
                     tokenizer, context: Optional[int], max_new_tokens: int) -> list[str]:
    """Prompt tokens + max_new_tokens must fit in the model's positions, or generation fails
    (or silently degrades) mid-run on the first long prompt."""
    if context is None:
        return []
    if max_new_tokens >= context:
        return [f"sampler.max_new_tokens={max_new_tokens} leaves no room for a prompt in the "
                f"model's context of {context} positions (max_position_embeddings). Lower it."]
    try:
        lengths = prompt_lengths(data, rows, tokenizer)
    except ConfigError as error:
        return [str(error)]
    too_long = [number for number, length in enumerate(lengths, start=1) if length + max_new_tokens > context]
    if not too_long:
        return []
    first = too_long[0]
    more = f" (and {len(too_long) - 1} more records)" if len(too_long) > 1 else ""
    return [
        f"{key}={path}: record {first}{more} has a prompt of {lengths[first - 1]} tokens; with "
        f"sampler.max_new_tokens={max_new_tokens} that needs {lengths[first - 1] + max_new_tokens} "
        f"positions, more than the model's context of {context} (max_position_embeddings). Shorten "
        "or drop those prompts, or lower sampler.max_new_tokens."
    ]


def prompt_lengths(data: DataConfig, rows: list[dict[str, Any]], tokenizer) -> list[int]:
    """Each row's prompt in tokens, formatted as PromptSource formats it."""
    chat = wants_chat_template(data.use_chat_template, tokenizer)
    texts = [format_prompt(tokenizer, str(row[data.prompt_field]), data.system_prompt, chat) for row in rows]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=not chat, verbose=False)["input_ids"]]


def format_prompt(tokenizer, text: str, system_prompt: str | None, use_chat_template: bool) -> str:
    if use_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n\n{text}" if system_prompt else text


def wants_chat_template(setting: str, tokenizer) -> bool:
    setting = str(setting).lower()
    if setting == "auto":
        return bool(getattr(tokenizer, "chat_template", None))
    if setting == "true" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data.use_chat_template=true, but the tokenizer has no chat template. Set it to "
            "false (plain prompts) or use a model folder whose tokenizer defines one."
        )
    return setting == "true"


class PromptSource:
    """Hands out PromptBatch after PromptBatch, epoch after epoch, in a resumable order. Each
    batch is data.prompts_per_step prompts, or this rank's share of them under torchrun."""

    def __init__(self, data: DataConfig, tokenizer, rows: list[dict[str, Any]] | None = None,
                 place: Distributed = SINGLE):
        self.data = data
        self.place = place  # under torchrun: every rank walks the same order and keeps its share
        self.tokenizer = tokenizer
        self.rows = rows if rows is not None else load_rows(data.path)
        self.chat = wants_chat_template(data.use_chat_template, tokenizer)
        self.epoch = 0
        self.position = 0  # rows of the current epoch already handed out
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.data.shuffle:
            random.Random(f"{self.data.seed}-{epoch}").shuffle(order)
        return order

    def next_batch(self) -> PromptBatch:
        picked = []
        while len(picked) < self.data.prompts_per_step:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            picked.append(self.rows[self._order[self.position]])
            self.position += 1
        return self.make_batch(local_share(picked, self.place))

    def make_batch(self, rows: list[dict[str, Any]]) -> PromptBatch:
        data = self.data
        texts = [
            format_prompt(self.tokenizer, str(row[data.prompt_field]), data.system_prompt, self.chat)
            for row in rows
        ]
        # A chat template already writes the model's special tokens itself.
        encoded = self.tokenizer(
            texts, return_tensors="pt", padding=True, add_special_tokens=not self.chat
        )
        columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != data.prompt_field}
        columns["answer"] = [row.get(data.answer_field) for row in rows]
        return PromptBatch(
            texts=texts,
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            columns=columns,
        )

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


def batches(rows: list[dict[str, Any]], size: int) -> Iterable[list[dict[str, Any]]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]
