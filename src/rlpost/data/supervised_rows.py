"""Rows of SFT (chat messages, only the assistant's tokens trained) and of preference pairs (DPO, RM): read from
local JSONL / parquet or generated, checked, and tokenized into ids with a loss mask.

The rules (documented in conf/data/sft_jsonl.yaml and preference_jsonl.yaml):
- A row that breaks the format stops the run before anything starts, with exit 2 and its file and line:
  missing keys, a message that is not {role, content}, an unknown role, an empty content, a role order other
  than [system] user assistant (user assistant)*, a conversation not ending with the assistant, an empty or
  identical chosen / rejected pair.
- A row whose tokens exceed policy.max_total_sequence_length is skipped and counted (`skipped_too_long`); the
  run says how many, and stops with exit 2 when that leaves too few rows for one step.

Tokenization renders the conversation with the tokenizer's chat template one message at a time: the text each
message adds is tokenized on its own, and an assistant message's tokens after its template header are trained.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlpost.config.schema.supervised import PreferenceDataConfig, SFTDataConfig, SupervisedDataConfig
from rlpost.data.datasets import DataError, read_objects
from rlpost.data.rows import Message, PreferenceRow, SFTRow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[Message]
ROLES = ("system", "user", "assistant")


@dataclass
class Tokenized:
    """One sequence: token ids and a 0/1 loss mask of the same length."""

    ids: list[int]
    mask: list[int]


# ---- generated rows -----------------------------------------------------------------------------------------


def _answer_pairs(task: str, n: int, seed: int) -> list[tuple[str, str, str]]:
    """(prompt, right answer, a wrong answer) of a generated task."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if task == "copy_digit":
            d = rng.randrange(10)
            prompt, alphabet, right = f"Copy the digit {d}", string.digits, str(d)
        elif task == "next_letter":
            i = rng.randrange(26)
            prompt, alphabet, right = f"Next letter after {string.ascii_lowercase[i]}", string.ascii_lowercase, \
                string.ascii_lowercase[(i + 1) % 26]
        else:
            raise ValueError(f"unknown generated task {task!r}")
        wrong = rng.choice([c for c in alphabet if c != right])
        out.append((prompt, right, wrong))
    return out


def _memorise_rows(n: int, seed: int) -> list[tuple[str, str]]:
    """n distinct keys 'Code 417' with random two-digit values: a mapping only memory can reproduce."""
    rng = random.Random(seed)
    keys = rng.sample(range(100, 1000), min(n, 900))
    return [(f"Code {k}", f"{rng.randrange(10)}{rng.randrange(10)}") for k in keys]


def _calc_tool_rows(n: int, seed: int) -> list[tuple[str, str]]:
    """GRPO's calc_mul prompts, answered by calling the calculator and copying its result."""
    from rlpost.data.synthetic_tasks import make_rows

    out = []
    for row in make_rows("calc_mul", n, seed):
        a, b = re.match(r"What is (\d+) \* (\d+)\?", row["problem"]).groups()  # type: ignore[union-attr]
        v = row["expected_answer"]
        out.append((row["problem"], f"<call>{a}*{b}</call><result>{v}</result> The answer is \\boxed{{{v}}}."))
    return out


def _sft_generated(cfg: SFTDataConfig, split: str) -> list[SFTRow]:
    s = cfg.synthetic
    if s.task == "memorise":  # validation asks the training keys again: the mapping is the thing to learn
        pairs = _memorise_rows(s.num_train, s.seed)
        pairs = pairs if split == "train" else pairs[: s.num_val]
    elif s.task == "calc_tool":
        pairs = _calc_tool_rows(*((s.num_train, s.seed) if split == "train" else (s.num_val, s.seed + 1)))
    else:
        n, seed = (s.num_train, s.seed) if split == "train" else (s.num_val, s.seed + 1)
        pairs = [(p, right) for p, right, _ in _answer_pairs(s.task, n, seed)]
    return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}],
             "source": f"data.synthetic ({s.task}) row {i}"} for i, (p, a) in enumerate(pairs)]


def _preference_generated(cfg: PreferenceDataConfig, split: str) -> list[PreferenceRow]:
    s = cfg.synthetic
    n, seed = (s.num_train, s.seed) if split == "train" else (s.num_val, s.seed + 1)
    return [{"prompt": [{"role": "user", "content": p}], "chosen": right, "rejected": wrong,
             "source": f"data.synthetic ({s.task}) row {i}"}
            for i, (p, right, wrong) in enumerate(_answer_pairs(s.task, n, seed))]


# ---- checked rows from files --------------------------------------------------------------------------------


