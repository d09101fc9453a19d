"""Stage 1, prompt loading: file formats, data checks, batching, epoch order and exact resume.

The tokenizer is the project's own tiny byte-level BPE, trained here in milliseconds on a few
texts: nothing is downloaded.
"""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo_cli.config import ConfigError, DataConfig
from grpo_cli.data.prompts import PromptSource, data_problems, read_rows, train_and_eval_rows
from grpo_cli.data.tasks import addition_rows

ROWS = [
    {"id": 0, "question": "What is 1 + 1?", "solution": "2"},
    {"id": 1, "question": "Name a colour of the sky on a clear summer day.", "solution": "blue"},
    {"id": 2, "question": "Hi?", "solution": "hello"},
    {"id": 3, "question": "What is 10 - 3?", "solution": "7"},
    {"id": 4, "question": "Spell cat backwards.", "solution": "tac"},
]


@pytest.fixture(scope="module")
def tokenizer():
    from grpo_cli.models.tiny import train_tokenizer

    texts = [row["question"] for row in ROWS] + ["Question: what is 3 + 4? Answer: 7", "Be brief."]
    return train_tokenizer(texts, 300)


def data_config(path: str, **overrides) -> DataConfig:
    fields = dict(
        path=path,
        prompt_field="question",
        answer_field="solution",
        system_prompt=None,
        use_chat_template="false",
        prompts_per_step=2,
        shuffle=True,
        seed=0,
        eval_path=None,
        eval_size=200,
    )
    fields.update(overrides)
    return DataConfig(**fields)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def ids(batch) -> list[int]:
    return list(batch.columns["id"])


# ---------------------------------------------------------------- read_rows: formats

SIMPLE = [{"prompt": "p1", "answer": "1"}, {"prompt": "p2", "answer": "2"}, {"prompt": "p3", "answer": "3"}]


def _write(tmp_path: Path, kind: str) -> Path:
    if kind == "jsonl":
        return write_jsonl(tmp_path / "rows.jsonl", SIMPLE)
    if kind == "json-list":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps(SIMPLE), encoding="utf-8")
        return path
    if kind == "json-data":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps({"data": SIMPLE, "version": 1}), encoding="utf-8")
        return path
    if kind == "csv":
        path = tmp_path / "rows.csv"
        with path.open("w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["prompt", "answer"])
            writer.writeheader()
            writer.writerows(SIMPLE)
        return path
    if kind == "parquet":
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(SIMPLE), path)
        return path
    raise AssertionError(kind)


FORMATS = ["jsonl", "json-list", "json-data", "csv", "parquet"]


@pytest.mark.parametrize("kind", FORMATS)
def test_read_rows_every_format(tmp_path, kind):
    # All values are strings, so CSV (which only knows strings) gives the same dicts.
    assert read_rows(str(_write(tmp_path, kind))) == SIMPLE


@pytest.mark.parametrize("kind", FORMATS)
def test_read_rows_limit_one(tmp_path, kind):
    assert read_rows(str(_write(tmp_path, kind)), limit=1) == SIMPLE[:1]


def test_read_rows_suffix_is_case_insensitive(tmp_path):
    path = write_jsonl(tmp_path / "ROWS.JSONL", SIMPLE)
    assert read_rows(str(path)) == SIMPLE


def test_read_rows_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('\n{"prompt": "a"}\n\n   \n{"prompt": "b"}\n', encoding="utf-8")
    assert read_rows(str(path)) == [{"prompt": "a"}, {"prompt": "b"}]
    assert read_rows(str(path), limit=1) == [{"prompt": "a"}]


def test_read_rows_jsonl_limit_stops_before_a_bad_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\nnot json\n', encoding="utf-8")
    assert read_rows(str(path), limit=1) == [{"prompt": "a"}]  # line 2 is never parsed


# ---------------------------------------------------------------- read_rows: errors


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError) as info:
        read_rows(str(path))
    assert str(path) in str(info.value) and "does not exist" in str(info.value)


