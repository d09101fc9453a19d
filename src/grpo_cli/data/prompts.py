"""Stage 1, prompt loading: rows from a file or a built-in task, formatted, batched, resumable.

Rows come from JSONL, JSON (a list of objects, or {"data": [...]}), Parquet or CSV, or from a
built-in synthetic task (`synthetic:addition`). Each step takes the next `prompts_per_step` rows
of an epoch order that is a fixed function of (data.seed, epoch), so the data position is two
integers and resume continues with exactly the prompts a run without a stop would have seen.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import random
import reprlib
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from grpo_cli.config import ConfigError, DataConfig
from grpo_cli.data.tasks import SYNTHETIC_TASKS, synthetic_task_name
from grpo_cli.distributed import ONE_PROCESS, World, local_share
from grpo_cli.records import PromptBatch

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
    kind = _not_a_regular_file(file)
    if kind is not None:
        raise ConfigError(f"Data file {path} {kind}")
    try:
        rows = list(_iter_rows(file, suffix, limit))
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"Data file {path} is not UTF-8 text (line {_first_non_utf8_line(file)}: {error.reason}). "
            "Save it as UTF-8, or check that the path names the data file and not a binary one."
        ) from error
    except PermissionError as error:
        raise ConfigError(
            f"Data file {path} cannot be read: permission denied. Make it readable (chmod a+r {path})."
        ) from error
    except (ValueError, OSError) as error:
        raise ConfigError(
            f"Data file {path} could not be read as {suffix[1:]}: {error}. Fix the file "
            f"(or convert it to one of {', '.join(FILE_FORMATS)})."
        ) from error
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ConfigError(f"Data file {path}: record {bad + 1} is not an object with named fields.")
    if not rows:
        raise ConfigError(
            f"Data file {path} holds no records. Give data.path / data.eval_path a file with at least one."
        )
    return rows


# What a path that is not a regular file is, by its stat mode. None of them is opened: reading
# a FIFO would wait for a writer, and a device may never end.
SPECIAL_FILES = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _not_a_regular_file(file: Path) -> Optional[str]:
    """Why `file` cannot be read as a data file (the rest of the sentence after its name), or
    None for a regular file (or a symlink to one)."""
    try:
        mode = file.stat().st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            return (
                "is a symlink loop (its links lead back to themselves, never to a file). Point "
                "the link at the data file, or give the file itself in data.path / data.eval_path."
            )
        if file.is_symlink():
            return (
                f"is a symlink to {os.readlink(file)}, which does not exist. Fix the link, or "
                "give the file itself in data.path / data.eval_path."
            )
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            return "does not exist. Check data.path / data.eval_path."
        return f"cannot be looked at ({error.strerror}). Check data.path / data.eval_path."
    if stat.S_ISDIR(mode):
        return "is a folder, not a file. Give the file itself in data.path / data.eval_path."
    for test, kind in SPECIAL_FILES:
        if test(mode):
            return (
                f"is {kind}, not a regular file, so it was not opened: validation reads every "
                "record before the run starts. Save the data to a file and give that in data.path "
                "/ data.eval_path."
            )
    return None


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
                except RecursionError:
                    raise ValueError(f"line {number} {TOO_DEEP}") from None
                count += 1
    elif suffix == ".json":
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except RecursionError:
            raise ValueError(f"the file {TOO_DEEP}") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError('expected a list of objects, or {"data": [...]}')
        yield from data[:limit]
    elif suffix == ".csv":
        # utf-8-sig: spreadsheet programs often start CSV files with a byte-order mark.
        with file.open(encoding="utf-8-sig", newline="") as handle:
            reader = csv.DictReader(handle, restkey=RAGGED, restval=RAGGED)
            for index, row in enumerate(reader):
                if limit is not None and index >= limit:
                    return
                if RAGGED in row or RAGGED in row.values():  # a field more, or fewer, than the header
                    fields = len(reader.fieldnames) + len(row.get(RAGGED, [])) - list(row.values()).count(RAGGED)
                    raise ValueError(
                        f"line {reader.line_num} has {fields} fields, but the header has "
                        f"{len(reader.fieldnames)} ({', '.join(reader.fieldnames)}). Quote values that "
                        "hold commas, and give every row one value per column"
                    )
                yield row
    else:
        import pyarrow.parquet as parquet

        table = parquet.read_table(file)
        yield from (table.slice(0, limit) if limit is not None else table).to_pylist()


TOO_DEEP = "is nested too deeply to read (lists or objects inside each other past Python's recursion limit)"
RAGGED = object()  # csv.DictReader's stand-in for the values a ragged row lacks, and the key of its extras


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
    and removed from training; else there are none. data.eval_size=0 turns the eval off: no
    eval rows, data.eval_path is not read (a preset's may live on another machine) and nothing
    is held out.
    """
    rows = load_rows(data.path)
    if data.eval_size <= 0:
        return rows, []
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
    if (
        data.eval_holdout < len(rows)
        or data.eval_path
        or synthetic_task_name(data.path) is not None
        or data.eval_size <= 0
    ):
        return None
    return (
        f"data.eval_holdout={data.eval_holdout} leaves no training prompt: {data.path} holds "
        f"{len(rows)} rows. Hold out fewer, or give data.eval_path."
    )