def _text(value: object, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: {key!r} is empty")
    return value


def _messages(value: object, key: str, where: str, final: str) -> Messages:
    """A checked conversation: [system] user assistant (user assistant)* ..., ending with the role `final`."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{role, content}} messages")
    msgs: Messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: {key}[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: {key}[{i}] has role {m['role']!r}; roles are {list(ROLES)}")
        msgs.append({"role": m["role"], "content": _text(m["content"], f"{key}[{i}].content", where)})
    roles = [m["role"] for m in msgs]
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(body))]
    if body != expected:
        raise DataError(f"{where}: {key!r} has roles {roles}; the order must be [system] user assistant "
                        "(user assistant)*")
    if body[-1] != final:
        raise DataError(f"{where}: {key!r} ends with a {body[-1]} message; it must end with {final!r}"
                        + (" (the trained reply)" if final == "assistant" else ""))
    return msgs


def _sft_row(obj: object, cfg: SFTDataConfig, where: str) -> SFTRow:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if cfg.messages_key in obj:
        msgs = _messages(obj[cfg.messages_key], cfg.messages_key, where, "assistant")
    elif cfg.prompt_key in obj and cfg.response_key in obj:
        msgs = _prompt(obj[cfg.prompt_key], cfg.prompt_key, where) + [
            {"role": "assistant", "content": _text(obj[cfg.response_key], cfg.response_key, where)}]
    else:
        raise DataError(f"{where}: needs {cfg.messages_key!r} (data.messages_key), or {cfg.prompt_key!r} and "
                        f"{cfg.response_key!r} (data.prompt_key / data.response_key)")
    return {"messages": msgs, "source": where}


def _prompt(value: object, key: str, where: str) -> Messages:
    if isinstance(value, list):
        return _messages(value, key, where, "user")
    return [{"role": "user", "content": _text(value, key, where)}]


def _preference_row(obj: object, cfg: PreferenceDataConfig, where: str) -> PreferenceRow:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in (cfg.prompt_key, cfg.chosen_key, cfg.rejected_key):
        if key not in obj:
            raise DataError(f"{where}: missing key {key!r} (data.prompt_key / data.chosen_key / data.rejected_key)")
    chosen = _text(obj[cfg.chosen_key], cfg.chosen_key, where)
    rejected = _text(obj[cfg.rejected_key], cfg.rejected_key, where)
    if chosen == rejected:
        raise DataError(f"{where}: {cfg.chosen_key!r} and {cfg.rejected_key!r} are identical; a pair must differ")
    return {"prompt": _prompt(obj[cfg.prompt_key], cfg.prompt_key, where), "chosen": chosen, "rejected": rejected,
            "source": where}


def load_supervised_rows(cfg: SupervisedDataConfig, split: str) -> list[SFTRow] | list[PreferenceRow]:
    """Checked rows of the train or val split (val: [] when there are no validation files)."""
    if isinstance(cfg, PreferenceDataConfig):
        if cfg.dataset_name == "synthetic":
            return _preference_generated(cfg, split)
        paths = [cfg.train_data_path] if split == "train" else cfg.val_data_paths
        return [_preference_row(o, cfg, w) for p in paths if p for o, w in read_objects(p, cfg.dataset_name)]
    assert isinstance(cfg, SFTDataConfig)
    if cfg.dataset_name == "synthetic":
        return _sft_generated(cfg, split)
    paths = [cfg.train_data_path] if split == "train" else cfg.val_data_paths
    return [_sft_row(o, cfg, w) for p in paths if p for o, w in read_objects(p, cfg.dataset_name)]


# ---- tokenization -------------------------------------------------------------------------------------------


class ConversationTokenizer:
    """Token ids and loss masks of conversations, rendered with the tokenizer's chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, add_eos: bool,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tok = tokenizer
        self.add_eos = add_eos
        self.kwargs = chat_template_kwargs or {}

    def _render(self, msgs: Messages, opener: bool = False) -> str:
        if not msgs and not opener:
            return ""
        return str(self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=opener, **self.kwargs))

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def conversation(self, msgs: Messages, where: str) -> Tokenized:
        """Every message's tokens; an assistant message's (after its template header) have mask 1."""
        ids: list[int] = []
        mask: list[int] = []
        done = ""
        last_body: list[int] = []
        for i, m in enumerate(msgs):
            full = self._render(msgs[: i + 1])
            if not full.startswith(done):
                raise DataError(f"{where}: the chat template does not render this conversation message by message "
                                "(an earlier message's text changes when a later one is added)")
            if m["role"] == "assistant":
                header = self._render(msgs[:i], opener=True)[len(done):]
                if not full[len(done):].startswith(header):
                    header = ""
                head_ids, body_ids = self._ids(header), self._ids(full[len(done) + len(header):])
                ids += head_ids + body_ids
                mask += [0] * len(head_ids) + [1] * len(body_ids)
                last_body = body_ids
            else:
                piece = self._ids(full[len(done):])
                ids += piece
                mask += [0] * len(piece)
            done = full
        if self.tok.eos_token_id not in last_body:  # the template did not close the reply with EOS itself
            self._eos(ids, mask)
        return Tokenized(ids, mask)

    def prompt_and_response(self, prompt: Messages, response: str) -> Tokenized:
        """The prompt with the assistant opener (mask 0), then the response's tokens (mask 1)."""
        head = self._ids(self._render(prompt, opener=True))
        body = self._ids(response)
        ids, mask = head + body, [0] * len(head) + [1] * len(body)
        self._eos(ids, mask)
        return Tokenized(ids, mask)

    def _eos(self, ids: list[int], mask: list[int]) -> None:
        eos = self.tok.eos_token_id
        if self.add_eos and eos is not None and ids[-1:] != [eos]:
            ids.append(eos)
            mask.append(1)


def tokenize_rows(rows: list[SFTRow] | list[PreferenceRow], tokenizer: ConversationTokenizer, max_len: int
                  ) -> tuple[list[list[Tokenized]], int]:
    """Each row as its sequences (SFT: one; a preference pair: chosen, rejected), dropping rows with a sequence
    over max_len; (kept rows, number skipped)."""
    kept: list[list[Tokenized]] = []
    skipped = 0
    for row in rows:
        if "messages" in row:
            seqs = [tokenizer.conversation(row["messages"], row.get("source", "?"))]
        else:
            seqs = [tokenizer.prompt_and_response(row["prompt"], row[k]) for k in ("chosen", "rejected")]
        if any(len(s.ids) > max_len for s in seqs):
            skipped += 1
            continue
        if any(sum(s.mask) == 0 for s in seqs):
            raise DataError(f"{row.get('source', '?')}: no trained token (the response tokenizes to nothing)")
        kept.append(seqs)
    return kept, skipped