def test_unknown_suffix(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("hello\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        read_rows(str(path))
    message = str(info.value)
    assert str(path) in message and "'.txt'" in message
    assert ".jsonl" in message and "synthetic:addition" in message


def test_invalid_json_line_names_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    # Line 1 ok, line 2 blank (still counted), line 3 broken.
    path.write_text('{"prompt": "a"}\n\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        read_rows(str(path))
    message = str(info.value)
    assert str(path) in message and "line 3" in message


def test_invalid_json_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text("[{", encoding="utf-8")
    with pytest.raises(ConfigError, match="rows.json"):
        read_rows(str(path))


def test_json_that_is_not_a_list(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": SIMPLE}), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        read_rows(str(path))
    assert str(path) in str(info.value) and '{"data": [...]}' in str(info.value)


def test_record_that_is_not_an_object(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n["b"]\n', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        read_rows(str(path))
    assert str(path) in str(info.value) and "record 2" in str(info.value)


@pytest.mark.parametrize(
    "name, content",
    [
        ("empty.jsonl", ""),
        ("blank.jsonl", "\n\n  \n"),
        ("empty.json", "[]"),
        ("empty_data.json", '{"data": []}'),
        ("header_only.csv", "prompt,answer\n"),
        ("empty.csv", ""),
    ],
)
def test_file_without_records(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        read_rows(str(path))
    assert str(path) in str(info.value) and "holds no records" in str(info.value)


@pytest.mark.parametrize("name", ["empty.json", "empty.parquet"])
def test_zero_byte_file_that_cannot_parse(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        read_rows(str(path))
    assert str(path) in str(info.value)


# ---------------------------------------------------------------- data_problems


def test_data_problems_none_for_good_fields(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    assert data_problems(data_config(str(path))) == []


def test_data_problems_unknown_fields_name_field_and_list_available(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    problems = data_problems(data_config(str(path), prompt_field="prompt", answer_field="answer"))
    assert len(problems) == 2
    prompt_problem, answer_problem = problems
    assert "data.prompt_field='prompt'" in prompt_problem
    assert "data.answer_field='answer'" in answer_problem
    for problem in problems:
        assert str(path) in problem
        assert "'id', 'question', 'solution'" in problem  # the first record's fields, in order


def test_data_problems_reports_only_the_wrong_field(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    problems = data_problems(data_config(str(path), answer_field="gold"))
    assert len(problems) == 1 and "data.answer_field='gold'" in problems[0]


def test_data_problems_checks_the_eval_file_too(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    missing = tmp_path / "eval.jsonl"
    problems = data_problems(data_config(str(train), eval_path=str(missing)))
    assert len(problems) == 1
    assert problems[0].startswith("data.eval_path:") and str(missing) in problems[0]


def test_data_problems_unknown_synthetic_task():
    problems = data_problems(data_config("synthetic:multiplication", prompt_field="prompt", answer_field="answer"))
    assert len(problems) == 1
    assert "synthetic:multiplication" in problems[0] and "synthetic:addition" in problems[0]


def test_data_problems_known_synthetic_task():
    assert data_problems(data_config("synthetic:addition", prompt_field="prompt", answer_field="answer")) == []


def test_data_problems_checks_fields_of_synthetic_tasks():
    problems = data_problems(data_config("synthetic:addition", prompt_field="question", answer_field="answer"))
    assert any("prompt_field" in problem for problem in problems)


# ---------------------------------------------------------------- PromptSource: batches


def source(tokenizer, tmp_path, **overrides) -> PromptSource:
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    return PromptSource(data_config(str(path), **overrides), tokenizer)


def test_batch_size_texts_and_columns(tokenizer, tmp_path):
    batch = source(tokenizer, tmp_path, prompts_per_step=3, shuffle=False).next_batch()
    assert batch.size == 3 and batch.input_ids.shape[0] == 3 and batch.attention_mask.shape[0] == 3
    assert batch.input_ids.shape == batch.attention_mask.shape
    assert batch.texts == [row["question"] for row in ROWS[:3]]
    # `answer` comes from data.answer_field ("solution"); other fields keep their names;
    # the prompt field itself is not a column.
    assert batch.columns["answer"] == ["2", "blue", "hello"]
    assert batch.columns["solution"] == ["2", "blue", "hello"]
    assert batch.columns["id"] == [0, 1, 2]
    assert "question" not in batch.columns


def test_batches_are_left_padded(tokenizer, tmp_path):
    # Rows 1 (long) and 2 ("Hi?", short) in one batch.
    src = source(tokenizer, tmp_path, prompts_per_step=3, shuffle=False)
    batch = src.next_batch()
    mask, input_ids = batch.attention_mask, batch.input_ids
    lengths = mask.sum(dim=1)
    assert lengths[2] < lengths[1] == mask.shape[1]  # the longest row fills the width
    for row in range(batch.size):
        width = mask.shape[1]
        expected = torch.cat([torch.zeros(width - lengths[row]), torch.ones(lengths[row])]).long()
        assert torch.equal(mask[row], expected)  # zeros on the left, then ones
        pads = input_ids[row][mask[row] == 0]
        assert (pads == tokenizer.pad_token_id).all()
        assert tokenizer.decode(input_ids[row][mask[row] == 1]) == batch.texts[row]


def test_answer_column_defaults_to_answer_field_named_answer(tokenizer, tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    src = PromptSource(
        data_config("unused.jsonl", prompt_field="prompt", answer_field="answer", shuffle=False), tokenizer, rows=rows
    )
    assert src.next_batch().columns == {"answer": ["1", "2"]}


def test_no_shuffle_keeps_file_order_and_wraps(tokenizer, tmp_path):
    src = source(tokenizer, tmp_path, prompts_per_step=2, shuffle=False)
    seen = [i for _ in range(5) for i in ids(src.next_batch())]
    assert seen == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]  # a batch straddles the epoch boundary


def test_shuffled_order_covers_every_row_once_per_epoch(tokenizer, tmp_path):
    src = source(tokenizer, tmp_path, prompts_per_step=2, shuffle=True, seed=7)
    seen = [i for _ in range(10) for i in ids(src.next_batch())]  # 20 prompts = 4 epochs of 5
    epochs = [seen[start : start + 5] for start in range(0, 20, 5)]
    for epoch in epochs:
        assert sorted(epoch) == [0, 1, 2, 3, 4]
    # The next epoch starts lazily, when its first row is taken: 20 rows end epoch 3.
    assert src.state_dict() == {"epoch": 3, "position": 5}
    assert len({tuple(epoch) for epoch in epochs}) > 1  # reshuffled between epochs


def test_same_seed_same_order_other_seed_other_order(tokenizer, tmp_path):
    def order(seed):
        src = source(tokenizer, tmp_path, prompts_per_step=5, shuffle=True, seed=seed)
        return [ids(src.next_batch()) for _ in range(3)]

    assert order(1) == order(1)
    assert order(1) != order(2)


def test_state_dict_tracks_epoch_and_position(tokenizer, tmp_path):
    src = source(tokenizer, tmp_path, prompts_per_step=2, shuffle=False)
    assert src.state_dict() == {"epoch": 0, "position": 0}
    src.next_batch()
    assert src.state_dict() == {"epoch": 0, "position": 2}
    src.next_batch(), src.next_batch()  # 6 prompts: the 6th is the first of epoch 1
    assert src.state_dict() == {"epoch": 1, "position": 1}


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 5, 7])
def test_resume_gives_exactly_the_following_batches(tokenizer, tmp_path, stop_after):
    uninterrupted = source(tokenizer, tmp_path, prompts_per_step=2, shuffle=True, seed=3)
    reference = [uninterrupted.next_batch() for _ in range(stop_after + 6)]

    first = source(tokenizer, tmp_path, prompts_per_step=2, shuffle=True, seed=3)
    for _ in range(stop_after):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it

    resumed = source(tokenizer, tmp_path, prompts_per_step=2, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    for expected in reference[stop_after:]:
        batch = resumed.next_batch()
        assert batch.texts == expected.texts
        assert batch.columns == expected.columns
        assert torch.equal(batch.input_ids, expected.input_ids)
        assert torch.equal(batch.attention_mask, expected.attention_mask)


# ---------------------------------------------------------------- PromptSource: formatting


def test_system_prompt_as_first_paragraph_without_chat_template(tokenizer, tmp_path):
    src = source(tokenizer, tmp_path, shuffle=False, system_prompt="Be brief.", use_chat_template="false")
    batch = src.next_batch()
    assert batch.texts == ["Be brief.\n\n" + ROWS[0]["question"], "Be brief.\n\n" + ROWS[1]["question"]]
    assert tokenizer.decode(batch.input_ids[0][batch.attention_mask[0] == 1]) == batch.texts[0]


def test_auto_without_chat_template_is_plain(tokenizer, tmp_path):
    src = source(tokenizer, tmp_path, shuffle=False, system_prompt="SYS", use_chat_template="auto")
    assert src.next_batch().texts[0] == "SYS\n\n" + ROWS[0]["question"]


def test_no_system_prompt_is_the_bare_prompt(tokenizer, tmp_path):
    src = source(tokenizer, tmp_path, shuffle=False, system_prompt=None, use_chat_template="false")
    assert src.next_batch().texts[0] == ROWS[0]["question"]


@pytest.mark.parametrize("setting", ["true", "True", "TRUE"])
def test_chat_template_true_without_template_is_a_config_error(tokenizer, tmp_path, setting):
    with pytest.raises(ConfigError, match="use_chat_template=true"):
        source(tokenizer, tmp_path, use_chat_template=setting)


def test_chat_template_is_applied_when_present(tokenizer, tmp_path):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    for setting in ("auto", "true"):
        src = PromptSource(data_config(str(path), shuffle=False, system_prompt="S", use_chat_template=setting), chat)
        assert src.next_batch().texts[0] == f"<system>S<user>{ROWS[0]['question']}<assistant>"
    src = PromptSource(data_config(str(path), shuffle=False, system_prompt="S", use_chat_template="false"), chat)
    assert src.next_batch().texts[0] == "S\n\n" + ROWS[0]["question"]


def test_prompt_source_on_the_synthetic_task(tokenizer):
    src = PromptSource(
        data_config(
            "synthetic:addition", prompt_field="prompt", answer_field="answer", prompts_per_step=4, shuffle=False
        ),
        tokenizer,
    )
    batch = src.next_batch()
    # addition_rows() is a, b in range(10) row-major: 0+0, 0+1, 0+2, 0+3.
    assert batch.texts == [f"Question: what is 0 + {b}? Answer:" for b in range(4)]
    assert batch.columns["answer"] == ["0", "1", "2", "3"]


# ---------------------------------------------------------------- train_and_eval_rows


def test_eval_rows_synthetic_size_and_determinism():
    config = data_config("synthetic:addition", prompt_field="prompt", answer_field="answer", eval_size=7, seed=5)
    rows = train_and_eval_rows(config)[1]
    assert len(rows) == 7
    assert rows == train_and_eval_rows(config)[1]
    all_rows = addition_rows()
    for row in rows:
        assert row in all_rows
        # "Question: what is a + b? Answer:" -> a + b must be the answer
        a, b = row["prompt"].removeprefix("Question: what is ").removesuffix("? Answer:").split(" + ")
        assert row["answer"] == str(int(a) + int(b))
    other = train_and_eval_rows(data_config("synthetic:addition", eval_size=7, seed=6))[1]
    assert other != rows  # another seed, another draw (7 of 100 with repetition)


def test_eval_rows_larger_than_the_task():
    rows = train_and_eval_rows(data_config("synthetic:addition", eval_size=250, seed=0))[1]
    assert len(rows) == 250  # drawn with repetition from the 100 problems


def test_eval_rows_from_an_eval_file_is_cut_to_eval_size(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = write_jsonl(tmp_path / "eval.jsonl", ROWS[::-1])
    rows = train_and_eval_rows(data_config(str(train), eval_path=str(held_out), eval_size=2))[1]
    assert [row["id"] for row in rows] == [4, 3]


def test_eval_rows_file_without_eval_path_is_empty(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert train_and_eval_rows(data_config(str(train)))[1] == []


def test_eval_holdout_takes_rows_out_of_training(tmp_path):
    train_file = write_jsonl(tmp_path / "train.jsonl", ROWS)
    config = data_config(str(train_file), eval_holdout=2)
    train, held = train_and_eval_rows(config)
    assert len(train) == len(ROWS) - 2 and len(held) == 2
    assert sorted(row["id"] for row in train + held) == sorted(row["id"] for row in ROWS)  # a split
    assert (train, held) == train_and_eval_rows(config)  # a fixed draw
    assert train_and_eval_rows(data_config(str(train_file), eval_holdout=2, eval_path=str(train_file)))[0] == ROWS


def test_eval_holdout_of_every_row_is_refused(tmp_path):
    train_file = write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(ConfigError, match="data.eval_holdout=5 leaves no training prompt"):
        train_and_eval_rows(data_config(str(train_file), eval_holdout=len(ROWS)))


def test_few_shot_messages_sit_between_the_system_prompt_and_each_question(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    chat_tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    few_shot = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]
    path = str(write_jsonl(tmp_path / "rows.jsonl", ROWS))
    data = data_config(path, system_prompt="Be brief.", use_chat_template="true", few_shot=few_shot)
    batch = PromptSource(data, chat_tokenizer).make_batch(ROWS[3:4])
    question = {"role": "user", "content": "What is 10 - 3?"}
    assert batch.messages[0] == [{"role": "system", "content": "Be brief."}, *few_shot, question]
    rendered = chat_tokenizer.apply_chat_template(batch.messages[0], tokenize=False, add_generation_prompt=True)
    assert batch.texts[0] == rendered and rendered.index("1 + 1") < rendered.index("10 - 3")


def test_few_shot_messages_need_a_chat_template(tokenizer, tmp_path):
    path = str(write_jsonl(tmp_path / "rows.jsonl", ROWS))
    data = data_config(path, use_chat_template="auto", few_shot=[{"role": "user", "content": "Hi?"}])
    with pytest.raises(ConfigError, match="data.few_shot needs a chat template"):
        PromptSource(data, tokenizer)  # the tiny tokenizer has none: auto means plain prompts


def test_bad_few_shot_messages_are_named(tiny_model_dir):
    from grpo_cli.validation import validate
    from helpers import config

    cfg = config(tiny_model_dir, "data.few_shot=[{role: robot, content: hi}]", "data.use_chat_template=false")
    with pytest.raises(ConfigError) as caught:
        validate(cfg, check_files=False)
    message = str(caught.value)
    assert "data.few_shot needs chat prompts" in message
    assert (
        "data.few_shot[0]={'role': 'robot', 'content': 'hi'}: give a message {role: user | assistant | tool" in message
    )