def _unknown_task(path: str) -> str:
    return (
        f"data.path={path}: no built-in task of that name; the built-in tasks are "
        f"{', '.join('synthetic:' + name for name in SYNTHETIC_TASKS)}."
    )


def data_problems(
    data: DataConfig, model: Optional[tuple[Any, Optional[int]]] = None, max_new_tokens: int = 0
) -> list[str]:
    """The data checks of `validate`: every file exists and parses, every record has a prompt
    (non-empty text) and an answer (not null), no column takes the name of a reward function's
    own argument, and (given `model` = (tokenizer, context length)) every formatted prompt plus
    sampler.max_new_tokens fits the model's context. data.eval_path is not read when
    data.eval_size=0 turns the eval off."""
    problems = []
    for key, path in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if not path or (key == "data.eval_path" and data.eval_size <= 0):
            continue
        task = synthetic_task_name(path)
        try:
            rows = load_rows(path)
        except ConfigError as error:
            problems.append(str(error) if task is not None else f"{key}: {error}")
            continue
        field_problems = _field_problems(data, path, rows) + _value_problems(data, key, path, rows)
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


# The names a reward function is called with besides the data's columns (rewards/api.py:
# call_reward passes prompts and completions, RewardScorer.score adds completion_length). A column
# of one of these names would collide with it in the call, and fail inside the reward.
REWARD_ARGUMENTS = ("prompts", "completions", "completion_length")


def _value_problems(data: DataConfig, key: str, path: str, rows: list[dict[str, Any]]) -> list[str]:
    """Records whose prompt is not text, whose answer is null, or whose columns collide with
    the reward call's own arguments. Missing fields are _field_problems' to report."""
    problems = []
    prompt, answer = data.prompt_field, data.answer_field
    bad = [
        (number, row[prompt])
        for number, row in enumerate(rows, start=1)
        if prompt in row and not (isinstance(row[prompt], str) and row[prompt].strip())
    ]
    if bad:
        number, value = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        problems.append(
            f"data.prompt_field={prompt!r}: record {number}{more} of {path} holds {_describe(value)}, "
            "not prompt text. Every prompt must be a non-empty string: fix or drop those records, "
            "or point data.prompt_field at the column that holds the prompts."
        )
    if answer != prompt:
        null = [number for number, row in enumerate(rows, start=1) if answer in row and row[answer] is None]
        if null:
            more = f" (and {len(null) - 1} more)" if len(null) > 1 else ""
            problems.append(
                f"data.answer_field={answer!r}: record {null[0]}{more} of {path} holds null, so its "
                "completions cannot be scored. Give every record an answer, or drop those records."
            )
    columns = {name for row in rows for name in row if name != prompt}
    for name in REWARD_ARGUMENTS:
        if name in columns:
            problems.append(
                f"{key}={path}: the column {name!r} has the name of an argument every reward function "
                f"is called with ({', '.join(REWARD_ARGUMENTS)}), so it cannot reach them as a column. "
                "Rename the column in the file (data.prompt_field may name it, if it holds the prompts)."
            )
    return problems


