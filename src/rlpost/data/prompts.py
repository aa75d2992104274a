"""Rows -> token ids: prompt template, system prompt, the tokenizer's (or a file's) chat template.

Prompts longer than data.max_input_seq_length tokens are found when the rows are loaded
(`apply_too_long`) and handled as data.too_long says: truncated to the limit and masked out of the
loss (loss_multiplier 0, counted in the step metrics), dropped, or refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlpost.config.schema.data import DataConfig
from rlpost.config.schema.policy import TokenizerConfig
from rlpost.data.rows import Message, PromptRow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlpost.config.schema.master import MasterConfig


def load_tokenizer(cfg: TokenizerConfig, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of a local path; pad = eos if missing; chat template from cfg.chat_template.

    A directory with a tokenizer.json loads through the `tokenizers` backend class itself (what AutoTokenizer
    returns for it in transformers 5): importing AutoTokenizer's model registry would pull torch._dynamo and
    DTensor into the driver, a lot of memory it never uses. Other tokenizers (sentencepiece only, remote code) use
    AutoTokenizer."""
    if (Path(cfg.name) / "tokenizer.json").is_file() and not trust_remote_code:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(cfg.name)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.name, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ct = cfg.chat_template
    if ct is None:
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    elif ct != "default":
        p = Path(ct)
        tok.chat_template = p.read_text() if p.suffix == ".jinja" else ct  # a missing *.jinja is an error, not a template
    return tok


class PromptProcessor:
    """Formats and tokenizes rows."""

    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
                 chat_template_kwargs: dict[str, Any] | None = None, room: int | None = None) -> None:
        """`room`: the tokens a prompt may take and still leave the engine max_new_tokens before the sequence's end
        (`prompt_room`); the limit is the smaller of it and data.max_input_seq_length."""
        self.cfg = cfg
        self.limit = min(cfg.max_input_seq_length, room) if room is not None else cfg.max_input_seq_length
        self.tok = tokenizer
        self.template = Path(cfg.prompt_file).read_text() if cfg.prompt_file else None
        self.system = Path(cfg.system_prompt_file).read_text().strip() if cfg.system_prompt_file else None
        self.kwargs = chat_template_kwargs or {}

    def messages(self, row: PromptRow) -> list[Message]:
        text = self.template.format(row["problem"]) if self.template else row["problem"]
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": text}]

    def __call__(self, row: PromptRow) -> PromptRow:
        return self.batch([row])[0]

    def batch(self, rows: list[PromptRow]) -> list[PromptRow]:
        """Every row formatted and tokenized, in one tokenizer call for the whole batch: per-row calls would dominate
        the driver's time on a step's small batch of prompts."""
        if not rows:
            return []
        texts = [
            self.tok.apply_chat_template(
                self.messages(row), tokenize=False, add_generation_prompt=self.cfg.add_generation_prompt, **self.kwargs
            )
            for row in rows
        ]
        out: list[PromptRow] = []
        for row, ids in zip(rows, self.tok(texts, add_special_tokens=False)["input_ids"], strict=True):
            too_long = len(ids) > self.limit
            if too_long:
                ids = ids[: self.limit]
            out.append({**row, "prompt_ids": ids, "loss_multiplier": 0.0 if too_long else 1.0, "too_long": too_long})
        return out


def prompt_room(cfg: MasterConfig) -> int:
    """The tokens a prompt may take and leave policy.generation.max_new_tokens before policy.max_total_sequence_length
    (at least one): a longer prompt would leave the engine no room to answer."""
    return max(1, cfg.policy.max_total_sequence_length - cfg.generation.max_new_tokens)


TOO_LONG_CHUNK = 1024
"""Rows tokenized per call when a whole data set's prompt lengths are measured."""


def over_length(rows: list[PromptRow], processor: PromptProcessor) -> list[int]:
    """Indices of the rows whose prompt is longer than the processor's limit."""
    out: list[int] = []
    for start in range(0, len(rows), TOO_LONG_CHUNK):
        done = processor.batch(rows[start: start + TOO_LONG_CHUNK])
        out += [start + i for i, r in enumerate(done) if r["too_long"]]
    return out


def apply_too_long(rows: list[PromptRow], processor: PromptProcessor, split: str,
                   where: Callable[[int], str]) -> tuple[list[PromptRow], int]:
    """(the rows data.too_long keeps, how many were over the limit). 'truncate' keeps every row (each batch cuts
    and masks its long prompts), 'drop' leaves them out, 'error' raises DataError naming the first by
    `where(index)` (its file:line)."""
    from rlpost.data.datasets import DataError

    cfg = processor.cfg
    over = over_length(rows, processor)
    if not over or cfg.too_long == "truncate":
        return rows, len(over)
    if cfg.too_long == "error":
        limit = (f"data.max_input_seq_length={cfg.max_input_seq_length}" if processor.limit == cfg.max_input_seq_length
                 else f"{processor.limit}, the room policy.max_total_sequence_length leaves for max_new_tokens")
        raise DataError(f"{where(over[0])}: the prompt is longer than {limit} tokens (over it: {len(over)} of "
                        f"{len(rows)} {split} prompts; data.too_long=error)")
    dropped = set(over)
    return [r for i, r in enumerate(rows) if i not in dropped], len(over)


def row_source(cfg: DataConfig, split: str, index: int) -> str:
    """Where row `index` of `split` comes from, for a message: its file:line, or the synthetic row's number."""
    from rlpost.data.datasets import load_rows

    if cfg.dataset_name == "synthetic":
        return f"data.synthetic.task={cfg.synthetic.task} ({split} row {index})"
    return str(load_rows(cfg, split, with_source=True)[index]["source"])


def load_prompt_rows(cfg: DataConfig, processor: PromptProcessor, split: str) -> tuple[list[PromptRow], int]:
    """The rows of `split` ('train' or 'val') that data.too_long keeps, and how many prompts were over the limit."""
    from rlpost.data.datasets import load_rows

    return apply_too_long(load_rows(cfg, split), processor, split, lambda i: row_source(cfg, split, i))
