"""Local data: JSONL/parquet rows, bad rows named by file and line, prompt masking, resumable loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlpost.config.schema.data import DataConfig
from rlpost.data.dataloader import PromptLoader
from rlpost.data.datasets import DataError, load_rows, read_jsonl


def cfg(path: Path, **kw: object) -> DataConfig:
    return DataConfig(dataset_name="jsonl", train_data_path=str(path), env_name="math", **kw)  # type: ignore[arg-type]


def test_jsonl_rows(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"problem": "1+1", "expected_answer": 2}\n\n{"problem": "2+2", "expected_answer": "4"}\n')
    rows = load_rows(cfg(p), "train")
    assert rows == [
        {"problem": "1+1", "expected_answer": "2", "env_name": "math"},
        {"problem": "2+2", "expected_answer": "4", "env_name": "math"},
    ]


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ('{"problem": "a", "expected_answer": "b"}\n{"problem": "c", \n', ":2:", "malformed JSON"),
        ('{"problem": "a", "expected_answer": "b"}\n[1, 2]\n', ":2:", "expected a JSON object"),
        ('{"problem": "a"}\n', ":1:", "missing key 'expected_answer'"),
        ('{"problem": {"x": 1}, "expected_answer": "b"}\n', ":1:", "must be a string or number"),
        ('{"problem": "a", "expected_answer": "b"}\n{"problem": "c", "expected_answer": "d", "problem": "e"}\n',
         ":2:", "key 'problem' appears twice in one object"),
        ('{"problem": "a", "expected_answer": "b", "meta": {"k": 1, "k": 2}}\n', ":1:", "key 'k' appears twice"),
    ],
)
def test_bad_rows_are_named_by_file_and_line(tmp_path: Path, text: str, where: str, what: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(DataError) as e:
        read_jsonl(str(p), cfg(p))
    assert f"{p}{where}" in str(e.value) and what in str(e.value)


def test_a_row_nested_too_deeply_is_named_by_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "deep.jsonl"
    p.write_text('{"problem": "a", "expected_answer": "b"}\n{"problem": ' + "[" * 50_000 + "]" * 50_000 + "}\n")
    with pytest.raises(DataError, match=rf"^{p}:2: nested too deeply"):
        read_jsonl(str(p), cfg(p))


def test_parquet_rows(tmp_path: Path) -> None:
    from datasets import Dataset

    p = tmp_path / "t.parquet"
    Dataset.from_list([{"problem": "x", "expected_answer": "1"}, {"problem": "y", "expected_answer": "2"}]).to_parquet(p)
    rows = load_rows(DataConfig(dataset_name="parquet", train_data_path=str(p), env_name="math"), "train")
    assert [r["problem"] for r in rows] == ["x", "y"]


def test_prompt_processor_masks_overlong_prompts(tiny_tokenizer: object) -> None:
    from rlpost.data.prompts import PromptProcessor

    proc = PromptProcessor(DataConfig(max_input_seq_length=6), tiny_tokenizer)
    short = proc({"problem": "Copy the digit 7", "expected_answer": "7"})
    long = proc({"problem": "Copy the digit 7 " * 10, "expected_answer": "7"})
    assert short["loss_multiplier"] == 1.0 and not short["too_long"]
    assert long["loss_multiplier"] == 0.0 and long["too_long"] and len(long["prompt_ids"]) == 6


def test_a_prompt_keeps_room_for_the_answer(tiny_tokenizer: object) -> None:
    """A prompt cut to the whole sequence left the engine no room to answer (the run died at its first step): the
    limit is also policy.max_total_sequence_length - max_new_tokens, and data.too_long=error names the row."""
    from rlpost.config.load import load_master_config
    from rlpost.data.datasets import DataError
    from rlpost.data.prompts import PromptProcessor, apply_too_long, prompt_room

    _, cfg = load_master_config(["policy.max_total_sequence_length=64", "policy.generation.max_new_tokens=60"])
    assert prompt_room(cfg) == 4
    proc = PromptProcessor(DataConfig(max_input_seq_length=48), tiny_tokenizer, room=prompt_room(cfg))
    row = proc({"problem": "Copy the digit 7 and 8", "expected_answer": "7"})
    assert row["too_long"] and len(row["prompt_ids"]) == 4
    strict = PromptProcessor(DataConfig(max_input_seq_length=48, too_long="error"), tiny_tokenizer, room=4)
    with pytest.raises(DataError, match="rows.jsonl:1: the prompt is longer than 4, the room"):
        apply_too_long([{"problem": "Copy the digit 7 and 8", "expected_answer": "7"}], strict, "train",
                       lambda i: f"rows.jsonl:{i + 1}")


def test_a_batch_of_prompts_is_tokenized_as_each_alone(tiny_tokenizer: object) -> None:
    """`PromptProcessor.batch` (one tokenizer call for a step's prompts) gives every row what `__call__` gives it:
    ragged lengths, a truncated overlong prompt, the row's own keys kept."""
    from rlpost.data.prompts import PromptProcessor

    proc = PromptProcessor(DataConfig(max_input_seq_length=6), tiny_tokenizer)
    rows = [{"problem": p, "expected_answer": "7", "k": i}
            for i, p in enumerate(["7", "Copy the digit 7", "Copy the digit 7 " * 10, "abc xyz", ""])]
    batched = proc.batch(rows)
    tok: Any = tiny_tokenizer
    for row, got in zip(rows, batched, strict=True):  # each text tokenized on its own, as the tokenizer does it
        text = tok.apply_chat_template(proc.messages(row), tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert got["prompt_ids"] == ids[:6] and got["too_long"] == (len(ids) > 6)
    assert proc(rows[1]) == batched[1] and proc.batch([]) == []
    assert len({len(r["prompt_ids"]) for r in batched}) > 2 and [r["too_long"] for r in batched].count(True) == 1
    assert [r["k"] for r in batched] == list(range(5))


def test_loader_resumes_exactly() -> None:
    rows = [{"i": i} for i in range(10)]
    a = PromptLoader(rows, 3, shuffle=True, seed=1)
    seq = [[r["i"] for r in a.next_batch()] for _ in range(7)]
    b = PromptLoader(rows, 3, shuffle=True, seed=1)
    first = [[r["i"] for r in b.next_batch()] for _ in range(4)]
    c = PromptLoader(rows, 3, shuffle=True, seed=1)
    c.load_state_dict(b.state_dict())
    rest = [[r["i"] for r in c.next_batch()] for _ in range(3)]
    assert first + rest == seq
    assert len(a) == 3 and a.epochs_done() == 2  # 7 batches of a 3-batch epoch, drop_last
    assert sorted(sum(seq[:3], [])) != sorted(sum(seq[3:6], [])) or seq[:3] != seq[3:6]


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ('{"problem": "a", "expected_answer": "b"}\n{"problem": "", "expected_answer": "b"}\n', ":2:", "'problem' is empty"),
        ('{"problem": "a", "expected_answer": "  \\t"}\n', ":1:", "'expected_answer' is empty (whitespace only)"),
        ('{"problem": true, "expected_answer": "b"}\n', ":1:", "'problem' must be a string or number, got bool"),
        ('{"problem": "a", "expected_answer": false}\n', ":1:", "'expected_answer' must be a string or number, got bool"),
        ('{"problem": "a", "expected_answer": NaN}\n', ":1:", "'expected_answer' is nan"),
        ('{"problem": "a", "expected_answer": -Infinity}\n', ":1:", "'expected_answer' is -inf"),
        ('{"problem": "a", "expected_answer": null}\n', ":1:", "got NoneType"),
    ],
    ids=["empty", "blank", "bool-problem", "bool-answer", "nan", "inf", "null"],
)
def test_bad_text_fields_are_refused(tmp_path: Path, text: str, where: str, what: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(DataError) as e:
        read_jsonl(str(p), cfg(p))
    assert f"{p}{where}" in str(e.value) and what in str(e.value), str(e.value)


def test_numbers_stay_answers_and_bom_is_accepted(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"problem": "1+1", "expected_answer": 2}\n{"problem": 7, "expected_answer": 0.5}\n')
    assert [(r["problem"], r["expected_answer"]) for r in read_jsonl(str(p), cfg(p))] == [("1+1", "2"), ("7", "0.5")]


def test_invalid_utf8_is_named_by_line_and_offset(tmp_path: Path) -> None:
    p = tmp_path / "latin1.jsonl"
    first = b'{"problem": "a", "expected_answer": "b"}\n'
    p.write_bytes(first + '{"problem": "caf\xe9", "expected_answer": "b"}\n'.encode("latin-1"))
    with pytest.raises(DataError) as e:
        read_jsonl(str(p), cfg(p))
    msg = str(e.value)
    assert f"{p}:2: not valid UTF-8" in msg and "0xe9" in msg and f"file offset {len(first) + 16}" in msg, msg


def test_binary_file_given_as_jsonl(tmp_path: Path) -> None:
    p = tmp_path / "blob.jsonl"
    p.write_bytes(b"\x00\x01\x02garbage\xff")
    with pytest.raises(DataError, match="not a JSONL text file .binary data: a NUL byte at offset 0"):
        read_jsonl(str(p), cfg(p))


def _write_parquet(path: Path, rows: list[dict[str, object]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def test_parquet_file_given_to_the_jsonl_reader(tmp_path: Path) -> None:
    p = tmp_path / "train.jsonl"  # a parquet file with the wrong extension
    _write_parquet(p, [{"problem": "x", "expected_answer": "1"}])
    with pytest.raises(DataError) as e:
        load_rows(cfg(p), "train")
    assert str(e.value) == f"{p}: this is a parquet file, not JSONL; read it with data.dataset_name=parquet"


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (b'{"problem": "x", "expected_answer": "1"}\n', "it looks like JSONL text); read it with data.dataset_name=jsonl"),
        (b"just some text\n", "does not start with the PAR1 magic bytes"),
        (b"PAR1 truncated", "cannot be read as parquet"),
    ],
    ids=["jsonl", "text", "truncated"],
)
def test_non_parquet_given_to_the_parquet_reader(tmp_path: Path, content: bytes, what: str) -> None:
    p = tmp_path / "train.parquet"
    p.write_bytes(content)
    with pytest.raises(DataError) as e:
        load_rows(DataConfig(dataset_name="parquet", train_data_path=str(p), env_name="math"), "train")
    assert str(e.value).startswith(f"{p}: ") and what in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("answer", "what"),
    [(float("nan"), "'expected_answer' is nan"), (True, "got bool"), ("", "'expected_answer' is empty")],
    ids=["nan", "bool", "empty"],
)
def test_bad_parquet_rows_are_named_by_row(tmp_path: Path, answer: object, what: str) -> None:
    p = tmp_path / "t.parquet"
    _write_parquet(p, [{"problem": "x", "expected_answer": answer}, {"problem": "y", "expected_answer": answer}])
    with pytest.raises(DataError) as e:
        load_rows(DataConfig(dataset_name="parquet", train_data_path=str(p), env_name="math"), "train")
    assert f"{p}: row 0: " in str(e.value) and what in str(e.value), str(e.value)