_SHORT = reprlib.Repr()  # a bounded repr: a huge or deeply nested value cannot flood (or overflow) the message
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel = 60, 60, 3


def _describe(value: Any) -> str:
    """A prompt value that is not text, in words: `null`, `the number 17`, `a list [...]`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "an empty string" if not value else f"only whitespace ({value!r})"
    kind = {dict: "an object", list: "a list"}.get(type(value), f"a {type(value).__name__}")
    return f"{kind} {_SHORT.repr(value)}"


def _length_problems(
    data: DataConfig,
    key: str,
    path: str,
    rows: list[dict[str, Any]],
    tokenizer,
    context: Optional[int],
    max_new_tokens: int,
) -> list[str]:
    """Prompt tokens + max_new_tokens must fit in the model's positions, or generation fails
    (or silently degrades) mid-run on the first long prompt."""
    if context is None:
        return []
    if max_new_tokens >= context:
        return [
            f"sampler.max_new_tokens={max_new_tokens} leaves no room for a prompt in the "
            f"model's context of {context} positions (max_position_embeddings). Lower it."
        ]
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
    texts = [format_prompt(tokenizer, str(row[data.prompt_field]), data, chat) for row in rows]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=not chat, verbose=False)["input_ids"]]


def prompt_messages(text: str, data: DataConfig) -> list[dict[str, str]]:
    """The chat of one prompt: the system prompt where there is one, the few-shot messages, then
    the row's text."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    messages += [dict(message) for message in data.few_shot]
    return [*messages, {"role": "user", "content": text}]


def format_prompt(tokenizer, text: str, data: DataConfig, use_chat_template: bool) -> str:
    if use_chat_template:
        messages = prompt_messages(text, data)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{data.system_prompt}\n\n{text}" if data.system_prompt else text


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

    def __init__(
        self, data: DataConfig, tokenizer, rows: list[dict[str, Any]] | None = None, world: World = ONE_PROCESS
    ):
        self.data = data
        self.world = world  # under torchrun: every rank walks the same order and keeps its share
        self.tokenizer = tokenizer
        self.rows = rows if rows is not None else load_rows(data.path)
        self.chat = wants_chat_template(data.use_chat_template, tokenizer)
        if data.few_shot and not self.chat:  # auto on a tokenizer without a template: they would be lost
            raise ConfigError("data.few_shot needs a chat template, and this tokenizer has none; set few_shot=[].")
        self.epoch = 0
        self.position = 0  # rows of the current epoch already handed out
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.data.shuffle:
            random.Random(f"{self.data.seed}-{epoch}").shuffle(order)
        return order

    @property
    def prompts_per_rank(self) -> int:
        """The prompts of one batch on this rank: its share of data.prompts_per_step."""
        return max(1, self.data.prompts_per_step // self.world.world_size)

    def next_batch(self) -> PromptBatch:
        picked = []
        while len(picked) < self.data.prompts_per_step:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            picked.append(self.rows[self._order[self.position]])
            self.position += 1
        return self.make_batch(local_share(picked, self.world))

    def make_batch(self, rows: list[dict[str, Any]]) -> PromptBatch:
        data = self.data
        texts = [format_prompt(self.tokenizer, str(row[data.prompt_field]), data, self.chat) for row in rows]
        # A chat template already writes the model's special tokens itself.
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not self.chat)
        columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != data.prompt_field}
        columns["answer"] = [row.get(data.answer_field) for row in rows]
        return PromptBatch(
            texts=texts,
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            columns=columns,
            messages=[prompt_messages(str(row[data.prompt_field]), data) for row in rows] if self.chat else None,
        )

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


def batches(rows: list[dict[str, Any]], size: int) -> Iterable[list[dict[str, Any]]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]
