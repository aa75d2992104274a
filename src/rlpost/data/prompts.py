"""Rows -> token ids: prompt template, system prompt, the tokenizer's (or a file's) chat template.

Prompts longer than data.max_input_seq_length tokens are truncated to it and masked out of the
loss (loss_multiplier 0); they are counted in the step metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlpost.config.schema.data import DataConfig
from rlpost.config.schema.policy import TokenizerConfig
from rlpost.data.rows import Message, PromptRow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
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
            too_long = len(ids) > self.cfg.max_input_seq_length
            if too_long:
                ids = ids[: self.cfg.max_input_seq_length]
            out.append({**row, "prompt_ids": ids, "loss_multiplier": 0.0 if too_long else 1.0, "too_long": too_long})
        return out
