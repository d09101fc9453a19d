"""Bad data and wrong-key blame: each case refused by `validate` with one message naming the file,
the record or line and the key, before anything is loaded (and never as a traceback).

In process through validate(config(...)) on the tiny model (the CLI path is the same one:
pipeline.run calls validate first); one case through the real `grpo-train`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo_cli.config import ConfigError
from grpo_cli.data.prompts import train_and_eval_rows
from grpo_cli.validation import validate
from helpers import config, input_error

GOOD = {"prompt": "Question: what is 1 + 2? Answer:", "answer": "3"}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def validate_error(tiny_model_dir: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError, match="nothing was loaded") as caught:
        validate(config(tiny_model_dir, *overrides))
    return str(caught.value)


# ---------------------------------------------------------------- the prompt and the answer


@pytest.mark.parametrize(
    "value,described",
    [
        (17, "the number 17"),
        (2.5, "the number 2.5"),
        (None, "null"),
        (True, "the boolean true"),
        ({"text": "hi"}, "an object {'text': 'hi'}"),
        (["a", "b"], "a list ['a', 'b']"),
        ("", "an empty string"),
        ("  \n", "only whitespace ('  \\n')"),
    ],
)
def test_a_prompt_that_is_not_text_is_refused(tiny_model_dir, tmp_path, value, described):
    # Before: str(value) became the prompt ("None", "{'text': 'hi'}", ""), and training went on.
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, {"prompt": value, "answer": "3"}, GOOD])
    message = validate_error(tiny_model_dir, f"data.path={path}")
    assert (
        f"data.prompt_field='prompt': record 2 of {path} holds {described}, not prompt text. Every "
        "prompt must be a non-empty string"
    ) in message


def test_bad_prompts_are_counted_and_a_huge_one_is_shown_short(tiny_model_dir, tmp_path):
    nested = [[[[list(range(1000))]]]]
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, {"prompt": nested, "answer": "3"}, {"prompt": 1, "answer": "3"}])
    message = validate_error(tiny_model_dir, f"data.path={path}")
    assert f"record 2 (and 1 more) of {path} holds a list [[[[...]]]], not prompt text" in message


def test_an_empty_csv_prompt_and_a_null_parquet_prompt(tiny_model_dir, tmp_path):
    csv_path = tmp_path / "rows.csv"
    csv_path.write_text("prompt,answer\nWhat is 1 + 2?,3\n,4\n", encoding="utf-8")
    assert f"record 2 of {csv_path} holds an empty string" in validate_error(tiny_model_dir, f"data.path={csv_path}")
    parquet_path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, {"prompt": None, "answer": "4"}]), parquet_path)
    assert f"record 2 of {parquet_path} holds null" in validate_error(tiny_model_dir, f"data.path={parquet_path}")


def test_a_null_answer_is_refused(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, GOOD, {"prompt": "What is 2 + 2?", "answer": None}])
    message = validate_error(tiny_model_dir, f"data.path={path}")
    assert (
        f"data.answer_field='answer': record 3 of {path} holds null, so its completions cannot be "
        "scored. Give every record an answer, or drop those records."
    ) in message


def test_good_prompts_and_answers_pass(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, {"prompt": "x", "answer": 7}, {"prompt": "y", "answer": ""}])
    validate(config(tiny_model_dir, f"data.path={path}"))  # a number or empty answer is the reward's to judge


# ---------------------------------------------------------------- columns and file shapes


@pytest.mark.parametrize("column", ["prompts", "completions", "completion_length"])
def test_a_column_named_like_a_reward_argument_is_refused(tiny_model_dir, tmp_path, column):
    # Before: validate passed, and the reward call failed ("got multiple values for argument
    # 'completions'") blaming the reward function, or completion_length silently replaced it.
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, {**GOOD, column: "x"}])
    message = validate_error(tiny_model_dir, f"data.path={path}")
    assert (
        f"data.path={path}: the column '{column}' has the name of an argument every reward function "
        "is called with (prompts, completions, completion_length), so it cannot reach them as a "
        "column. Rename the column in the file"
    ) in message


def test_a_prompt_field_named_prompts_is_no_column(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompts": "What is 1 + 2?", "answer": "3"}])
    validate(config(tiny_model_dir, f"data.path={path}", "data.prompt_field=prompts"))


@pytest.mark.parametrize("row,fields", [("What is 2 + 2?,4,extra", 3), ("What is 2 + 2?", 1)])
def test_a_ragged_csv_row_names_its_line(tiny_model_dir, tmp_path, row, fields):
    path = tmp_path / "rows.csv"
    path.write_text(f'prompt,answer\nWhat is 1 + 2?,3\n"What is\n1 + 1?",2\n{row}\n', encoding="utf-8")
    message = validate_error(tiny_model_dir, f"data.path={path}")
    # line 5: the quoted prompt of the record before spans lines 3 and 4
    assert (
        f"Data file {path} could not be read as csv: line 5 has {fields} fields, but the header has 2 "
        "(prompt, answer). Quote values that hold commas, and give every row one value per column"
    ) in message


@pytest.mark.parametrize(
    "name,text",
    [
        ("rows.jsonl", json.dumps(GOOD) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n"),
        ("rows.json", "[" * 100_000 + "]" * 100_000),
    ],
)
def test_a_deeply_nested_record_is_a_message_not_a_recursion_error(tiny_model_dir, tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    where = "line 2" if name.endswith("jsonl") else "the file"
    assert (
        f"Data file {path} could not be read as {path.suffix[1:]}: {where} is nested too deeply to read"
        in validate_error(tiny_model_dir, f"data.path={path}")
    )


@pytest.mark.slow
def test_a_deeply_nested_record_through_the_cli(tiny_model_dir, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    message = input_error(
        "grpo-train",
        f"model.name_or_path={tiny_model_dir}",
        f"data.path={path}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert f"data.path: Data file {path} could not be read as jsonl: line 2 is nested too deeply to read" in message


def make_special(kind: str, path: Path, tmp_path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))  # the file stays after the close
        server.close()
    elif kind == "device":
        path.symlink_to("/dev/null")
    elif kind == "loop":
        path.symlink_to(tmp_path / "other.jsonl")
        (tmp_path / "other.jsonl").symlink_to(path)
    else:
        path.symlink_to(tmp_path / "gone.jsonl")


@pytest.mark.parametrize(
    "kind,said",
    [
        ("fifo", "is a FIFO, not a regular file, so it was not opened"),
        ("socket", "is a socket, not a regular file, so it was not opened"),
        ("device", "is a character device, not a regular file, so it was not opened"),
        ("loop", "is a symlink loop (its links lead back to themselves, never to a file)"),
        ("dangling", "is a symlink to {tmp}/gone.jsonl, which does not exist. Fix the link"),
    ],
)
def test_a_data_path_that_is_not_a_regular_file_says_what_it_is(tiny_model_dir, tmp_path, monkeypatch, kind, said):
    # Before: each was "does not exist". The FIFO is never opened: opening it would wait for a writer.
    monkeypatch.chdir(tmp_path)  # a short relative path: a socket's path must fit in 108 bytes
    path = Path("rows.jsonl")
    make_special(kind, path, tmp_path)
    message = validate_error(tiny_model_dir, f"data.path={path}")
    assert f"data.path: Data file {path} {said.format(tmp=tmp_path)}" in message


# ---------------------------------------------------------------- data.eval_size=0


def test_eval_size_zero_turns_off_an_eval_path_that_is_not_here(tiny_model_dir, tmp_path):
    # As a preset's data.eval_path on another machine: eval_size=0 must not even read it.
    train = write_jsonl(tmp_path / "train.jsonl", [GOOD] * 3)
    overrides = (f"data.path={train}", f"data.eval_path={tmp_path / 'missing.jsonl'}", "data.eval_size=0")
    cfg = config(tiny_model_dir, *overrides)
    validate(cfg)
    assert train_and_eval_rows(cfg.data) == ([GOOD] * 3, [])


def test_eval_size_zero_holds_nothing_out(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"p{index}", "answer": str(index)} for index in range(5)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = config(tiny_model_dir, f"data.path={train}", "data.eval_holdout=5", "data.eval_size=0")
    validate(cfg)  # a holdout of every row leaves training rows when nothing is evaluated
    assert train_and_eval_rows(cfg.data) == (rows, [])


# ---------------------------------------------------------------- the key that is blamed


@pytest.mark.parametrize("rank", [0, -4])
def test_a_lora_rank_below_one_names_model_lora_r(tiny_model_dir, rank):
    # Before: validate passed and peft's error came back as model.lora.target_modules=[...].
    message = validate_error(tiny_model_dir, "model.lora.enabled=true", f"model.lora.r={rank}")
    assert f"model.lora.r={rank} must be at least 1: it is the rank of the adapter matrices" in message
    assert "target_modules" not in message


def test_a_reference_device_without_cuda_names_model_reference_device(tiny_model_dir, monkeypatch):
    # Before: validate passed and load_models said "trainer.device=cuda:0, but torch sees no CUDA device".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = validate_error(tiny_model_dir, "model.reference_device=cuda:0", "trainer.device=cpu")
    assert "model.reference_device=cuda:0, but torch sees no CUDA device" in message
    assert "Use model.reference_device=same (the policy's device), cpu" in message
    assert "trainer.device" not in message


def test_a_reference_device_index_beyond_the_devices(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    message = validate_error(tiny_model_dir, "model.reference_device=cuda:3", "trainer.device=cpu")
    assert "model.reference_device=cuda:3, but torch sees 1 CUDA device(s), numbered from 0" in message