@pytest.mark.parametrize("policy", ["truncate", "drop", "error"])
def test_over_length_prompts_are_found_at_load_and_handled_as_data_too_long_says(
    tiny_tokenizer: object, tmp_path: Path, policy: str
) -> None:
    from rlpost.data.prompts import PromptProcessor, load_prompt_rows

    p = tmp_path / "t.jsonl"
    long = "Copy the digit 7 " * 10
    p.write_text("".join(f'{{"problem": "{text}", "expected_answer": "7"}}\n' for text in ["1", long, "2", long]))
    d = cfg(p, max_input_seq_length=8, too_long=policy)
    proc = PromptProcessor(d, tiny_tokenizer)
    if policy == "error":
        with pytest.raises(DataError) as e:
            load_prompt_rows(d, proc, "train")
        assert str(e.value).startswith(f"{p}:2: the prompt is longer than data.max_input_seq_length=8 tokens")
        assert "(over it: 2 of 4 train prompts; data.too_long=error)" in str(e.value)
        return
    rows, over = load_prompt_rows(d, proc, "train")
    assert over == 2
    assert [r["problem"] for r in rows] == (["1", long, "2", long] if policy == "truncate" else ["1", "2"])


def test_an_unknown_too_long_policy_is_refused() -> None:
    from rlpost.config.errors import ConfigError

    with pytest.raises(ConfigError, match="must be one of"):
        DataConfig(too_long="skip").check("data")
