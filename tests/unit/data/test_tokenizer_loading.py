"""load_tokenizer reads a tokenizer.json without AutoTokenizer's model registry, and tokenizes as AutoTokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TEXTS = ["Copy the digit 7", "Hello, world!  two  spaces\nnew line", "<call>12*34</call><result>408</result> \\boxed{}",
         "éàü 漢字 🙂", "<|im_start|>user\nhi<|im_end|>\n"]


def test_same_ids_specials_and_template_as_autotokenizer(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from rlpost.config.schema.policy import TokenizerConfig
    from rlpost.data.prompts import load_tokenizer

    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = load_tokenizer(TokenizerConfig(name=str(tiny_model_dir), chat_template="default"))
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"], text
        ids = auto(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == auto.decode(ids)
    assert (ours.eos_token_id, ours.pad_token_id, ours.all_special_ids) == (
        auto.eos_token_id, auto.pad_token_id, auto.all_special_ids)
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_loading_does_not_import_the_model_registry(tiny_model_dir: Path) -> None:
    code = ("import sys; from rlpost.config.schema.policy import TokenizerConfig; from rlpost.data.prompts import "
            f"load_tokenizer; load_tokenizer(TokenizerConfig(name={str(tiny_model_dir)!r})); "
            "print('torch._dynamo' in sys.modules, 'transformers.models.auto.auto_factory' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]
