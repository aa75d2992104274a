from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> object:
    from rlpost.config.schema.policy import TokenizerConfig
    from rlpost.data.prompts import load_tokenizer

    return load_tokenizer(TokenizerConfig(name=str(tiny_model_dir), chat_template=None))
