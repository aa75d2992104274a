"""SFT and preference rows: the loss mask covers the assistant's tokens only, bad rows are named by file and line,
over-length rows are skipped and counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlpost.config.schema.supervised import PreferenceDataConfig, SFTDataConfig, SupervisedTaskConfig
from rlpost.data.datasets import DataError
from rlpost.data.supervised_rows import ConversationTokenizer, load_supervised_rows, tokenize_rows


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny tokenizer with its own chat template (<|im_start|>role ... <|im_end|>)."""
    from rlpost.config.schema.policy import TokenizerConfig
    from rlpost.data.prompts import load_tokenizer

    return load_tokenizer(TokenizerConfig(name=str(tiny_model_dir), chat_template="default"))


def _write(tmp_path: Path, rows: list[Any]) -> str:
    p = tmp_path / "rows.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def test_only_assistant_tokens_are_trained(chat_tokenizer: Any) -> None:
    msgs = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Copy the digit 3"},
            {"role": "assistant", "content": "3"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "3 3"}]
    t = ConversationTokenizer(chat_tokenizer, add_eos=True).conversation(msgs, "x")
    trained = [i for i, m in zip(t.ids, t.mask, strict=True) if m]
    text = chat_tokenizer.decode(t.ids)
    assert text == chat_tokenizer.apply_chat_template(msgs, tokenize=False)  # nothing added or lost
    # Exactly each reply and the template's end of turn; no header, no user or system text, no extra EOS.
    assert chat_tokenizer.decode(trained) == "3<|im_end|>\n3 3<|im_end|>\n"
    untrained = chat_tokenizer.decode([i for i, m in zip(t.ids, t.mask, strict=True) if not m])
    assert "assistant\n" in untrained and "Be brief" in untrained and "again" in untrained


def test_without_a_template_eos_is_appended_and_trained(tiny_tokenizer: Any) -> None:
    conv = ConversationTokenizer(tiny_tokenizer, add_eos=True)
    t = conv.prompt_and_response([{"role": "user", "content": "Copy the digit 7"}], "7")
    assert t.ids[-1] == tiny_tokenizer.eos_token_id and t.mask[-1] == 1
    assert tiny_tokenizer.decode([i for i, m in zip(t.ids, t.mask, strict=True) if m]) == "7" + tiny_tokenizer.eos_token
    no_eos = ConversationTokenizer(tiny_tokenizer, add_eos=False).prompt_and_response(
        [{"role": "user", "content": "Copy the digit 7"}], "7")
    assert no_eos.ids == t.ids[:-1]


@pytest.mark.parametrize("row,needle", [
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "the order must be"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "the order must be"),
    ({"messages": [{"role": "user", "content": "a"}]}, "must end with 'assistant'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]}, "is empty"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}, "role 'bot'"),
    ({"messages": [{"text": "a"}]}, "'role' and 'content'"),
    ({"question": "a"}, "needs 'messages'"),
    ({"prompt": "a", "response": ""}, "is empty"),
    ("[1, 2]", "expected a JSON object"),
    ('{"prompt": "a", "response": "b", "response": "c"}', "key 'response' appears twice"),
])
def test_a_bad_sft_row_is_named_by_file_and_line(tmp_path: Path, row: Any, needle: str) -> None:
    good = {"prompt": "Copy the digit 1", "response": "1"}
    path = _write(tmp_path, [good, row])
    cfg = SFTDataConfig(dataset_name="jsonl", train_data_path=path)
    with pytest.raises(DataError, match=needle) as err:
        load_supervised_rows(cfg, "train")
    assert str(err.value).startswith(f"{path}:2:")


@pytest.mark.parametrize("row,needle", [
    ({"prompt": "p", "chosen": "a"}, "missing key 'rejected'"),
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "identical"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "'chosen' is empty"),
    ({"prompt": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "x"}], "chosen": "a",
      "rejected": "b"}, "must end with 'user'"),
])
def test_a_bad_pair_is_named_by_file_and_line(tmp_path: Path, row: Any, needle: str) -> None:
    path = _write(tmp_path, [row])
    with pytest.raises(DataError, match=needle) as err:
        load_supervised_rows(PreferenceDataConfig(dataset_name="jsonl", train_data_path=path), "train")
    assert str(err.value).startswith(f"{path}:1:")


def test_over_length_rows_are_skipped_and_counted(tiny_tokenizer: Any, tmp_path: Path) -> None:
    rows = [{"prompt": "Copy the digit 1", "response": "1"}, {"prompt": "Copy the digit 1", "response": "1 " * 40}]
    cfg = SFTDataConfig(dataset_name="jsonl", train_data_path=_write(tmp_path, rows))
    kept, skipped = tokenize_rows(load_supervised_rows(cfg, "train"), ConversationTokenizer(tiny_tokenizer, True), 16)
    assert skipped == 1 and len(kept) == 1 and len(kept[0][0].ids) <= 16
    pairs = [{"prompt": "p", "chosen": "a", "rejected": "b " * 40}]
    pcfg = PreferenceDataConfig(dataset_name="jsonl", train_data_path=_write(tmp_path, pairs))
    kept, skipped = tokenize_rows(load_supervised_rows(pcfg, "train"), ConversationTokenizer(tiny_tokenizer, True), 16)
    assert (len(kept), skipped) == (0, 1)  # a pair goes whole: its short side alone would teach nothing


def test_generated_rows() -> None:
    mem = SFTDataConfig(synthetic=SupervisedTaskConfig(task="memorise", num_train=50, num_val=10))
    train, val = load_supervised_rows(mem, "train"), load_supervised_rows(mem, "val")
    assert len({r["messages"][0]["content"] for r in train}) == 50  # distinct keys
    assert [r["messages"] for r in val] == [r["messages"] for r in train[:10]]  # validation asks memorised keys
    pairs = load_supervised_rows(PreferenceDataConfig(), "train")
    assert all(p["chosen"] == p["prompt"][0]["content"][-1] != p["rejected"] for p in pairs)


def test_calc_tool_rows_answer_grpo_prompts_with_a_working_call() -> None:
    """The warm-up transcripts: GRPO's own calc_mul prompt, a call the calculator env accepts, its true result."""
    from rlpost.data.synthetic_tasks import make_rows
    from rlpost.environments.calculator import calculate

    cfg = SFTDataConfig(synthetic=SupervisedTaskConfig(task="calc_tool", num_train=8, num_val=2, seed=3))
    rows = load_supervised_rows(cfg, "train")
    assert [r["messages"][0]["content"] for r in rows] == [r["problem"] for r in make_rows("calc_mul", 8, 3)]
    for row in rows:
        reply = row["messages"][1]["content"]
        call = reply.split("<call>")[1].split("</call>")[0]
        value = int(calculate(call))
        assert reply.endswith(f"<result>{value}</result> The answer is \\boxed{{{value}}}.")
