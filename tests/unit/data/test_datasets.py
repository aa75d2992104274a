"""Local data: JSONL/parquet rows, bad rows named by file and line, prompt masking, resumable loader."""

from __future__ import annotations

from pathlib import Path

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
    ],
)
def test_bad_rows_are_named_by_file_and_line(tmp_path: Path, text: str, where: str, what: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(DataError) as e:
        read_jsonl(str(p), cfg(p))
    assert f"{p}{where}" in str(e.value) and what in str(e.value)


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
